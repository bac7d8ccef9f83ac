"""FAKE: stand-ins for TensorRT-LLM's request and config types (TensorRT-LLM cannot run here).

TensorRT-LLM cannot be installed on a machine without CUDA and NVIDIA's package index,
so tests build these instead. Each carries only what the connector reads, under the
names TensorRT-LLM 1.2 uses:

- :class:`FakeLlmArgs`: ``TorchLlmArgs`` (``model``, ``dtype``, ``tensor_parallel_size``,
  ``kv_cache_config``).
- :class:`FakeKvCacheConfig`: ``KvCacheConfig`` (``tokens_per_block``, ``dtype``).
- :class:`FakeLlmRequest`: ``LlmRequest`` (``request_id``, ``get_tokens(beam)``,
  ``prompt_len``).
- :class:`FakeRequestData` / :class:`FakeSchedulerOutput`: ``RequestData`` and
  ``SchedulerOutput`` of ``kv_cache_connector.py`` (``new_requests``,
  ``cached_requests``; ``request_id``, ``new_tokens``, ``new_block_ids``,
  ``computed_position``, ``num_scheduled_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "FakeKvCacheConfig",
    "FakeLlmArgs",
    "FakeLlmRequest",
    "FakeRequestData",
    "FakeSchedulerOutput",
]


@dataclass
class FakeKvCacheConfig:
    """FAKE ``tensorrt_llm.llmapi.KvCacheConfig``: the fields the connector reads."""

    tokens_per_block: int = 32
    dtype: str = "auto"


@dataclass
class FakeLlmArgs:
    """FAKE ``TorchLlmArgs``: the fields the connector reads."""

    model: str
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    kv_cache_config: FakeKvCacheConfig = field(default_factory=FakeKvCacheConfig)


@dataclass
class FakeLlmRequest:
    """FAKE ``LlmRequest``: an id and its tokens (the prompt, before generation)."""

    request_id: int
    tokens: list[int]

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    def get_tokens(self, beam: int) -> list[int]:
        return list(self.tokens)


@dataclass
class FakeRequestData:
    """FAKE ``RequestData`` (one request of one step)."""

    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class FakeSchedulerOutput:
    """FAKE ``SchedulerOutput`` (what ``build_connector_meta`` gets each step)."""

    new_requests: list[FakeRequestData] = field(default_factory=list)
    cached_requests: list[FakeRequestData] = field(default_factory=list)
