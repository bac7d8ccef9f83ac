"""Hot keys and tier moves with real processes: a master, holder and reader client processes.

- Hot-key replication: two readers read 24 keys with Zipf popularity; the hottest key gains
  memory replicas up to the per-key cap (within the byte cap), its reads are then spread
  over those segments, cold keys keep one replica, and once the load stops the extra
  replicas go away. Every read returns the key's bytes.
- Tier moves: objects evicted past the high watermark are offloaded to the holder's SSD and
  read back exactly; a single read brings an object into memory only for that read, a
  second read within the window keeps it there (the master's query shows the replica).
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from store_support import Agent, Master

pytestmark = [pytest.mark.slow]
KiB, MiB = 1 << 10, 1 << 20


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def _config(tmp: Path, **store: Any) -> str:
    p = tmp / "mooncake.json"
    p.write_text(json.dumps({"store": store}))
    return str(p)


def _replicas(m: Master, key: str) -> list[str]:
    q = json.loads(m.http(f"/query_key?key={key}")[1])
    return sorted(rep[0]["segment"] for rep in q["replicas"])


def _start(n: int, make: Any) -> list[Agent]:
    out: list[Agent | None] = [None] * n
    errs: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = make(i)
        except BaseException as exc:
            errs.append(exc)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    agents = [a for a in out if a is not None]
    if errs:
        for a in agents:
            a.stop()
        raise errs[0]
    return agents


def _zipf_all(readers: list[Agent], keys: list[str], n: int, seed: int) -> list[dict[str, Any]]:
    res: list[dict[str, Any]] = [{} for _ in readers]

    def one(i: int) -> None:
        res[i] = readers[i].call("zipf", keys=keys, n=n, seed=seed + i)

    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(readers))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for r in res:
        assert r and r["mismatch"] == 0, "a read returned wrong bytes"
    return res


@pytest.mark.timeout(90)
def test_hot_keys_gain_replicas_spread_reads_and_cool(tmp_path: Path) -> None:
    size = 128 * KiB
    m = Master(  # the settings as command-line flags (the same as store.hot_key_* keys)
        tmp_path,
        "--hot-key-replicas",
        "3",
        "--hot-key-reads",
        "10",
        "--hot-key-window",
        "1",
        "--hot-key-max-bytes",
        f"{4 * size // KiB}KiB",  # room for 4 extra replicas
        "--default-kv-lease-ttl",
        "0.5",
    )
    agents: list[Agent] = []
    try:
        agents = _start(
            5,
            lambda i: Agent(
                m.address,
                segment_size=(16 * MiB if i < 3 else 0),
                log=tmp_path / f"agent{i}.log",
            ),
        )
        holders, readers = agents[:3], agents[3:]
        segs = sorted(h.segment for h in holders)
        keys = [f"z/{i}" for i in range(24)]  # keys[0] is the most popular
        for k in keys:
            readers[0].call("put", key=k, size=size)
        assert all(len(_replicas(m, k)) == 1 for k in keys)
        # warm up until the hottest key has its replicas (reads keep it hot meanwhile)
        deadline = time.monotonic() + 20
        seed = 1
        while time.monotonic() < deadline and _replicas(m, keys[0]) != segs:
            _zipf_all(readers, keys, 100, seed)
            seed += 10
        assert _replicas(m, keys[0]) == segs, "the hottest key should be on every segment"
        # a measured round: reads of the hottest key are spread over its three replicas
        res = _zipf_all(readers, keys, 300, 1000)
        hot = {s: sum(r["served"].get(keys[0], {}).get(s, 0) for r in res) for s in segs}
        total = sum(hot.values())
        assert total >= 60, hot
        assert min(hot.values()) > 0, f"some replica of the hottest key served nothing: {hot}"
        assert max(hot.values()) <= 0.6 * total, f"one segment served most reads: {hot}"
        extra = {k: len(_replicas(m, k)) - 1 for k in keys}
        multi = [k for k, n in extra.items() if n]
        assert sum(extra.values()) <= 4, extra  # within the byte cap (4 objects)
        assert all(len(_replicas(m, k)) == 1 for k in keys[12:])  # the cold tail: one each
        text = m.http("/metrics")[1]
        assert _metric(text, "mooncake_master_hot_replicas_added_total") >= 2
        assert _metric(text, "mooncake_master_hot_bytes") <= 4 * size
        # the load stops: the extra replicas go once the keys cool and their leases end
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(len(_replicas(m, k)) > 1 for k in multi):
            time.sleep(0.2)
        assert all(len(_replicas(m, k)) == 1 for k in keys)
        assert _metric(m.http("/metrics")[1], "mooncake_master_hot_replicas_dropped_total") >= 2
        for k in keys[:3]:  # still exactly the key's bytes
            assert holders[0].call("get", key=k) == {"size": size, "match": True}
    finally:
        for a in agents:
            a.stop()
        m.stop()


@pytest.mark.timeout(90)
def test_evicted_objects_read_from_ssd_and_promote_on_the_second_read(tmp_path: Path) -> None:
    cfg = _config(tmp_path, ssd_promote_after=2, ssd_promote_window_s=60.0)
    m = Master(
        tmp_path,
        "--config",
        cfg,
        "--eviction-high-watermark",
        "0.75",
        "--eviction-ratio",
        "0.25",
        "--default-kv-lease-ttl",
        "0.3",
    )
    ssd = tmp_path / "ssd"
    agents: list[Agent] = []
    try:
        agents = _start(
            2,
            lambda i: Agent(
                m.address,
                segment_size=8 * MiB if i == 0 else 0,
                ssd_path=str(ssd) if i == 0 else "",
                log=tmp_path / f"agent{i}.log",
            ),
        )
        writer = agents[1]
        keys = [f"ssd/{i}" for i in range(16)]  # 16 MiB through an 8 MiB segment
        for k in keys:
            writer.call("put", key=k, size=MiB)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _replicas(m, keys[0]):
            time.sleep(0.1)
        q = json.loads(m.http(f"/query_key?key={keys[0]}")[1])
        assert q["ssd"] and q["replicas"] == [], q  # offloaded, not dropped
        # one read: exact bytes, in memory for that read only
        assert writer.call("get", key=keys[0]) == {"size": MiB, "match": True}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _replicas(m, keys[0]):
            time.sleep(0.1)
        assert _replicas(m, keys[0]) == [], "one read should not keep it in memory"
        # a second read within the window: promoted for good
        assert writer.call("get", key=keys[0]) == {"size": MiB, "match": True}
        time.sleep(1.0)  # several ticks and the 0.3 s lease: it stays
        assert _replicas(m, keys[0]) != []
        text = m.http("/metrics")[1]
        assert _metric(text, "mooncake_master_ssd_promotions_transient_total") >= 1
        assert _metric(text, "mooncake_master_ssd_promotions_admitted_total") >= 1
        assert _metric(text, "mooncake_master_ssd_offload_dropped_total") == 0
        for k in keys:  # every object, in memory or on SSD, reads back exactly
            assert writer.call("get", key=k) == {"size": MiB, "match": True}, k
    finally:
        for a in agents:
            a.stop()
        m.stop()
