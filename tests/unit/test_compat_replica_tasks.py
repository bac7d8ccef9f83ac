"""Replica copy/move tasks in MasterState, without sockets (the published ``create_copy_task`` /
``create_move_task`` / ``query_task`` run on these; the same calls against the wheel are in
tests/integration/test_compat_parity.py): a copy is listed only once reported, a move waits
for read leases taken before or during it, failures and timeouts free the bytes."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_core.config import StoreConfig
from mooncake_core.errors import NoSpace, ObjectNotFound
from mooncake_core.store.protocol import InvalidArgument, ObjectBusy, ReplicaCfg
from mooncake_core.store.state import MasterState

MiB = 1 << 20


def _state(**kw: Any) -> MasterState:
    st = MasterState(StoreConfig(**kw))
    for i in range(3):
        st.register_client(f"c{i}", "h", f"p{i}", False, 0.0)
        st.mount(f"c{i}", f"seg{i}", f"p{i}", 1 << 30, 8 * MiB, "h", 0.0)
    tok, _ = st.put_start("c0", "k", MiB, ReplicaCfg(preferred_segment="seg0"), 0.0)
    st.put_end("c0", "k", tok, 0.0)
    return st


def _copies(st: MasterState, now: float) -> list[tuple[str, dict[str, Any]]]:
    return [(c, t) for c in list(st.clients) for t in st.take_tasks(c, now) if t["kind"] == "copy"]


def _where(st: MasterState) -> list[str]:
    return sorted(r[0]["segment"] for r in st.query_key("k")["replicas"])


def _status(st: MasterState, tid: str) -> tuple[int, str]:
    q = st.query_replica_task(tid)
    assert q is not None
    return q["status"], q["message"]


def test_copy_is_listed_only_when_reported_and_holders_are_skipped() -> None:
    st = _state()
    tid = st.create_replica_task("c0", "copy", "k", ["seg1", "seg0", "seg2"], "", 0.0)
    tasks = _copies(st, 0.0)
    assert sorted(c for c, _ in tasks) == ["c1", "c2"]  # seg0 holds it already
    assert _where(st) == ["seg0"] and _status(st, tid)[0] == 0  # PENDING
    for c, t in tasks:
        assert t["src"][0][0] == "seg0" and t["dst"][0][0] == f"seg{c[1]}"
        st.task_done(c, "copy", "k", t["token"], True, "", 0.1)
    assert _where(st) == ["seg0", "seg1", "seg2"]
    assert _status(st, tid) == (3, "Task completed successfully")
    assert st.query_replica_task("f" * 32) is None


def test_move_waits_for_an_earlier_read_lease_then_drops_the_source() -> None:
    st = _state(lease_ttl_s=1.0)
    st.get_replica_list("k", 0.0)  # a reader holds seg0's address until 1.0
    tid = st.create_replica_task("c0", "move", "k", ["seg1"], "seg0", 0.2)
    ((c, t),) = _copies(st, 0.2)
    st.task_done(c, "copy", "k", t["token"], True, "", 0.3)
    assert _status(st, tid)[0] == 1 and _where(st) == ["seg0", "seg1"]  # PROCESSING
    st.replica_task_tick(0.5)
    assert _where(st) == ["seg0", "seg1"]
    st.replica_task_tick(1.1)
    assert _where(st) == ["seg1"] and _status(st, tid)[0] == 3
    assert st.segments["seg0"].allocator.used == 0
    # a move without an earlier read finishes as soon as the copy is reported
    tid = st.create_replica_task("c1", "move", "k", ["seg2"], "seg1", 5.0)
    ((c, t),) = _copies(st, 5.0)
    st.task_done(c, "copy", "k", t["token"], True, "", 5.1)
    assert _where(st) == ["seg2"] and _status(st, tid)[0] == 3


def test_failed_late_or_stale_copies_fail_the_task_and_free_the_bytes() -> None:
    st = _state(put_timeout_s=1.0)
    tid = st.create_replica_task("c0", "copy", "k", ["seg1"], "", 0.0)
    ((c, t),) = _copies(st, 0.0)
    st.task_done(c, "copy", "k", t["token"], False, "peer gone", 0.1)
    assert _status(st, tid) == (2, "copy to seg1 failed: peer gone")
    tid = st.create_replica_task("c0", "copy", "k", ["seg1"], "", 1.0)
    st.replica_task_tick(2.5)  # not reported within put_timeout_s
    assert _status(st, tid)[0] == 2 and len(_copies(st, 2.5)) == 1
    tid = st.create_replica_task("c0", "copy", "k", ["seg2"], "", 3.0)
    ((c, t),) = _copies(st, 3.0)
    st.remove("k", True, 3.1)
    st.task_done(c, "copy", "k", t["token"], True, "", 3.2)
    assert _status(st, tid) == (2, "the object changed")
    assert all(s.allocator.used == 0 for s in st.segments.values())


def test_refusals() -> None:
    st = _state()
    with pytest.raises(ObjectNotFound):
        st.create_replica_task("c0", "copy", "nope", ["seg1"], "", 0.0)
    for kind, targets, source in [
        ("copy", [], ""),
        ("copy", ["nope"], ""),
        ("move", ["seg1"], "seg2"),  # seg2 holds no replica
        ("move", ["seg0"], "seg0"),
        ("move", ["seg1"], "nope"),
        ("swap", ["seg1"], ""),
    ]:
        with pytest.raises(InvalidArgument):
            st.create_replica_task("c0", kind, "k", targets, source, 0.0)
    tok, _ = st.put_start("c0", "big", 15 * MiB // 2, ReplicaCfg(preferred_segment="seg0"), 0.0)
    st.put_end("c0", "big", tok, 0.0)
    st.create_replica_task("c0", "copy", "big", ["seg1"], "", 0.0)
    with pytest.raises(NoSpace):
        st.create_replica_task("c0", "copy", "k", ["seg2", "seg1"], "", 0.0)
    assert st.segments["seg2"].allocator.used == 0  # the partial reservation was given back


def test_drop_replicas_keeps_the_others_and_refuses_while_leased() -> None:
    st = _state(lease_ttl_s=1.0)
    tid = st.create_replica_task("c0", "copy", "k", ["seg1"], "", 0.0)
    ((c, t),) = _copies(st, 0.0)
    st.task_done(c, "copy", "k", t["token"], True, "", 0.1)
    assert _status(st, tid)[0] == 3 and _where(st) == ["seg0", "seg1"]
    st.get_replica_list("k", 2.0)  # a read lease until 3.0
    with pytest.raises(ObjectBusy):
        st.drop_replicas("c0", "k", "seg0", 2.5)
    assert st.drop_replicas("c0", "k", "seg2", 3.5) == 0  # none there
    assert st.drop_replicas("c0", "k", "seg0", 3.5) == 1
    assert _where(st) == ["seg1"] and st.segments["seg0"].allocator.used == 0
    assert st.drop_replicas("c0", "k", "seg1", 3.5) == 0  # never the last replica
    with pytest.raises(ObjectNotFound):
        st.drop_replicas("c0", "nope", "seg1", 3.5)
