"""KV events from the store master (``--kv-events-endpoint``), and a proxy routed by them.

A real master process publishes; a ZMQ SUB socket reads. The events are decoded with the
vLLM adapter's own decoder (what the proxy reads from vLLM; vLLM itself takes ~40 s to
import here, so its msgspec classes are checked by hand, see docs/store.md) and with the
proxy's store-event decoder. Stub upstreams stand in for vLLM where the whole proxy runs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from store_support import Master, free_port

from mooncake_core.errors import ConfigError
from mooncake_core.proxy import ProxyConfig, ProxyServer
from mooncake_core.proxy.store_events import StoreEvents, decode_store_events
from mooncake_core.store.client import StoreClient
from mooncake_core.store.kvevents import KVEventPublisher, check_endpoint, key_hash

zmq = pytest.importorskip("zmq")
proxy_support = pytest.importorskip("mooncake_vllm.proxy_support")
StoreKeyScheme = pytest.importorskip("mooncake_vllm.store_keys").StoreKeyScheme

pytestmark = [pytest.mark.timeout(120)]

BT = 16
MODEL = "/models/tiny-llama"


class Sub:
    """A SUB socket on the master's endpoint, collecting decoded events."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.raw: list[dict[str, Any]] = []
        self.seqs: list[int] = []

    def drain(self, until: Any = None, timeout: float = 5.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                assert len(frames) == 3 and len(frames[1]) == 8
                self.seqs.append(int.from_bytes(frames[1], "big"))
                batch = msgspec.msgpack.decode(frames[2])
                assert isinstance(batch, list) and isinstance(batch[0], float)
                # the vLLM adapter's decoder reads them as vLLM events
                assert len(proxy_support.decode_kv_events(frames[2])) == len(batch[1])
                self.raw.extend(batch[1])
            elif until is not None and until(self.raw):
                break
        return self.raw

    def close(self) -> None:
        self.sock.close(linger=0)


def keyed(events: list[dict[str, Any]], kind: str) -> list[str]:
    return [e["object_key"] for e in events if e.get("type") == kind]


@pytest.fixture()
def evmaster(tmp_path: Path) -> Iterator[tuple[Master, str]]:
    ep = f"tcp://127.0.0.1:{free_port()}"
    m = Master(
        tmp_path,
        "--kv-events-endpoint",
        ep,
        "--eviction-high-watermark",
        "0.95",
        "--eviction-ratio",
        "0.2",
    )
    try:
        yield m, ep
    finally:
        m.stop()


def test_every_stored_evicted_and_removed_object_is_an_event(
    evmaster: tuple[Master, str],
) -> None:
    m, ep = evmaster
    sub = Sub(ep)
    time.sleep(0.3)  # ZMQ subscriptions take a moment to reach the publisher
    with StoreClient(master=m.address, segment_size=1 << 20) as c:
        seg = c.segment_names[0]
        c.put("a", b"x" * 1000)
        c.put_batch(["b1", "b2"], [b"y" * 100, b"z" * 100])
        c.remove("a", force=True)
        ev = sub.drain(until=lambda r: "a" in keyed(r, "BlockRemoved"))
        stored = [e for e in ev if e["type"] == "BlockStored"]
        assert sorted(e["object_key"] for e in stored) == ["a", "b1", "b2"]
        a = next(e for e in stored if e["object_key"] == "a")
        # vLLM's fields, then the store's
        assert a["block_hashes"] == [key_hash("a")] and a["parent_block_hash"] is None
        assert a["token_ids"] == [] and a["medium"] == "CPU" and a["holders"] == [seg]
        assert a["size"] == 1000 and a["tenant"] == ""
        assert keyed(ev, "BlockRemoved") == ["a"]
        assert sub.seqs == sorted(sub.seqs) and len(set(sub.seqs)) == len(sub.seqs)
        # eviction: fill the 1 MiB segment with 64 KiB objects until the oldest go
        n0 = len(ev)
        for i in range(24):
            c.put(f"fill{i}", b"f" * (64 << 10))
        ev = sub.drain(until=lambda r: "fill0" in keyed(r[n0:], "BlockRemoved"))
        evicted = keyed(ev[n0:], "BlockRemoved")
        assert "b1" in evicted and "fill0" in evicted
        live = {k for k in keyed(ev, "BlockStored")} - set(keyed(ev, "BlockRemoved"))
        assert {k for k in live if c.exists(k)} == live  # nothing announced that is gone
        n1 = len(ev)
    # the client closed: its segment went away with every object on it
    ev = sub.drain(until=lambda r: len(keyed(r[n1:], "BlockRemoved")) >= len(live))
    assert set(keyed(ev[n1:], "BlockRemoved")) == live
    code, body = m.http("/stats")
    st = json.loads(body)["kv_events"]
    assert code == 200 and st["dropped"] == 0 and st["announced"] == 0
    sub.close()


def test_the_queue_drops_the_oldest_when_nobody_sends() -> None:
    from mooncake_core.store.kvevents import AllBlocksCleared

    pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", queue_capacity=4)
    try:
        with pub._cond:  # the sender thread waits on this lock: nothing leaves the queue
            for _ in range(10):
                pub._push(AllBlocksCleared())
            assert len(pub._queue) == 4
        assert pub.stats()["dropped"] >= 6
    finally:
        pub.close()


def test_bad_endpoints_are_one_line_errors(tmp_path: Path) -> None:
    for bad in ("", "127.0.0.1:5557", "http://127.0.0.1:1", "tcp://a b:1"):
        with pytest.raises(ConfigError, match="not a ZMQ endpoint") as exc:
            check_endpoint(bad)
        assert "\n" not in str(exc.value)
    r = subprocess.run(
        [sys.executable, "-m", "mooncake_core", "master", "--kv-events-endpoint", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "--kv-events-endpoint: 'nope' is not a ZMQ endpoint" in r.stderr


def test_published_flags_enable_the_events(tmp_path: Path) -> None:
    """``--enable_kv_events --kv_events_bind_endpoint=...`` (the published spelling) works."""
    ep = f"tcp://127.0.0.1:{free_port()}"
    m = Master(tmp_path, "--enable_kv_events", f"--kv_events_bind_endpoint={ep}")
    try:
        sub = Sub(ep)
        time.sleep(0.3)
        with StoreClient(master=m.address, segment_size=1 << 20) as c:
            c.put("pub", b"p")
            assert keyed(sub.drain(until=lambda r: r), "BlockStored") == ["pub"]
        sub.close()
    finally:
        m.stop()


# --- a proxy fed only by the store's events ------------------------------------------------------


def save_pages(client: StoreClient, scheme: Any, toks: list[int], n: int, seg: str) -> None:
    pages = scheme.pages(toks)[:n]
    for layer in range(2):
        for k in scheme.layer_keys(pages, 0, layer):
            client.put(k, b"kv" * 8, preferred_segment=seg)


def tokens(n: int, salt: int) -> list[int]:
    return [(i * 7 + salt * 31) % 400 + 3 for i in range(n)]


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _upstream() -> web.Application:
    async def complete(request: web.Request) -> web.StreamResponse:
        await request.json()
        return web.json_response(
            {"choices": [{"text": "x"}], "kv_transfer_params": {"do_remote_prefill": True}}
        )

    async def models(request: web.Request) -> web.StreamResponse:
        return web.json_response({"data": [{"id": "tiny", "root": MODEL}]})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/v1/models", models)
    return app


async def _post(url: str, body: Any) -> tuple[int, dict[str, str]]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=20)) as r,
    ):
        await r.read()
        return r.status, dict(r.headers)


