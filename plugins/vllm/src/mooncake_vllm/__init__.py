"""Mooncake-core adapter for vLLM."""

from __future__ import annotations

__all__ = ["ENGINE"]

ENGINE = "vllm"
