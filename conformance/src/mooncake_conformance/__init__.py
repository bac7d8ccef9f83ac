"""Abstract conformance suites for mooncake-core adapters (see plugin.py)."""

from __future__ import annotations

__all__: list[str] = []
