"""Fixtures for the vLLM adapter's tests: the tiny local model and the proxy.

Engine tests run real vLLM OpenAI servers in subprocesses (``VLLMServer``); they are
marked ``engine`` and ``slow`` and skip when vLLM is not installed. Their servers run with
``enforce_eager=True``: torch.compile's warm-up took 100-130 s per server when a module
started its servers together on these 2 cores, and none of the tests is about compiled
graphs (outputs are compared only between servers of the same module, all eager). Store
masters come from ``mooncake_vllm.testing.StoreMaster`` (they die with the test process).
Servers of one module start together; with ``fork_engine=True`` each imports vLLM once
(its engine core is forked, not spawned; see ``mooncake_vllm.testing.forked_engine``).

``vllm_reference`` is one plain eager server (no connector) shared by the modules that
compare their outputs against a monolithic reference (``test_vllm_pd``,
``test_vllm_builtin_compat``): started by the first module that asks for it, beside that
module's own servers, and stopped after the last test that uses it (or at the end of the
session). Tests only send it completions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mooncake_vllm.testing import VLLMServer, build_tiny_llama
from vllm_helpers import BLOCK, HAVE_VLLM, ProxyProcess

REFERENCE_FIXTURE = "vllm_reference"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight 2-layer Llama plus a locally trained tokenizer (built once)."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    return build_tiny_llama(tmp_path_factory.getbasetemp() / "tiny-llama")


class _SharedReference:
    """The one reference server of the session, and the last test that needs it."""

    def __init__(self) -> None:
        self.server: VLLMServer | None = None
        self.last_user: str | None = None

    def get(self, model: Path, logs: Path) -> VLLMServer:
        """The running reference server, started (not yet waited for) when there is none."""
        s = self.server
        if s is None or s.proc is None or s.proc.poll() is not None:
            s = VLLMServer(
                model,
                name="reference",
                log_path=logs / "reference.log",
                block_size=BLOCK,
                enforce_eager=True,
                fork_engine=True,
            )
            self.server = s.start()
        return s

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


_REFERENCE = _SharedReference()


@pytest.fixture(scope="module")
def vllm_reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> VLLMServer:
    """The shared monolithic reference (eager, block size ``BLOCK``), maybe still starting:
    call ``wait_ready`` beside the module's own servers."""
    return _REFERENCE.get(tiny_model, tmp_path_factory.getbasetemp())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    users = [i.nodeid for i in items if REFERENCE_FIXTURE in getattr(i, "fixturenames", ())]
    _REFERENCE.last_user = users[-1] if users else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield
    if item.nodeid == _REFERENCE.last_user:
        _REFERENCE.stop()


def pytest_sessionfinish() -> None:
    _REFERENCE.stop()


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
