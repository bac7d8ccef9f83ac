"""Hot keys and tier moves in MasterState, without sockets: the windowed read counter, hot-key
copies (listed only when done, new version, cooled away), the bounded offload queue and
promotion admission."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_core.config import StoreConfig
from mooncake_core.store.hotkeys import WindowCounter
from mooncake_core.store.protocol import ReplicaCfg, RetryLater
from mooncake_core.store.state import MasterState

MiB = 1 << 20


def _state(n_segs: int = 3, ssd: bool = False, **kw: Any) -> MasterState:
    st = MasterState(StoreConfig(**kw))
    for i in range(n_segs):
        st.register_client(f"c{i}", "h", f"p{i}", ssd, 0.0)
        st.mount(f"c{i}", f"seg{i}", f"p{i}", 1 << 30, 8 * MiB, "h", 0.0)
    return st


def _put(st: MasterState, key: str, size: int, now: float, **cfg: Any) -> None:
    tok, _ = st.put_start("c0", key, size, ReplicaCfg(**cfg), now)
    st.put_end("c0", key, tok, now)


def _tasks(st: MasterState, now: float) -> list[tuple[str, dict[str, Any]]]:
    return [(c, t) for c in list(st.clients) for t in st.take_tasks(c, now)]


def test_window_counter_slides_and_is_bounded() -> None:
    w = WindowCounter(1.0, max_keys=2)
    for _ in range(10):
        w.hit("a", 0.1)
    w.hit("b", 0.2)
    assert w.hit("c", 0.3) == 0 and w.untracked == 1  # a third key is not counted
    assert w.rate("a", 0.5) == 10
    assert 4 <= w.rate("a", 1.5) <= 6  # half of the previous window still overlaps
    assert w.rate("a", 3.0) == 0  # two windows later: forgotten


def test_hot_key_gets_copies_up_to_the_cap_then_cools() -> None:
    st = _state(hot_key_replicas=3, hot_key_reads=10, hot_key_window_s=1.0, lease_ttl_s=0.5)
    _put(st, "hot", MiB, 0.0, preferred_segment="seg0")
    _put(st, "cold", MiB, 0.0, preferred_segment="seg0")
    now = 0.1
    for _ in range(20):
        st.get_replica_list("hot", now)
    st.get_replica_list("cold", now)
    tok0 = st.get_replica_list("hot", now)[3]
    for _step in range(3):
        st.tier_tick(now)
        tasks = [(c, t) for c, t in _tasks(st, now) if t["kind"] == "copy"]
        assert len(tasks) <= 1  # one copy of a key at a time
        for c, t in tasks:
            assert len(st.query_key("hot")["replicas"]) < 3  # listed only once done
            st.task_done(c, "copy", t["key"], t["token"], True, "", now)
        for _ in range(20):
            st.get_replica_list("hot", now)
    q = st.query_key("hot")
    assert sorted(r[0]["segment"] for r in q["replicas"]) == ["seg0", "seg1", "seg2"]
    assert len(st.query_key("cold")["replicas"]) == 1
    assert st.get_replica_list("hot", now)[3] != tok0  # new replicas, new version
    assert st.stats()["hot_replicas_added"] == 2 and st.stats()["hot_bytes"] == 2 * MiB
    # no reads for two windows and the lease ran out: back to one replica
    st.tier_tick(3.0)
    assert len(st.query_key("hot")["replicas"]) == 1
    assert st.stats()["hot_replicas_dropped"] == 2 and st.stats()["hot_bytes"] == 0
    assert sum(s.allocator.used for s in st.segments.values()) == 2 * MiB


def test_hot_copy_of_a_changed_object_is_discarded_and_byte_cap_holds() -> None:
    st = _state(hot_key_replicas=3, hot_key_reads=5, hot_key_window_s=1.0, hot_key_max_bytes=MiB)
    _put(st, "a", MiB, 0.0, preferred_segment="seg0")
    _put(st, "b", MiB, 0.0, preferred_segment="seg0")
    for _ in range(10):
        st.get_replica_list("a", 0.1)
        st.get_replica_list("b", 0.1)
    st.tier_tick(0.1)
    copies = [(c, t) for c, t in _tasks(st, 0.1) if t["kind"] == "copy"]
    assert len(copies) == 1  # the byte cap leaves room for one extra replica only
    c, t = copies[0]
    st.remove(t["key"], True, 0.2)
    st.task_done(c, "copy", t["key"], t["token"], True, "", 0.2)
    assert sum(s.allocator.used for s in st.segments.values()) == MiB  # the copy was freed


def test_offload_queue_is_bounded_and_drops_with_a_counter() -> None:
    st = _state(n_segs=1, ssd=True, ssd_offload_queue=MiB, eviction_ratio=0.25)
    for i in range(6):
        _put(st, f"k{i}", MiB, 0.0)
    st.evict_for(2 * MiB, 100.0)  # two objects to evict: one offloaded, one dropped
    assert [t["kind"] for _c, t in _tasks(st, 100.0)] == ["offload"]
    assert st.stats()["offload_dropped"] >= 1


def test_promotion_is_transient_until_the_second_read() -> None:
    st = _state(n_segs=1, ssd=True, lease_ttl_s=1.0, ssd_promote_after=2)
    _put(st, "k", MiB, 0.0)
    st.evict_for(8 * MiB, 100.0)
    ((c, t),) = _tasks(st, 100.0)
    st.task_done(c, "offload", "k", t["token"], True, "", 100.0)
    assert st.query_key("k")["replicas"] == []

    def read(now: float) -> None:
        with pytest.raises(RetryLater):
            st.get_replica_list("k", now)
        ((c, t),) = _tasks(st, now)
        assert t["kind"] == "promote"
        st.task_done(c, "promote", "k", t["token"], True, "", now)
        st.get_replica_list("k", now)  # the retry of the same read

    read(101.0)
    assert st.query_key("k")["replicas"]  # in memory for this read
    st.tier_tick(101.5)
    assert st.query_key("k")["replicas"]  # leased: kept
    st.tier_tick(102.5)
    assert st.query_key("k")["replicas"] == [] and st.stats()["promotions_transient"] == 1
    read(103.0)  # the second read within the window: admitted
    st.tier_tick(110.0)
    assert st.query_key("k")["replicas"] and st.stats()["promotions_admitted"] == 1
