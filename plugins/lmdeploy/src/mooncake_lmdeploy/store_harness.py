"""The conformance harness: LMDeploy's own ``MooncakeStoreConnector`` on our compat store.

What runs is LMDeploy 0.18.0's code: ``build_kv_connector`` (its factory) builds
``MooncakeStoreConnector`` in the ``WORKER`` role, whose ``MooncakeStoreWorker`` loads
``mooncake.store.MooncakeDistributedStore`` (our :mod:`mooncake_core.compat.store`,
installed as ``mooncake`` by :mod:`mooncake_lmdeploy.autoload`), reads a Mooncake JSON
config, registers the cache engine's ``connector_kv_caches`` rows, and moves blocks with
its own sender/receiver threads (``batch_is_exist``, ``batch_put_from_multi_buffers``,
``batch_get_into_multi_buffers``). Keys are LMDeploy's (``build_prefix_block_hashes``,
``build_store_key``). The KV memory is a real ``CacheEngine``'s pools, on the CPU
(:func:`mooncake_lmdeploy.testing.cpu_cache_engine`).

Stand-ins, all for the GPU this machine lacks (named in docs/lmdeploy.md):

- :class:`HostRow`: the registered rows are CPU tensors that answer ``is_cuda = True``
  (LMDeploy's worker refuses non-CUDA rows); same memory, same ``data_ptr()``.
- :class:`HostEvent`: ``torch.cuda.Event`` in LMDeploy's worker module (a CPU tensor is
  written before the save is submitted, so ``record``/``synchronize`` have nothing to do).
- ``_get_local_hostname`` of LMDeploy's worker answers 127.0.0.1 (upstream picks the
  default-route address; tests listen on loopback only).

The harness stands in for LMDeploy's scheduler: it builds the
``MooncakeStoreConnectorMetadata`` (save and load requests) the scheduler would, binds
it, calls ``start_save_kv`` / ``start_load_kv`` and polls ``get_finished`` as LMDeploy's
model agent does. Bad block ids are checked with LMDeploy's own ``_scatter_block`` and
``_owned_entries`` before submitting (upstream runs those checks on its worker threads,
where they only turn into failed blocks).
"""

from __future__ import annotations

import json
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mooncake_conformance.harness import EngineHarness, HarnessSpec

from mooncake_lmdeploy.testing import block_bytes, cpu_cache_engine

__all__ = ["LMDeployStoreHarness", "make_harness", "HostRow", "HostEvent", "preload"]


def preload() -> None:
    """Import what a harness needs, so the conformance suite's worker processes fork from one
    process that did it (see ``mooncake_conformance.worker``)."""
    import torch  # noqa: F401
    from lmdeploy.pytorch.kv_connector.mooncake.store import worker  # noqa: F401


_ids = iter(range(1, 1 << 62))


class HostEvent:
    """Stand-in for ``torch.cuda.Event`` (CPU writes are complete when a save is queued)."""

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _host_row_class() -> type:
    import torch

    class HostRow(torch.Tensor):
        """A CPU row that reports ``is_cuda`` (stand-in for a GPU cache row)."""

        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

    return HostRow


HostRow: Any = None


def _install_stand_ins() -> None:
    global HostRow
    import torch
    from lmdeploy.pytorch.kv_connector.mooncake.store import worker as worker_mod

    if HostRow is None:
        HostRow = _host_row_class()
    if not isinstance(worker_mod.torch, _TorchStandIn):
        stand_in = _TorchStandIn("torch")
        stand_in.cuda = types.SimpleNamespace(Event=HostEvent)  # type: ignore[attr-defined]
        worker_mod.torch = stand_in
    worker_mod._get_local_hostname = lambda: "127.0.0.1"
    assert torch is not None


