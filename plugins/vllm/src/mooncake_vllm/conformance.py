"""Moved to :mod:`mooncake_vllm.testing.harness`; this name re-exports it for old factories.

Use ``mooncake_vllm.testing.harness:make_harness`` in new code.
"""

from __future__ import annotations

from mooncake_vllm.testing.harness import VLLMStoreHarness, allocate_cpu_kv_caches, make_harness

__all__ = ["VLLMStoreHarness", "make_harness", "allocate_cpu_kv_caches"]
