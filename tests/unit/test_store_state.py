"""MasterState logic without sockets: leases, pins, eviction order, zombies, expiry, replay."""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_core.config import StoreConfig
from mooncake_core.errors import NoSpace, ObjectExists, ObjectNotFound
from mooncake_core.store.allocator import align
from mooncake_core.store.protocol import (
    InvalidArgument,
    ObjectBusy,
    ReplicaCfg,
    RetryLater,
    UnknownClient,
)
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
    size, reps, ttl, _token = st.get_replica_list("a", 1.0)
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
    for args, msg in [
        (("", 1), "non-empty"),
        (("k" * 4097, 1), "limit is 4096"),
        (("k", 0), "positive"),
        (("k", -5), "positive"),
        (("k", 11 * MiB), "larger than all mounted"),
    ]:
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
        return {
            k: (o.size, sorted(map(tuple, (tuple(r) for r in o.replicas))), o.hard_pin)
            for k, o in s.objects.items()
            if o.complete
        }

    assert view(other) == view(st)
    assert {n: s.allocator.used for n, s in other.segments.items()} == {
        n: s.allocator.used for n, s in st.segments.items()
    }


def test_object_cap_evicts_lru_objects_and_refuses_when_nothing_can_go() -> None:
    st, _ = _state(max_objects=10, eviction_ratio=0.2, lease_ttl_s=5.0)
    for i in range(10):
        _put(st, f"k{i}", 100, float(i))
    st.get_replica_list("k0", 10.0)  # k0 becomes the most recently used (and leased until 15)
    _put(
        st, "new", 100, 11.0
    )  # at the cap: LRU objects k1, k2 go (2 = 20% of the cap); k0 is leased
    assert (
        "k0" in st.objects
        and "k1" not in st.objects
        and "k2" not in st.objects
        and "k3" in st.objects
    )
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


# ---------------------------------------------------------------------- reservations (one-RPC puts)
def _big_state(**kw: Any) -> tuple[MasterState, list[Any]]:
    st = MasterState(StoreConfig(**kw))
    log: list[Any] = []
    st.on_change = log.append
    for c in ("c1", "c2"):
        st.register_client(c, "h", f"p-{c}", False, 0.0)
    st.mount("c1", "seg1", "p-c1", 1 << 32, 256 * MiB, "h", 0.0)
    return st, log


def _no_overlap(st: MasterState) -> None:
    """Every committed object's range and every reserved block are disjoint and allocated."""
    spans = []
    for o in st.objects.values():
        for rep in o.replicas:
            spans += [(seg, off, off + ((n + 63) & ~63)) for seg, off, n in rep]
    for r in st.reservations.values():
        spans += [(r.segment, b, b + n) for b, n in r.blocks.items()]
    spans.sort()
    for a, b in zip(spans, spans[1:], strict=False):
        assert a[0] != b[0] or a[2] <= b[1], (a, b)
    for seg in st.segments.values():
        assert seg.allocator.used == sum(e - s for name, s, e in spans if name == seg.name)


