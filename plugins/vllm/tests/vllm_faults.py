"""Test-only vLLM plugin: zero the KV our connectors loaded for flagged requests.

It proves that a decode instance (``MooncakeCoreConnector``) or a store hit
(``MooncakeCoreStoreConnector``) really computes with the KV it loaded: for a request whose
``kv_transfer_params`` carry ``"mooncake_test_corrupt_kv": true`` the loaded blocks are
overwritten with zeros after the load finished and before the forward reads them, so its
output must differ from the reference. The worker's counter ``test_corrupted_requests``
(in its stats file) counts such requests, so a test also sees that the fault fired.

The adapter knows nothing of this. A test enables it for one server with
``env=corrupt_kv_env(tmp_dir)``: that server's processes then find a generated
``dist-info`` on ``PYTHONPATH`` and load :func:`register` through vLLM's own
``vllm.general_plugins`` entry-point group, as they load the adapter's plugin. ``register``
patches the connector classes of that process only:

- scheduler side (both connectors): ``update_state_after_alloc`` notes the flagged request
  ids; ``build_connector_meta`` hands the step's flagged ids to the workers as the
  metadata attribute ``test_corrupt_kv``;
- PD worker: ``PDWorker.start_load`` remembers the local blocks of flagged fetches and
  ``PDWorker.results`` zeroes them when it reports the fetch finished (vLLM schedules the
  request's forward after that);
- store worker: ``MooncakeCoreStoreConnector.start_load_kv`` waits for the step's loads when
  one is flagged and zeroes the flagged requests' blocks (the forward runs after it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncake_conformance.faults import entry_point_dir, pythonpath

__all__ = ["FLAG", "corrupt_kv_env", "register"]

logger = logging.getLogger(__name__)

#: The ``kv_transfer_params`` key that flags a request.
FLAG = "mooncake_test_corrupt_kv"
_ATTR = "test_corrupt_kv"  # metadata attribute: the step's flagged request ids
_PATCHED = "_mooncake_test_corrupt_kv_patched"
_HERE = Path(__file__).resolve().parent


def corrupt_kv_env(directory: Path) -> dict[str, str]:
    """Environment for a ``VLLMServer`` whose processes load this plugin."""
    root = entry_point_dir(
        directory,
        {"vllm.general_plugins": {"mooncake_test_corrupt_kv": f"{__name__}:register"}},
        dist="mooncake-test-vllm-faults",
    )
    return {"PYTHONPATH": pythonpath(root, _HERE)}


def _zero(layers: list[Any], block_ids: list[int]) -> None:
    import torch

    idx = torch.tensor(block_ids, dtype=torch.long)
    for t in layers:
        t.index_fill_(0, idx, 0)


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    real = getattr(cls, name)
    setattr(cls, name, functools.wraps(real)(make(real)))


def _patch_scheduler_side(cls: type) -> None:
    def note(real: Callable[..., Any]) -> Callable[..., Any]:
        def update_state_after_alloc(
            self: Any, request: Any, blocks: Any, num_external_tokens: int
        ) -> None:
            real(self, request, blocks, num_external_tokens)
            if (request.kv_transfer_params or {}).get(FLAG):
                self.__dict__.setdefault("_test_flagged", set()).add(request.request_id)

        return update_state_after_alloc

    def attach(real: Callable[..., Any]) -> Callable[..., Any]:
        def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
            meta = real(self, scheduler_output)
            setattr(meta, _ATTR, frozenset(self.__dict__.pop("_test_flagged", ())))
            return meta

        return build_connector_meta

    _wrap(cls, "update_state_after_alloc", note)
    _wrap(cls, "build_connector_meta", attach)


def _patch_pd_worker(cls: type) -> None:
    def remember(real: Callable[..., Any]) -> Callable[..., Any]:
        def start_load(self: Any, meta: Any) -> None:
            flagged = getattr(meta, _ATTR, frozenset())
            pending = self.__dict__.setdefault("_test_corrupt", {})
            for spec in meta.recvs:
                if spec.request_id in flagged and spec.local_block_ids:
                    pending[spec.request_id] = list(spec.local_block_ids)
            real(self, meta)

        return start_load

    def zero(real: Callable[..., Any]) -> Callable[..., Any]:
        def results(self: Any, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
            sending, recving, failed = real(self, finished_req_ids)
            pending: dict[str, list[int]] = self.__dict__.get("_test_corrupt", {})
            for rid in recving:
                blocks = pending.pop(rid, None)
                if blocks and rid not in failed:
                    _zero(list(self.layers.values()), blocks)
                    self.counters.add(test_corrupted_requests=1)
                    logger.warning(
                        "test fault: zeroed the %d fetched KV blocks of %s", len(blocks), rid
                    )
            return sending, recving, failed

        return results

    _wrap(cls, "start_load", remember)
    _wrap(cls, "results", zero)


def _patch_store_worker(cls: type) -> None:
    def zero(real: Callable[..., Any]) -> Callable[..., Any]:
        def start_load_kv(self: Any, forward_context: Any, **kwargs: Any) -> None:
            real(self, forward_context, **kwargs)
            if self.worker is None or not self.has_connector_metadata():
                return
            meta = self._get_connector_metadata()
            flagged = getattr(meta, _ATTR, frozenset())
            jobs = [j for j in getattr(meta, "loads", []) if j.request_id in flagged]
            if not jobs:
                return
            self.worker.finish_loads()  # the loads must land before they are overwritten
            for job in jobs:
                _zero([t for _, t in self.worker.layers], list(job.block_ids))
                self.worker.counters.add(test_corrupted_requests=1)
                logger.warning(
                    "test fault: zeroed the %d loaded KV pages of %s",
                    len(job.block_ids),
                    job.request_id,
                )

        return start_load_kv

    _wrap(cls, "start_load_kv", zero)


def register() -> None:
    """``vllm.general_plugins`` entry point: patch this process's connector classes (once)."""
    from mooncake_vllm.connector import MooncakeCoreConnector
    from mooncake_vllm.store_connector import MooncakeCoreStoreConnector
    from mooncake_vllm.worker import PDWorker

    if getattr(MooncakeCoreConnector, _PATCHED, False):
        return
    _patch_scheduler_side(MooncakeCoreConnector)
    _patch_scheduler_side(MooncakeCoreStoreConnector)
    _patch_pd_worker(PDWorker)
    _patch_store_worker(MooncakeCoreStoreConnector)
    setattr(MooncakeCoreConnector, _PATCHED, True)
    logger.warning("test fault plugin active: KV loaded for requests flagged %r is zeroed", FLAG)
