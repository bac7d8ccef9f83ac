"""Mooncake-core adapter for SGLang."""

from __future__ import annotations

__all__ = ["ENGINE"]

ENGINE = "sglang"
