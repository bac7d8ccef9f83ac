"""The conductor in the PD proxy (``--policy global-cache``) on real vLLM CPU instances.

Two prefill instances, one decode instance (``kv_consumer``) and ``mooncake-core proxy
--policy global-cache``. Each prefill instance runs vLLM's ``MultiConnector`` over our PD
connector (``kv_producer``) and our store connector (``kv_both``, against a real store
master), so prompts it computes are also saved into the shared pool and prefixes saved by
others are loaded from it.

- Two long prompts arrive together, so the conductor spreads them over both prefill
  instances; later requests that extend either prompt must go to the instance that holds
  its prefix, where vLLM's prefix cache hits.
- The prefill instances publish their KV events to the proxy, so a prefix computed by a
  request that never went through the proxy is found too, for token-id prompts, text
  prompts and chat (the proxy tokenizes text through ``/tokenize``).
- A second proxy with ``--store-master`` asks the master which pages of each prompt are
  saved: a prefix in the store is counted as fetchable, which turns a request that early
  rejection refuses (recompute predicted over the TTFT SLO) into one that is accepted and
  served with a store hit.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mooncake_vllm.testing import StoreMaster, VLLMServer, free_port, read_counters
from vllm_helpers import BLOCK, ProxyProcess, needs_vllm, token_prompt, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow, needs_vllm, pytest.mark.timeout(900)]


def _pd(role: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "kv_connector": "MooncakeCoreConnector",
        "kv_role": role,
        "kv_connector_module_path": "mooncake_vllm.connector",
    }
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def _prefill_config(master: str, stats: Path) -> dict[str, Any]:
    """PD producer and store connector together (vLLM's MultiConnector)."""
    store = {
        "kv_connector": "MooncakeCoreStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "mooncake_vllm.store_connector",
        "kv_connector_extra_config": {
            "mooncake": {"master_server_address": master},
            "segment_size": "64MiB",
            "stats_dir": str(stats),
        },
    }
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [_pd("kv_producer"), store]},
    }


@dataclasses.dataclass
class Cluster:
    servers: list[VLLMServer]
    proxy: ProxyProcess
    master: str
    base: Path

    def store_sched(self, i: int) -> dict[str, float]:
        return read_counters(self.base / "stats" / f"prefill{i}", "store-sched-")

    def store_worker(self, i: int) -> dict[str, float]:
        return read_counters(self.base / "stats" / f"prefill{i}", "store-worker-")


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("conductor")
    master = StoreMaster(base / "master.log").start()
    master_addr = master.addr
    events = [
        f"tcp://127.0.0.1:{free_port()}" for _ in range(2)
    ]  # bound by the proxy, vLLM connects
    servers = [
        VLLMServer(
            tiny_model,
            name=f"prefill{i}",
            log_path=base / f"prefill{i}.log",
            block_size=BLOCK,
            kv_transfer_config=_prefill_config(master_addr, base / "stats" / f"prefill{i}"),
            log_stats=True,
            enforce_eager=True,
            fork_engine=True,
            args=[
                "--kv-events-config",
                json.dumps(
                    {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events[i]}
                ),
            ],
        )
        for i in range(2)
    ]
    servers.append(
        VLLMServer(
            tiny_model,
            name="decode",
            log_path=base / "decode.log",
            block_size=BLOCK,
            kv_transfer_config=_pd("kv_consumer"),
            enforce_eager=True,
            fork_engine=True,
        )
    )
    proxy: ProxyProcess | None = None
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(600)
        proxy = ProxyProcess(
            [servers[0].url, servers[1].url],
            [servers[2].url],
            base / "proxy.log",
            "--policy",
            "global-cache",
            "--block-tokens",
            str(BLOCK),
            "--kv-events",
            *events,
        )
        yield Cluster(servers, proxy, master_addr, base)
    finally:
        if proxy is not None:
            proxy.stop()
        for s in servers:
            s.stop()
        master.stop()


def _served(proxy: ProxyProcess) -> list[int]:
    with urllib.request.urlopen(proxy.url + "/proxy/stats", timeout=10) as r:
        return [int(i["served"]) for i in json.loads(r.read())["prefill"]]


def _prefix_hits(server: VLLMServer, name: str = "prefix_cache_hits") -> float:
    """Prompt tokens vLLM served from its prefix cache, or with ``external_prefix_cache_hits``
    from its KV connector (its Prometheus counters)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^vllm:{name}(?:_total)?\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    assert m, f"vLLM exposes no vllm:{name} counter"
    return float(m.group(1))


def _post(
    url: str, body: dict[str, Any], timeout: float = 300
) -> tuple[int, dict[str, str], dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), dict(exc.headers), json.loads(exc.read() or b"{}")


def _complete(
    proxy: ProxyProcess, prompt: list[int] | str, out: dict[int, str] | None = None, key: int = 0
) -> str:
    """Run one completion through the proxy; return the prefill instance it went to."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, headers, answer = _post(proxy.url + "/v1/completions", body)
    assert status == 200, answer
    assert answer["choices"][0]["text"] is not None
    where = str(headers["X-Mooncake-Prefill"])
    if out is not None:
        out[key] = where
    return where


