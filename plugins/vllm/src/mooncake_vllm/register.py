"""``vllm.general_plugins`` entry point: make our connectors selectable by name.

vLLM loads general plugins in every process it starts (API server, EngineCore,
workers), possibly several times, so :func:`register` is idempotent: it adds
``MooncakeCoreConnector`` and ``MooncakeCoreStoreConnector`` to vLLM's
``KVConnectorFactory`` only when the names are not there yet. Only this function
imports vLLM; importing the module does not.

It also installs ``mooncake_core.compat`` as the ``mooncake`` package (see
:mod:`mooncake_vllm.compat_shim`) so that vLLM's built-in ``MooncakeConnector`` and
``MooncakeStoreConnector`` run on our implementation when the published package is
absent, or always with ``MOONCAKE_CORE_COMPAT=1``.
"""

from __future__ import annotations

import logging

__all__ = ["CONNECTORS", "register"]

logger = logging.getLogger(__name__)

# name -> (module, class)
CONNECTORS: dict[str, tuple[str, str]] = {
    "MooncakeCoreConnector": ("mooncake_vllm.connector", "MooncakeCoreConnector"),
    "MooncakeCoreStoreConnector": ("mooncake_vllm.store_connector", "MooncakeCoreStoreConnector"),
}


def register() -> None:
    """Register our connectors in vLLM's connector factory (once per process)."""
    from mooncake_vllm.compat_shim import install_compat, install_cpu_workarounds

    install_compat()
    install_cpu_workarounds()
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM absent or too old: nothing to register with
        return
    registry = getattr(KVConnectorFactory, "_registry", {})
    for name, (module, cls) in CONNECTORS.items():
        if name in registry:
            continue
        try:
            KVConnectorFactory.register_connector(name, module, cls)
        except ValueError:  # a concurrent registration won the race
            continue
        logger.debug("registered vLLM KV connector %s -> %s.%s", name, module, cls)
