"""``MooncakeCoreConnector``: vLLM prefill/decode disaggregation over mooncake-core.

Select it with::

    --kv-transfer-config '{"kv_connector":"MooncakeCoreConnector",
                           "kv_connector_module_path":"mooncake_vllm.connector",
                           "kv_role":"kv_producer"}'      # prefill; "kv_consumer" on decode

(``kv_connector_module_path`` may be left out when the package is installed: the
``vllm.general_plugins`` entry point registers the name.) Options: see
:mod:`mooncake_vllm.common`.

Scheduler side (EngineCore process), in :mod:`mooncake_vllm.scheduler`:
``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
``request_finished``, ``set_xfer_handshake_metadata[_pp_aware]``.

Worker side (worker process), in :mod:`mooncake_vllm.worker`: ``register_kv_caches``,
``get_handshake_metadata``, ``start_load_kv`` (starts fetches, returns at once),
``wait_for_layer_load`` / ``save_kv_layer`` / ``wait_for_save`` (no-ops: the prefill
side keeps blocks, the decode side pulls), ``get_transfer_results`` (finished and
failed fetches, released sends), ``shutdown``.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from mooncake_vllm.metadata import PDMetadata
from mooncake_vllm.scheduler import PDScheduler
from mooncake_vllm.stats import ConnectorStatsMixin
from mooncake_vllm.worker import PDWorker

__all__ = ["MooncakeCoreConnector"]

logger = logging.getLogger(__name__)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (unit tests)
        return 0


class MooncakeCoreConnector(ConnectorStatsMixin, KVConnectorBase_V1):
    """PD connector: the decode instance pulls the prefill instance's KV blocks."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.engine_id = str(ktc.engine_id)
        self.kv_role = str(ktc.kv_role)
        extra = dict(ktc.kv_connector_extra_config or {})
        self.scheduler: PDScheduler | None = None
        self.worker: PDWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = PDScheduler(
                self.engine_id, self.kv_role, int(vllm_config.cache_config.block_size)
            )
        else:
            self.worker = PDWorker(self.engine_id, self.kv_role, extra, _tp_rank())

    # ============================== scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self.scheduler is not None:
            self.scheduler.set_handshake(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        if self.scheduler is not None:
            self.scheduler.set_handshake(metadata)

    # ============================== worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Any:
        return self.worker.handshake() if self.worker is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, PDMetadata):
            self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # the prefill side keeps its blocks; the decode side pulls them

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self.worker.results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
