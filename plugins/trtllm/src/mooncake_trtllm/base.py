"""TensorRT-LLM's KV cache connector base classes, or stand-alone copies of their interface.

Interface followed: TensorRT-LLM 1.2 (1.2.1),
``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py``: both halves are built with
``(llm_args: TorchLlmArgs)``; the worker keeps the step's metadata through
``bind_connector_meta`` / ``_get_connector_meta`` / ``_clear_connector_meta``. Newer
TensorRT-LLM main moved the module to ``.../pyexecutor/connectors/kv_cache_connector.py``
with the same classes; both places are tried.

When ``tensorrt_llm`` is importable, :data:`SchedulerBase` and :data:`WorkerBase` are
TensorRT-LLM's own ABCs, so the connector *is* a ``KvCacheConnectorScheduler`` /
``KvCacheConnectorWorker``. When it is not (this machine: TensorRT-LLM cannot be
installed without CUDA and NVIDIA's package index), they are the stand-alone classes
below, which declare the same abstract methods with the same signatures.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from typing import Any

__all__ = [
    "SchedulerBase",
    "WorkerBase",
    "StandaloneScheduler",
    "StandaloneWorker",
    "TRTLLM_INTERFACE",
    "USING_TRTLLM",
]

TRTLLM_INTERFACE = "TensorRT-LLM 1.2 (tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py)"

_MODULES = (
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",  # 1.1.x, 1.2.x
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",  # main
)


class StandaloneWorker(ABC):
    """``KvCacheConnectorWorker`` of TensorRT-LLM 1.2, for when TensorRT-LLM is absent."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._metadata: object = None
        super().__init__()

    def bind_connector_meta(self, metadata: object) -> None:
        self._metadata = metadata

    def _get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: Any) -> None: ...

    @abstractmethod
    def start_load_kv(self, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None: ...

    @abstractmethod
    def wait_for_save(self, stream: Any) -> None: ...

    @abstractmethod
    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]: ...


class StandaloneScheduler(ABC):
    """``KvCacheConnectorScheduler`` of TensorRT-LLM 1.2 (runs on rank 0 only)."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        super().__init__()

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> object: ...

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]: ...

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool: ...

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None: ...


def _bases() -> tuple[Any, Any, bool]:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return StandaloneScheduler, StandaloneWorker, False
    last: ImportError | None = None
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as exc:  # the other location
            last = exc
            continue
        return mod.KvCacheConnectorScheduler, mod.KvCacheConnectorWorker, True
    raise ImportError(
        f"tensorrt_llm is installed but has no KV cache connector module ({', '.join(_MODULES)}): "
        f"{last}"
    )


SchedulerBase, WorkerBase, USING_TRTLLM = _bases()
