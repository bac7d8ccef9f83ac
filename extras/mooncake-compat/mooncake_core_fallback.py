"""``import mooncake`` without ``install()``: the last-resort finder of mooncake-core.

:func:`register` (run at start-up by ``mooncake_core_fallback.pth``) appends a finder to the
END of :data:`sys.meta_path`. Python asks it only after every path finder failed to find a
top-level ``mooncake``, i.e. when the published package is not installed; it then runs
``mooncake_core.compat.install()``, which puts our modules into :data:`sys.modules` as
``mooncake``, ``mooncake.engine``, ``mooncake.store`` and adds the hook for the others.
Start-up cost: this module only (standard library imports); mooncake-core is imported on
the first ``import mooncake``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

__all__ = ["MooncakeFallback", "register"]


class _Loader(importlib.abc.Loader):
    #: read by mooncake_core.compat: a spec with this loader is not the published package
    mooncake_core_fallback = True

    def __init__(self) -> None:
        self._spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        from mooncake_core import compat

        compat.install(force=True)  # reached only when no other `mooncake` was found
        module = sys.modules["mooncake"]
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set our spec on the module; give mooncake_core.compat its own back
        module.__spec__ = self._spec


class MooncakeFallback(importlib.abc.MetaPathFinder):
    """Finds a top-level ``mooncake`` (ours) when nothing before it did."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "mooncake":
            return None
        return importlib.machinery.ModuleSpec("mooncake", _Loader(), is_package=True)


def register() -> None:
    """Append the finder to :data:`sys.meta_path` (once)."""
    if not any(type(f).__name__ == "MooncakeFallback" for f in sys.meta_path):
        sys.meta_path.append(MooncakeFallback())