def _decision(headers: dict[str, str]) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in headers["X-Mooncake-Decision"].split("; "))


def _last_decision(proxy: ProxyProcess) -> dict[str, Any]:
    """The proxy's decision record of the last request (``GET /proxy/decisions``)."""
    with urllib.request.urlopen(proxy.url + "/proxy/decisions", timeout=10) as r:
        records: list[dict[str, Any]] = json.loads(r.read())
    return records[-1]


def test_requests_follow_the_instance_that_holds_their_prefix(cluster: Cluster) -> None:
    servers, proxy = cluster.servers, cluster.proxy
    by_url = {s.url: s for s in servers[:2]}
    prompts = [token_prompt(12 * BLOCK, salt=101), token_prompt(12 * BLOCK, salt=202)]
    holders: dict[int, str] = {}
    threads = [
        threading.Thread(target=_complete, args=(proxy, p, holders, k))
        for k, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    # arriving together, the two prompts were spread over both prefill instances
    assert sorted(holders.values()) == sorted(by_url), holders
    for k, prompt in enumerate(prompts):
        for extra in range(3):
            hits = _prefix_hits(by_url[holders[k]])
            went = _complete(proxy, prompt + token_prompt(BLOCK + extra, salt=300 + extra))
            assert went == holders[k], (
                f"prompt {k}: extension {extra} went to {went}, its prefix is on {holders[k]}"
            )
            # and vLLM really reused the prefix there
            assert _prefix_hits(by_url[went]) >= hits + 11 * BLOCK, (
                "no prefix-cache hit on the holder"
            )


def _kv_events(proxy: ProxyProcess) -> int:
    """How many KV events the proxy has taken in so far."""
    with urllib.request.urlopen(proxy.url + "/proxy/stats", timeout=10) as r:
        return int(json.loads(r.read())["policy_stats"]["kv_events"])


def _wait_for_kv_events(proxy: ProxyProcess, before: int, timeout: float = 60.0) -> None:
    """Until the proxy has taken in new KV events and no more arrived for half a second (a fixed
    sleep was too short on a busy CI machine)."""
    deadline = time.monotonic() + timeout
    seen, quiet_since = before, time.monotonic()
    while time.monotonic() < deadline:
        now = _kv_events(proxy)
        if now != seen:
            seen, quiet_since = now, time.monotonic()
        elif seen > before and time.monotonic() - quiet_since >= 0.5:
            return
        time.sleep(0.05)
    raise AssertionError(
        f"the proxy took in no KV events within {timeout:.0f}s (count stayed at {before})"
        if seen == before
        else f"KV events kept arriving for {timeout:.0f}s"
    )


def test_kv_events_reveal_prefixes_the_proxy_did_not_route(cluster: Cluster) -> None:
    servers, proxy = cluster.servers, cluster.proxy
    prompt = token_prompt(10 * BLOCK, salt=404)
    for target in (servers[1], servers[0]):  # both orders: the proxy cannot be guessing
        p = prompt + token_prompt(2 * BLOCK, salt=500 + target.port % 97)
        # computed on `target` directly, bypassing the proxy: only its KV events tell
        req = urllib.request.Request(
            target.url + "/v1/completions",
            headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "tiny", "prompt": p, "max_tokens": 1}).encode(),
        )
        before = _kv_events(proxy)
        urllib.request.urlopen(req, timeout=120).read()
        _wait_for_kv_events(proxy, before)  # events are published asynchronously
        status, headers, answer = _post(
            proxy.url + "/v1/completions",
            {"model": "tiny", "prompt": p + token_prompt(BLOCK, salt=600), "max_tokens": 4},
        )
        assert status == 200, answer
        went, decision = str(headers["X-Mooncake-Prefill"]), _decision(headers)
        record = _last_decision(proxy)
        t = servers.index(target)
        # the proxy learnt from the target's events alone that it holds the whole prefix
        assert record["events"][t] >= 12 and record["events"][t] == max(record["events"]), record
        # and used it: the request went there, or (when the holder's measured speed and queue
        # made it slower even with its cache: CI noise) to an instance told to fetch it there
        assert went == target.url or decision["fetch_source"] == target.url, (
            f"prefix computed on {target.url} but the proxy chose {went}: {decision}, {record}"
        )


_WORDS = (
    "mooncake kvcache prefill decode store pages transfer tokens layers heads blocks instance "
    "quick brown fox lazy dog zero one two three four five six seven eight nine ten"
).split()


def _text(words: int, salt: int) -> str:
    return " ".join(_WORDS[(i * 7 + salt * 13 + i * i * salt) % len(_WORDS)] for i in range(words))


