"""Make LMDeploy use mooncake-core in every process, without editing LMDeploy.

LMDeploy has no plugin entry points, and its migration backend is chosen from a fixed enum
(``--migration-backend {DLSlime,Mooncake}``). So installing ``mooncake-lmdeploy`` puts a
file ``mooncake_lmdeploy.pth`` into site-packages (see the package's ``setup.py``). Python
runs its one line at start-up in every interpreter of that environment (the API server,
the engine process, ray workers), and that line calls :func:`install`, which only adds a
finder to :data:`sys.meta_path`: nothing is imported, start-up stays as fast as before.

When (and only when) a process imports LMDeploy's modules, the finder runs after them:

- after ``lmdeploy.pytorch.disagg.backend`` (its ``__init__`` registers LMDeploy's own
  ``DLSlime``/``Mooncake`` backends): :func:`mooncake_lmdeploy.migration.register`
  replaces the ``Mooncake`` entry of ``MIGRATION_BACKENDS`` with ours (``force=True``).
  ``--migration-backend Mooncake`` then means mooncake-core's transfer engine.
- after ``lmdeploy.pytorch.engine.engine_loop``:
  :func:`mooncake_lmdeploy.per_request.patch_engine_loop` makes a failed migration fail
  only its request (LMDeploy 0.18.0's decode engine otherwise stops on it).
- after ``lmdeploy.pytorch.kv_connector``: ``mooncake_core.compat.install()`` makes
  ``mooncake.store`` our compat store, so LMDeploy's ``MooncakeStoreConnector`` (which
  imports ``mooncake.store.MooncakeDistributedStore`` when it starts) runs on our store.
- after LMDeploy's store-connector modules (``...kv_connector.mooncake.store.data``,
  ``.worker``, ``.worker_threads``): :func:`mooncake_lmdeploy.store_keys.patch` makes
  their ``build_store_key`` put the TP size into keys (LMDeploy's keys lack it, so a TP-1
  and a TP-2 engine of one model would share keys for different bytes).

With the published ``mooncake`` package also installed: the migration backend is still
ours (LMDeploy's ``Mooncake`` backend imports ``mooncake.engine`` only when a link is
made, and our class replaced it before that); ``mooncake.store`` stays the published
package (``compat.install`` never shadows it), so the store connector talks to a
published master. ``MOONCAKE_LMDEPLOY_AUTOLOAD=0`` turns both off (LMDeploy's own classes
run); ``MOONCAKE_LMDEPLOY_FORCE_COMPAT=1`` installs our store even over the published one.

This module must stay cheap to import: it runs in every Python process of the venv.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["install", "uninstall", "HOOKS", "AUTOLOAD_ENV", "FORCE_COMPAT_ENV"]

logger = logging.getLogger(__name__)

AUTOLOAD_ENV = "MOONCAKE_LMDEPLOY_AUTOLOAD"
FORCE_COMPAT_ENV = "MOONCAKE_LMDEPLOY_FORCE_COMPAT"
_OFF = {"0", "false", "no", "off"}


def _flag(name: str) -> bool:
    # os.environ directly: importing mooncake_core.config here would slow every start-up
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _register_backend(module: ModuleType) -> None:
    from mooncake_lmdeploy.migration import register

    register()


def _patch_engine_loop(module: ModuleType) -> None:
    from mooncake_lmdeploy.per_request import patch_engine_loop

    patch_engine_loop(module)


def _install_compat(module: ModuleType) -> None:
    import mooncake_core.compat as compat

    compat.install(force=_flag(FORCE_COMPAT_ENV))


def _tp_size_keys(module: ModuleType) -> None:
    from mooncake_lmdeploy.store_keys import patch

    patch(module)


#: LMDeploy module -> what runs right after it has executed
HOOKS: dict[str, Callable[[ModuleType], None]] = {
    "lmdeploy.pytorch.disagg.backend": _register_backend,
    "lmdeploy.pytorch.kv_connector": _install_compat,
    "lmdeploy.pytorch.engine.engine_loop": _patch_engine_loop,
    # store keys with the TP size (mooncake_lmdeploy.store_keys.MODULES; data first)
    "lmdeploy.pytorch.kv_connector.mooncake.store.data": _tp_size_keys,
    "lmdeploy.pytorch.kv_connector.mooncake.store.worker": _tp_size_keys,
    "lmdeploy.pytorch.kv_connector.mooncake.store.worker_threads": _tp_size_keys,
}


class _After(importlib.abc.Loader):
    """Wraps a module's loader: runs the hook once the module has executed."""

    def __init__(self, inner: importlib.abc.Loader, hook: Callable[[ModuleType], None]) -> None:
        self.inner = inner
        self.hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        try:
            self.hook(module)
        except Exception:  # never break LMDeploy's import over our hook
            logger.exception("mooncake-lmdeploy: hook after %s failed", module.__name__)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        hook = HOOKS.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _After(spec.loader, hook)
                return spec
        return None


_FINDER = _Finder()


def install() -> bool:
    """Add the finder (idempotent); hooks for modules already imported run now.

    Returns False when ``MOONCAKE_LMDEPLOY_AUTOLOAD`` is off."""
    if os.environ.get(AUTOLOAD_ENV, "").strip().lower() in _OFF:
        return False
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    for name, hook in HOOKS.items():
        mod = sys.modules.get(name)
        if mod is not None:
            try:
                hook(mod)
            except Exception:  # as in _After: never break the host process
                logger.exception("mooncake-lmdeploy: hook for %s failed", name)
    return True


def uninstall() -> None:
    """Remove the finder (registrations already made stay)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