def test_reserved_puts_carve_objects_out_of_the_extent_and_release_the_rest() -> None:
    st, _ = _big_state()
    cfg = ReplicaCfg()
    rid, ext, ttl = st.reserve("c2", MiB, cfg, [], 1.0)
    seg, peer, base, off, length, host = ext
    assert (
        rid
        and seg == "seg1"
        and peer == "p-c1"
        and base == 1 << 32
        and length == 16 * MiB
        and ttl == 30.0
    )
    used = st.segments["seg1"].allocator.used
    assert used == length
    # commits in any order (several writer threads share one reservation), with gaps
    for i in (2, 0, 5, 1):
        assert st.put_commit("c2", f"k{i}", rid, off + i * MiB, MiB - 7, cfg, 2.0)[0] == 30.0
    _no_overlap(st)
    size, reps, _, _ = st.get_replica_list("k5", 3.0)
    assert size == MiB - 7 and reps == [[("seg1", "p-c1", base + off + 5 * MiB, MiB - 7, "h")]]
    assert (
        st.segments["seg1"].allocator.used == used
    )  # carving moves bytes from the extent to objects
    with pytest.raises(ObjectExists):
        st.put_commit("c2", "k2", rid, off + 8 * MiB, 100, cfg, 3.0)
    with pytest.raises(InvalidArgument, match="not a free part of reservation"):
        st.put_commit("c2", "again", rid, off + 2 * MiB, 100, cfg, 3.0)  # k2's range
    with pytest.raises(InvalidArgument, match="not a free part of reservation"):
        st.put_commit("c2", "past", rid, off + 16 * MiB - 64, 128, cfg, 3.0)
    with pytest.raises(InvalidArgument, match="unknown or expired for client 'c1'"):
        st.put_commit("c1", "thief", rid, off + 9 * MiB, 100, cfg, 3.0)
    # release: the uncommitted parts go back, the objects stay
    assert st.reserve("c2", 0, cfg, [rid], 4.0) == (0, [], 0.0)
    assert not st.reservations
    assert st.segments["seg1"].allocator.used == 4 * MiB
    _no_overlap(st)
    with pytest.raises(InvalidArgument, match="unknown or expired"):
        st.put_commit("c2", "late", rid, off + 9 * MiB, 100, cfg, 5.0)
    st.remove("k0", True, 6.0)  # an object carved from an extent frees like any other
    assert st.segments["seg1"].allocator.used == 3 * MiB


def test_early_commits_stay_invisible_until_confirmed_and_are_dropped_when_not() -> None:
    """A commit sent while the write is in flight makes an object nobody sees until its
    writer confirms the write; a failed write, a wrong token or no confirm within
    ``put_timeout_s`` drops it and frees its bytes."""
    st, _ = _big_state(put_timeout_s=10.0)
    cfg = ReplicaCfg()
    rid, ext, _ = st.reserve("c2", MiB, cfg, [], 1.0)
    off = ext[3]
    used = st.segments["seg1"].allocator.used
    _ttl, tok = st.put_commit("c2", "e", rid, off, 1000, cfg, 2.0, early=True)
    assert st.early == {"e": tok}
    with pytest.raises(ObjectNotFound):
        st.get_replica_list("e", 2.0)
    assert (
        not st.exists("e", 2.0)
        and st.keys_by_regex("") == []
        and st.remove_by_regex("", True, 2.0) == 0
    )
    assert st.check_watermarks(2.0) == 0 and "e" not in st.lru  # never an eviction candidate
    with pytest.raises(InvalidArgument, match="no early commit with this token"):
        st.put_confirm("c2", "e", tok + 1, True, 3.0)
    with pytest.raises(InvalidArgument, match="no early commit with this token"):
        st.put_confirm("c1", "e", tok, True, 3.0)  # only its writer confirms it
    st.put_confirm("c2", "e", tok, True, 3.0)
    assert st.early == {} and st.get_replica_list("e", 3.0)[3] == tok
    with pytest.raises(InvalidArgument, match="no early commit with this token"):
        st.put_confirm("c2", "e", tok, True, 3.0)  # twice: the object is complete, nothing changes
    assert st.exists("e", 3.0)
    # a failed write: dropped, its bytes freed
    _ttl, tok2 = st.put_commit("c2", "f", rid, off + 4096, 1000, cfg, 4.0, early=True)
    st.put_confirm("c2", "f", tok2, False, 4.0)
    assert "f" not in st.objects and st.early == {}
    assert st.segments["seg1"].allocator.used == used - align(
        1000
    )  # f's range left the extent and was freed
    # never confirmed: reclaimed with the unfinished puts
    st.put_commit("c2", "g", rid, off + 8192, 1000, cfg, 5.0, early=True)
    st.reclaim(14.0)
    assert "g" in st.early
    st.reclaim(15.5)
    assert "g" not in st.objects and st.early == {}
    # a second early commit of a key whose first is unconfirmed: the key is busy
    rid, ext, _ = st.reserve("c2", MiB, cfg, [], 16.0)  # the first one expired with g
    st.put_commit("c2", "h", rid, ext[3], 1000, cfg, 16.0, early=True)
    with pytest.raises(ObjectBusy):
        st.put_commit("c2", "h", rid, ext[3] + 4096, 1000, cfg, 16.0, early=True)
    # its segment goes away before the confirm: the object goes with it, the confirm is refused
    tok_h = st.early["h"]
    st.drop_client("c1")
    assert "h" not in st.objects and st.early == {}
    with pytest.raises(InvalidArgument, match="no early commit with this token"):
        st.put_confirm("c2", "h", tok_h, True, 17.0)


