"""Drop-in compatibility with the published ``mooncake`` Python package.

- :mod:`mooncake_core.compat.engine` is ``mooncake.engine``: ``TransferEngine``,
  ``TransferOpcode``, ``TransferNotify`` with the published names, signatures and
  0/negative return codes.
- :mod:`mooncake_core.compat.store` is ``mooncake.store``: ``MooncakeDistributedStore``
  and ``ReplicateConfig`` on top of :class:`mooncake_core.store.StoreClient`.

- ``mooncake.mooncake_config``, ``mooncake.http_metadata_server`` and
  ``mooncake.async_store`` (:data:`LAZY_MODULES`) are imported when first asked for.

:func:`install` registers these modules as ``mooncake``, ``mooncake.engine`` and
``mooncake.store`` in :data:`sys.modules` when the real package is absent (as PyMySQL's
``install_as_MySQLdb()`` does), and the :data:`LAZY_MODULES` through an import hook, so
code written for Mooncake runs unchanged. What of the published surface we leave out, and
why: :data:`mooncake_core.compat.inventory.NOT_PROVIDED`::

    import mooncake_core.compat
    mooncake_core.compat.install()
    from mooncake.engine import TransferEngine     # ours

The upstream-only environment variables we honour are listed in
:data:`mooncake_core.compat.engine.UPSTREAM_ENV` (one table; see docs/compat.md).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from mooncake_core.compat import engine
from mooncake_core.compat.buffer_pool import BufferPool, RegisteredBufferPool
from mooncake_core.compat.engine import TransferEngine, TransferNotify, TransferOpcode

__all__ = [
    "install",
    "uninstall",
    "installed",
    "engine",
    "TransferEngine",
    "TransferOpcode",
    "TransferNotify",
    "BufferPool",
    "RegisteredBufferPool",
]

logger = logging.getLogger(__name__)

#: upstream module name -> our module (the store part is imported on first use).
_MODULES = {
    "mooncake": "mooncake_core.compat",
    "mooncake.engine": "mooncake_core.compat.engine",
    "mooncake.store": "mooncake_core.compat.store",
}

#: further upstream modules, imported when first asked for (``import mooncake.X``).
LAZY_MODULES: dict[str, str] = {
    "mooncake.mooncake_config": "mooncake_core.compat.mooncake_config",
    "mooncake.http_metadata_server": "mooncake_core.compat.http_metadata_server",
    "mooncake.async_store": "mooncake_core.compat.async_store",
    "mooncake.buffer_pool": "mooncake_core.compat.buffer_pool",
    "mooncake.structured_object_store": "mooncake_core.compat.structured_object_store",
    "mooncake.cli_client": "mooncake_core.compat.cli_client",
    "mooncake.dataproto_catalog": "mooncake_core.compat.dataproto_catalog",
    "mooncake.reshard": "mooncake_core.compat.reshard",
    "mooncake.mooncake_store_service": "mooncake_core.compat.store_service",
    "mooncake.cli": "mooncake_core.compat.cli",
    "mooncake.cli_bench": "mooncake_core.compat.cli_bench",
    "mooncake.transfer_engine_topology_dump": "mooncake_core.compat.transfer_engine_topology_dump",
    "mooncake.mooncake_connector_v1": "mooncake_core.compat.mooncake_connector_v1",
    "mooncake.vllm_v1_proxy_server": "mooncake_core.compat.vllm_v1_proxy_server",
    "mooncake.pg": "mooncake_core.compat.pg",
    "mooncake.fabric_allocator_utils": "mooncake_core.compat.fabric_allocator_utils",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads ``mooncake.X`` as the already importable ``mooncake_core.compat.X``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the target module executed when it was imported."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the :data:`LAZY_MODULES` while :func:`install` is in effect."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not installed():
            return None
        ours = LAZY_MODULES.get(fullname)
        if ours is None:  # a submodule of a lazy package: mooncake.reshard.weight
            parent, _, leaf = fullname.rpartition(".")
            base = LAZY_MODULES.get(parent) or _SUBMODULES.get(parent)
            if base is None or importlib.util.find_spec(f"{base}.{leaf}") is None:
                return None
            ours = _SUBMODULES[fullname] = f"{base}.{leaf}"
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(ours))


_FINDER = _AliasFinder()
#: submodules of the lazy packages found so far (upstream name -> ours)
_SUBMODULES: dict[str, str] = {}


def __getattr__(name: str) -> Any:
    # ``import mooncake; mooncake.store`` after install(): load the store part lazily.
    if name == "store":
        return importlib.import_module("mooncake_core.compat.store")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _real_package_present() -> bool:
    mod = sys.modules.get("mooncake")
    if mod is not None:
        return mod is not sys.modules[__name__]
    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return False
    # extras/mooncake-compat's last-resort finder answers for ours, not for a published package
    return spec is not None and not getattr(spec.loader, "mooncake_core_fallback", False)


def installed() -> bool:
    """True if ``mooncake`` in :data:`sys.modules` is this package."""
    return sys.modules.get("mooncake") is sys.modules[__name__]


def install(*, force: bool = False) -> bool:
    """Make ``import mooncake.engine`` / ``mooncake.store`` load our implementation.

    Does nothing (returns False) when the published package is importable, unless
    ``force``. Idempotent: returns True when ours is (now) installed. The store module
    is registered only if it imports (it needs :mod:`mooncake_core.store`).
    """
    if installed():
        return True
    if not force and _real_package_present():
        logger.info(
            "the published mooncake package is installed; compat.install() leaves it in place"
        )
        return False
    modules: dict[str, ModuleType] = {}
    for upstream, ours in _MODULES.items():
        try:
            modules[upstream] = importlib.import_module(ours)
        except ImportError as exc:
            if upstream == "mooncake.store":
                logger.warning("mooncake.store not provided: %s", exc)
                continue
            raise
    for key in [k for k in sys.modules if k == "mooncake" or k.startswith("mooncake.")]:
        del sys.modules[key]  # with force: drop the real package's modules
    sys.modules.update(modules)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    logger.info("installed mooncake_core.compat as %s", ", ".join(sorted(modules)))
    return True


def uninstall() -> None:
    """Undo :func:`install` (for tests)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for upstream in [*_MODULES, *LAZY_MODULES, *_SUBMODULES]:
        mod = sys.modules.get(upstream)
        if mod is not None and mod.__name__.startswith("mooncake_core.compat"):
            del sys.modules[upstream]
