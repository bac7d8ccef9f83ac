"""Test support for the vLLM adapter: one package, two parts (no vLLM or torch import here).

- :mod:`mooncake_vllm.testing.server`: real-engine helpers for tests, the PD demo and the
  benchmark: a tiny local Llama (:func:`build_tiny_llama`), :class:`VLLMServer` (a vLLM
  OpenAI server in a subprocess), HTTP helpers, connector configs and counters; re-exported
  here.
- :mod:`mooncake_vllm.testing.procs`: the store master of the engine tests
  (:class:`StoreMaster`, dies with its parent) and :func:`stop_process`; re-exported here.
- :mod:`mooncake_vllm.testing.harness`: the conformance harness of
  ``MooncakeCoreStoreConnector`` (factory ``mooncake_vllm.testing.harness:make_harness``,
  also reachable as ``mooncake_vllm.testing:make_harness``); imports torch and vLLM only
  when a harness is built.

The SGLang adapter follows the same scheme (``mooncake_sglang.testing.harness``).
"""

from __future__ import annotations

from typing import Any

from mooncake_vllm.testing.procs import StoreMaster, stop_process
from mooncake_vllm.testing.server import (
    VLLMServer,
    build_tiny_llama,
    engine_env,
    free_port,
    http_json,
    pd_transfer_config,
    read_counters,
    store_transfer_config,
    stream_ttft,
)

__all__ = [
    "build_tiny_llama",
    "VLLMServer",
    "free_port",
    "engine_env",
    "http_json",
    "stream_ttft",
    "read_counters",
    "pd_transfer_config",
    "store_transfer_config",
    "StoreMaster",
    "stop_process",
    "make_harness",
]


def __getattr__(name: str) -> Any:
    if name in ("make_harness", "VLLMStoreHarness", "allocate_cpu_kv_caches"):
        from mooncake_vllm.testing import harness

        return getattr(harness, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
