"""Mooncake-core adapter for TensorRT-LLM."""

from __future__ import annotations

__all__ = ["ENGINE"]

ENGINE = "trtllm"
