"""The conductor in the PD proxy (``--policy global-cache``) on real vLLM CPU instances.

Two prefill instances (``kv_producer``), one decode instance (``kv_consumer``) and
``mooncake-core proxy --policy global-cache``. Two long prompts arrive together, so the
conductor spreads them over both prefill instances; later requests that extend either
prompt must go to the instance that holds its prefix, where vLLM's prefix cache hits.
The prefill instances also publish their KV events to the proxy, so a prefix computed by
a request that never went through the proxy is found too.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mooncake_vllm.testing import VLLMServer, free_port
from vllm_helpers import BLOCK, ProxyProcess, needs_vllm, token_prompt

pytestmark = [pytest.mark.engine, pytest.mark.slow, needs_vllm, pytest.mark.timeout(900)]


def _pd(role: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {"kv_connector": "MooncakeCoreConnector", "kv_role": role,
                           "kv_connector_module_path": "mooncake_vllm.connector"}
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[VLLMServer], ProxyProcess]]:
    base = tmp_path_factory.mktemp("conductor")
    events = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]  # bound by the proxy, vLLM connects
    servers = [VLLMServer(tiny_model, name=f"prefill{i}", log_path=base / f"prefill{i}.log", block_size=BLOCK,
                          kv_transfer_config=_pd("kv_producer"), log_stats=True,
                          args=["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                                  "endpoint": events[i]})])
               for i in range(2)]
    servers.append(VLLMServer(tiny_model, name="decode", log_path=base / "decode.log", block_size=BLOCK,
                              kv_transfer_config=_pd("kv_consumer")))
    proxy: ProxyProcess | None = None
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(600)
        proxy = ProxyProcess([servers[0].url, servers[1].url], [servers[2].url], base / "proxy.log",
                             "--policy", "global-cache", "--block-tokens", str(BLOCK), "--kv-events", *events)
        yield servers, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        for s in servers:
            s.stop()


def _served(proxy: ProxyProcess) -> list[int]:
    with urllib.request.urlopen(proxy.url + "/proxy/stats", timeout=10) as r:
        return [int(i["served"]) for i in json.loads(r.read())["prefill"]]


def _prefix_hits(server: VLLMServer) -> float:
    """Prompt tokens vLLM served from its prefix cache (its Prometheus counter)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r"^vllm:prefix_cache_hits(?:_total)?\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert m, "vLLM exposes no vllm:prefix_cache_hits counter"
    return float(m.group(1))


def _complete(proxy: ProxyProcess, prompt: list[int], out: dict[int, str] | None = None, key: int = 0) -> str:
    """Run one completion through the proxy; return the prefill instance it went to."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(proxy.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert json.loads(r.read())["choices"][0]["text"] is not None
        where = str(r.headers["X-Mooncake-Prefill"])
    if out is not None:
        out[key] = where
    return where


def test_requests_follow_the_instance_that_holds_their_prefix(cluster: tuple[list[VLLMServer], ProxyProcess]) -> None:
    servers, proxy = cluster
    by_url = {s.url: s for s in servers[:2]}
    prompts = [token_prompt(12 * BLOCK, salt=101), token_prompt(12 * BLOCK, salt=202)]
    holders: dict[int, str] = {}
    threads = [threading.Thread(target=_complete, args=(proxy, p, holders, k)) for k, p in enumerate(prompts)]
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
            assert went == holders[k], f"prompt {k}: extension {extra} went to {went}, its prefix is on {holders[k]}"
            # and vLLM really reused the prefix there
            assert _prefix_hits(by_url[went]) >= hits + 11 * BLOCK, "no prefix-cache hit on the holder"


def test_kv_events_reveal_prefixes_the_proxy_did_not_route(cluster: tuple[list[VLLMServer], ProxyProcess]) -> None:
    servers, proxy = cluster
    prompt = token_prompt(10 * BLOCK, salt=404)
    for target in (servers[1], servers[0]):  # both orders: the proxy cannot be guessing
        p = prompt + token_prompt(2 * BLOCK, salt=500 + target.port % 97)
        # computed on `target` directly, bypassing the proxy: only its KV events tell
        req = urllib.request.Request(target.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "tiny", "prompt": p, "max_tokens": 1}).encode())
        urllib.request.urlopen(req, timeout=120).read()
        time.sleep(1.0)  # events are published asynchronously
        went = _complete(proxy, p + token_prompt(BLOCK, salt=600))
        assert went == target.url, f"prefix computed on {target.url} but the proxy chose {went}"
