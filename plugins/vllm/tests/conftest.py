"""Fixtures for the vLLM adapter's tests: the tiny local model and the proxy.

Engine tests run real vLLM OpenAI servers in subprocesses (``VLLMServer``); they are
marked ``engine`` and ``slow`` and skip when vLLM is not installed. Their servers run with
``enforce_eager=True``: torch.compile's warm-up took 100-130 s per server when a module
started its servers together on these 2 cores, and none of the tests is about compiled
graphs (outputs are compared only between servers of the same module, all eager). Store
masters come from ``mooncake_vllm.testing.StoreMaster`` (they die with the test process).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mooncake_vllm.testing import build_tiny_llama
from vllm_helpers import HAVE_VLLM, ProxyProcess


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight 2-layer Llama plus a locally trained tokenizer (built once)."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    return build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")


@pytest.fixture
def proxy_factory() -> Iterator[Any]:
    made: list[ProxyProcess] = []

    def make(prefill: list[str], decode: list[str], log: Path, *extra: str) -> ProxyProcess:
        p = ProxyProcess(prefill, decode, log, *extra)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop()