def test_a_proxy_fed_by_store_events_routes_to_where_the_prefix_is(
    evmaster: tuple[Master, str],
) -> None:
    m, ep = evmaster
    scheme = StoreKeyScheme(MODEL, "float32", BT)
    p_tokens, q_tokens = tokens(12 * BT + 3, 1), tokens(12 * BT + 3, 2)
    with (
        StoreClient(master=m.address, segment_size=4 << 20) as a,
        StoreClient(master=m.address, segment_size=4 << 20) as b,
    ):
        seg_a, seg_b = a.segment_names[0], b.segment_names[0]

        async def main() -> None:
            served = [await _serve(_upstream()) for _ in range(3)]
            urls = [u for _, u in served]
            opts = {
                "block_tokens": BT,
                "store_events": ep,
                "store_holders": [seg_a, seg_b],
                "store_dtype": "float32",
                "store_model": MODEL,
            }
            proxy = ProxyServer(
                ProxyConfig(
                    prefill=tuple(urls[:2]),
                    decode=(urls[2],),
                    port=0,
                    policy="global-cache",
                    policy_options=tuple(opts.items()),
                )
            )
            purl = await proxy.start()
            pol: Any = proxy.policy
            store: StoreEvents = pol.store
            try:
                await asyncio.sleep(0.3)  # the subscription reaches the master
                loop = asyncio.get_running_loop()
                # P's prefix lives in B's segment, Q's in A's: written by clients, not the proxy
                await loop.run_in_executor(None, save_pages, b, scheme, p_tokens, 10, seg_b)
                await loop.run_in_executor(None, save_pages, a, scheme, q_tokens, 10, seg_a)
                deadline = time.monotonic() + 5
                while store.stats()["keys"] < 40 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert store.held_by(p_tokens) == [0, 10] and store.held_by(q_tokens) == [10, 0]
                body = {"model": "tiny", "max_tokens": 2}
                for toks, where in ((p_tokens, urls[1]), (q_tokens, urls[0])):
                    st, hdr = await _post(purl + "/v1/completions", {**body, "prompt": toks})
                    assert st == 200 and hdr["X-Mooncake-Prefill"] == where, hdr
                    assert "store_blocks=10" in hdr["X-Mooncake-Decision"]
                # a third prompt sharing P's first 6 pages goes to B as well
                r_tokens = p_tokens[: 6 * BT] + tokens(6 * BT + 3, 3)
                st, hdr = await _post(purl + "/v1/completions", {**body, "prompt": r_tokens})
                assert st == 200 and hdr["X-Mooncake-Prefill"] == urls[1], hdr
                # removals reach the proxy too
                p_keys = [
                    k
                    for layer in range(2)
                    for k in scheme.layer_keys(scheme.pages(p_tokens)[:10], 0, layer)
                ]

                def drop_p() -> None:
                    for k in p_keys:
                        b.remove(k, force=True)

                await loop.run_in_executor(None, drop_p)
                deadline = time.monotonic() + 5
                while store.held_pages(p_tokens) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert store.held_pages(p_tokens) == 0 and store.held_pages(q_tokens) == 10
                assert store.stats()["malformed"] == 0
            finally:
                await proxy.stop()
                for r, _ in served:
                    await r.cleanup()

        asyncio.run(main())


def test_store_event_decoder_skips_engine_events_and_rejects_garbage() -> None:
    batch = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2]},
                {"type": "BlockStored", "object_key": "k", "holders": ["s"]},
                {"type": "BlockRemoved", "object_key": "j"},
                {"type": "AllBlocksCleared"},
            ],
        ]
    )
    assert decode_store_events(batch) == [
        ("stored", "k", ("s",)),
        ("removed", "j", ()),
        ("cleared", "", ()),
    ]
    for bad in (b"\xc1", msgspec.msgpack.encode({"x": 1})):
        with pytest.raises(ValueError):
            decode_store_events(bad)
