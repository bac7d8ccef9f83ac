"""MasterState: holders a writer could not reach are avoided until they heartbeat again.

A put placed again names the segments its writer could not write (``exclude``): they are never
used for that put, and their holders become suspect: placement and reservations skip them for
every writer until the holder sends any request, or for the client TTL at most. Suspect
segments are still used when nothing else has room.
"""

from __future__ import annotations

from typing import Any

import pytest

from mooncake_core.config import StoreConfig
from mooncake_core.errors import NoSpace
from mooncake_core.store.protocol import ReplicaCfg
from mooncake_core.store.state import MasterState

MiB = 1 << 20


def _state(**kw: Any) -> MasterState:
    """A writer w (no segment) and holders a and b, 16 MiB each; b much fuller than a, so
    free-ratio-first placement picks a."""
    st = MasterState(StoreConfig(client_ttl_s=5.0, **kw))
    st.register_client("w", "h", "pw", False, 0.0)
    for i, c in enumerate(("a", "b")):
        st.register_client(c, "h", f"p{c}", False, 0.0)
        st.mount(c, f"seg-{c}", f"p{c}", (i + 1) << 32, 16 * MiB, "h", 0.0)
    tok, _ = st.put_start("w", "fill", 8 * MiB, ReplicaCfg(preferred_segment="seg-b"), 0.0)
    st.put_end("w", "fill", tok, 0.0)
    return st


def _segment(st: MasterState, key: str, now: float) -> str:
    """The segment a new 1000-byte object of ``w`` goes to."""
    tok, reps = st.put_start("w", key, 1000, ReplicaCfg(), now)
    st.put_end("w", key, tok, now)
    return str(reps[0][0][0])


def test_an_excluded_segment_is_skipped_and_its_holder_avoided_until_it_heartbeats() -> None:
    st = _state()
    assert _segment(st, "k0", 1.0) == "seg-a"  # the emptier one
    tok, reps = st.put_start("w", "k1", 1000, ReplicaCfg(), 1.1, ["seg-a"])
    assert [s[0] for rep in reps for s in rep] == ["seg-b"]
    st.put_end("w", "k1", tok, 1.1)
    assert st.stats()["suspect_holders"] == 1 and st.counters["suspect_marks"] == 1
    # every writer now avoids a, without naming it; reservations too
    st.register_client("w2", "h", "pw2", False, 1.2)
    assert _segment(st, "k2", 1.2) == "seg-b"
    rid, ext, _ttl = st.reserve("w2", 1000, ReplicaCfg(), [], 1.2)
    assert rid and ext.segment == "seg-b"  # type: ignore[union-attr]
    # the end of a long poll that arrived before the mark is no sign of life
    assert st.take_tasks_after_wait("a", 1.3) == []
    assert _segment(st, "k3", 1.3) == "seg-b"
    # any request that arrives after the mark is: a is used again
    st.take_tasks("a", 1.4)
    assert st.stats()["suspect_holders"] == 0
    assert _segment(st, "k4", 1.5) == "seg-a"


def test_a_mark_lasts_the_client_ttl_at_most_and_goes_with_the_holder() -> None:
    st = _state()
    st.report_unreachable("w", ["seg-a"], 1.0)
    st.report_unreachable("w", ["seg-w-none", "seg-a"], 1.5)  # unknown names are ignored
    assert st.counters["suspect_marks"] == 1
    assert _segment(st, "k0", 6.0) == "seg-b"
    assert _segment(st, "k1", 6.6) == "seg-a"  # 5 s after the last report: expired
    st.report_unreachable("w", ["seg-a"], 7.0)
    st.drop_client("a")
    assert st.suspects == {}
    # a writer cannot make itself suspect
    st.report_unreachable("b", ["seg-b"], 8.0)
    assert st.suspects == {}


def test_suspect_segments_are_used_when_nothing_else_has_room_but_excluded_ones_never() -> None:
    st = _state()
    st.report_unreachable("w", ["seg-a"], 1.0)
    # 10 MiB does not fit b (8 MiB used of 16): a, though suspect
    tok, reps = st.put_start("w", "big", 10 * MiB, ReplicaCfg(), 1.1)
    assert [s[0] for rep in reps for s in rep] == ["seg-a"]
    st.put_revoke("w", "big", tok, 1.1)
    # excluded, a is never used: b cannot hold it (fill is leased, so not evicted), and
    # nothing is evicted in vain for what no other segment could hold
    st.get_replica_list("fill", 1.15)
    with pytest.raises(NoSpace):
        st.put_start("w", "big", 10 * MiB, ReplicaCfg(), 1.2, ["seg-a"])
    with pytest.raises(NoSpace, match="could not write"):
        st.put_start("w", "huge", 20 * MiB, ReplicaCfg(), 1.2, ["seg-a"])
    assert st.exists("fill", 1.3)
    # two replicas asked, one holder trusted: one replica, on b
    tok, reps = st.put_start("w", "two", 1000, ReplicaCfg(replica_num=2), 1.4)
    assert [s[0] for rep in reps for s in rep] == ["seg-b"]


def test_a_closed_heartbeat_connection_makes_its_client_suspect_until_heard_from() -> None:
    st = _state()
    st.heartbeat_lost("a", 1.0)
    assert st.counters["suspect_marks"] == 1 and _segment(st, "k0", 1.1) == "seg-b"
    st.heartbeat_lost("a", 1.2)  # already suspect: one mark
    st.heartbeat_lost("gone", 1.2)  # not a client (unregistered first): nothing
    assert st.counters["suspect_marks"] == 1 and set(st.suspects) == {"a"}
    st.take_tasks("a", 1.3)  # it reconnected and polled: alive
    assert _segment(st, "k1", 1.4) == "seg-a"
    off = _state(suspect_on_disconnect=False)
    off.heartbeat_lost("a", 1.0)
    assert off.suspects == {} and _segment(off, "k0", 1.1) == "seg-a"
