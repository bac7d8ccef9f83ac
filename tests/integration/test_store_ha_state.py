"""HA state beyond the object table, on a real etcd with real master processes:

- snapshots in etcd: the leader writes them periodically (retention kept), the whole master
  group is SIGKILLed, a fresh master restores the newest snapshot plus the oplog after it,
  clients re-attach, and every object reads back byte-exact (and a replica task finished
  before the snapshots is known there by its id);
- leases and pins survive a takeover: the new leader refuses to remove a leased or
  hard-pinned object (code -706 in the published API), eviction skips pinned objects, and
  the remove works once the lease ends. In the same takeover: a hot key's extra replica is
  known as extra by the new leader, which drops it once the key cools; a replica copy task
  queued for a (SIGSTOPped) client before the takeover is known to the new leader (same id,
  its lease honoured) and completes there once the client runs again.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from store_support import Agent, Master, payload

from mooncake_core.compat.store_types import OBJECT_HAS_LEASE, _code
from mooncake_core.errors import ObjectNotFound
from mooncake_core.store.client import StoreClient
from mooncake_core.store.ha import Snapshots, StoreEtcd
from mooncake_core.store.protocol import ObjectBusy
from mooncake_core.transfer.procfs import all_threads_stopped

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(90)]


def _role(m: Master) -> str:
    try:
        status, body = m.http("/role")
    except OSError:
        return "down"
    return str(json.loads(body)["role"]) if status == 200 else "down"


def _wait(pred: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout}s")


def test_whole_group_killed_a_new_master_restores_from_etcd(etcd_url: str, tmp_path: Path) -> None:
    cluster = f"snap-{uuid.uuid4().hex[:8]}"
    ha = ("--ha", etcd_url, "--cluster-id", cluster, "--ha-lease-ttl", "2")
    snaps = ("--snapshot-interval", "0.5", "--snapshot-retention", "2")
    etcd = StoreEtcd(etcd_url, cluster)
    m1 = Master(tmp_path, *ha, *snaps, "--ha-snapshot-every", "100000", name="m1")
    masters = [m1]
    try:
        _wait(lambda: _role(m1) == "leader", 15, "m1 leads")
        url = etcd_url
        with StoreClient(
            master=url, cluster_id=cluster, segment_size=16 << 20, failover_timeout_s=30
        ) as holder:
            sizes = {f"obj/{i}": 30_000 + 997 * i for i in range(20)}
            sizes["pinned"] = 1000
            for k, n in sizes.items():
                holder.put(k, payload(k, n), hard_pin=k == "pinned")
            with StoreClient(  # a finished copy task: the snapshots below carry it
                master=url, cluster_id=cluster, segment_size=1 << 20, failover_timeout_s=30
            ) as other:
                tid = holder._call(
                    "create_replica_task",
                    (holder.client_id, "copy", "obj/1", [other.segment_names[0]], ""),
                )
                _wait(
                    lambda: holder._call("query_replica_task", (tid,))["status"] == 3,
                    10,
                    "the copy task",
                )
            # periodic snapshots by time: three rounds of growth, at most 2 kept
            for r in range(3):
                before = Snapshots(etcd).seqs()
                holder.put(f"round/{r}", payload(f"round/{r}", 5000))
                sizes[f"round/{r}"] = 5000
                _wait(lambda b=before: Snapshots(etcd).seqs() != b, 10, "a periodic snapshot")
            # changes right after the newest snapshot live only in the oplog (the next
            # snapshot is due 0.5 s later at the earliest)
            for i in range(5):
                holder.put(f"late/{i}", payload(f"late/{i}", 70_000 + i))
                sizes[f"late/{i}"] = 70_000 + i
            holder.remove("obj/0")
            del sizes["obj/0"]
            m1.kill()  # the whole group: there was no standby
            kept = Snapshots(etcd).seqs()
            assert 1 <= len(kept) <= 2, kept
            snap = Snapshots(etcd).load()
            assert snap is not None and snap[0] == kept[-1]
            assert not any(e[0] == "obj" and e[1] == "late/4" for e in snap[1])
            log = etcd.read_log(0, limit=100_000)
            assert log and log[0][0] >= kept[0]  # the log was trimmed below the oldest kept
            assert any(
                e[0] == "obj" and e[1] == "late/4" for q, b in log if q >= snap[0] for e in b
            )
            m2 = Master(tmp_path, *ha, *snaps, name="m2")
            masters.append(m2)
            _wait(lambda: _role(m2) == "leader", 15, "m2 leads")
            assert "loaded snapshot at seq" in Path(m2.log.name).read_text()
            with StoreClient(
                master=url, cluster_id=cluster, segment_size=0, failover_timeout_s=30
            ) as reader:
                for k, n in sizes.items():
                    assert reader.get(k) == payload(k, n), k
                with pytest.raises(ObjectNotFound):
                    reader.get("obj/0")
                assert reader.query("pinned")["hard_pin"] is True
                task = reader._call("query_replica_task", (tid,))
                assert task is not None and task["status"] == 3, task  # from the snapshot
                # the holder re-attached (its registration came back with the snapshot)
                holder.put("after", b"new bytes")
                assert reader.get("after") == b"new bytes"
    finally:
        etcd.close()
        for m in masters:
            m.stop()


def _segs(c: StoreClient, key: str) -> list[str]:
    return sorted(rep[0]["segment"] for rep in c.query(key)["replicas"])


def test_leases_pins_hot_replicas_and_tasks_survive_a_takeover(
    etcd_url: str, tmp_path: Path
) -> None:
    cluster = f"lease-{uuid.uuid4().hex[:8]}"
    lease_s = 5.0
    args = (
        *("--ha", etcd_url, "--cluster-id", cluster, "--ha-lease-ttl", "2"),
        *("--default-kv-lease-ttl", str(lease_s), "--ha-takeover-lease", "0"),
        *("--hot-key-replicas", "2", "--hot-key-reads", "8", "--hot-key-window", "2"),
    )
    m1 = Master(tmp_path, *args, name="m1")
    masters = [m1]
    etcd = StoreEtcd(etcd_url, cluster)
    mib = 1 << 20
    agent: Agent | None = None
    try:
        _wait(lambda: _role(m1) == "leader", 15, "m1 leads")
        m2 = Master(tmp_path, *args, name="m2")
        masters.append(m2)
        _wait(lambda: _role(m2) == "standby", 15, "m2 follows")
        # a client process with a small segment (no 1 MiB object fits): it runs the copies
        agent = Agent(etcd_url, segment_size=512 << 10, cluster_id=cluster, log=tmp_path / "a.log")
        with (
            StoreClient(
                master=etcd_url, cluster_id=cluster, segment_size=8 * mib, failover_timeout_s=30
            ) as holder,
            StoreClient(
                master=etcd_url, cluster_id=cluster, segment_size=0, failover_timeout_s=30
            ) as reader,
        ):
            holder.put("hard", payload("hard", mib), hard_pin=True)
            holder.put("soft", payload("soft", mib), soft_pin_ttl_s=120)
            for i in range(3):
                holder.put(f"plain/{i}", payload(f"plain/{i}", mib))
            holder.put("free", payload("free", 1000))
            home = holder.segment_names[0]
            for k in ("hot", "task"):  # soft-pinned: the fill below evicts others first
                holder.put(k, payload(k, 64 << 10), preferred_segment=home, soft_pin_ttl_s=120)
            for _ in range(12):  # a hot key: the agent's segment gets an extra replica
                assert reader.get("hot") == payload("hot", 64 << 10)
            _wait(lambda: _segs(reader, "hot") == sorted([home, agent.segment]), 10, "hot copy")
            os.kill(agent.pid, signal.SIGSTOP)  # the copy task below waits for the agent
            _wait(lambda: all_threads_stopped(agent.pid), 10, "every thread of the agent stopped")
            tid = holder._call(
                "create_replica_task", (holder.client_id, "copy", "task", [agent.segment], "")
            )
            holder.put("leased", payload("leased", mib))
            assert reader.get("leased") == payload("leased", mib)  # grants the lease
            t0 = time.monotonic()

            def logged() -> bool:
                leased: set[str] = set()
                for _seq, entries in etcd.read_log(0, limit=100_000):
                    for e in entries:
                        if e[0] == "lease":
                            leased.update(k for k, _ in e[1])
                return {"leased", "task"} <= leased  # a read's lease, and the copy task's

            _wait(logged, 3, "the leases are logged")  # on the leader's next tick
            m1.kill()
            _wait(lambda: _role(m2) == "leader", 10, "m2 takes over")
            # on the new leader the lease runs to t0 + 1.5 * lease_s (coarse replication)
            assert time.monotonic() - t0 < 1.5 * lease_s - 1, "takeover too slow for this check"
            with pytest.raises(ObjectBusy, match="leased") as busy:
                reader.remove("leased")
            assert _code(busy.value) == OBJECT_HAS_LEASE  # what the published API returns
            with pytest.raises(ObjectBusy, match="leased"):  # the copy task's lease
                reader.remove("task")
            q = reader._call("query_replica_task", (tid,))
            assert q is not None and q["status"] == 0, q  # PENDING, known to the new leader
            os.kill(agent.pid, signal.SIGCONT)  # its copy completes against the new leader

            def task_done() -> bool:
                return reader._call("query_replica_task", (tid,))["status"] == 3  # type: ignore[no-any-return]

            _wait(task_done, 15, "the copy task finishes on the new leader")
            assert _segs(reader, "task") == sorted([home, agent.segment])
            assert agent.call("get", key="task") == {"size": 64 << 10, "match": True}
            with pytest.raises(ObjectBusy, match="hard-pinned"):
                reader.remove("hard")
            reader.remove("free")  # no lease on it: the takeover lease is 0 here
            q = reader.query("soft")
            assert q["soft_pin_s"] > 100, q  # the soft pin's deadline came across
            # memory pressure on the new leader: 6 MiB used of 8; 4 more MiB must evict
            for i in range(4):
                holder.put(f"fill/{i}", payload(f"fill/{i}", mib))
            for k in ("hard", "soft"):
                assert reader.get(k) == payload(k, mib), k
            assert reader.query("leased")["lease_s"] > 0  # (a get would renew the lease)
            gone = [i for i in range(3) if not reader.exists(f"plain/{i}")]
            assert gone, "nothing unpinned was evicted"
            # once the lease ends (at most half a lease period later than on the old
            # leader: coarse replication), the remove goes through
            deadline = t0 + 1.5 * lease_s + 3
            while True:
                try:
                    reader.remove("leased")
                    break
                except ObjectBusy:
                    assert time.monotonic() < deadline, "the lease never ended"
                    time.sleep(0.2)
            assert time.monotonic() - t0 >= lease_s - 0.5
            assert not reader.exists("leased")
            # the hot key's extra replica, unread since before the takeover, is dropped once
            # its replicated lease ends (a new leader that took it as ordinary kept it)
            _wait(lambda: _segs(reader, "hot") == [home], 5, "the hot key cools")
            assert _segs(reader, "task") == sorted([home, agent.segment])  # not a hot extra
            assert reader.get("hot") == payload("hot", 64 << 10)
    finally:
        if agent is not None:
            if agent.proc.poll() is None:
                os.kill(agent.pid, signal.SIGCONT)
            agent.stop()
        etcd.close()
        for m in masters:
            m.stop()


def test_etcd_snapshots_keep_retention_and_skip_a_damaged_one(etcd_url: str) -> None:
    """Retention, the oplog kept from the oldest snapshot kept, and the fallback when the
    newest snapshot lost a part."""
    from mooncake_core.errors import MetadataError
    from mooncake_core.store.ha import LeaderInfo

    etcd = StoreEtcd(etcd_url, f"ret-{uuid.uuid4().hex[:8]}")
    try:
        me = LeaderInfo("me", "127.0.0.1:1")
        assert etcd.campaign(me, etcd.grant_lease(30))
        snaps = Snapshots(etcd, retention=2)
        seq = 0
        for s in (3, 6, 9):
            while seq < s:  # one batch per seq
                seq = etcd.append(me, seq, [["k", seq]])
            snaps.write(me, s, [["state", s]])
        assert snaps.seqs() == [6, 9]
        assert etcd.read_log(0, limit=1)[0][0] == 6  # below the oldest snapshot kept: gone
        assert snaps.load() == (9, [["state", 9]])
        etcd.delete(f"{snaps.prefix}{9:016d}/{0:06d}")  # the newest loses its only part
        assert snaps.load() == (6, [["state", 6]])  # and the log from 6 on is still there
        etcd.delete(f"{snaps.prefix}{6:016d}/parts")
        with pytest.raises(MetadataError, match="no complete snapshot"):
            snaps.load()
    finally:
        etcd.close()
