"""What a standby learns beyond objects and read leases (``store/replication.py``): hot keys'
extra replicas, replica copy/move tasks, and the leases both set; replayed from the change
log and from a snapshot, then taken over (the etcd round trip with real processes is in
``tests/integration/test_store_ha_state.py``)."""

from __future__ import annotations

import time
from typing import Any

from mooncake_core.config import StoreConfig
from mooncake_core.store.protocol import ReplicaCfg
from mooncake_core.store.state import MasterState

MiB = 1 << 20
CFG = {"hot_key_replicas": 2, "hot_key_reads": 5, "hot_key_window_s": 1.0, "lease_ttl_s": 0.5}


def _leader(log: list[Any]) -> MasterState:
    st = MasterState(StoreConfig(**CFG))  # type: ignore[arg-type]
    st.lease_dirty = {}  # HA on
    st.on_change = log.append
    for i in range(3):
        st.register_client(f"c{i}", "h", f"p{i}", False, 0.0)
        st.mount(f"c{i}", f"seg{i}", f"p{i}", 1 << 30, 8 * MiB, "h", 0.0)
    for key in ("hot", "k"):
        tok, _ = st.put_start("c0", key, MiB, ReplicaCfg(preferred_segment="seg0"), 0.0)
        st.put_end("c0", key, tok, 0.0)
    return st


def _standby(entries: list[Any], now: float, **kw: Any) -> MasterState:
    st = MasterState(StoreConfig(**{**CFG, **kw}))
    for e in entries:
        st.apply(list(e), now)
    return st


def _copies(st: MasterState, now: float) -> list[tuple[str, dict[str, Any]]]:
    return [(c, t) for c in list(st.clients) for t in st.take_tasks(c, now) if t["kind"] == "copy"]


def _segs(st: MasterState, key: str) -> list[str]:
    return sorted(r[0]["segment"] for r in st.query_key(key)["replicas"])


def _make_hot(st: MasterState, t: float) -> None:
    for i in range(6):
        st.get_replica_list("hot", t + 0.01 * i)
    st.tier_tick(t + 0.1)
    [(c, task)] = _copies(st, t + 0.1)
    st.task_done(c, "copy", "hot", task["token"], True, "", t + 0.1)
    assert len(_segs(st, "hot")) == 2
    st.take_leases(t + 0.1, time.time())  # the leader's tick logs the read lease


def test_a_new_leader_cools_the_extra_replicas_it_learned_from_the_log() -> None:
    log: list[Any] = []
    st = _leader(log)
    t = time.monotonic()  # leases are replicated on the wall clock: real clocks here
    _make_hot(st, t)
    assert any(e[0] == "hot" and e[1] == "hot" and len(e[2]) == 1 for e in log)
    for entries in (log, st.export()):  # the change log, and a snapshot
        # a new leader with hot keys off still cools what it learned
        new = _standby(entries, t + 0.2, hot_key_replicas=1)
        assert len(_segs(new, "hot")) == 2
        new.on_takeover(t + 0.2, 0.0)
        new.tier_tick(t + 0.3)  # cool, but the replicated read lease still runs
        assert len(_segs(new, "hot")) == 2
        new.tier_tick(t + 2.0)
        assert _segs(new, "hot") == ["seg0"], "the extra replica was kept after the takeover"
        assert new.counters["hot_replicas_dropped"] == 1
        assert new.segments["seg1"].allocator.used + new.segments["seg2"].allocator.used == 0
    # cooled on the leader: the standby unmarks the key
    n = len(log)
    st.tier_tick(t + 2.0)
    assert _segs(st, "hot") == ["seg0"]
    assert [e[0] for e in log[n:]] == ["obj", "hot"] and log[-1][2] == []
    new = _standby(log, t + 2.1)
    assert not new.hot_extra and _segs(new, "hot") == ["seg0"]


