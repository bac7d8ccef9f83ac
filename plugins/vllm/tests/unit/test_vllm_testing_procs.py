"""The engine tests' store master helper: it serves, stops, and dies with the process that
started it (a killed test run leaves no orphan master)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mooncake_vllm.testing import StoreMaster, stop_process

_ORPHAN = """
import sys, time
from mooncake_vllm.testing import StoreMaster
m = StoreMaster(sys.argv[1]).start().wait_ready(60)
print(m.proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too (its parent has not reaped it yet)
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False


def test_master_serves_and_stops(tmp_path: Path) -> None:
    import urllib.request

    with StoreMaster(tmp_path / "master.log") as m:
        m.wait_ready(60)
        with urllib.request.urlopen(m.http_url + "/stats", timeout=10) as r:
            assert r.status == 200
        assert m.proc is not None
    assert m.proc.poll() is not None


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is missing")
def test_master_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN, str(tmp_path / "master.log")],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        assert _alive(pid)
        parent.send_signal(signal.SIGKILL)  # never runs any clean-up
        parent.wait(10)
        deadline = time.monotonic() + 15
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the master outlived the killed process that started it"
    finally:
        stop_process(parent)  # type: ignore[arg-type]
