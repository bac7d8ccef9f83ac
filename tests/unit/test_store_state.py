"""MasterState logic without sockets: leases, pins, eviction order, zombies, expiry, replay."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_core.config import StoreConfig
from mooncake_core.errors import NoSpace, ObjectExists, ObjectNotFound
from mooncake_core.store.protocol import InvalidArgument, ObjectBusy, ReplicaCfg, UnknownClient
from mooncake_core.store.state import MasterState

MiB = 1 << 20


def _state(**kw: Any) -> tuple[MasterState, list[Any]]:
    st = MasterState(StoreConfig(**kw))
    log: list[Any] = []
    st.on_change = log.append
    st.register_client("c1", "h", "p1", False, 0.0)
    st.mount("c1", "seg1", "p1", 1 << 30, 10 * MiB, "h", 0.0)
    return st, log


def _put(st: MasterState, key: str, size: int, now: float, **cfg: Any) -> None:
    tok, _ = st.put_start("c1", key, size, ReplicaCfg(**cfg), now)
    st.put_end("c1", key, tok, now)


def test_put_get_remove_and_leases() -> None:
    st, _ = _state(lease_ttl_s=2.0)
    _put(st, "a", MiB, 0.0)
    with pytest.raises(ObjectExists):
        st.put_start("c1", "a", 10, ReplicaCfg(), 0.0)
    size, reps, ttl = st.get_replica_list("a", 1.0)
    assert size == MiB and len(reps) == 1 and ttl == 2.0
    seg, peer, addr, n, host = reps[0][0]
    assert (seg, peer, n, host) == ("seg1", "p1", MiB, "h") and addr >= 1 << 30
    with pytest.raises(ObjectBusy, match="leased"):
        st.remove("a", False, 2.0)
    st.remove("a", False, 3.5)
    with pytest.raises(ObjectNotFound):
        st.get_replica_list("a", 4.0)


def test_pending_puts_are_invisible_and_reclaimed() -> None:
    st, _ = _state(put_timeout_s=5.0)
    tok, _ = st.put_start("c1", "p", MiB, ReplicaCfg(), 0.0)
    assert st.exists("p", 0.0) is False
    with pytest.raises(ObjectBusy, match="in progress"):
        st.put_start("c1", "p", MiB, ReplicaCfg(), 1.0)
    assert st.reclaim(6.0) == 1
    with pytest.raises(InvalidArgument, match="no put in progress"):
        st.put_end("c1", "p", tok, 6.0)
    assert st.usage()[0] == 0


def test_eviction_is_lru_and_skips_leases_and_pins() -> None:
    st, _ = _state(eviction_high_watermark=0.9, eviction_ratio=0.2, lease_ttl_s=100.0)
    _put(st, "hard", MiB, 0.0, hard_pin=True)
    _put(st, "soft", MiB, 0.0, soft_pin_ttl_s=1000.0)
    for i in range(7):
        _put(st, f"o{i}", MiB, 0.0)
    st.get_replica_list("o0", 1.0)  # o0 is now leased and most recently used
    # 9 MiB used of 10: a 2 MiB put must evict the oldest unpinned, unleased objects
    _put(st, "new", 2 * MiB, 2.0)
    gone = [k for k in ("o1", "o2", "o3", "o4", "o5", "o6") if not st.exists(k, 2.0)]
    assert gone and gone == ["o1", "o2", "o3", "o4", "o5", "o6"][: len(gone)]
    assert st.exists("hard", 2.0) and st.exists("soft", 2.0) and st.exists("o0", 2.0)
    assert st.counters["evictions"] == len(gone)


def test_soft_pins_go_last_and_hard_pins_never() -> None:
    st, _ = _state(lease_ttl_s=0.0)
    _put(st, "hard", 5 * MiB, 0.0, hard_pin=True)
    _put(st, "soft", 4 * MiB, 0.0, soft_pin_ttl_s=1000.0)
    _put(st, "n", MiB // 2, 0.0)
    _put(st, "x", 2 * MiB, 1.0)  # needs the soft-pinned object's space
    assert not st.exists("soft", 1.0) and st.exists("hard", 1.0)
    with pytest.raises(NoSpace, match="largest free extent"):
        st.put_start("c1", "y", 6 * MiB, ReplicaCfg(), 2.0)


def test_watermark_check_and_bounded_memory_under_flood() -> None:
    st, _ = _state(eviction_high_watermark=0.5, eviction_ratio=0.1, lease_ttl_s=0.0)
    for i in range(200):
        _put(st, f"f{i}", 256 << 10, float(i))
        st.check_watermarks(float(i))
        assert st.usage()[0] <= 10 * MiB
    assert st.usage()[0] <= 0.5 * 10 * MiB + (256 << 10)
    assert len(st.objects) < 30 and len(st.lru) == len(st.objects)


def test_client_expiry_drops_segments_and_orphans() -> None:
    st, _ = _state(client_ttl_s=5.0)
    st.register_client("c2", "h2", "p2", False, 0.0)
    st.mount("c2", "seg2", "p2", 1 << 30, 10 * MiB, "h2", 0.0)
    _put(st, "two", MiB, 0.0, replica_num=2)
    _put(st, "one", MiB, 0.0, preferred_segment="seg2")
    st.touch("c1", 4.0)
    assert st.expire_clients(6.0) == ["c2"]
    assert st.exists("two", 6.0) and not st.exists("one", 6.0)
    assert len(st.objects["two"].replicas) == 1
    with pytest.raises(UnknownClient):
        st.put_start("c2", "z", 1, ReplicaCfg(), 6.0)


def test_validation_messages() -> None:
    st, _ = _state()
    for args, msg in [(("", 1), "non-empty"), (("k" * 4097, 1), "limit is 4096"), (("k", 0), "positive"),
                      (("k", -5), "positive"), (("k", 11 * MiB), "larger than all mounted")]:
        with pytest.raises(InvalidArgument, match=msg):
            st.put_start("c1", args[0], args[1], ReplicaCfg(), 0.0)
    with pytest.raises(InvalidArgument, match="already mounted"):
        st.mount("c1", "seg1", "p1", 1 << 31, MiB, "h", 0.0)
    with pytest.raises(InvalidArgument, match="invalid regex"):
        st.keys_by_regex("(")


def test_replay_of_the_log_rebuilds_the_same_state() -> None:
    st, log = _state(lease_ttl_s=0.0)
    st.register_client("c2", "h2", "p2", False, 0.0)
    st.mount("c2", "seg2", "p2", 1 << 31, 10 * MiB, "h2", 0.0)
    for i in range(12):
        _put(st, f"k{i}", MiB, float(i), replica_num=2 if i % 2 else 1, hard_pin=i == 3)
    st.remove("k0", True, 20.0)
    st.remove_by_regex("^k1", True, 20.0)  # k1, k10, k11
    _put(st, "big", 7 * MiB, 21.0)  # evicts
    st.unmount("c2", "seg2", 22.0)
    other = MasterState(StoreConfig())
    for e in log:
        other.apply(e, 30.0)

    def view(s: MasterState) -> dict[str, Any]:
        return {k: (o.size, sorted(map(tuple, (tuple(r) for r in o.replicas))), o.hard_pin)
                for k, o in s.objects.items() if o.complete}

    assert view(other) == view(st)
    assert {n: s.allocator.used for n, s in other.segments.items()} == {n: s.allocator.used for n, s in st.segments.items()}


def test_object_cap_evicts_lru_objects_and_refuses_when_nothing_can_go() -> None:
    st, _ = _state(max_objects=10, eviction_ratio=0.2, lease_ttl_s=5.0)
    for i in range(10):
        _put(st, f"k{i}", 100, float(i))
    st.get_replica_list("k0", 10.0)  # k0 becomes the most recently used (and leased until 15)
    _put(st, "new", 100, 11.0)  # at the cap: LRU objects k1, k2 go (2 = 20% of the cap); k0 is leased
    assert "k0" in st.objects and "k1" not in st.objects and "k2" not in st.objects and "k3" in st.objects
    assert len(st.objects) == 9 and st.counters["evictions"] == 2
    for k in list(st.objects):
        st.objects[k].hard_pin = True
    _put(st, "fills", 100, 12.0, hard_pin=True)
    with pytest.raises(NoSpace, match="max_objects"):
        st.put_start("c1", "over", 100, ReplicaCfg(), 13.0)
    assert len(st.objects) == 10


def test_max_objects_must_be_positive() -> None:
    from mooncake_core.config import load_config
    from mooncake_core.errors import ConfigError

    with pytest.raises(ConfigError, match="max_objects: must be at least 1"):
        load_config(environ={}, store={"max_objects": 0})
