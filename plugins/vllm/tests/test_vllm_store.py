"""Shared KV pool on a real vLLM: store hits on another instance, partial hits, faults.

A store master (``mooncake-core master``) and two vLLM servers A and B with
``MooncakeCoreStoreConnector`` (each lends 64 MiB to the pool). B never serves a prompt
before A did, so every hit on B comes from the pool, not from B's own prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mooncake_vllm.testing import StoreMaster, VLLMServer, read_counters
from vllm_faults import FLAG, corrupt_kv_env
from vllm_helpers import BLOCK, needs_vllm, token_prompt, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow, needs_vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 12


@dataclass
class Pool:
    master: StoreMaster
    master_addr: str
    a: VLLMServer
    b: VLLMServer
    stats: Path

    def sched(self, server: VLLMServer) -> dict[str, float]:
        return read_counters(self.stats / server.name, "store-sched-")

    def worker(self, server: VLLMServer) -> dict[str, float]:
        return read_counters(self.stats / server.name, "store-worker-")


def _store_config(addr: str, stats: Path, by_name: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "kv_connector": "MooncakeCoreStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "mooncake": {"master_server_address": addr},
            "segment_size": "64MiB",
            "stats_dir": str(stats),
        },
    }
    if not by_name:  # B finds the class by name alone (the vllm.general_plugins entry point)
        cfg["kv_connector_module_path"] = "mooncake_vllm.store_connector"
    return cfg


@pytest.fixture(scope="module")
def pool(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    base = tmp_path_factory.mktemp("store")
    master = StoreMaster(base / "master.log").start()
    addr = master.addr
    servers = [
        VLLMServer(
            tiny_model,
            name=n,
            log_path=base / f"{n}.log",
            block_size=BLOCK,
            kv_transfer_config=_store_config(addr, base / "stats" / n, by_name=n == "B"),
            # stats logged every second (not 10): the log-line check does not wait long
            env={**corrupt_kv_env(base / "faults"), "VLLM_LOG_STATS_INTERVAL": "1"},
            log_stats=n == "B",  # B's connector stats feed its /metrics
            enforce_eager=True,
            fork_engine=True,
        )
        for n in ("A", "B")
    ]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(600)
        yield Pool(master, addr, servers[0], servers[1], base / "stats")
    finally:
        for s in servers:
            s.stop()
        master.stop()


def _text(ans: dict[str, Any]) -> str:
    return str(ans["choices"][0]["text"])


def _saved(pool: Pool, server: VLLMServer, objects: int) -> None:
    wait_for(
        lambda: pool.worker(server).get("save_objects", 0) >= objects,
        60,
        f"{objects} objects saved",
    )


def test_fresh_instance_hits_the_pool(pool: Pool) -> None:
    prompt = token_prompt(500)
    want = _text(pool.a.completion(prompt, MAX_TOKENS))
    pages = 500 // BLOCK
    _saved(pool, pool.a, pages * 2)  # 2 layers
    got = _text(pool.b.completion(prompt, MAX_TOKENS))
    assert got == want
    sched = pool.sched(pool.b)
    assert sched.get("hit_pages") == (500 - 1) // BLOCK and sched.get("hit_requests") == 1
    assert pool.worker(pool.b).get("load_pages") == (500 - 1) // BLOCK
    assert not pool.worker(pool.b).get("load_failures")


def test_shared_prefix_gets_a_partial_hit(pool: Pool) -> None:
    shared = token_prompt(8 * BLOCK, salt=7)
    first = shared + token_prompt(70, salt=8)
    second = shared + token_prompt(90, salt=9)
    saved = pool.worker(pool.a).get("save_objects", 0)
    pool.a.completion(first, MAX_TOKENS)
    _saved(pool, pool.a, saved + (len(first) // BLOCK) * 2)
    hits = pool.sched(pool.b).get("hit_pages", 0)
    got = _text(pool.b.completion(second, MAX_TOKENS))
    assert pool.sched(pool.b).get("hit_pages", 0) - hits == 8  # the shared pages only
    assert got == _text(pool.a.completion(second, MAX_TOKENS))


def _vllm_metric(server: VLLMServer, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_connector_stats_reach_vllm_metrics(pool: Pool) -> None:
    """Hits, loads and saves go through vLLM's connector-stats interface to its /metrics."""
    prompt = token_prompt(5 * BLOCK + 3, salt=12)
    saved = pool.worker(pool.a).get("save_objects", 0)
    pool.a.completion(prompt, MAX_TOKENS)
    _saved(pool, pool.a, saved + 5 * 2)
    before = _vllm_metric(pool.b, "vllm:mooncake_lookup_full_hits_total")
    loaded = _vllm_metric(pool.b, "vllm:mooncake_load_bytes_total")
    pool.b.completion(prompt, MAX_TOKENS)
    wait_for(
        lambda: _vllm_metric(pool.b, "vllm:mooncake_lookup_full_hits_total") == before + 1,
        30,
        "one more full hit on B's /metrics",
    )
    assert _vllm_metric(pool.b, "vllm:mooncake_load_bytes_total") > loaded
    assert _vllm_metric(pool.b, "vllm:mooncake_lookup_requests_total") >= 1
    # and in vLLM's own periodic log line (its LoggingStatLogger, every second here)
    wait_for(
        lambda: any(
            "KV Transfer metrics:" in ln and "lookup_full_hits=" in ln and "load_bytes=" in ln
            for ln in pool.b.log_text().splitlines()
        ),
        30,
        "vLLM's 'KV Transfer metrics' log line with a full hit on B",
    )


def test_loaded_pages_are_really_used(pool: Pool) -> None:
    prompt = token_prompt(6 * BLOCK + 5, salt=10)
    saved = pool.worker(pool.a).get("save_objects", 0)
    want = _text(pool.a.completion(prompt, MAX_TOKENS))
    _saved(pool, pool.a, saved + 6 * 2)
    corrupted = pool.worker(pool.b).get("test_corrupted_requests", 0)
    bad = _text(pool.b.completion(prompt, MAX_TOKENS, kv_transfer_params={FLAG: True}))
    assert pool.worker(pool.b).get("test_corrupted_requests", 0) == corrupted + 1
    assert bad != want, "zeroing the loaded pages did not change the output: B did not use them"


def test_master_killed_instances_recompute(pool: Pool) -> None:
    prompt = token_prompt(7 * BLOCK + 3, salt=11)
    want = _text(pool.a.completion(prompt, MAX_TOKENS))
    failed = _vllm_metric(pool.b, "vllm:mooncake_lookup_failures_total")
    pool.master.kill()
    assert _text(pool.b.completion(prompt, MAX_TOKENS)) == want
    wait_for(  # the fallback to recompute shows on vLLM's /metrics
        lambda: _vllm_metric(pool.b, "vllm:mooncake_lookup_failures_total") > failed,
        30,
        "a lookup failure (recomputed) on B's /metrics",
    )
    lines = [ln for ln in pool.b.log_text().splitlines() if "KV store lookup failed" in ln]
    assert len(lines) == 1, lines
    assert pool.b.healthy() and pool.a.healthy()
    p2 = token_prompt(3 * BLOCK + 1, salt=12)
    assert _text(pool.b.completion(p2, MAX_TOKENS)) == _text(pool.a.completion(p2, MAX_TOKENS))
