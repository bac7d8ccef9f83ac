"""HA: two masters on a real etcd; SIGKILL the leader, the standby takes over, nothing
acknowledged is lost."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import pytest
from store_support import Agent, AgentError, Master

pytestmark = [pytest.mark.slow, pytest.mark.etcd]


def _role(m: Master) -> str:
    try:
        status, body = m.http("/role")
    except OSError:
        return "down"
    return str(json.loads(body)["role"]) if status == 200 else "down"


def _wait_role(m: Master, role: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if _role(m) == role:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"master did not become {role} within {timeout}s (is {_role(m)})")


@pytest.mark.timeout(150)
def test_leader_killed_standby_takes_over_without_losing_acknowledged_objects(
    etcd_url: str, tmp_path: Path
) -> None:
    cluster = f"ha-{uuid.uuid4().hex[:8]}"
    ha = [
        "--ha",
        etcd_url,
        "--cluster-id",
        cluster,
        "--ha-lease-ttl",
        "2",
        "--ha-snapshot-every",
        "40",
    ]
    m1 = Master(tmp_path, *ha, name="m1")
    masters = [m1]
    agents: list[Agent] = []
    stop = threading.Event()
    try:
        _wait_role(m1, "leader", 15)
        m2 = Master(tmp_path, *ha, name="m2")
        masters.append(m2)
        _wait_role(m2, "standby", 15)
        agents = [
            Agent(etcd_url, segment_size=24 << 20, cluster_id=cluster, log=tmp_path / f"a{i}.log")
            for i in range(3)
        ]
        writer, reader, _h = agents
        # an HA master logs each commit before answering it, so it takes no early commits
        assert writer.call("attr", name="_early") is False
        acked: list[tuple[str, int]] = []
        for i in range(30):
            size = [1000, 100_000, 1 << 20][i % 3]
            writer.call("put", key=f"before/{i}", size=size, replica_num=2)
            acked.append((f"before/{i}", size))
        writer.call("put", key="pinned", size=5000, hard_pin=True)
        assert (
            reader.call("call", method="remove", args=["before/0"], kwargs={"force": True}) is None
        )
        acked.pop(0)

        failures: list[str] = []

        def keep_writing() -> None:  # small objects, at most 2000: no eviction may muddle the check
            i = 0
            while not stop.is_set() and i < 2000:
                key = f"during/{i}"
                try:
                    writer.call("put", key=key, size=5000)
                    acked.append((key, 5000))
                except AgentError as exc:
                    failures.append(f"{key}: {exc}")
                i += 1

        t = threading.Thread(target=keep_writing)
        t.start()
        time.sleep(0.5)
        m1.kill()  # SIGKILL the leader mid-stream
        took = _wait_role(m2, "leader", 10)
        assert took < 5.0, f"standby took {took:.2f}s to take over"
        time.sleep(1.0)  # the writer carries on against the new leader
        stop.set()
        t.join(timeout=60)
        assert not failures, failures[:3]
        assert len([k for k, _ in acked if k.startswith("during/")]) > 3
        assert 'method="put_confirm"' not in m2.http("/metrics")[1]
        # no acknowledged object lost; byte-exact from a different client process
        for key, size in acked:
            assert reader.call("get", key=key) == {"size": size, "match": True}, key
        assert (
            reader.call("call", method="exists", args=["before/0"]) is False
        )  # removals replicated too
        q = json.loads(m2.http("/query_key?key=pinned")[1])
        assert q["hard_pin"] is True
        # the new leader keeps serving new work, and its metrics show the objects
        writer.call("put", key="after", size=2 << 20, replica_num=2)
        assert reader.call("get", key="after") == {"size": 2 << 20, "match": True}
        metrics = m2.http("/metrics")[1]
        assert "mooncake_master_is_leader 1" in metrics
        assert "mooncake_master_evictions_total 0" in metrics
        # a restarted old master rejoins as a standby and follows the log
        m3 = Master(tmp_path, *ha, name="m3")
        masters.append(m3)
        _wait_role(m3, "standby", 15)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = json.loads(m3.http("/stats")[1])
            if st["objects"] == json.loads(m2.http("/stats")[1])["objects"]:
                break
            time.sleep(0.1)
        assert st["objects"] == json.loads(m2.http("/stats")[1])["objects"]
        # the oplog was compacted: a snapshot exists, at most 2 are kept (the default
        # retention), and the log below the oldest one kept is gone
        from mooncake_core.store.ha import Snapshots, StoreEtcd

        etcd = StoreEtcd(etcd_url, cluster)
        try:
            snap = Snapshots(etcd).load()
            assert snap is not None and snap[0] > 0
            kept = Snapshots(etcd).seqs()
            assert 1 <= len(kept) <= 2 and kept[-1] == snap[0], kept
            first = etcd.read_log(0, limit=1)  # empty when nothing was logged after the snapshot
            assert not first or first[0][0] >= kept[0], (first[0][0], kept)
        finally:
            etcd.close()
        assert "loaded snapshot" in Path(m3.log.name).read_text()
    finally:
        stop.set()
        for a in agents:
            a.stop()
        for m in masters:
            m.stop()


@pytest.mark.timeout(60)
def test_a_deposed_leader_cannot_write_snapshot_parts(etcd_url: str) -> None:
    """Every snapshot write is fenced on the leader key: a master that lost it changes nothing."""
    from mooncake_core.errors import MetadataError
    from mooncake_core.store.ha import LeaderInfo, Snapshots, StoreEtcd

    etcd = StoreEtcd(etcd_url, f"fence-{uuid.uuid4().hex[:8]}")
    try:
        old, new = LeaderInfo("old", "127.0.0.1:1"), LeaderInfo("new", "127.0.0.1:2")
        assert etcd.campaign(old, etcd.grant_lease(30))
        Snapshots(etcd).write(old, 5, [["put", "k", 1]])
        assert Snapshots(etcd).load() == (5, [["put", "k", 1]])
        etcd.delete(etcd.leader_key)  # the old leader's lease ran out; another master wins
        assert etcd.campaign(new, etcd.grant_lease(30))
        new_entries = [["put", f"n{i}", i] for i in range(3)]
        Snapshots(etcd).write(new, 7, new_entries)
        before = etcd.get_prefix(etcd.prefix + "snap/")
        # the deposed master, unaware, snapshots at the new leader's seq with other contents
        with pytest.raises(MetadataError, match="no longer the leader"):
            Snapshots(etcd).write(old, 7, [["put", "stale", 0]])
        assert etcd.get_prefix(etcd.prefix + "snap/") == before
        assert Snapshots(etcd).load() == (7, new_entries)
    finally:
        etcd.close()
