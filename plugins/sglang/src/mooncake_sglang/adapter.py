"""Registration of the SGLang adapter with mooncake-core's plugin manager.

Loaded through the ``mooncake_core.adapters`` entry-point group. It must not import
SGLang itself: engines are imported lazily, only when a connector is built.
"""

from __future__ import annotations

import importlib.util

from mooncake_core.plugins import AdapterInfo, hookimpl

ENGINE = "sglang"
ENGINE_MODULE = "sglang"
BACKEND = "mooncake_sglang.hicache:MooncakeCoreStorage"


def conformance_status() -> str:
    """The last conformance result recorded for this adapter (see docs/conformance.md)."""
    if importlib.util.find_spec("mooncake_conformance") is None:
        return "unknown (mooncake-conformance is not installed)"
    from mooncake_conformance.status import describe

    return describe(ENGINE, "mooncake_sglang")


@hookimpl
def mooncake_adapter_info() -> AdapterInfo:
    """Describe this adapter for ``mooncake-core plugins``."""
    return AdapterInfo(
        name=ENGINE,
        package="mooncake-sglang",
        engine="SGLang",
        engine_installed=importlib.util.find_spec(ENGINE_MODULE) is not None,
        conformance=conformance_status(),
        status=f"HiCache L3 backend {BACKEND} (--hicache-storage-backend dynamic); "
        "built-in 'mooncake' backend via mooncake_core.compat",
    )
