"""The shm transport's C-library lookup never forks.

``ctypes.util.find_library`` runs ``ldconfig -p`` (then gcc and ld) in subprocesses; in a
vLLM TP worker the fork held the process's memory-map lock for 30-90 s on a busy 2-core
machine, so a decode worker's first KV fetch took that long (issue 20, TP=2 PD).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from typing import Any

import pytest

from mooncake_core.transfer.transports import shm
from mooncake_core.transfer.types import READ, WRITE


def test_libc_is_loaded_without_a_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_subprocess(*a: Any, **k: Any) -> None:
        raise AssertionError("the libc lookup started a subprocess")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_subprocess)
    monkeypatch.setattr(os, "fork", no_subprocess)
    monkeypatch.setattr(shm, "_libc", None)
    lib = shm._cma()
    assert lib is shm._cma()  # resolved once
    assert lib.process_vm_readv.restype is ctypes.c_ssize_t


@pytest.mark.parametrize("op", [READ, WRITE])
def test_cross_memory_attach_copies_exactly(op: int) -> None:
    src = ctypes.create_string_buffer(os.urandom(4096), 4096)
    dst = ctypes.create_string_buffer(4096)
    a, b = ctypes.addressof(dst), ctypes.addressof(src)
    # READ copies remote -> local; WRITE local -> remote (our own pid as the peer)
    local, remote = (a, b) if op == READ else (b, a)
    shm.cma_copy(os.getpid(), op, local, remote, 4096)
    assert dst.raw == src.raw
