"""Eviction (leases, soft and hard pins), bounded memory under a flood, and the SSD tier."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from store_support import Agent, AgentError, Master

pytestmark = [pytest.mark.slow]
MiB = 1 << 20


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


@pytest.mark.timeout(90)
def test_eviction_respects_leases_and_pins(tmp_path: Path) -> None:
    m = Master(
        tmp_path,
        "--eviction-high-watermark",
        "0.8",
        "--eviction-ratio",
        "0.1",
        "--default-kv-lease-ttl",
        "3",
    )
    agents: list[Agent] = []
    try:
        holder = Agent(m.address, segment_size=16 * MiB, log=tmp_path / "holder.log")
        agents.append(holder)
        writer = Agent(m.address, segment_size=0, log=tmp_path / "writer.log")
        agents.append(writer)
        writer.call("put", key="pin/hard", size=2 * MiB, hard_pin=True)
        writer.call("put", key="pin/soft", size=2 * MiB, soft_pin_ttl_s=120.0)
        writer.call("put", key="leased", size=MiB)
        for i in range(40):  # 40 MiB through a 16 MiB pool
            if i % 4 == 0:
                assert holder.call("get", key="leased")["match"]  # keep its read lease fresh
            writer.call("put", key=f"flood/{i}", size=MiB)
        exists = writer.call(
            "call", method="batch_exists", args=[["pin/hard", "pin/soft", "leased"]]
        )
        assert exists == [True, True, True]
        flood = writer.call("call", method="batch_exists", args=[[f"flood/{i}" for i in range(40)]])
        assert not all(flood[:10]), "old unpinned objects should have been evicted"
        assert all(flood[-3:]), "the newest objects should be there"
        segs = json.loads(m.http("/segments")[1])
        assert segs[0]["used"] <= 16 * MiB
        text = m.http("/metrics")[1]
        assert _metric(text, "mooncake_master_evictions_total") >= 10
        # hard-pinned objects refuse a plain remove; forced removal works
        with pytest.raises(AgentError) as ei:
            writer.call("call", method="remove", args=["pin/hard"])
        assert "hard-pinned" in ei.value.msg
        writer.call("call", method="remove", args=["pin/hard"], kwargs={"force": True})
        # once only pinned objects remain, the soft pin yields before a put fails
        writer.call("call", method="remove_by_regex", args=["^flood/"], kwargs={"force": True})
        writer.call("call", method="remove", args=["leased"], kwargs={"force": True})
        for i in range(15):
            writer.call("put", key=f"late/{i}", size=MiB)
        assert m.alive()
    finally:
        for a in agents:
            a.stop()
        m.stop()


@pytest.mark.timeout(120)
def test_ssd_tier_offloads_on_eviction_and_promotes_on_hit(tmp_path: Path) -> None:
    m = Master(
        tmp_path,
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
        holder = Agent(
            m.address, segment_size=8 * MiB, ssd_path=str(ssd), log=tmp_path / "holder.log"
        )
        agents.append(holder)
        writer = Agent(m.address, segment_size=0, log=tmp_path / "writer.log")
        agents.append(writer)
        keys = [f"ssd/{i}" for i in range(16)]  # 16 MiB through an 8 MiB segment
        for k in keys:
            writer.call("put", key=k, size=MiB)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(list(ssd.glob("*.obj"))) < 8:
            time.sleep(0.1)
        assert len(list(ssd.glob("*.obj"))) >= 8, (
            "evicted objects should have been offloaded to the SSD directory"
        )
        text = m.http("/metrics")[1]
        assert _metric(text, "mooncake_master_ssd_offloads_total") >= 8
        q = json.loads(m.http("/query_key?key=ssd/0")[1])
        assert q["ssd"] and q["replicas"] == []  # SSD only
        # every object reads back exactly: the offloaded ones are promoted on the hit
        for k in keys:
            assert writer.call("get", key=k) == {"size": MiB, "match": True}, k
        text = m.http("/metrics")[1]
        assert _metric(text, "mooncake_master_ssd_promotions_total") >= 1
        # removing an offloaded object deletes its SSD file
        n_before = len(list(ssd.glob("*.obj")))
        writer.call("call", method="remove_all", kwargs={"force": True})
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and list(ssd.glob("*.obj")):
            time.sleep(0.1)
        assert n_before > 0 and not list(ssd.glob("*.obj"))
    finally:
        for a in agents:
            a.stop()
        m.stop()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmRSS:")))


@pytest.mark.timeout(120)
def test_object_cap_bounds_master_metadata_under_a_tiny_object_flood(tmp_path: Path) -> None:
    """64-byte objects would fit by the million in a segment; max_objects bounds the master
    instead."""
    cap = 400
    m = Master(
        tmp_path,
        "--max-objects",
        str(cap),
        "--eviction-ratio",
        "0.1",
        "--default-kv-lease-ttl",
        "0.5",
    )
    agents: list[Agent] = []
    try:
        holder = Agent(m.address, segment_size=32 * MiB, log=tmp_path / "holder.log")
        agents.append(holder)
        writer = Agent(m.address, segment_size=0, log=tmp_path / "writer.log")
        agents.append(writer)
        rss: list[int] = []
        for r in range(40):  # 40 x 100 tiny puts: ten times the cap
            keys = [f"tiny/{r}/{i}" for i in range(100)]
            assert writer.call("put_batch", keys=keys, size=64) == [None] * 100
            stats = writer.call("call", method="stats")
            assert stats["objects"] + stats["pending_puts"] <= cap, stats
            if r in (9, 39):
                rss.append(_rss_kib(m.proc.pid))
        assert stats["evictions"] >= 3000
        # the newest objects are there and read back exactly
        newest = [f"tiny/39/{i}" for i in range(100)]
        assert writer.call("get_batch", keys=newest) == [True] * 100
        # metadata memory does not keep growing once the cap is reached (loose: allocator noise)
        assert rss[1] - rss[0] < 16 * 1024, (
            f"master RSS grew {rss[1] - rss[0]} KiB between 1k and 4k puts"
        )
        # at the cap with every object leased or pinned: a clear error, the master stays up
        writer.call("call", method="remove_all", kwargs={"force": True})
        pinned = [f"pin/{i}" for i in range(cap)]
        for i in range(0, cap, 100):
            assert (
                writer.call("put_batch", keys=pinned[i : i + 100], size=64, hard_pin=True)
                == [None] * 100
            )
        with pytest.raises(AgentError) as ei:
            writer.call("put", key="one-too-many", size=64)
        assert "max_objects" in ei.value.msg and ei.value.type == "NoSpace", ei.value
        assert m.alive()
        writer.call("call", method="remove", args=["pin/0"], kwargs={"force": True})
        writer.call("put", key="fits-again", size=64)
        assert writer.call("get", key="fits-again")["match"]
    finally:
        for a in agents:
            a.stop()
        m.stop()
