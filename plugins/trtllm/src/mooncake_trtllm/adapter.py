"""Registration of the TensorRT-LLM adapter with mooncake-core's plugin manager.

Loaded through the ``mooncake_core.adapters`` entry-point group. It must not import
TensorRT-LLM itself: engines are imported lazily, only when a connector is built.
"""

from __future__ import annotations

import importlib.util

from mooncake_core.plugins import AdapterInfo, hookimpl

ENGINE = "trtllm"
ENGINE_MODULE = "tensorrt_llm"


@hookimpl
def mooncake_adapter_info() -> AdapterInfo:
    """Describe this adapter for ``mooncake-core plugins``."""
    return AdapterInfo(
        name=ENGINE,
        package="mooncake-trtllm",
        engine="TensorRT-LLM",
        engine_installed=importlib.util.find_spec(ENGINE_MODULE) is not None,
        conformance="not yet run",
        status="skeleton: registration only",
    )
