"""Mooncake-core adapter for LMDeploy."""

from __future__ import annotations

__all__ = ["ENGINE"]

ENGINE = "lmdeploy"
