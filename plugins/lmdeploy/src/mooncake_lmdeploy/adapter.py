"""Registration of the LMDeploy adapter with mooncake-core's plugin manager.

Loaded through the ``mooncake_core.adapters`` entry-point group. It must not import
LMDeploy itself: engines are imported lazily, only when a connector is built.
"""

from __future__ import annotations

import importlib.util

from mooncake_core.plugins import AdapterInfo, hookimpl

ENGINE = "lmdeploy"
ENGINE_MODULE = "lmdeploy"


def conformance_status() -> str:
    """The last conformance result recorded for this adapter (see docs/conformance.md)."""
    if importlib.util.find_spec("mooncake_conformance") is None:
        return "unknown (mooncake-conformance is not installed)"
    from mooncake_conformance.status import describe

    return describe(ENGINE, "mooncake_lmdeploy")


@hookimpl
def mooncake_adapter_info() -> AdapterInfo:
    """Describe this adapter for ``mooncake-core plugins``."""
    return AdapterInfo(
        name=ENGINE,
        package="mooncake-lmdeploy",
        engine="LMDeploy",
        engine_installed=importlib.util.find_spec(ENGINE_MODULE) is not None,
        conformance=conformance_status(),
        status="PD migration backend for --migration-backend Mooncake on our transfer engine "
        "(tcp/shm/rdma; registered by mooncake_lmdeploy.pth); LMDeploy's "
        "MooncakeStoreConnector on mooncake_core.compat; tested on LMDeploy's classes "
        "with CPU pools (its engine needs a GPU)",
    )
