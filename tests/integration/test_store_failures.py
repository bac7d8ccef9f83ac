"""Holder failure, client expiry and concurrent writers/readers, across processes."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from store_support import Agent, Master

from mooncake_core.store import StoreClient

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(90)
def test_killed_holder_loses_nothing_with_two_replicas(tmp_path: Path) -> None:
    m = Master(tmp_path, "--client-ttl", "1.5")
    agents: list[Agent] = []
    try:
        agents = [
            Agent(m.address, segment_size=(24 << 20) if i != 1 else 0, log=tmp_path / f"a{i}.log")
            for i in range(4)
        ]
        writer, reader, h1, h2 = agents
        sizes = [1000, 70_000, 1 << 20, 3 << 20]
        keys = [f"k/{i}" for i in range(24)]
        for i, k in enumerate(keys):
            writer.call("put", key=k, size=sizes[i % 4], replica_num=2)
        # which keys have a replica on h1?
        on_h1 = [
            k
            for k in keys
            if any(
                s["segment"] == h1.segment
                for rep in reader.call("call", method="query", args=[k])["replicas"]
                for s in rep
            )
        ]
        assert on_h1, "placement never used the holder we are about to kill"
        for i, k in enumerate(keys):  # the reader remembers one replica of each key
            assert reader.call("get", key=k) == {"size": sizes[i % 4], "match": True}, k
        remembered_on_h1 = [k for k, peers in reader.call("remembered").items() if h1.peer in peers]
        assert remembered_on_h1  # 16 or so keys, each with even odds: never none in practice
        hits = reader.call("attr", name="location_hits")
        misses = reader.call("attr", name="location_misses")
        h1.kill()
        # immediately (before the master notices): reads fail over to the surviving replica,
        # remembered replicas on the dead holder included
        for i, k in enumerate(keys):
            assert reader.call("get", key=k) == {"size": sizes[i % 4], "match": True}, k
        assert reader.call("attr", name="location_hits") - hits == len(keys) - len(remembered_on_h1)
        # only the first remembered read from the dead holder was tried: it made the reader
        # forget the rest
        assert reader.call("attr", name="location_misses") - misses == 1
        assert not [k for k, peers in reader.call("remembered").items() if h1.peer in peers]
        # after the client TTL the master drops the dead segment; objects keep one replica
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            segs = json.loads(m.http("/segments")[1])
            if h1.segment not in [s["name"] for s in segs]:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the master did not unmount the dead holder's segment")
        for i, k in enumerate(keys):
            q = reader.call("call", method="query", args=[k])
            assert all(s["segment"] != h1.segment for rep in q["replicas"] for s in rep)
            assert h2.call("get", key=k) == {"size": sizes[i % 4], "match": True}
        # single-replica objects that lived only on a dead holder disappear
        writer.call("put", key="solo", size=5000, preferred_segment=h2.segment)
        h2.kill()
        deadline = time.monotonic() + 10
        while reader.call("call", method="exists", args=["solo"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reader.call("call", method="exists", args=["solo"]) is False
        assert m.alive()
    finally:
        for a in agents:
            a.stop()
        m.stop()


@pytest.mark.timeout(90)
def test_concurrent_writers_and_readers_never_see_torn_objects(tmp_path: Path) -> None:
    m = Master(tmp_path, "--default-kv-lease-ttl", "0.3")
    agents: list[Agent] = []
    try:
        agents = [
            Agent(m.address, segment_size=32 << 20, log=tmp_path / f"a{i}.log") for i in range(2)
        ]
        keys = [f"hot/{i}" for i in range(24)]
        with ThreadPoolExecutor(2) as ex:
            futs = [
                ex.submit(
                    a.call, "stress", keys=keys, seconds=4.0, writers=4, readers=4, name=f"p{i}"
                )
                for i, a in enumerate(agents)
            ]
            results = [f.result(timeout=60) for f in futs]
        total = {
            k: sum(r[k] for r in results) for k in ("puts", "gets", "torn", "removes", "errors")
        }
        assert total["torn"] == 0, json.dumps(results)
        assert total["errors"] == 0, json.dumps(results)
        # enough contention to mean something (removes are rare: readers keep most keys leased)
        assert total["puts"] > 20 and total["gets"] > 50 and total["removes"] > 2, results
        assert m.alive()
    finally:
        for a in agents:
            a.stop()
        m.stop()


@pytest.mark.timeout(120)
def test_a_restarted_master_gets_no_writes_into_extents_it_never_lent(tmp_path: Path) -> None:
    """One-RPC puts write into an extent before committing. A master that dies and comes back
    empty (no HA) knows nothing of the extents it lent, and places new objects there; a writer
    that held one must notice the broken connection and not write into it again."""
    m = Master(tmp_path)
    port = m.rpc_port
    agents: list[Agent] = []
    m2: Master | None = None
    try:
        holder = Agent(m.address, segment_size=24 << 20, log=tmp_path / "holder.log")
        a = Agent(m.address, segment_size=0, log=tmp_path / "a.log")
        agents = [holder, a]
        a.call(
            "put", key="a/0", size=5000, preferred_segment=holder.segment
        )  # a holds an extent on the holder
        before = a.call("call", method="query", args=["a/0"])["replicas"][0][0]["offset"]
        m.kill()
        m2 = Master(tmp_path, "--rpc-port", str(port), name="master2")
        deadline = time.monotonic() + 20
        while holder.segment not in [s["name"] for s in json.loads(m2.http("/segments")[1])]:
            assert time.monotonic() < deadline, (
                "the holder did not mount its segment on the new master"
            )
            time.sleep(0.2)
        b = Agent(m2.address, segment_size=0, log=tmp_path / "b.log")
        agents.append(b)
        for i in range(
            20
        ):  # the empty master places these from the start of the segment: over a's old extent
            b.call("put", key=f"b/{i}", size=60_000, preferred_segment=holder.segment)
        offsets = sorted(
            b.call("call", method="query", args=[f"b/{i}"])["replicas"][0][0]["offset"]
            for i in range(20)
        )
        assert offsets[0] <= before + 5056 <= offsets[-1] + 60_000, (
            before,
            offsets,
        )  # they overlap a's extent
        # a remembers where a/0 was; the new master knows another a/0: a must not trust the
        # old place
        b.call("put", key="a/0", size=5000, salt="v2", preferred_segment=holder.segment)
        hits = a.call("attr", name="location_hits")
        assert a.call("get", key="a/0", salt="v2") == {"size": 5000, "match": True}
        assert a.call("attr", name="location_hits") == hits
        for i in range(1, 6):
            a.call("put", key=f"a/{i}", size=5000 + i, preferred_segment=holder.segment)
        for i in range(20):
            assert holder.call("get", key=f"b/{i}") == {"size": 60_000, "match": True}, (
                f"b/{i} was overwritten"
            )
        for i in range(1, 6):
            assert holder.call("get", key=f"a/{i}") == {"size": 5000 + i, "match": True}
        assert m2.alive()
    finally:
        for ag in agents:
            ag.stop()
        if m2 is not None:
            m2.stop()
        m.stop()


@pytest.mark.timeout(60)
def test_close_does_not_wait_out_the_failover_when_the_master_is_gone(tmp_path: Path) -> None:
    """Saying goodbye at close (give back reservations, unmount) is bounded: a master that died
    must not hold ``close()`` for the client's failover wait (15 s here), and the heartbeat
    thread, blocked on the dead master, is woken and stops."""
    m = Master(tmp_path)
    try:
        c = StoreClient(master=m.address, segment_size=4 << 20).start()
        assert c.rpc.failover_timeout_s == 15.0
        c.put("k", b"x" * 70_000)  # takes a reservation: close has one to give back, and a segment
        m.kill()
        t0 = time.monotonic()
        c.close()
        took = time.monotonic() - t0
        assert took < 6, f"close() took {took:.1f}s with the master gone"
        assert c._poller is not None and not c._poller.is_alive()
    finally:
        m.stop()
