"""An inert ``torchvision`` for importing SGLang's host-pool modules on a CPU-only machine.

SGLang's ``mem_cache.pool_host`` pulls in model configs that import ``torchvision``;
PyPI's torchvision builds are CUDA ones that break on a CPU torch. :func:`install` puts an
inert stand-in module on ``sys.meta_path`` when torchvision is absent (tests and benches
only). Standard library only, and outside the adapter package: the SGLang tests install
it (``conftest.py``, ``_sglang_pd_role.py``), and ``mooncake-core bench sglang`` and the
published-Mooncake rank script (``benchmarks/published/_mooncake_sglang.py``, run by
another venv's Python) load this file by path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

__all__ = ["install"]


class _Inert:
    def __getattr__(self, name: str) -> _Inert:
        return self

    def __call__(self, *a: Any, **k: Any) -> _Inert:
        return self

    def __getitem__(self, k: Any) -> _Inert:
        return self

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, name: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        m = types.ModuleType(spec.name)
        m.__path__ = []

        def attr(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Inert()

        m.__getattr__ = attr  # type: ignore[method-assign]
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def install() -> None:
    """Install the stand-in once, and only when torchvision is not installed."""
    if importlib.util.find_spec("torchvision") is not None:
        return
    try:  # transformers caches "torchvision available?"; ask it before the stand-in exists
        from transformers.utils import import_utils

        import_utils.is_torchvision_available()
    except ImportError:
        pass
    if not any(type(f).__name__ == "_TorchvisionStandIn" for f in sys.meta_path):
        sys.meta_path.append(_TorchvisionStandIn())
