"""Registration of the TensorRT-LLM adapter with mooncake-core's plugin manager.

Loaded through the ``mooncake_core.adapters`` entry-point group. It must not import
TensorRT-LLM itself: engines are imported lazily, only when a connector is built.
"""

from __future__ import annotations

import importlib.util

from mooncake_core.plugins import AdapterInfo, hookimpl

ENGINE = "trtllm"
ENGINE_MODULE = "tensorrt_llm"
CONNECTOR = "mooncake_trtllm.connector"


def conformance_status() -> str:
    """The last conformance result recorded for this adapter (see docs/conformance.md)."""
    if importlib.util.find_spec("mooncake_conformance") is None:
        return "unknown (mooncake-conformance is not installed)"
    from mooncake_conformance.status import describe

    return describe(ENGINE, "mooncake_trtllm")


@hookimpl
def mooncake_adapter_info() -> AdapterInfo:
    """Describe this adapter for ``mooncake-core plugins``."""
    return AdapterInfo(
        name=ENGINE,
        package="mooncake-trtllm",
        engine="TensorRT-LLM",
        engine_installed=importlib.util.find_spec(ENGINE_MODULE) is not None,
        conformance=conformance_status(),
        status=f"KV cache connector {CONNECTOR} (kv_connector_config, TensorRT-LLM 1.2 "
        "interface); tested with FAKE stand-ins for TensorRT-LLM's request/config types "
        "(TensorRT-LLM cannot be installed here: none of its code ran)",
    )
