"""Install ``mooncake_core.compat`` as ``mooncake`` inside vLLM processes.

vLLM's built-in ``MooncakeConnector`` (``from mooncake.engine import TransferEngine``)
and ``MooncakeStoreConnector`` (``from mooncake.store import MooncakeDistributedStore``)
import the published ``mooncake`` package. :func:`install_compat` makes those imports
load our implementation:

- ``MOONCAKE_CORE_COMPAT`` unset (or empty): install only when the published package
  is not importable (``mooncake_core.compat.install()`` leaves a real one in place);
- ``MOONCAKE_CORE_COMPAT=1`` (``true``/``yes``/``on``): install even over a published
  package (``install(force=True)``);
- ``MOONCAKE_CORE_COMPAT=0`` (``false``/``no``/``off``): never install.

Idempotent and never raises: vLLM calls its general plugins in every process, possibly
several times, and a failure here must not stop vLLM (our own connectors do not need
the compat layer).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from mooncake_core.config import env_str, parse_bool
from mooncake_core.errors import ConfigError

__all__ = ["ENV", "CPU_SHIM_ENV", "compat_mode", "install_compat", "install_cpu_workarounds"]

logger = logging.getLogger(__name__)

#: the switch (see the module docstring)
ENV = "MOONCAKE_CORE_COMPAT"


def _switch(name: str, environ: Mapping[str, str] | None) -> bool | None:
    """A yes/no switch (``force`` means yes); None when unset or not understood."""
    value = env_str(name, "", environ)
    if not value:
        return None
    if value.lower() == "force":
        return True
    try:
        return parse_bool(value, name)
    except ConfigError:
        logger.warning("%s=%r is not understood (use 1 or 0); treating it as unset", name, value)
        return None


def compat_mode(environ: Mapping[str, str] | None = None) -> str:
    """``"force"``, ``"off"`` or ``"auto"`` from ``MOONCAKE_CORE_COMPAT``."""
    on = _switch(ENV, environ)
    return "auto" if on is None else ("force" if on else "off")


def install_compat(environ: Mapping[str, str] | None = None) -> bool:
    """Register our ``mooncake`` / ``mooncake.engine`` / ``mooncake.store`` modules.

    Returns True when ours is installed after the call.
    """
    mode = compat_mode(environ)
    if mode == "off":
        return False
    try:
        from mooncake_core import compat
    except Exception as exc:  # noqa: BLE001 - never break vLLM start-up
        logger.warning(
            "mooncake_core.compat is not importable; vLLM's Mooncake connectors need "
            "the published mooncake package: %s",
            exc,
        )
        return False
    if compat.installed():
        return True
    try:
        done = compat.install(force=mode == "force")
    except Exception as exc:  # noqa: BLE001
        logger.warning("installing mooncake_core.compat as mooncake failed: %s", exc)
        return False
    if done:
        logger.debug("mooncake_core.compat installed as mooncake (%s)", mode)
    return done


# --------------------------------------------------------------------------- CPU workarounds
#: opt-in switch for :func:`install_cpu_workarounds`
CPU_SHIM_ENV = "MOONCAKE_CORE_CPU_SHIM"


def install_cpu_workarounds(environ: Mapping[str, str] | None = None) -> list[str]:
    """With ``MOONCAKE_CORE_CPU_SHIM=1`` on a host without an accelerator, patch the one
    accelerator-only torch call that stops vLLM 0.32.0's built-in ``MooncakeConnector`` on
    the CPU backend: ``torch.accelerator.current_device_index()`` in
    ``MooncakeConnectorWorker.__init__`` (``mooncake_connector.py:1186``) raises
    "Cannot access accelerator device when none is available"; patched to return 0
    (``CpuPlatform.set_device`` ignores it). vLLM's CPU worker already replaces
    ``torch.cuda.Event`` / streams with placeholders (``vllm/v1/worker/cpu/shm.py``), so
    ``MooncakeStoreConnector`` needs no patch.

    Off by default: unmodified, ``MooncakeConnector`` stops with exactly that error on CPU.
    Returns the names patched (empty when off, already patched, or an accelerator exists).
    """
    if not _switch(CPU_SHIM_ENV, environ):
        return []
    try:
        import torch
    except ImportError:
        return []
    patched: list[str] = []
    acc = getattr(torch, "accelerator", None)
    if (
        acc is not None
        and not acc.is_available()
        and not getattr(acc.current_device_index, "_mooncake_shim", False)
    ):
        original = acc.current_device_index

        def current_device_index() -> int:
            if acc.is_available():
                return int(original())
            return 0

        current_device_index._mooncake_shim = True  # type: ignore[attr-defined]
        acc.current_device_index = current_device_index
        patched.append("torch.accelerator.current_device_index")
    if patched:
        logger.warning(
            "%s=1: patched %s for vLLM's built-in MooncakeConnector on CPU",
            CPU_SHIM_ENV,
            ", ".join(patched),
        )
    return patched
