"""Test support for the SGLang adapter (no SGLang or torch import here).

- :mod:`mooncake_sglang.testing.harness`: the conformance harness on SGLang's real host
  pools and HiCache controller methods (factory
  ``mooncake_sglang.testing.harness:make_harness``, also reachable as
  ``mooncake_sglang.testing:make_harness``); imports torch and SGLang only when used.

On a CPU-only machine without torchvision, SGLang's host pools need an inert
``torchvision`` first: the SGLang tests' ``torchvision_stand_in`` (their ``conftest.py``
installs it). The vLLM adapter follows the same scheme (``mooncake_vllm.testing.harness``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["make_harness", "SGLangHarness", "import_sglang_pools", "build_host_pool"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mooncake_sglang.testing import harness

        return getattr(harness, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
