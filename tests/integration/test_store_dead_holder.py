"""Puts right after a holder died: placed again on the live segments, never failed.

A SIGKILLed holder keeps its segment on the master until its client TTL runs out. Puts made in
that time, from clients with no segment of their own, must still all succeed while a live
segment has room: single puts, ``put_from``, batches, multi-replica puts, and one-RPC puts
through reservations the clients hold on the dead holder.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from store_support import Agent, Master, payload

from mooncake_core.config import load_config
from mooncake_core.store import StoreClient


def _two_phase_client(master: str) -> StoreClient:
    cfg = load_config().replace(store={"client_reservations": False})
    return StoreClient(cfg, master=master, segment_size=0).start()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["single", "batch", "reserved"])
def test_puts_right_after_a_holder_died_all_land_on_the_live_one(
    tmp_path: Path, first: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the master does not learn of the death from the heartbeat connection's close, as when a
    # holder is cut off without its sockets closing: only the failed writes tell it
    monkeypatch.setenv("MOONCAKE_STORE_SUSPECT_ON_DISCONNECT", "false")
    # a TTL far longer than the test: the dead holder's segment stays registered throughout
    m = Master(tmp_path, "--client-ttl", "60")
    agents: list[Agent] = []
    clients: list[StoreClient] = []
    try:
        agents = [
            Agent(m.address, segment_size=64 << 20, log=tmp_path / f"h{i}.log") for i in (1, 2)
        ]
        victim, live = agents
        two = _two_phase_client(m.address)  # puts in two phases only
        res1 = StoreClient(master=m.address, segment_size=0).start()  # one-RPC puts
        res2 = StoreClient(master=m.address, segment_size=0).start()
        clients = [two, res1, res2]
        # fill the live holder: the master's placement (free-ratio-first) then prefers the victim,
        # for two-phase puts and for the reservations it lends
        fill = [f"fill/{i}" for i in range(12)]
        for k in fill:
            two.put(k, payload(k, 2 << 20), preferred_segment=live.segment)
        res1.put("warm/1", payload("warm/1", 100_000))
        res2.put("warm/2", payload("warm/2", 100_000))
        for c in (res1, res2):  # each holds a reservation on the victim
            assert [lent.segment for lent in c._lent.values()] == [victim.segment]

        victim.kill()  # SIGKILL; the master hears nothing until the TTL
        sizes = [1000, 70_000, 300_000]  # with the rest, under the live holder's watermark
        put: dict[str, int] = {}

        def singles(c: StoreClient, tag: str, n: int, replica_num: int = 1) -> None:
            for i in range(n):
                k = f"{tag}/{i}"
                size = sizes[i % len(sizes)]
                c.put(k, payload(k, size), replica_num=replica_num)
                put[k] = size

        def batch(c: StoreClient, tag: str, n: int, replica_num: int = 1) -> None:
            keys = [f"{tag}/{i}" for i in range(n)]
            vals = [payload(k, sizes[i % len(sizes)]) for i, k in enumerate(keys)]
            assert c.put_batch(keys, vals, replica_num=replica_num) == [None] * n
            put.update({k: len(v) for k, v in zip(keys, vals, strict=True)})

        # the first put of each kind goes to the dead holder: no mark on the master yet for the
        # first two-phase put (or for the first one-RPC put, with first="reserved"); the
        # reservations are the clients' own
        if first == "single":
            singles(two, "two/single", 8)
        elif first == "batch":
            batch(two, "two/batch", 16)
        singles(res1, "res/single", 8)
        batch(res2, "res/batch", 16)
        # everything else, now that the master avoids the dead holder
        singles(two, "two/single2", 4)
        batch(two, "two/batch2", 8)
        singles(two, "two/rep2", 4, replica_num=2)
        batch(two, "two/brep2", 4, replica_num=2)
        batch(res1, "res/batch2", 8)
        singles(res2, "res/single2", 4)
        big = "res/5mb"  # beyond what a reservation takes: two phases
        res1.put(big, payload(big, 5 << 20))
        put[big] = 5 << 20
        reg = np.frombuffer(bytearray(payload("res/from", 200_000)), dtype=np.uint8)
        res2.register_buffer(reg)
        res2.put_from("res/from", int(reg.ctypes.data), reg.nbytes)  # zero-copy, an address
        put["res/from"] = reg.nbytes
        keys = sorted(put)
        bufs = [bytearray(size) for size in (put[k] for k in keys)]
        assert two.batch_get_into(keys, bufs) == [put[k] for k in keys]
        for k, b in zip(keys, bufs, strict=True):
            assert bytes(b) == payload(k, put[k]), k
            assert res1.get(k) == payload(k, put[k]), k
            q = two.query(k)
            assert all(s["segment"] == live.segment for rep in q["replicas"] for s in rep), k
        st = two.stats()
        assert st["suspect_marks"] == 1 and st["suspect_holders"] == 1
        prom = m.http("/metrics")[1]
        assert "mooncake_master_suspect_marks_total 1.0" in prom, prom
        assert "mooncake_master_suspect_holders 1.0" in prom
        # all of it before the master dropped the dead holder
        segs = [s["name"] for s in json.loads(m.http("/segments")[1])]
        assert victim.segment in segs
    finally:
        for c in clients:
            c.close()
        for a in agents:
            a.stop()
        m.stop()


@pytest.mark.timeout(60)
def test_a_killed_holder_gets_no_new_object_from_its_death_on(tmp_path: Path) -> None:
    """The killed holder's heartbeat connection closes with it: the master avoids its segment
    at once (``suspect_on_disconnect``), so puts never try it, long before the TTL."""
    m = Master(tmp_path, "--client-ttl", "60")
    agents: list[Agent] = []
    try:
        agents = [
            Agent(m.address, segment_size=64 << 20, log=tmp_path / f"h{i}.log") for i in (1, 2)
        ]
        victim, live = agents
        with _two_phase_client(m.address) as two:
            for i in range(12):  # the live holder fuller: placement would prefer the victim
                two.put(f"fill/{i}", payload(f"fill/{i}", 2 << 20), preferred_segment=live.segment)
            assert two.stats()["suspect_holders"] == 0
            victim.kill()
            deadline = time.monotonic() + 5.0
            while two.stats()["suspect_holders"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            st = two.stats()
            assert st["suspect_holders"] == 1 and st["suspect_marks"] == 1
            keys = [f"after/{i}" for i in range(10)]
            for k in keys:
                two.put(k, payload(k, 70_000))
            for k in keys:
                assert two.get(k) == payload(k, 70_000)
                q = two.query(k)
                assert all(s["segment"] == live.segment for rep in q["replicas"] for s in rep), k
            assert two.stats()["suspect_marks"] == 1  # the one from the closed connection
            segs = [s["name"] for s in json.loads(m.http("/segments")[1])]
            assert victim.segment in segs  # all before the TTL
    finally:
        for a in agents:
            a.stop()
        m.stop()