def test_text_and_chat_prompts_follow_the_instance_that_holds_their_prefix(
    cluster: Cluster,
) -> None:
    """KV events name blocks by token ids; the proxy tokenizes text prompts to match them."""
    servers, proxy = cluster.servers, cluster.proxy
    # both orders: characters alone would always pick instance 0. Salts are fixed and distinct
    # modulo len(_WORDS): salts taken from the ports could coincide, making two prompts equal
    # (the second one then came from the proxy's tokenizer cache and the call count fell short)
    for idx, target in enumerate((servers[1], servers[0])):
        text = _text(300, salt=1 + idx)
        before = _kv_events(proxy)
        _post(
            target.url + "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 1}
        )  # bypasses the proxy
        msgs = [{"role": "user", "content": _text(300, salt=3 + idx)}]
        _post(
            target.url + "/v1/chat/completions",
            {"model": "tiny", "messages": msgs, "max_tokens": 1},
        )
        _wait_for_kv_events(proxy, before)  # events are published asynchronously
        hits = _prefix_hits(target)
        went = _complete(proxy, text + " and a few more words")
        assert went == target.url, (
            f"text prefix computed on {target.url} but the proxy chose {went}"
        )
        assert _prefix_hits(target) >= hits + 4 * BLOCK, "no prefix-cache hit on the holder"
        body = {
            "model": "tiny",
            "max_tokens": 2,
            "temperature": 0,
            "ignore_eos": True,
            "messages": msgs
            + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}],
        }
        status, headers, answer = _post(proxy.url + "/v1/chat/completions", body)
        assert status == 200, answer
        assert headers["X-Mooncake-Prefill"] == target.url, (
            f"chat prefix on {target.url}, proxy chose {headers}"
        )
        assert int(_decision(headers)["cached_blocks"]) >= 4
    with urllib.request.urlopen(proxy.url + "/proxy/stats", timeout=10) as r:
        stats = json.loads(r.read())
    assert stats["tokenizer"]["calls"] >= 4 and stats["tokenizer"]["failures"] == 0
    assert stats["policy_stats"]["char_hashed_prompts"] == 0


def test_store_held_prefix_is_counted_and_served_from_the_store(cluster: Cluster) -> None:
    """A prefix saved in the store by instance 1 makes a request acceptable that recompute would
    not be."""
    from mooncake_core.conductor import DEFAULT_PROFILE, CostModel

    servers = cluster.servers
    n_prefix = 40
    n = (n_prefix + 1) * BLOCK
    cost = CostModel(dataclasses.replace(DEFAULT_PROFILE, block_tokens=BLOCK))
    recompute, fetch = (
        cost.prefill_s(n, 0),
        cost.transfer_s(n_prefix) + cost.prefill_s(n, n_prefix * BLOCK),
    )
    slo = (recompute + fetch) / 2
    assert fetch < slo < recompute
    prefix = token_prompt(n_prefix * BLOCK, salt=707)
    prompt = prefix + token_prompt(BLOCK, salt=708)
    # instance 1 computes the prefix for a client that bypasses every proxy; its store connector
    # saves it
    saved = cluster.store_worker(1).get("save_objects", 0)
    direct = servers[1].completion(prompt, max_tokens=4)["choices"][0]["text"]
    wait_for(
        lambda: cluster.store_worker(1).get("save_objects", 0) >= saved + 2 * n_prefix,
        60,
        "instance 1 saving the prefix's pages (2 layers each)",
    )
    proxy = ProxyProcess(
        [servers[0].url, servers[1].url],
        [servers[2].url],
        cluster.base / "proxy-store.log",
        "--policy",
        "global-cache",
        "--block-tokens",
        str(BLOCK),
        "--reject",
        "--slo-ttft",
        f"{slo:.4f}",
        "--slo-tbt",
        "10",
        "--store-master",
        cluster.master,
        "--store-dtype",
        "float32",
    )
    try:
        body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        # nothing of this prompt is stored: recompute is predicted over the SLO, so 429
        status, _, answer = _post(
            proxy.url + "/v1/completions", {**body, "prompt": token_prompt(n, salt=709)}
        )
        assert status == 429, answer
        hits0 = _prefix_hits(servers[0], "external_prefix_cache_hits")
        loaded0 = cluster.store_sched(0).get("hit_pages", 0)
        status, headers, answer = _post(proxy.url + "/v1/completions", {**body, "prompt": prompt})
        assert status == 200, answer
        d = _decision(headers)
        assert d["store_blocks"] == str(n_prefix) and d["fetch_source"] == "store", d
        assert d["fetch_blocks"] == str(n_prefix), d
        # this proxy knows nothing of instance 1's own cache, so both are equal and instance 0
        # (which never saw the prompt) runs it: its store connector loads the saved pages
        assert headers["X-Mooncake-Prefill"] == servers[0].url
        assert cluster.store_sched(0).get("hit_pages", 0) == loaded0 + n_prefix
        assert _prefix_hits(servers[0], "external_prefix_cache_hits") >= hits0 + n_prefix * BLOCK
        assert answer["choices"][0]["text"] == direct
        with urllib.request.urlopen(proxy.url + "/proxy/stats", timeout=10) as r:
            ps = json.loads(r.read())["policy_stats"]
        assert ps["store"]["pages_held"] >= n_prefix and ps["store"]["failures"] == 0
        assert ps["fetch_from_store"] == 1 and ps["rejections"] == 1
    finally:
        proxy.stop()
