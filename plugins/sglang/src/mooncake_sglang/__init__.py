"""Mooncake-core adapter for SGLang.

- :mod:`mooncake_sglang.hicache`: ``MooncakeCoreStorage``, a HiCache L3 backend
  (``--hicache-storage-backend dynamic``; imports SGLang).
- :mod:`mooncake_sglang.plugin`: the ``sglang.srt.plugins`` hook that puts
  ``mooncake_core.compat`` under SGLang's built-in mooncake backends.
- :mod:`mooncake_sglang.keys`, :mod:`mooncake_sglang.layout`: page keys and host-pool
  layouts (no SGLang import).
- :mod:`mooncake_sglang.testing`: test support; ``testing.harness`` is the conformance
  harness on SGLang's real classes.
- :mod:`mooncake_sglang.bench`: ``mooncake-core bench sglang`` (entry-point group
  ``mooncake_core.cli``).
"""

from __future__ import annotations

__all__ = ["ENGINE", "BACKEND_MODULE", "BACKEND_CLASS"]

ENGINE = "sglang"
BACKEND_MODULE = "mooncake_sglang.hicache"
BACKEND_CLASS = "MooncakeCoreStorage"
