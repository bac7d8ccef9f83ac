"""Local snapshots of the master's metadata (``--snapshot-dir``) and restore at start.

A real master process is killed (SIGKILL, no HA) after a periodic snapshot and started
again on the same port from the same directory; the holder client, still alive, re-attaches
by its heartbeats, and every object snapshotted reads back exactly from another client.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from store_support import Master, free_port, payload

from mooncake_core.store.client import StoreClient
from mooncake_core.store.snapshots import LocalSnapshots

pytestmark = [pytest.mark.timeout(120)]


def test_kill_the_master_and_restore_it_from_its_snapshot(tmp_path: Path) -> None:
    port, snap = free_port(), tmp_path / "snaps"
    args = ("--rpc-port", str(port), "--snapshot-dir", str(snap), "--snapshot-interval", "0.3")
    m = Master(tmp_path, *args, name="first")
    keys = [f"obj/{i}" for i in range(20)]
    with StoreClient(master=m.address, segment_size=8 << 20, failover_timeout_s=30) as holder:
        for k in keys:
            holder.put(k, payload(k, 40_000 + len(k)))
        holder.put("pinned", payload("pinned", 1000), hard_pin=True)
        time.sleep(1.2)  # a few periodic snapshots, all holding every object
        # retention 2: a write renames the new file into place, then deletes the oldest, so a
        # listing between the two sees 3 for a moment
        deadline = time.monotonic() + 2.0
        while len(files := LocalSnapshots(str(snap)).files()) > 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert 1 <= len(files) <= 2
        m.kill()
        m2 = Master(tmp_path, *args, name="second")
        try:
            assert m2.address == m.address
            with StoreClient(master=m2.address, segment_size=0) as reader:
                for k in keys:
                    assert reader.get(k) == payload(k, 40_000 + len(k))
                assert reader.query("pinned")["hard_pin"] is True
                # the holder is still registered and lends its segment for new objects
                holder.put("after", b"new")
                assert reader.get("after") == b"new"
            time.sleep(2.5)  # longer than a heartbeat period: the holder kept its liveness
            assert holder.get("obj/3") == payload("obj/3", 40_005)
        finally:
            m2.stop()
    # a clean stop wrote one more snapshot, which has "after"
    last = LocalSnapshots(str(snap)).latest()
    assert last is not None and any(e[1] == "after" for e in last[1] if e[0] == "obj")
    # a fresh start can skip restoring
    m3 = Master(tmp_path, *args, "--no-snapshot-restore", name="third")
    try:
        with StoreClient(master=m3.address, segment_size=1 << 20) as c:
            assert not c.exists("obj/0")
    finally:
        m3.stop()


def test_damaged_snapshots_are_skipped(tmp_path: Path) -> None:
    s = LocalSnapshots(str(tmp_path), retention=3)
    s.write([("client", "c", "h", "p", False)])
    time.sleep(0.01)
    bad = tmp_path / "snapshot-99999999999999999999.msgpack"
    bad.write_bytes(b"\xc1 not msgpack")
    found = s.latest()
    assert found is not None and found[1] == [["client", "c", "h", "p", False]]
