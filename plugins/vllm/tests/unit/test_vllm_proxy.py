"""PD proxy against fake upstream instances (no vLLM): routing, streaming, errors."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from mooncake_core.errors import ConfigError
from mooncake_core.proxy import (
    Instance,
    Job,
    LeastLoadPolicy,
    ProxyConfig,
    ProxyServer,
    make_policy,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve(handler: Handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _prefill_ok(seen: list[dict[str, Any]]) -> Handler:
    async def h(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        return web.json_response(
            {
                "choices": [{"text": "x"}],
                "kv_transfer_params": {"do_remote_prefill": True, "remote_request_id": "r1"},
            }
        )

    return h


def _decode_ok(seen: list[dict[str, Any]]) -> Handler:
    async def h(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for t in ("a", "b", "c"):
                await resp.write(f"data: {json.dumps({'choices': [{'text': t}]})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return web.json_response(
            {"choices": [{"text": "abc"}], "echo": body.get("kv_transfer_params")}
        )

    return h


async def _run(
    prefill: list[Handler],
    decode: list[Handler],
    client: Callable[[str, ProxyServer], Awaitable[None]],
    **cfg: Any,
) -> None:
    runners = []
    purls, durls = [], []
    for h in prefill:
        r, u = await _serve(h)
        runners.append(r)
        purls.append(u)
    for h in decode:
        r, u = await _serve(h)
        runners.append(r)
        durls.append(u)
    proxy = ProxyServer(ProxyConfig(prefill=tuple(purls), decode=tuple(durls), port=0, **cfg))
    url = await proxy.start()
    try:
        await client(url, proxy)
    finally:
        await proxy.stop()
        for r in runners:
            await r.cleanup()


async def _post(url: str, body: Any, raw: bool = False) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=20)) as r,
    ):
        data = await r.read()
        return r.status, (data if raw else json.loads(data))


def test_completion_goes_prefill_then_decode_with_params() -> None:
    pseen: list[dict[str, Any]] = []
    dseen: list[dict[str, Any]] = []

    async def client(url: str, proxy: ProxyServer) -> None:
        st, body = await _post(
            url + "/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}
        )
        assert st == 200
        assert body["echo"] == {"do_remote_prefill": True, "remote_request_id": "r1"}
        assert pseen[0]["max_tokens"] == 1 and pseen[0]["stream"] is False
        assert pseen[0]["kv_transfer_params"]["do_remote_decode"] is True
        assert dseen[0]["max_tokens"] == 5

    asyncio.run(_run([_prefill_ok(pseen)], [_decode_ok(dseen)], client))


@pytest.mark.parametrize("store_loads", ["on", "off"])
def test_store_loads_off_asks_prefill_instances_for_no_store_load(store_loads: str) -> None:
    """``--store-loads off``: every prefill body's kv_transfer_params carry
    ``"mooncake_store_load": false`` beside the PD hand-off request; the decode body does not."""
    import argparse

    from mooncake_core.cli.proxy import add_arguments, config_from_args

    pseen: list[dict[str, Any]] = []
    dseen: list[dict[str, Any]] = []
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    argv = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    cfg = config_from_args(ap.parse_args([*argv, "--store-loads", store_loads]))
    assert cfg.store_loads is (store_loads == "on")
    assert config_from_args(ap.parse_args(argv)).store_loads is True  # the default

    async def client(url: str, proxy: ProxyServer) -> None:
        for _ in range(2):
            st, _body = await _post(
                url + "/v1/completions", {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}
            )
            assert st == 200
        async with aiohttp.ClientSession() as s, s.get(url + "/proxy/stats") as r:
            assert (await r.json())["store_loads"] is cfg.store_loads

    asyncio.run(
        _run([_prefill_ok(pseen)], [_decode_ok(dseen)], client, store_loads=cfg.store_loads)
    )
    want = {"do_remote_decode": True, "do_remote_prefill": False}
    if store_loads == "off":
        want["mooncake_store_load"] = False
    assert [b["kv_transfer_params"] for b in pseen] == [want, want]
    assert [b["kv_transfer_params"] for b in dseen] == [
        {"do_remote_prefill": True, "remote_request_id": "r1"}
    ] * 2


def test_chat_streaming_passes_through() -> None:
    pseen: list[dict[str, Any]] = []
    dseen: list[dict[str, Any]] = []

    async def client(url: str, proxy: ProxyServer) -> None:
        st, raw = await _post(
            url + "/v1/chat/completions",
            {
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_completion_tokens": 9,
            },
            raw=True,
        )
        assert st == 200
        assert raw.count(b"data: ") == 4 and raw.endswith(b"data: [DONE]\n\n")
        assert pseen[0]["max_completion_tokens"] == 1 and "stream_options" not in pseen[0]
        assert dseen[0]["stream"] is True

    asyncio.run(_run([_prefill_ok(pseen)], [_decode_ok(dseen)], client))


def test_prefill_500_is_a_clear_502() -> None:
    async def bad(request: web.Request) -> web.StreamResponse:
        return web.Response(status=500, text="engine dead")

    async def client(url: str, proxy: ProxyServer) -> None:
        st, body = await _post(url + "/v1/completions", {"prompt": "hello"})
        assert st == 502
        assert (
            "prefill instance" in body["error"]["message"]
            and "engine dead" in body["error"]["message"]
        )

    asyncio.run(_run([bad], [_decode_ok([])], client))


def test_upstream_400_passes_through() -> None:
    async def bad(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "prompt too long"}}, status=400)

    async def client(url: str, proxy: ProxyServer) -> None:
        st, body = await _post(url + "/v1/completions", {"prompt": "hello"})
        assert st == 400 and "prompt too long" in body["error"]["message"]

    asyncio.run(_run([_prefill_ok([])], [bad], client))


def test_prefill_without_params_names_the_fix() -> None:
    async def plain(request: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": [{"text": "x"}]})

    async def client(url: str, proxy: ProxyServer) -> None:
        st, body = await _post(url + "/v1/completions", {"prompt": "hello"})
        assert st == 502 and "kv_transfer_params" in body["error"]["message"]

    asyncio.run(_run([plain], [_decode_ok([])], client))


def test_hanging_prefill_times_out() -> None:
    async def hang(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(3)
        return web.json_response({})

    async def client(url: str, proxy: ProxyServer) -> None:
        st, body = await _post(url + "/v1/completions", {"prompt": "hello"})
        assert st == 504 and body["error"]["type"] == "timeout"
        assert proxy.prefill[0].in_flight == 0 and proxy.prefill[0].errors == 1

    asyncio.run(_run([hang], [_decode_ok([])], client, prefill_timeout_s=0.5))


def test_unreachable_prefill_is_502() -> None:
    async def client(url: str, proxy: ProxyServer) -> None:
        st, body = await _post(url + "/v1/completions", {"prompt": "hello"})
        assert st == 502 and "unreachable" in body["error"]["message"]

    async def main() -> None:
        # A port held by a bound socket that never listens: connecting is refused, and no
        # server started later in this test can be given the same port by the kernel.
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{held.getsockname()[1]}"
            r2, durl = await _serve(_decode_ok([]))
            proxy = ProxyServer(ProxyConfig(prefill=(dead,), decode=(durl,), port=0))
            url = await proxy.start()
            try:
                await client(url, proxy)
            finally:
                await proxy.stop()
                await r2.cleanup()

    asyncio.run(main())


def test_stream_that_stalls_ends_with_error_event() -> None:
    async def stall(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await asyncio.sleep(3)
        return resp

    async def client(url: str, proxy: ProxyServer) -> None:
        st, raw = await _post(
            url + "/v1/completions", {"prompt": "hello", "stream": True}, raw=True
        )
        assert st == 200
        assert b'"error"' in raw and raw.endswith(b"data: [DONE]\n\n")

    asyncio.run(_run([_prefill_ok([])], [stall], client, read_timeout_s=0.5))


def test_bad_json_is_400() -> None:
    async def client(url: str, proxy: ProxyServer) -> None:
        async with (
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/completions", data=b"{nope") as r,
        ):
            assert r.status == 400

    asyncio.run(_run([_prefill_ok([])], [_decode_ok([])], client))


def test_least_load_prefers_idle_instances() -> None:
    p = [Instance("http://p0", "prefill", 0), Instance("http://p1", "prefill", 1)]
    d = [Instance("http://d0", "decode", 0), Instance("http://d1", "decode", 1)]
    pol = LeastLoadPolicy(p, d)
    p[0].tokens_in_flight = 500
    d[1].in_flight = 3
    place = pol.choose(Job(1, 10, "x"))
    assert place.prefill is p[1] and place.decode is d[0]
    p[0].tokens_in_flight = 0
    d[1].in_flight = 0
    seen = {pol.choose(Job(i, 10, "x")).prefill.index for i in range(4)}
    assert seen == {0, 1}


def test_global_cache_policy_follows_the_prefix() -> None:
    p = [Instance(f"http://p{i}", "prefill", i) for i in range(3)]
    d = [Instance("http://d0", "decode", 0)]
    pol = make_policy("global-cache", p, d)
    prompt = list(range(64 * 32))
    first = pol.choose(Job(1, len(prompt), prompt, 4))
    pol.prefill_done(Job(1, len(prompt), prompt, 4), first)
    pol.finished(Job(1, len(prompt), prompt, 4), first, True)
    again = pol.choose(Job(2, len(prompt) + 5, prompt + [1, 2, 3, 4, 5], 4))
    assert again.prefill is first.prefill


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="least-load"):
        make_policy("nope", [Instance("u", "prefill", 0)], [Instance("v", "decode", 0)])


def test_early_rejection_answers_429_before_any_prefill() -> None:
    pseen: list[dict[str, Any]] = []
    dseen: list[dict[str, Any]] = []

    async def client(url: str, proxy: ProxyServer) -> None:
        # a 2k-token prompt cannot meet a 1 ms TTFT target on the shipped profile
        st, body = await _post(
            url + "/v1/completions", {"model": "m", "prompt": list(range(2048)), "max_tokens": 4}
        )
        assert st == 429, body
        assert (
            body["error"]["type"] == "rate_limit_exceeded"
            and "rejected early" in body["error"]["message"]
        )
        assert "TTFT" in body["error"]["message"]
        assert pseen == [] and dseen == []  # no prefill work was spent on it
        async with aiohttp.ClientSession() as s, s.get(url + "/proxy/stats") as r:
            assert (await r.json())["rejected"] == 1

    opts = (("reject", True), ("slo_ttft_s", 0.001), ("slo_tbt_s", 10.0))
    asyncio.run(
        _run(
            [_prefill_ok(pseen)],
            [_decode_ok(dseen)],
            client,
            policy="global-cache",
            policy_options=opts,
        )
    )


def test_rejection_triggers_exactly_at_the_predicted_ttft() -> None:
    from mooncake_core.conductor import Request
    from mooncake_core.proxy import RequestRejected

    p = [Instance("http://p0", "prefill", 0)]
    d = [Instance("http://d0", "decode", 0)]
    prompt = list(range(1024))
    probe = make_policy("global-cache", p, d)
    req = Request(rid=1, arrival_s=0.0, input_len=len(prompt), output_len=4, blocks=())
    predicted = probe.conductor.decide(req, now=0.0, commit=False).ttft_s
    ok = make_policy("global-cache", p, d, reject=True, slo_ttft_s=predicted * 1.01, slo_tbt_s=10.0)
    ok.choose(Job(1, len(prompt), [7] * 5 + prompt[5:], 4))  # accepted
    tight = make_policy(
        "global-cache", p, d, reject=True, slo_ttft_s=predicted * 0.99, slo_tbt_s=10.0
    )
    with pytest.raises(RequestRejected, match="rejected early"):
        tight.choose(Job(2, len(prompt), [9] * 5 + prompt[5:], 4))
    with pytest.raises(ConfigError, match="does not take options"):
        make_policy("least-load", p, d, reject=True)
