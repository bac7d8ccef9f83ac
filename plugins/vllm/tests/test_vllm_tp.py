"""Tensor parallelism 2 on a real vLLM (CPU, tiny random Llama), with both connectors.

One module-scoped set of servers, each TP=2 one running vLLM's multi-process executor with
rank 0 bound to core 0 and rank 1 to core 1 (``--enforce-eager``: torch.compile's warm-up
of two ranks at once took over 2 minutes on this 2-core machine):

- PD: a prefill instance (``kv_producer``) and a decode instance (``kv_consumer``), both
  TP=2, behind the proxy. The reference output is a TP=2 instance computing the prompt in
  full: S2 below on a prompt it never saw, or the decode instance asked directly (a request
  without ``kv_transfer_params`` is computed there) on a prompt it never saw.
- store: a master, a TP=2 instance S2 with ``MooncakeCoreStoreConnector`` and vLLM's own
  prefix cache off (so a repeated prompt can only be served from the store), and a TP=1
  instance S1 on the same master.

If this vLLM cannot run TP=2 on this CPU, the module skips with vLLM's own error line (and
only then: any other start failure fails the tests).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mooncake_vllm.testing import (
    VLLMServer,
    engine_env,
    free_port,
    http_json,
    pd_transfer_config,
    read_counters,
    store_transfer_config,
)
from vllm_helpers import BLOCK, needs_vllm, token_prompt, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow, needs_vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 12
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
TP2_ARGS = ["--tensor-parallel-size", "2", "--enforce-eager", "--enable-prompt-tokens-details"]
# What vLLM says when a platform or backend cannot run tensor parallelism: the only start
# failures this module turns into a skip.
_NO_TP = re.compile(
    r"(tensor.parallel|TP\b|world.size|distributed).*(not (yet )?supported|NotImplemented)"
    r"|(NotImplementedError|not (yet )?supported).*(tensor.parallel|TP\b|world.size|distributed)",
    re.IGNORECASE,
)


@dataclass
class TP:
    prefill: VLLMServer
    decode: VLLMServer
    s2: VLLMServer
    s1: VLLMServer
    proxy_url: str
    stats: Path


def _no_tp_error(server: VLLMServer) -> str | None:
    for line in server.log_text().splitlines():
        if _NO_TP.search(line):
            return str(line).strip()
    return None


@pytest.fixture(scope="module")
def tp(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TP]:
    from mooncake_core.proxy import ProxyConfig, ProxyServer

    base = tmp_path_factory.mktemp("tp2")
    stats = base / "stats"
    port = free_port()
    log = open(base / "master.log", "wb")  # noqa: SIM115
    master = subprocess.Popen(
        [sys.executable, "-m", "mooncake_core", "master", "--rpc-port", str(port),
         "--http-port", str(free_port())],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=engine_env(),
    )  # fmt: skip
    log.close()
    addr = f"127.0.0.1:{port}"

    def server(name: str, kv: dict[str, Any], tp2: bool, *extra: str) -> VLLMServer:
        return VLLMServer(
            tiny_model,
            name=name,
            log_path=base / f"{name}.log",
            block_size=BLOCK,
            kv_transfer_config=kv,
            env=TP2_ENV if tp2 else None,
            args=(TP2_ARGS if tp2 else TP2_ARGS[2:]) + list(extra),
            fork_engine=True,
        )

    def store(name: str) -> dict[str, Any]:
        cfg: dict[str, Any] = store_transfer_config(
            addr, segment_size="32MiB", stats_dir=str(stats / name)
        )
        return cfg

    servers = [
        server("prefill", pd_transfer_config("kv_producer", stats_dir=str(stats / "pd")), True),
        server("decode", pd_transfer_config("kv_consumer", stats_dir=str(stats / "pd")), True),
        server("S2", store("S2"), True, "--no-enable-prefix-caching"),
        server("S1", store("S1"), False),
    ]
    stop = None
    try:
        for s in servers:
            s.start()
        for s in servers:
            try:
                s.wait_ready(600)
            except (RuntimeError, TimeoutError):
                why = _no_tp_error(s)
                if why is not None:
                    pytest.skip(f"vLLM on this CPU cannot run TP=2 ({s.name}): {why}")
                raise
        prefill, decode, s2, s1 = servers
        proxy = ProxyServer(ProxyConfig(prefill=(prefill.url,), decode=(decode.url,), port=0))
        purl, stop = proxy.run_in_thread()
        yield TP(prefill, decode, s2, s1, purl, stats)
    finally:
        if stop is not None:
            stop.set()
        for s in servers:
            s.stop()
        master.kill()
        master.wait(10)


def _ask(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    out: dict[str, Any] = http_json(url + "/v1/completions", body)
    return out


def _text(ans: dict[str, Any]) -> str:
    return str(ans["choices"][0]["text"])


def _cached(ans: dict[str, Any]) -> int:
    details = (ans.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _per_rank(stats: Path, prefix: str, key: str) -> dict[int, float]:
    """Counter ``key`` of each TP rank, from ``<prefix>*-tp<rank>.json`` files."""
    out: dict[int, float] = {}
    for f in stats.glob(f"{prefix}*-tp*.json"):
        rank = int(f.stem.rsplit("-tp", 1)[1])
        out[rank] = out.get(rank, 0.0) + read_counters(stats, f.name[: -len(".json")]).get(key, 0)
    return out


def test_pd_tp2_equals_tp2_monolithic(tp: TP) -> None:
    stats = tp.stats / "pd"
    for n, salt in ((5 * BLOCK + 1, 1), (300, 2)):
        # A fetch that fails falls back to recompute on the decode instance (the answer stays
        # right, checked every time). That happened once in CI on one rank, under the load of
        # seven engine processes on two cores: such a prompt is tried again, with its reason
        # logged; a second failure fails the test.
        for attempt in range(2):
            prompt = token_prompt(n, salt + 100 * attempt)
            # the reference first, on S2 (prefix cache off, store empty for this prompt):
            # computed in full on TP=2; not on the decode instance, whose prefix cache would
            # then serve PD
            want = _ask(tp.s2.url, prompt)
            assert _cached(want) == 0
            before = _per_rank(stats, "pd-kv_consumer-", "recv_blocks")
            failures = _per_rank(stats, "pd-kv_consumer-", "recv_failures")
            got = _ask(tp.proxy_url, prompt)
            assert _text(got) == _text(want), f"PD TP=2 answer differs for a {n}-token prompt"
            after = _per_rank(stats, "pd-kv_consumer-", "recv_blocks")
            failed = _per_rank(stats, "pd-kv_consumer-", "recv_failures")
            if attempt == 0 and any(failed.get(r, 0) > failures.get(r, 0) for r in (0, 1)):
                logging.warning(
                    "a decode rank's fetch failed (recomputed): %s\n%s",
                    failed,
                    "\n".join(ln for ln in tp.decode.log_text().splitlines() if "fetch" in ln)[
                        -3000:
                    ],
                )
                continue
            # each decode rank pulled its own shard of the prompt's full blocks
            for rank in (0, 1):
                assert after.get(rank, 0) - before.get(rank, 0) >= n // BLOCK, (
                    rank,
                    before,
                    after,
                    failed,
                    tp.decode.log_tail(40),
                )
            break


def test_store_hit_tp2_seen_by_both_ranks(tp: TP) -> None:
    prompt = token_prompt(7 * BLOCK + 5, 3)
    pages = len(prompt) // BLOCK
    stats = tp.stats / "S2"
    before = _per_rank(stats, "store-worker-", "save_objects")  # cumulative over the module
    first = _ask(tp.s2.url, prompt)  # a miss: computed and saved by both ranks
    assert _cached(first) == 0
    wait_for(
        lambda: all(
            _per_rank(stats, "store-worker-", "save_objects").get(r, 0)
            >= before.get(r, 0) + pages * 2
            for r in (0, 1)
        ),
        60,
        "both ranks' pages saved (2 layers each)",
    )
    want = _ask(tp.decode.url, prompt)  # TP=2 monolithic reference
    hit = _ask(tp.s2.url, prompt)  # S2's own prefix cache is off: only the store can serve it
    assert _text(first) == _text(want)
    assert _text(hit) == _text(want)
    assert _cached(hit) == pages * BLOCK
    loaded = _per_rank(stats, "store-worker-", "load_pages")
    assert loaded.get(0, 0) >= pages and loaded.get(1, 0) >= pages, loaded
    assert read_counters(stats, "store-sched-").get("hit_pages", 0) >= pages


def test_tp1_does_not_take_tp2_shards(tp: TP) -> None:
    prompt = token_prompt(6 * BLOCK + 3, 4)
    stats = tp.stats / "S2"
    before = _per_rank(stats, "store-worker-", "save_objects")
    _ask(tp.s2.url, prompt)
    wait_for(  # 6 pages x 2 layers more on each rank
        lambda: all(
            _per_rank(stats, "store-worker-", "save_objects").get(r, 0) >= before.get(r, 0) + 12
            for r in (0, 1)
        ),
        60,
        "the TP=2 pages saved",
    )
    ans = _ask(tp.s1.url, prompt)
    assert _cached(ans) == 0, "a TP=1 instance loaded pages saved by a TP=2 one"
    sched = read_counters(tp.stats / "S1", "store-sched-")
    assert sched.get("hit_pages", 0) == 0
    assert sched.get("lookup_misses", 0) >= 1
