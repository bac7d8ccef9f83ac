"""Leases and pins in the replicated state: coarse lease entries, wall-clock deadlines, the
takeover lease (``store/replication.py``; the etcd round trip is in
``tests/integration/test_store_ha_state.py``)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from mooncake_core.config import StoreConfig
from mooncake_core.errors import ObjectNotFound
from mooncake_core.store.protocol import ObjectBusy, ReplicaCfg
from mooncake_core.store.state import MasterState

LEASE = 10.0


def _leader(log: list[Any]) -> MasterState:
    st = MasterState(StoreConfig(lease_ttl_s=LEASE))
    st.lease_dirty = {}  # HA on
    now = time.monotonic()
    st.on_change = log.append
    st.register_client("c", "127.0.0.1", "127.0.0.1:1", False, now)
    st.mount("c", "seg", "127.0.0.1:1", 1 << 30, 64 << 20, "127.0.0.1", now)
    for key, cfg in (
        ("a", ReplicaCfg()),
        ("b", ReplicaCfg()),
        ("soft", ReplicaCfg(soft_pin_ttl_s=300)),
        ("hard", ReplicaCfg(hard_pin=True)),
    ):
        tok, _ = st.put_start("c", key, 4096, cfg, now)
        st.put_end("c", key, tok, now)
    return st


def _standby(log: list[Any], now: float) -> MasterState:
    st = MasterState(StoreConfig(lease_ttl_s=LEASE))
    for e in log:
        st.apply(list(e), now)
    return st


def test_leases_are_logged_coarsely_and_only_on_the_tick() -> None:
    log: list[Any] = []
    st = _leader(log)
    n, t = len(log), time.monotonic()
    for i in range(200):  # a key read continuously for 4 s
        st.get_replica_list("a", t + i * 0.02)
    st.exists("b", t)
    assert len(log) == n  # the read path logs nothing itself
    st.take_leases(t + 4, 5000.0)
    leases = [e for e in log[n:] if e[0] == "lease"]
    assert len(leases) == 1
    got = dict(leases[0][1])
    assert set(got) == {"a", "b"}
    # deadlines on the wall clock, half a lease period beyond the lease
    assert got["a"] == pytest.approx(5000.0 + LEASE * 1.5 - 4)
    # reads within the logged deadline log nothing more; past it, once more
    st.get_replica_list("a", t + 4.5)
    st.take_leases(t + 4.6, 5000.6)
    assert len([e for e in log[n:] if e[0] == "lease"]) == 1
    st.get_replica_list("a", t + 6)
    st.take_leases(t + 6.1, 5002.1)
    assert len([e for e in log[n:] if e[0] == "lease"]) == 2


def test_a_new_leader_honours_replicated_leases_and_pins() -> None:
    log: list[Any] = []
    st = _leader(log)
    t = time.monotonic()
    st.get_replica_list("a", t)  # real clocks: the standby converts wall to its monotonic
    st.take_leases(t, time.time())
    new = _standby(log, time.monotonic())
    now = time.monotonic()
    new.on_takeover(now, 0.0)
    with pytest.raises(ObjectBusy, match="leased"):
        new.remove("a", False, now)
    with pytest.raises(ObjectBusy, match="hard-pinned"):
        new.remove("hard", False, now)
    new.remove("b", False, now)  # never read: no lease, and no takeover lease here
    q = new.query_key("soft")
    assert 290 < q["soft_pin_s"] <= 300
    assert new.query_key("a")["lease_s"] > LEASE  # (logged half a period longer)
    later = now + LEASE * 1.5 + 0.1
    new.remove("a", False, later)
    with pytest.raises(ObjectNotFound):
        new.get_size("a", later)
    # the default takeover lease (the read lease) still covers every object
    other = _standby(log, now)
    other.on_takeover(now)
    with pytest.raises(ObjectBusy):
        other.remove("b", False, now + 1)


def test_snapshot_export_carries_leases_and_soft_pins() -> None:
    log: list[Any] = []
    st = _leader(log)
    t = time.monotonic()
    st.get_replica_list("a", t)
    entries = st.export()
    assert any(e[0] == "lease" and e[1][0][0] == "a" for e in entries)
    new = _standby(entries, time.monotonic())
    assert new.query_key("a")["lease_s"] > LEASE  # (logged half a period longer)
    assert new.query_key("soft")["soft_pin_s"] > 290
    assert new.query_key("b")["lease_s"] == 0
