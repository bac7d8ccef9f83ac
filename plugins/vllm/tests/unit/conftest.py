"""Fixtures of the vLLM adapter's unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from vllm_helpers import thread_master


@pytest.fixture()
def master() -> Iterator[Any]:
    """A real store master in a thread of the test process (a test module may override it,
    e.g. with tenant quotas)."""
    with thread_master() as m:
        yield m
