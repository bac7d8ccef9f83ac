"""The suite's store (:class:`mooncake_conformance.store.StoreCluster`) never outlives the process
that started it: a master and node left behind by a killed test run used to keep running as
orphans (one was found hours later, and did not even stop on SIGTERM within 5 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

CHILD = """
import sys, time
from mooncake_conformance.store import StoreCluster
c = StoreCluster(segment_size="16MB").start()
print(c.master.pid, c.node.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_master_and_node_exit_when_the_test_process_is_killed() -> None:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids), pids
        proc.kill()  # no close(), no __exit__, no atexit: as a CI timeout kills pytest
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "master/node outlived the killed test process"
    finally:
        proc.kill()
        proc.wait()
        for p in pids:
            if _alive(p):
                os.kill(p, 9)
