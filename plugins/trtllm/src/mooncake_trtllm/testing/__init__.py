"""Test support for mooncake-trtllm: FAKE stand-ins for TensorRT-LLM's types (it cannot
run here) and the conformance harness driving the connector in TensorRT-LLM's call order."""

from __future__ import annotations

from mooncake_trtllm.testing.standins import (
    FakeKvCacheConfig,
    FakeLlmArgs,
    FakeLlmRequest,
    FakeRequestData,
    FakeSchedulerOutput,
)

__all__ = [
    "FakeKvCacheConfig",
    "FakeLlmArgs",
    "FakeLlmRequest",
    "FakeRequestData",
    "FakeSchedulerOutput",
]
