"""``bench vllm`` reaps its children on every exit path (no vLLM needed: ``sleep`` stands in).

A child script plays the bench: it installs :class:`ChildReaper`, starts a tracked process
group (a ``sh`` with a ``sleep`` child, like a vLLM server with its engine process) and
waits. The test then ends it by SIGTERM, SIGINT or SIGKILL (no handler runs: the watchdog
must do it) and checks that the whole group is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

_BENCH = r"""
import subprocess, sys, time
from mooncake_vllm.bench_reap import ChildReaper
r = ChildReaper().install()
p = r.popen(["sh", "-c", "sleep 300 & sleep 300; wait"])
print(p.pid, flush=True)
if sys.argv[1] == "return":
    sys.stdin.readline()
    r.reap()
    sys.exit(0)
time.sleep(300)
"""


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # zombies still count for killpg(0): look for a live member
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL", "return"])
def test_children_reaped(how: str) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-c", _BENCH, how],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    assert bench.stdout is not None
    line = bench.stdout.readline()
    assert line, "the bench stand-in did not start its child"
    pgid = int(line)
    try:
        assert _alive(pgid)
        assert bench.stdin is not None
        if how == "return":
            bench.stdin.close()
        else:
            time.sleep(0.3)  # the watchdog has read the group
            bench.send_signal(getattr(signal, how))
        bench.wait(30)
        deadline = time.monotonic() + 30
        while _alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pgid), f"children still running after the bench ended by {how}"
        if how in ("SIGTERM", "SIGINT"):
            assert bench.returncode == 128 + getattr(signal, how)
    finally:
        if _alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()
            bench.wait(5)