def test_leases_set_by_hot_copies_and_tasks_are_marked_for_standbys() -> None:
    log: list[Any] = []
    st = _leader(log)
    for i in range(6):
        st.get_replica_list("hot", 0.01 * i)
    st.take_leases(0.06, 0.06)  # the reads' leases are logged (to 0.05 + 0.75)
    st.tier_tick(0.9)  # hot copy at 0.9: leases the source to 1.4, beyond what was logged
    assert "hot" in (st.lease_dirty or {})
    st.create_replica_task("c0", "copy", "k", ["seg2"], "", 1.0)
    assert "k" in (st.lease_dirty or {})
    n = len(log)
    st.take_leases(1.0, 1.0)  # (wall = monotonic here)
    got = {k: d for e in log[n:] if e[0] == "lease" for k, d in e[1]}
    assert got["hot"] >= 1.4 and got["k"] >= 1.5


def test_a_copy_task_in_flight_at_a_takeover_finishes_on_the_new_leader() -> None:
    log: list[Any] = []
    st = _leader(log)
    tid = st.create_replica_task("c0", "copy", "k", ["seg1", "seg2"], "", 0.0)
    tasks = dict(_copies(st, 0.0))
    st.task_done("c1", "copy", "k", tasks["c1"]["token"], True, "", 0.1)  # one copy reported
    snap = st.export()
    for entries in (log, snap):
        new = _standby(entries, 0.2)
        # the copy in flight keeps its destination reserved; the reported one is listed
        assert new.segments["seg2"].allocator.used == MiB
        assert _segs(new, "k") == ["seg0", "seg1"]
        q = new.query_replica_task(tid)
        assert q is not None and q["status"] == 0  # PENDING
        new.on_takeover(0.2)
        again = _copies(new, 0.2)
        assert [(c, t["token"], t["dst"]) for c, t in again] == [
            ("c2", tasks["c2"]["token"], tasks["c2"]["dst"])
        ]
        new.task_done("c2", "copy", "k", tasks["c2"]["token"], True, "", 0.3)
        assert _segs(new, "k") == ["seg0", "seg1", "seg2"]
        assert new.query_replica_task(tid)["status"] == 3  # type: ignore[index]
        assert new.segments["seg2"].allocator.used == MiB  # listed once, not leaked
    # the client reports the old leader's copy before polling the one queued again: the
    # duplicate is taken back, so the copy is not run twice
    new = _standby(log, 0.2)
    new.on_takeover(0.2)
    new.task_done("c2", "copy", "k", tasks["c2"]["token"], True, "", 0.3)
    assert _copies(new, 0.3) == []
    # a copy that fails on the new leader fails the task with its reason
    new = _standby(log, 0.2)
    new.on_takeover(0.2)
    new.task_done("c2", "copy", "k", tasks["c2"]["token"], False, "disk on fire", 0.3)
    q = new.query_replica_task(tid)
    assert q is not None and q["status"] == 2 and "disk on fire" in q["message"]
    assert new.segments["seg2"].allocator.used == 0
    # the destination's client went away before the takeover: failed at once, with the reason
    st.drop_client("c2")
    new = _standby(log, 0.2)
    new.on_takeover(0.2)
    q = new.query_replica_task(tid)
    assert q is not None and q["status"] == 2 and "went away" in q["message"]


def test_a_move_replays_and_its_source_is_dropped_by_the_new_leader() -> None:
    log: list[Any] = []
    st = _leader(log)
    st.get_replica_list("k", 0.0)  # a reader holds seg0's address until 0.5
    st.take_leases(0.0, 0.0)  # logged to 0.75 (wall = monotonic here)
    tid = st.create_replica_task("c0", "move", "k", ["seg1"], "seg0", 0.1)
    [(c, t)] = _copies(st, 0.1)
    st.task_done(c, "copy", "k", t["token"], True, "", 0.2)
    assert st.query_replica_task(tid)["status"] == 1  # type: ignore[index]  # PROCESSING
    new = _standby(log, 0.3)
    new.on_takeover(0.3, 0.0)
    new.replica_task_tick(0.35)
    assert new.query_replica_task(tid)["status"] == 1  # type: ignore[index]  # still leased
    new.replica_task_tick(0.8)
    assert _segs(new, "k") == ["seg1"]
    assert new.query_replica_task(tid)["status"] == 3  # type: ignore[index]
    assert new.segments["seg0"].allocator.used == MiB  # only "hot" is left there