def test_unused_reservations_expire_and_limits_are_kept() -> None:
    st, _ = _big_state(put_timeout_s=10.0)
    cfg = ReplicaCfg()
    rid, ext, _ = st.reserve("c2", 64 << 10, cfg, [], 0.0)
    assert ext[4] == 4 * MiB  # the minimum extent
    st.put_commit("c2", "k", rid, ext[3], 1000, cfg, 8.0)  # a commit renews it: deadline 18
    st.reclaim(12.0)
    assert rid in st.reservations
    st.reclaim(18.5)
    assert rid not in st.reservations and st.counters["reservations_reclaimed"] == 1
    assert st.segments["seg1"].allocator.used == 1024  # only the object
    with pytest.raises(InvalidArgument, match="unknown or expired"):
        st.put_commit("c2", "k2", rid, ext[3] + 4096, 1000, cfg, 19.0)
    # a batch asks for room for all its objects (up to the extent limit)
    assert (
        st.reserve("c2", MiB // 4, cfg, [], 9.0)[1][4] == 4 * MiB
    )  # room for 16 objects by default
    big_rid, big_ext, _ = st.reserve("c2", MiB // 4, cfg, [], 9.0, count=40)
    assert big_ext[4] == 10 * MiB
    assert (
        st.reserve("c2", MiB // 4, cfg, [big_rid], 9.0, count=1000)[1][4] == 16 * MiB
    )  # 1/16 of the segment
    with pytest.raises(InvalidArgument, match="count must not be negative"):
        st.reserve("c2", MiB, cfg, [], 9.0, count=-1)
    st.reserve("c2", 0, cfg, [r for r in st.reservations if r != rid], 9.0)
    # at most 8 per client; none for large objects or several replicas; never past the watermark
    rids = [st.reserve("c2", MiB, cfg, [], 20.0)[0] for _ in range(9)]
    assert all(rids[:8]) and rids[8] == 0
    with pytest.raises(InvalidArgument, match="size must be 0.."):
        st.reserve("c1", 8 * MiB, cfg, [], 20.0)
    with pytest.raises(InvalidArgument, match="replica_num=2"):
        st.reserve("c1", MiB, ReplicaCfg(replica_num=2), [], 20.0)
    st.reserve("c2", 0, cfg, rids[:8], 21.0)
    _put(
        st, "fill", 200 * MiB, 21.0
    )  # 78% used: a 16 MiB extent would pass the 90% watermark... not yet
    assert st.reserve("c1", MiB, cfg, [], 21.0)[0]
    _put(st, "fill2", 20 * MiB, 21.0)  # now it would
    assert st.reserve("c1", MiB, cfg, [], 21.0) == (0, [], 0.0)
    with pytest.raises(UnknownClient):
        st.reserve("nobody", MiB, cfg, [], 21.0)


def test_reservations_survive_replay_and_takeover() -> None:
    """A standby that replayed the log (or a snapshot) knows the extents, so a client can commit
    into its reservation on the new leader, and the new leader never hands those ranges to anyone
    else."""
    st, log = _big_state()
    cfg = ReplicaCfg()
    rid, ext, _ = st.reserve("c2", MiB, cfg, [], 1.0)
    off = ext[3]
    st.put_commit("c2", "a", rid, off, MiB, cfg, 2.0)
    st.put_commit("c2", "b", rid, off + 3 * MiB, MiB, cfg, 2.0)
    rid2, ext2, _ = st.reserve("c1", 100_000, cfg, [], 2.0)
    st.reserve("c1", 0, cfg, [rid2], 2.5)
    for source in ("log", "snapshot"):
        other = MasterState(StoreConfig())
        for e in log if source == "log" else st.export():
            other.apply(e, 3.0)
        assert set(other.reservations) == {rid}, source
        assert other.reservations[rid].blocks == st.reservations[rid].blocks, source
        assert other.segments["seg1"].allocator.used == st.segments["seg1"].allocator.used, source
        other.on_takeover(100.0)  # long after: the reservation is renewed, not reclaimed
        other.reclaim(101.0)
        other.put_commit("c2", "c", rid, off + MiB, MiB, cfg, 102.0)  # the client carries on
        with pytest.raises(
            ObjectExists
        ):  # a commit the old leader applied, retried: ObjectExists, not a range error
            other.put_commit("c2", "b", rid, off + 3 * MiB, MiB, cfg, 102.0)
        assert other.get_replica_list("a", 102.0)[0] == MiB
        for i in range(100):  # the new leader's own placements stay clear of the extent
            _put(other, f"n{i}", MiB, 103.0)
        _no_overlap(other)


def test_reservations_never_trade_a_placement_preference_for_an_extent_elsewhere() -> None:
    st, _ = _big_state()
    st.mount("c2", "seg2", "p-c2", 1 << 33, 64 * MiB, "h", 0.0)
    assert st.reserve("c1", MiB, ReplicaCfg(preferred_segment="seg2"), [], 1.0)[1][0] == "seg2"
    assert st.reserve("c2", MiB, ReplicaCfg(strategy="local-first"), [], 1.0)[1][0] == "seg2"
    assert st.reserve("c1", MiB, ReplicaCfg(strategy="local-first"), [], 1.0)[1][0] == "seg1"
    _put(
        st, "fill", 52 * MiB, 2.0, preferred_segment="seg2"
    )  # seg2 cannot lend another 4 MiB extent now
    assert st.reserve("c1", MiB, ReplicaCfg(preferred_segment="seg2"), [], 3.0) == (0, [], 0.0)
    assert st.reserve("c2", MiB, ReplicaCfg(strategy="local-first"), [], 3.0) == (0, [], 0.0)
    assert (
        st.reserve("c1", MiB, ReplicaCfg(), [], 3.0)[1][0] == "seg1"
    )  # free-ratio-first: the emptier one
    _no_overlap(st)


def test_versions_are_never_reused_and_change_with_each_new_memory_replica() -> None:
    """The token ``get_replica_list`` returns is what lets a client trust a remembered replica:
    a new object, a new master and a replica promoted back from SSD (even at the same offset)
    all get a token never given before."""
    st = MasterState(StoreConfig())
    st.register_client("c1", "h", "p1", True, 0.0)  # with an SSD tier
    st.mount("c1", "seg1", "p1", 1 << 30, 10 * MiB, "h", 0.0)
    _put(st, "k", MiB, 0.0)
    _, reps1, _, tok1 = st.get_replica_list("k", 0.0)
    assert tok1
    st.remove("k", True, 1.0)
    _put(st, "k", MiB, 1.0)
    _, reps2, _, tok2 = st.get_replica_list("k", 1.0)
    assert reps2 == reps1 and tok2 != tok1  # same place, new object: a new version
    other, _ = _state()
    tok, _ = other.put_start("c1", "k", MiB, ReplicaCfg(), 0.0)
    assert tok not in (tok1, tok2)  # a restarted master starts from a fresh random base
    # offload to SSD, then promote back into memory: the same offset, a new version
    assert st.evict_for(10 * MiB, 100.0) == 0  # queued as an offload
    task = st.clients["c1"].tasks.pop()
    assert task["kind"] == "offload"
    st.task_done("c1", "offload", "k", task["token"], True, "", 100.0)
    with pytest.raises(RetryLater):
        st.get_replica_list("k", 101.0)
    task = st.clients["c1"].tasks.pop()
    assert task["kind"] == "promote"
    st.task_done("c1", "promote", "k", task["token"], True, "", 101.0)
    _, reps3, _, tok3 = st.get_replica_list("k", 102.0)
    assert reps3 == reps1 and tok3 not in (tok1, tok2)
    # a standby replaying the log gives its own fresh tokens too
    replayed, _ = _state()
    for e in st.export():
        replayed.apply(e, 103.0)
    assert replayed.get_replica_list("k", 103.0)[3] not in (tok1, tok2, tok3)