class _TorchStandIn(types.ModuleType):
    """``torch`` as LMDeploy's worker module sees it, with a host ``cuda.Event``."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


class LMDeployStoreHarness(EngineHarness):
    """One LMDeploy TP rank: a CPU ``CacheEngine`` plus LMDeploy's store connector (worker).

    Options: ``wait_s`` (how long to wait for a save or load to finish, default 30).
    """

    def __init__(self, spec: HarnessSpec) -> None:
        super().__init__(spec)
        from lmdeploy.messages import KVTransferConfig
        from lmdeploy.pytorch.kv_connector import KVConnectorRole, build_kv_connector

        import mooncake_core.compat as compat
        from mooncake_lmdeploy.autoload import install

        install()  # as mooncake_lmdeploy.pth does at start-up (no-op when already done)
        compat.install()
        _install_stand_ins()
        lay = spec.layout
        if lay.mla:
            raise ValueError(
                "LMDeploy's store connector has no MLA layout (replicated KV heads are "
                "split between ranks by block, not written by one rank)"
            )
        if lay.num_kv_heads % lay.tp_size:
            raise ValueError(f"{lay.num_kv_heads} KV heads do not split over tp {lay.tp_size}")
        self.wait_s = float(spec.options.get("wait_s", 30.0))
        self._dir = tempfile.TemporaryDirectory(prefix="mc-lmdeploy-")
        cfg_path = Path(self._dir.name) / "mooncake.json"
        cfg_path.write_text(
            json.dumps(
                {
                    "metadata_server": "P2PHANDSHAKE",
                    "master_server_address": spec.master,
                    "protocol": "tcp",
                    "device_name": "",
                    # LMDeploy requires > 0; 1 byte holds no block, so data lives on the
                    # store's memory node and outlives this rank
                    "global_segment_size": 1,
                    "local_buffer_size": 16 << 20,
                }
            )
        )
        self.transfer_config = KVTransferConfig(
            kv_connector="MooncakeStoreConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "mooncake_config_path": str(cfg_path),
                "model_name": spec.model,
            },
        )
        self.engine = cpu_cache_engine(
            layers=lay.num_layers,
            blocks=lay.num_slots,
            block_size=lay.page_size,
            kv_heads=lay.num_kv_heads // lay.tp_size,
            head_dim=lay.head_dim,
            dtype=lay.dtype,
            rank=spec.rank,
            tp_rank=spec.rank,
            kv_transfer_config=self.transfer_config,
        )
        self.connector = build_kv_connector(
            KVConnectorRole.WORKER,
            self.engine.cache_config,
            global_rank=spec.rank,
            tp_rank=spec.rank,
            tp_size=lay.tp_size,
        )
        self.worker = self.connector.connector_worker
        rows = {
            name: row.as_subclass(HostRow) for name, row in self.engine.connector_kv_caches.items()
        }
        self.connector.register_kv_caches(rows)

    # ------------------------------------------------------------------ engine memory
    def fill(self, slot: int, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed((seed * 1009 + self.spec.rank * 7919 + 1) % (1 << 63))
        for pool in self.engine.gpu_allocation.pools:
            row = pool.tensor.select(pool.entry_axis, slot)
            row.copy_(torch.randint(0, 256, row.shape, generator=g, dtype=torch.uint8))

    def read(self, slot: int) -> bytes:
        return block_bytes(self.engine, slot)

    # ------------------------------------------------------------------ keys
    def _hashes(self, tokens: Sequence[int]) -> tuple[bytes, ...]:
        from lmdeploy.pytorch.kv_connector.mooncake.store.data import build_prefix_block_hashes

        return tuple(build_prefix_block_hashes(list(tokens), self.page_size))

    def _key(self, block_hash: bytes) -> str:
        from lmdeploy.pytorch.kv_connector.mooncake.store.data import build_store_key

        meta = self.worker.key_metadata
        return str(build_store_key(meta, self.spec.rank // meta.kv_head_replica_num, block_hash))

    def page_keys(self, tokens: Sequence[int]) -> list[list[str]]:
        return [[self._key(h)] for h in self._hashes(tokens)]

    # ------------------------------------------------------------------ adapter calls
    def _slots(self, what: str, slots: Sequence[int], pages: int) -> tuple[int, ...]:
        from lmdeploy.pytorch.kv_connector.mooncake.store.worker_threads import _scatter_block

        if len(slots) < pages:
            raise ValueError(f"{what}: {pages} full pages but {len(slots)} slots")
        chosen = tuple(int(s) for s in slots[:pages])
        w = self.worker
        for s in chosen:  # LMDeploy's own bounds check, run before submitting
            _scatter_block(
                w._registered_regions, w._row_block_sizes, w._cache_config.num_gpu_blocks, s
            )
        return chosen

    def _finished(self, pred: Callable[[Any], bool], what: str) -> Any:
        deadline = time.monotonic() + self.wait_s
        while True:
            out = self.connector.get_finished()
            if pred(out):
                return out
            if time.monotonic() > deadline:
                raise TimeoutError(f"LMDeploy's store connector did not finish {what}")
            time.sleep(0.002)

    def save(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        from lmdeploy.pytorch.kv_connector.mooncake.store.data import (
            MooncakeStoreConnectorMetadata,
            MooncakeStoreSaveRequest,
        )

        hashes = self._hashes(tokens)
        if not hashes:
            return 0
        blocks = self._slots("save", slots, len(hashes))
        save_id, req_id = next(_ids), next(_ids)
        req = MooncakeStoreSaveRequest(
            save_id=save_id,
            request_id=req_id,
            start_block=0,
            block_ids=blocks,
            logical_block_ids=blocks,
            block_hashes=hashes,
        )
        self.worker.kv_send_thread._owned_entries(req)  # LMDeploy's own consistency check
        self.connector.bind_connector_metadata(MooncakeStoreConnectorMetadata(save_requests=(req,)))
        try:
            self.connector.start_save_kv()
        finally:
            self.connector.clear_connector_metadata()
        self._finished(lambda o: save_id in (o.completed_save_ids or ()), f"save {save_id}")
        # LMDeploy reports completion, not success: count the leading pages now present
        states = self.worker.store.batch_is_exist([self._key(h) for h in hashes])
        n = 0
        for st in states:
            if st != 1:
                break
            n += 1
        return n

    def lookup(self, tokens: Sequence[int]) -> int:
        """LMDeploy's ``MooncakeStoreWorker.lookup`` (which its lookup server answers).

        That lookup asks for every KV-head shard of a block (all TP ranks); the suite
        counts hits per rank, so with TP > 1 each rank narrows the same prefix query to
        its own shard's keys."""
        hashes = self._hashes(tokens)
        if self.spec.layout.tp_size == 1:
            return int(self.worker.lookup(len(tokens), hashes)) // self.page_size
        states = self.worker.store.batch_is_exist([self._key(h) for h in hashes])
        n = 0
        for st in states:
            if st != 1:
                break
            n += 1
        return n

    def load(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        from lmdeploy.pytorch.kv_connector.mooncake.store.data import (
            MooncakeStoreConnectorMetadata,
            MooncakeStoreLoadRequest,
        )

        hashes = self._hashes(tokens)
        if not hashes:
            return 0
        blocks = self._slots("load", slots, len(hashes))
        req_id = next(_ids)
        req = MooncakeStoreLoadRequest(request_id=req_id, block_ids=blocks, block_hashes=hashes)
        self.connector.bind_connector_metadata(MooncakeStoreConnectorMetadata(load_requests=(req,)))
        try:
            self.connector.start_load_kv()
        finally:
            self.connector.clear_connector_metadata()
        out = self._finished(lambda o: req_id in (o.finished_receiving or ()), f"load {req_id}")
        bad = set(out.invalid_block_ids or ())
        n = 0
        for b in blocks:
            if b in bad:
                break
            n += 1
        return n

    def expected_objects(self, tokens: Sequence[int], slots: Sequence[int]) -> dict[str, bytes]:
        """Each block's key holds its bytes in every registered row (= layer), in order."""
        return {
            self._key(h): block_bytes(self.engine, int(s))
            for h, s in zip(self._hashes(tokens), slots, strict=False)
        }

    def bad_inputs(self) -> dict[str, Callable[[], object]]:
        from lmdeploy.messages import KVTransferConfig

        def unknown_connector() -> object:
            return KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_role="kv_reader")

        def wrong_hash() -> object:
            from lmdeploy.pytorch.kv_connector.mooncake.store.data import build_store_key

            return build_store_key(self.worker.key_metadata, 0, b"short")

        return {"unknown kv_role": unknown_connector, "block hash of 5 bytes": wrong_hash}

    def close(self) -> None:
        try:
            self.connector.shutdown()
        finally:
            self._dir.cleanup()


def make_harness(spec: HarnessSpec) -> LMDeployStoreHarness:
    """The factory the conformance fixtures name (``...store_harness:make_harness``)."""
    return LMDeployStoreHarness(spec)
