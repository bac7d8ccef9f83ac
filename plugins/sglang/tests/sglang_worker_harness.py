"""The SGLang harness factory as the conformance suite's worker processes load it.

A worker process (``mooncake_conformance.worker``) does not run this folder's
``conftest.py``, so it would import SGLang's host pools without the inert ``torchvision``
that a CPU-only machine needs. :func:`make_harness` installs the stand-in first, then
builds the adapter's real harness (:func:`mooncake_sglang.testing.harness.make_harness`).
The test fixtures put this folder on the workers' ``PYTHONPATH``.
"""

from __future__ import annotations

from typing import Any

import torchvision_stand_in


def preload() -> None:
    """Import SGLang's pools and storage classes once, so the conformance suite's worker
    processes fork from one process that did it (see ``mooncake_conformance.worker``)."""
    torchvision_stand_in.install()
    import sglang.srt.managers.cache_controller  # noqa: F401
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    import sglang.srt.mem_cache.storage  # noqa: F401
    from mooncake_sglang.testing.harness import import_sglang_pools

    import mooncake_core.compat  # noqa: F401

    import_sglang_pools()


def make_harness(spec: Any) -> Any:
    """Install the inert torchvision (only when it is absent), then build the harness."""
    torchvision_stand_in.install()
    from mooncake_sglang.testing.harness import make_harness as build

    return build(spec)
