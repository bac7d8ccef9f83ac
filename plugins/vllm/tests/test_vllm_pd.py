"""Prefill/decode disaggregation on a real vLLM (CPU, tiny random Llama, subprocesses).

One module-scoped cluster: a monolithic server (the reference, ``vllm_reference`` shared
with ``test_vllm_builtin_compat``), a prefill server (``kv_producer``), a decode server
(``kv_consumer``, ``kv_load_failure_policy=recompute``, with the test-only plugin
``vllm_faults`` that zeroes fetched KV for flagged requests) and ``mooncake-core proxy``.
All servers are eager (conftest) and started together.
The prefill server is killed by the last test.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mooncake_vllm.bench_http import stream
from mooncake_vllm.testing import VLLMServer, http_json, read_counters
from vllm_faults import FLAG, corrupt_kv_env
from vllm_helpers import BLOCK, ProxyProcess, needs_vllm, token_prompt, wait_for

pytestmark = [pytest.mark.engine, pytest.mark.slow, needs_vllm, pytest.mark.timeout(900)]

MAX_TOKENS = 16
SEND_TIMEOUT_S = 20


@dataclass
class Cluster:
    mono: VLLMServer
    prefill: VLLMServer
    decode: VLLMServer
    proxy: ProxyProcess
    stats: Path
    logs: Path

    def decode_stats(self) -> dict[str, float]:
        return dict(read_counters(self.stats, "pd-kv_consumer-"))

    def prefill_stats(self) -> dict[str, float]:
        return dict(read_counters(self.stats, "pd-kv_producer-"))


def _pd_config(role: str, stats: Path, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "kv_connector": "MooncakeCoreConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"stats_dir": str(stats), **extra},
    }
    if role == "kv_producer":  # the decode side finds the class by name (vllm.general_plugins)
        cfg["kv_connector_module_path"] = "mooncake_vllm.connector"
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


@pytest.fixture(scope="module")
def cluster(
    tiny_model: Path, vllm_reference: VLLMServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    base = tmp_path_factory.mktemp("pd")
    stats = base / "stats"
    own = [
        VLLMServer(
            tiny_model,
            name="prefill",
            log_path=base / "prefill.log",
            block_size=BLOCK,
            kv_transfer_config=_pd_config("kv_producer", stats, send_timeout_s=SEND_TIMEOUT_S),
            enforce_eager=True,
            fork_engine=True,
        ),
        VLLMServer(
            tiny_model,
            name="decode",
            log_path=base / "decode.log",
            block_size=BLOCK,
            kv_transfer_config=_pd_config("kv_consumer", stats),
            env=corrupt_kv_env(base / "faults"),
            enforce_eager=True,
            fork_engine=True,
        ),
    ]
    proxy: ProxyProcess | None = None
    try:
        for s in own:
            s.start()
        for s in [vllm_reference, *own]:
            s.wait_ready(600)
        mono, (prefill, decode) = vllm_reference, own
        proxy = ProxyProcess([prefill.url], [decode.url], base / "proxy.log")
        yield Cluster(mono, prefill, decode, proxy, stats, base)
    finally:
        if proxy is not None:
            proxy.stop()
        for s in own:
            s.stop()


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice.get("text") if "text" in choice else choice["message"]["content"])


def _sse_text(url: str, body: dict[str, Any]) -> str:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    out = []
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for c in ev.get("choices", []):
                out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 1, 500]


def test_pd_outputs_equal_monolithic(cluster: Cluster) -> None:
    before = cluster.decode_stats()
    for n in LENGTHS:
        prompt = token_prompt(n)
        want = _text(cluster.mono.completion(prompt, MAX_TOKENS))
        got = _text(
            http_json(
                cluster.proxy.url + "/v1/completions",
                {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
        )
        assert got == want, f"prompt of {n} tokens: PD {got!r} != monolithic {want!r}"
    after = cluster.decode_stats()
    # every request's prompt KV came over the transfer engine, block by block
    assert after.get("recv_requests", 0) - before.get("recv_requests", 0) == len(LENGTHS)
    want_blocks = sum(-(-n // BLOCK) for n in LENGTHS)
    assert after.get("recv_blocks", 0) - before.get("recv_blocks", 0) == want_blocks
    assert after.get("recv_bytes", 0) > before.get("recv_bytes", 0)
    assert after.get("recv_failures", 0) == before.get("recv_failures", 0)
    # ... and the prefill instance freed every kept request once the decode side was done
    wait_for(
        lambda: (
            cluster.prefill_stats().get("sends_released_by_peer", 0)
            >= cluster.prefill_stats().get("send_requests", 0)
            > 0
        ),
        30,
        "prefill blocks released",
    )


def test_pd_chat_and_streaming_through_proxy(cluster: Cluster) -> None:
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "the quick brown fox " * 20}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    want = _text(http_json(cluster.mono.url + "/v1/chat/completions", chat))
    assert _text(http_json(cluster.proxy.url + "/v1/chat/completions", chat)) == want
    assert _sse_text(cluster.proxy.url + "/v1/chat/completions", {**chat, "stream": True}) == want
    prompt = token_prompt(3 * BLOCK + 5, salt=1)
    comp = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    want_c = _text(cluster.mono.completion(prompt, MAX_TOKENS))
    assert _sse_text(cluster.proxy.url + "/v1/completions", {**comp, "stream": True}) == want_c
    stats = http_json(cluster.proxy.url + "/proxy/stats")
    assert stats["errors"] == 0 and stats["decode"][0]["in_flight"] == 0


def _prefill_params(cluster: Cluster, prompt: list[int]) -> dict[str, Any]:
    ans = cluster.prefill.completion(
        prompt, 1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False}
    )
    params = ans["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    return dict(params)


def test_decode_really_uses_transferred_kv(cluster: Cluster) -> None:
    prompt = token_prompt(6 * BLOCK + 7, salt=2)
    want = _text(cluster.mono.completion(prompt, MAX_TOKENS))
    ok = _text(
        cluster.decode.completion(
            prompt, MAX_TOKENS, kv_transfer_params=_prefill_params(cluster, prompt)
        )
    )
    assert ok == want
    prompt2 = token_prompt(6 * BLOCK + 7, salt=3)
    want2 = _text(cluster.mono.completion(prompt2, MAX_TOKENS))
    before = cluster.decode_stats().get("test_corrupted_requests", 0)
    params = {**_prefill_params(cluster, prompt2), FLAG: True}
    bad = _text(cluster.decode.completion(prompt2, MAX_TOKENS, kv_transfer_params=params))
    assert cluster.decode_stats().get("test_corrupted_requests", 0) == before + 1
    assert bad != want2, (
        "zeroing the fetched KV did not change the output: the decode did not use it"
    )


def test_decode_keeps_streaming_while_a_fetch_hangs(cluster: Cluster) -> None:
    """A KV fetch in flight never holds up the decode steps of other requests.

    The fetch of one request goes to a socket that accepts and never answers (a prefill
    worker that hangs): it stays in flight until the transfer engine gives up on the handshake
    (after 5 s it closes the connection), then fails and the prompt is recomputed. A request
    streamed straight to the decode instance meanwhile gets all its tokens before that.
    """
    prompt = token_prompt(3 * BLOCK + 1, salt=8)
    want = _text(cluster.mono.completion(prompt, MAX_TOKENS))
    params = _prefill_params(cluster, prompt)
    failures = cluster.decode_stats().get("recv_failures", 0)
    got: dict[str, Any] = {}

    def ask_stuck(p: dict[str, Any]) -> None:
        got["stuck"] = _text(cluster.decode.completion(prompt, MAX_TOKENS, kv_transfer_params=p))

    def ask_other() -> None:
        body = {
            "model": "tiny",
            "prompt": token_prompt(2 * BLOCK + 5, salt=9),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        got["other"] = stream(cluster.decode.url + "/v1/completions", body)
        got["other_done"] = time.perf_counter()  # after [DONE]: every token generated

    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        hole.settimeout(60)
        dead = f"127.0.0.1:{hole.getsockname()[1]}"
        peers = {r: {**p, "peer": dead} for r, p in params["remote_peers"].items()}
        stuck = threading.Thread(target=ask_stuck, args=({**params, "remote_peers": peers},))
        stuck.start()
        conn, _ = hole.accept()  # the fetch is in flight: the worker waits for our greeting
        with conn:
            other = threading.Thread(target=ask_other)
            other.start()
            conn.settimeout(60)
            assert conn.recv(1) == b""  # the worker gave up on this peer: the fetch fails now
            gave_up = time.perf_counter()
            other.join(120)
            stuck.join(120)
    assert not other.is_alive() and not stuck.is_alive()
    assert got["other"].arrivals  # (tokens that detokenize to "" send no text chunk)
    assert got["other_done"] < gave_up, "decode steps waited for another request's KV fetch"
    assert got["stuck"] == want  # the failed fetch was recomputed
    assert cluster.decode_stats().get("recv_failures", 0) == failures + 1
    # the real fetch (the decode instance's prefix cache, then the last block) frees the
    # prefill instance's blocks, so no release by timeout is left behind for other tests
    ok = cluster.decode.completion(prompt, MAX_TOKENS, kv_transfer_params=params)
    assert _text(ok) == want


def test_unfetched_blocks_are_released_after_timeout(cluster: Cluster) -> None:
    before = cluster.prefill_stats().get("sends_released_by_timeout", 0)
    _prefill_params(cluster, token_prompt(2 * BLOCK + 3, salt=4))  # nobody fetches it
    wait_for(
        lambda: cluster.prefill_stats().get("sends_released_by_timeout", 0) == before + 1,
        SEND_TIMEOUT_S + 30,
        "the prefill instance to release unfetched blocks",
    )
    assert "no decode instance fetched request" in cluster.prefill.log_text()
    assert cluster.prefill.healthy()


def test_prefill_killed_decode_recomputes(cluster: Cluster) -> None:
    prompt = token_prompt(4 * BLOCK + 9, salt=5)
    want = _text(cluster.mono.completion(prompt, MAX_TOKENS))
    params = _prefill_params(cluster, prompt)
    cluster.prefill.kill()
    failures = cluster.decode_stats().get("recv_failures", 0)
    failed_before = cluster.decode.log_text().count("KV fetch for request")
    t0 = time.monotonic()
    got = _text(cluster.decode.completion(prompt, MAX_TOKENS, kv_transfer_params=params))
    assert got == want
    assert time.monotonic() - t0 < 60
    assert cluster.decode_stats().get("recv_failures", 0) == failures + 1
    assert cluster.decode.log_text().count("KV fetch for request") == failed_before + 1
    assert cluster.decode.healthy()
    # the instance keeps serving, with and without transfer parameters
    p2 = token_prompt(BLOCK + 3, salt=6)
    assert _text(cluster.decode.completion(p2, MAX_TOKENS)) == _text(
        cluster.mono.completion(p2, MAX_TOKENS)
    )
    # and the proxy turns the dead prefill instance into a clear error, not a hang
    try:
        http_json(
            cluster.proxy.url + "/v1/completions", {"model": "tiny", "prompt": p2, "max_tokens": 2}
        )
        raise AssertionError("the proxy answered although its prefill instance is dead")
    except urllib.error.HTTPError as exc:
        assert exc.code == 502
        assert "prefill instance" in json.loads(exc.read())["error"]["message"]
