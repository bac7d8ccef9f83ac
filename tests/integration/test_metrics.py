"""Metrics with real processes: a store master and two store nodes (each transfer engine
serving its process's /metrics through ``MOONCAKE_TRANSFER_METRICS_PORT``) move real bytes;
the scrapes must show exactly that traffic, and ``mooncake-core top --once`` must read it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from store_support import Agent, AgentError, Master, free_port

from mooncake_core.errors import TransportError
from mooncake_core.metrics import Sample, parse
from mooncake_core.transfer import TransferEngine

pytestmark = [pytest.mark.timeout(120)]

MiB = 1 << 20
N = 4


def scrape(port: int) -> list[Sample]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return parse(r.read().decode())


def total(samples: list[Sample], sample: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.sample == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


@dataclass
class Cluster:
    master: Master
    a: Agent
    b: Agent
    a_port: int
    b_port: int


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("metrics")
    m = Master(tmp)
    ports = free_port(), free_port()
    agents: list[Agent] = []
    try:
        for name, port in zip("ab", ports, strict=True):
            agents.append(
                Agent(
                    m.address,
                    env={"MOONCAKE_TRANSFER_METRICS_PORT": str(port)},
                    log=tmp / f"{name}.log",
                )
            )
        yield Cluster(m, agents[0], agents[1], *ports)
    finally:
        for ag in agents:
            ag.stop()
        m.stop()


def test_counters_move_with_real_traffic(cluster: Cluster) -> None:
    m, a, b = cluster.master, cluster.a, cluster.b
    before_master = parse(m.http("/metrics")[1])
    before_a, before_b = scrape(cluster.a_port), scrape(cluster.b_port)
    # A writes into B's memory; B reads from A's memory: real transfers both ways
    for i in range(N):
        a.call("put", key=f"to-b/{i}", size=MiB, preferred_segment=b.segment)
        a.call("put", key=f"on-a/{i}", size=MiB, preferred_segment=a.segment)
    for i in range(N):
        assert b.call("get", key=f"on-a/{i}")["match"]
    with pytest.raises(AgentError):
        b.call("get", key="never-stored")

    after_a, after_b = scrape(cluster.a_port), scrape(cluster.b_port)
    wrote = total(after_a, "mooncake_transfer_bytes_total", op="write", peer=b.peer) - total(
        before_a, "mooncake_transfer_bytes_total", op="write", peer=b.peer
    )
    assert wrote == N * MiB
    read = total(after_b, "mooncake_transfer_bytes_total", op="read", peer=a.peer) - total(
        before_b, "mooncake_transfer_bytes_total", op="read", peer=a.peer
    )
    assert read == N * MiB
    for snap, old in ((after_a, before_a), (after_b, before_b)):
        assert (
            total(snap, "mooncake_transfer_requests_total")
            - total(old, "mooncake_transfer_requests_total")
            >= N
        )
        assert (
            total(snap, "mooncake_transfer_seconds_count")
            - total(old, "mooncake_transfer_seconds_count")
            >= N
        )
        assert total(snap, "mooncake_transfer_slice_errors_total") == 0
        assert total(snap, "process_resident_memory_bytes") > 10 * MiB

    after = parse(m.http("/metrics")[1])
    assert total(after, "master_key_count") == 2 * N
    assert total(after, "mooncake_master_objects") == 2 * N
    assert total(after, "master_active_clients") == 2
    assert total(after, "master_allocated_bytes") >= 2 * N * MiB
    assert total(after, "master_total_capacity_bytes") == 2 * (32 << 20)
    assert total(after, "mooncake_master_is_leader") == 1
    assert total(after, "mooncake_master_role", role="leader") == 1
    hits = total(after, "valid_get_nums_") - total(before_master, "valid_get_nums_")
    lookups = total(after, "total_get_nums_") - total(before_master, "total_get_nums_")
    assert hits >= N and lookups - hits >= 1  # the key never stored was a miss
    assert total(after, "mooncake_master_gets_total", result="miss") >= 1
    assert total(after, "mem_cache_hit_bytes_total") >= N * MiB
    assert total(after, "mooncake_master_leased_objects") >= N
    reqs = total(after, "mooncake_master_requests_total")
    assert reqs - total(before_master, "mooncake_master_requests_total") >= 3 * N
    # replicas per segment: each segment holds the N keys placed on it
    seg_keys = {
        s.labels["segment"]: s.value for s in after if s.sample == "mooncake_master_segment_keys"
    }
    assert sorted(seg_keys.values()) == [N, N]


def test_top_once_reads_master_and_nodes(cluster: Cluster, tmp_path: Path) -> None:
    m = cluster.master
    cmd = [sys.executable, "-m", "mooncake_core", "top", "--master", f"127.0.0.1:{m.http_port}"]
    cmd += ["--node", f"127.0.0.1:{cluster.a_port}", "--node", f"127.0.0.1:{cluster.b_port}"]
    out = subprocess.run([*cmd, "--once", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    snap = json.loads(out.stdout.strip().splitlines()[-1])
    master = snap[f"master:127.0.0.1:{m.http_port}"]
    assert master["keys"] == 2 * N and master["leader"] is True and master["clients"] == 2
    node_a = snap[f"node:127.0.0.1:{cluster.a_port}"]
    assert node_a["written_bytes"] >= N * MiB and cluster.b.peer in node_a["peers"]
    text = subprocess.run([*cmd, "--once"], capture_output=True, text=True, timeout=60)
    assert text.returncode == 0
    assert "[leader] keys 8" in text.stdout and text.stdout.count("NODE") == 2
    # a target that does not answer: shown DOWN, exit status 1
    down = free_port()
    bad = subprocess.run(
        [*cmd, "--proxy", f"127.0.0.1:{down}", "--once"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 1 and f"127.0.0.1:{down}: DOWN" in bad.stdout


def test_engine_counts_failovers_retries_and_slice_errors_per_path(
    spawn_peer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's own fault paths move the per-(peer, transport) counters, on the endpoint
    ``transfer.metrics_port`` turns on: shared memory failing fails over to TCP (its slices
    counted as errors on shm, the failover on tcp), a TCP connection broken mid-batch is
    retried, and the bytes land exactly once on the path that moved them."""
    eng = TransferEngine(
        transfer={
            "slice_size": 64 << 10,
            "connections_per_peer": 2,
            "timeout_s": 10,
            "metrics_port": 0,
        }
    ).start()
    try:
        assert eng.metrics_url.startswith("http://127.0.0.1:")
        port = int(eng.metrics_url.rsplit(":", 1)[1].split("/")[0])
        peer = spawn_peer()
        size = 1 << 20  # 16 slices
        raddr = peer.call("alloc", size=size)["addr"]
        data = np.random.default_rng(9).integers(0, 256, size, dtype=np.uint8)
        want = hashlib.sha256(data.tobytes()).hexdigest()
        before = scrape(port)

        def shm_fails(*_a: Any, **_k: Any) -> None:
            raise TransportError("injected: shared memory unavailable")

        monkeypatch.setattr(eng.transports["shm"], "execute", shm_fails)
        eng.write(peer.name, data, raddr, transport="shm")  # fails over to TCP
        monkeypatch.undo()
        assert peer.call("digest", addr=raddr, length=size)["sha"] == want
        tcp: Any = eng.transports["tcp"]
        sends = {"n": 0}

        def break_third(_conn: Any) -> bool:
            sends["n"] += 1
            return sends["n"] == 3  # one connection breaks once, mid-batch

        tcp.fault_hook = break_third
        try:
            eng.write(peer.name, data, raddr, transport="tcp")
        finally:
            tcp.fault_hook = None
        assert peer.call("digest", addr=raddr, length=size)["sha"] == want
        after = scrape(port)
    finally:
        eng.close()

    def d(sample: str, **labels: str) -> float:
        return total(after, sample, peer=peer.name, **labels) - total(
            before, sample, peer=peer.name, **labels
        )

    assert d("mooncake_transfer_slices_total", transport="shm") == 16
    assert d("mooncake_transfer_slice_errors_total", transport="shm") == 16
    assert d("mooncake_transfer_bytes_total", transport="shm", op="write") == 0
    assert d("mooncake_transfer_failovers_total", transport="tcp") == 1
    assert d("mooncake_transfer_failovers_total", transport="shm") == 0
    assert d("mooncake_transfer_retries_total", transport="tcp") >= 1
    assert d("mooncake_transfer_slice_errors_total", transport="tcp") == 0
    assert d("mooncake_transfer_bytes_total", transport="tcp", op="write") == 2 * size
    assert d("mooncake_transfer_requests_total", transport="tcp") == 2
    assert d("mooncake_transfer_seconds_count", transport="shm") == 1
    assert d("mooncake_transfer_seconds_count", transport="tcp") == 2
