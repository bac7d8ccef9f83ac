"""``mooncake-core proxy --policy global-cache`` fed vLLM's KV-event stream (real ZMQ, vLLM's
wire format), in front of fake instances (no vLLM): it routes a request to the instance whose
events hold its prefix, and its decision log shows why (matched blocks per instance, from its
index and from the events alone) and the live queue it weighed (load, predicted wait).

The wire format is vLLM 0.32's ``ZmqEventPublisher``: frames ``(topic, 8-byte big-endian
sequence, msgpack KVEventBatch)``, the batch ``[ts, [event, ...], dp_rank]``, each event a map
tagged ``"type"`` with vLLM's fields (block hashes are 32-byte digests, as vLLM sends them by
default). vLLM itself is not imported: importing its event module alone takes seconds here.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from mooncake_vllm.testing import free_port

from mooncake_core.proxy import ProxyConfig, ProxyServer

BT = 32  # tokens per block, as the instances run


def _vllm_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """A 32-byte block hash (vLLM's are sha256 over the parent and the tokens; any digest does,
    the proxy re-chains blocks by their tokens)."""
    return hashlib.sha256((parent or b"seed") + json.dumps(tokens).encode()).digest()


def _stored_events(tokens: list[int], per_event: int) -> list[dict[str, Any]]:
    """vLLM's BlockStored events for the full blocks of ``tokens``, ``per_event`` blocks each,
    chained by ``parent_block_hash`` as vLLM's block pool emits them across steps."""
    events: list[dict[str, Any]] = []
    parent: bytes | None = None
    blocks = [tokens[i : i + BT] for i in range(0, len(tokens) - BT + 1, BT)]
    for s in range(0, len(blocks), per_event):
        hashes: list[bytes] = []
        first_parent = parent
        for b in blocks[s : s + per_event]:
            parent = _vllm_hash(parent, b)
            hashes.append(parent)
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": first_parent,
                "token_ids": [t for b in blocks[s : s + per_event] for t in b],
                "block_size": BT,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "extra_keys": None,
                "group_idx": 0,
            }
        )
    return events


def _frames(seq: int, events: list[dict[str, Any]]) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), events, None])]


def _prefill(delays: dict[str, float], seen: list[str]) -> Any:
    async def h(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(str(body.get("user")))
        await asyncio.sleep(delays.get(str(body.get("user")), 0.0))
        return web.json_response(
            {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_request_id": "r"}}
        )

    return h


async def _decode(request: web.Request) -> web.StreamResponse:
    return web.json_response({"choices": [{"text": "ab"}]})


async def _serve(handler: Any) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


@pytest.mark.parametrize("live", [True, False])
def test_proxy_routes_by_vllm_events_and_logs_why(live: bool) -> None:
    zmq = pytest.importorskip("zmq")
    prefix = [3 + (i * 7) % 400 for i in range(16 * BT)]  # 16 blocks
    eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    delays = {"first": 0.5, "held": 0.9}  # CPU-slow instances: seconds per prefill
    seen: list[list[str]] = [[], []]

    async def main() -> None:
        runners, urls = [], []
        for i in range(2):
            r, u = await _serve(_prefill(delays, seen[i]))
            runners.append(r)
            urls.append(u)
        rd, durl = await _serve(_decode)
        runners.append(rd)
        opts: tuple[tuple[str, Any], ...] = (
            ("block_tokens", BT),
            ("kv_events", tuple(eps)),
            ("live_queues", live),
        )
        proxy = ProxyServer(
            ProxyConfig(
                prefill=tuple(urls),
                decode=(durl,),
                port=0,
                policy="global-cache",
                policy_options=opts,
            )
        )
        url = await proxy.start()
        pubs = []
        try:
            for ep in eps:  # vLLM connects to an endpoint without '*'
                s = zmq.Context.instance().socket(zmq.PUB)
                s.connect(ep)
                pubs.append(s)
            frames = _frames(0, _stored_events(prefix, per_event=6))  # 6 + 6 + 4 blocks
            async with aiohttp.ClientSession() as http:
                for _ in range(100):  # PUB drops messages until the connection is up
                    pubs[1].send_multipart(frames)
                    await asyncio.sleep(0.05)
                    async with http.get(url + "/proxy/stats") as resp:
                        st = (await resp.json())["policy_stats"]
                    if st["event_blocks_stored"] >= 16:
                        break
                assert st["event_blocks_stored"] >= 16, st

                async def post(tag: str, prompt: list[int]) -> str:
                    body = {"model": "m", "prompt": prompt, "max_tokens": 2, "user": tag}
                    async with http.post(url + "/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        return r.headers["X-Mooncake-Prefill"]

                # only instance 1's events know the prefix: the request goes there
                assert await post("first", prefix + [5] * 10) == urls[1]
                # while a second turn is held in flight there, a third one is routed
                held = asyncio.create_task(post("held", prefix + [6] * 10))
                await asyncio.sleep(0.3)
                await post("third", prefix + [7] * 10)
                await held
                async with http.get(url + "/proxy/decisions") as resp:
                    log = {d["tag"]: d for d in await resp.json()}
        finally:
            for s in pubs:
                s.close(linger=0)
            await proxy.stop()
            for r in runners:
                await r.cleanup()
        first, third = log["first"], log["third"]
        assert first["prefill"] == 1 and seen[1][0] == "first"
        # why: instance 1 holds all 16 blocks, by the index and by its own events alone
        assert first["local"] == [0, 16] and first["events"] == [0, 16]
        assert first["blocks"] == 16
        assert first["ok"] and first["prefill_s"] >= 0 and first["ttft_s"] >= first["prefill_s"]
        assert log["held"]["prefill"] == 1
        # the third saw the held request in flight on instance 1 ...
        assert third["load"][1] == len(prefix) + 10 and third["load"][0] == 0
        if live:
            # ... and a wait there, in real seconds at instance 1's measured speed
            assert third["wait_s"][1] > 0 and third["wait_s"][0] == 0
            assert third["speed"][1] > 1
        else:
            # the profile's own queue (the old mode) has long drained: the log shows a
            # busy instance with no wait, which is how the live run's decisions went blind
            assert third["wait_s"] == [0.0, 0.0]

    asyncio.run(main())
