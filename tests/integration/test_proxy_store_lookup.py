"""The proxy's store lookup (``--store-master``) against a real master process.

Pages are written under the vLLM store connector's own key scheme
(:class:`mooncake_vllm.store_keys.StoreKeyScheme`) by a real :class:`StoreClient`; the
lookup must count exactly the leading run the connector would load, every TP rank
included, and a master outage must only mean "nothing stored" (one warning, requests
served). Stub upstreams stand in for vLLM where the whole proxy is exercised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from store_support import Master

from mooncake_core.conductor import DEFAULT_PROFILE, CostModel
from mooncake_core.errors import ConfigError
from mooncake_core.proxy import ProxyConfig, ProxyServer, StoreLookup
from mooncake_core.proxy.policy import prefix_blocks
from mooncake_core.proxy.storelookup import parse_master_address
from mooncake_core.store.client import StoreClient

mooncake_vllm_keys = pytest.importorskip("mooncake_vllm.store_keys")
StoreKeyScheme = mooncake_vllm_keys.StoreKeyScheme

pytestmark = [pytest.mark.timeout(120)]

BT = 32
MODEL = "/models/tiny-llama"


def tokens(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt * 31) % 400 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    m = Master(tmp_path_factory.mktemp("proxy-store"))
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def writer(master: Master) -> Iterator[StoreClient]:
    with StoreClient(master=master.address, segment_size=8 << 20) as c:
        yield c


def save_pages(
    client: StoreClient,
    scheme: Any,
    toks: list[int],
    n_pages: int,
    ranks: list[int] | None = None,
    layers: int = 2,
) -> None:
    """What the connector's worker saves: one object per (page, layer) per TP rank."""
    pages = scheme.pages(toks)[:n_pages]
    for r in ranks if ranks is not None else range(scheme.tp_size):
        for layer in range(layers):
            for k in scheme.layer_keys(pages, r, layer):
                if not client.exists(k):
                    client.put(k, b"kv" * 8)


def test_lookup_counts_the_leading_run_of_saved_pages(master: Master, writer: StoreClient) -> None:
    scheme = StoreKeyScheme(MODEL, "torch.float32", BT)
    look = StoreLookup(master.address, BT, "float32", model=MODEL)  # "float32" names the same keys
    assert look.scheme == scheme
    t = tokens(10 * BT + 5, salt=1)
    assert look.held_pages(t) == 0
    save_pages(writer, scheme, t, 6)
    assert look.held_pages(t) == 6
    # a prompt sharing the first 4 pages, then diverging
    assert look.held_pages(t[: 4 * BT] + tokens(6 * BT, salt=2)) == 4
    # at least one prompt token is always computed: a 6-page prompt can use only 5 pages
    assert look.held_pages(t[: 6 * BT]) == 5
    # a gap ends the run, as in the connector (page 7 alone is of no use)
    save_pages(writer, scheme, t, 8)
    writer.remove(scheme.layer_keys(scheme.pages(t)[6:7], 0, 0)[0], force=True)
    assert look.held_pages(t) == 6
    # other dtype, block size or model: other keys
    assert StoreLookup(master.address, BT, "bfloat16", model=MODEL).held_pages(t) == 0
    assert StoreLookup(master.address, BT, "float32", model="/other/tiny-llama").held_pages(t) == 0
    assert StoreLookup(master.address, BT // 2, "float32", model=MODEL).held_pages(t) == 0
    st = look.stats()
    assert st["lookups"] == 5 and st["failures"] == 0 and st["down"] is False
    look.close()


def test_every_tp_rank_must_hold_the_page(master: Master, writer: StoreClient) -> None:
    scheme = StoreKeyScheme(MODEL, "float32", BT, tp_size=2)
    look = StoreLookup(master.address, BT, "float32", tp_size=2, model=MODEL)
    t = tokens(5 * BT, salt=3)
    save_pages(writer, scheme, t, 4, ranks=[0])
    assert look.held_pages(t) == 0
    save_pages(writer, scheme, t, 2, ranks=[1])
    assert look.held_pages(t) == 2
    look.close()


def test_connector_and_proxy_name_the_same_keys() -> None:
    """The connector builds its scheme from vLLM's config; the proxy from its options."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from mooncake_vllm.store_connector import scheme_of

    torch = pytest.importorskip("torch")
    vc = SimpleNamespace(
        model_config=SimpleNamespace(model=MODEL, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(block_size=BT),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    assert scheme_of(vc) == StoreKeyScheme(MODEL, "bf16", BT)
    assert (
        scheme_of(vc).seed == f"{MODEL}|torch.bfloat16|{BT}"
    )  # the seed the connector always used


def test_master_outage_means_no_store_holdings(
    tmp_path: Path, writer: StoreClient, caplog: pytest.LogCaptureFixture
) -> None:
    m = Master(tmp_path, name="outage")
    scheme = StoreKeyScheme(MODEL, "float32", BT)
    t = tokens(4 * BT + 1, salt=4)
    with StoreClient(master=m.address, segment_size=4 << 20, failover_timeout_s=1.0) as w:
        save_pages(w, scheme, t, 4)
        look = StoreLookup(m.address, BT, "float32", model=MODEL, timeout_s=0.5, retry_after_s=0.5)
        assert look.held_pages(t) == 4
        m.kill()
        caplog.set_level(logging.INFO, logger="mooncake_core.proxy.storelookup")
        t0 = time.monotonic()
        assert look.held_pages(t) == 0
        assert time.monotonic() - t0 < 2.0
        # paused: the next lookups do not even try, and log nothing more
        assert look.held_pages(t) == 0 and look.held_pages(t) == 0
        st = look.stats()
        assert st["failures"] == 1 and st["skipped"] == 2 and st["down"] is True
        time.sleep(0.6)
        assert look.held_pages(t) == 0  # tried again, still down: still one warning
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and m.address in warnings[0].getMessage()
        assert not look.probe()
        look.close()
    m.stop()


def test_bad_addresses_are_one_line_errors() -> None:
    for bad in (
        "",
        "localhost",
        "127.0.0.1:",
        "127.0.0.1:99999",
        "http://127.0.0.1:50051",
        "a b:1",
        "etcd://",
    ):
        with pytest.raises(ConfigError, match="--store-master") as exc:
            parse_master_address(bad)
        assert "\n" not in str(exc.value)
    assert parse_master_address(" 127.0.0.1:50051 ") == "127.0.0.1:50051"
    assert (
        parse_master_address("etcd://10.0.0.1:2379,10.0.0.2:2379")
        == "etcd://10.0.0.1:2379,10.0.0.2:2379"
    )
    with pytest.raises(ConfigError, match="--store-dtype"):
        StoreLookup("127.0.0.1:50051", BT, "")


def test_cli_rejects_bad_store_options() -> None:
    base = [
        sys.executable,
        "-m",
        "mooncake_core",
        "proxy",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
        "--port",
        "0",
        "--policy",
        "global-cache",
    ]
    for extra, needle in (
        (
            ["--store-master", "nowhere", "--store-dtype", "float32"],
            "is not a store master address",
        ),
        (["--store-master", "127.0.0.1:50051"], "needs --store-dtype"),
        (["--store-dtype", "float32"], "need --store-master"),
    ):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert (
            len(lines) == 1 and lines[0].startswith("mooncake-core: error:") and needle in lines[0]
        ), out.stderr


# --- the whole proxy, stub upstreams, a real master ----------------------------------------------


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def _upstream(seen: list[dict[str, Any]]) -> web.Application:
    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        return web.json_response(
            {"choices": [{"text": "x"}], "kv_transfer_params": {"do_remote_prefill": True}}
        )

    async def models(request: web.Request) -> web.StreamResponse:
        return web.json_response({"data": [{"id": "tiny", "root": MODEL}]})

    async def tokenize(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if "prompt" not in body:
            return web.json_response({"error": "no"}, status=400)
        text = body["prompt"]
        return web.json_response({"tokens": [ord(c) % 400 + 3 for c in text], "count": len(text)})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    return app


async def _upstreams(seen: list[dict[str, Any]], n: int) -> tuple[list[web.AppRunner], list[str]]:
    """``n`` stub instances (see :func:`_upstream`) recording into ``seen``: their runners and
    URLs."""
    served = [await _serve(_upstream(seen)) for _ in range(n)]
    return [r for r, _ in served], [u for _, u in served]


async def _stats(proxy_url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(proxy_url + "/proxy/stats") as r:
        return await r.json()


async def _post(url: str, body: Any) -> tuple[int, dict[str, str], Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=20)) as r,
    ):
        return r.status, dict(r.headers), json.loads(await r.read())


def _decision(headers: dict[str, str]) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in headers["X-Mooncake-Decision"].split("; "))


def test_proxy_counts_store_pages_and_accepts_what_only_the_store_makes_fast(
    tmp_path: Path, writer: StoreClient, master: Master, caplog: pytest.LogCaptureFixture
) -> None:
    """A prompt of n tokens: recomputing misses the TTFT SLO; fetching its saved prefix meets it."""
    n = 40 * BT + 8
    cost = CostModel(dataclasses.replace(DEFAULT_PROFILE, block_tokens=BT))
    recompute = cost.prefill_s(n, 0)
    fetch = cost.transfer_s(40) + cost.prefill_s(n, 40 * BT)
    slo = (recompute + fetch) / 2
    assert fetch < slo < recompute
    scheme = StoreKeyScheme(MODEL, "float32", BT)
    saved = tokens(n, salt=7)
    save_pages(writer, scheme, saved, 40)
    fresh = tokens(n, salt=8)
    own = Master(tmp_path, name="down-later")

    async def main() -> None:
        seen: list[dict[str, Any]] = []
        runners, urls = await _upstreams(seen, 3)
        opts = {
            "block_tokens": BT,
            "reject": True,
            "slo_ttft_s": slo,
            "slo_tbt_s": 10.0,
            "store_master": master.address,
            "store_dtype": "float32",
        }  # model: from /v1/models
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
        try:
            body = {"model": "tiny", "max_tokens": 4}
            st, _, err = await _post(purl + "/v1/completions", {**body, "prompt": fresh})
            assert st == 429, err  # nothing stored: recompute, predicted over the SLO
            st, hdr, _ = await _post(purl + "/v1/completions", {**body, "prompt": saved})
            assert st == 200
            d = _decision(hdr)
            assert (
                d["store_blocks"] == "40"
                and d["fetch_source"] == "store"
                and d["fetch_blocks"] == "40"
            )
            assert float(d["predicted_ttft_ms"]) == pytest.approx(fetch * 1e3, abs=0.2)
            stats = await _stats(purl)
            ps = stats["policy_stats"]
            assert (
                ps["store"]["pages_held"] == 40
                and ps["fetch_from_store"] == 1
                and ps["rejections"] == 1
            )
            assert ps["store"]["scheme"] == scheme.seed  # the model path came from GET /v1/models
        finally:
            await proxy.stop()
        # the same with the store master gone: never a failed request, one warning
        opts = {**opts, "store_master": own.address, "reject": False, "store_model": MODEL}
        own.kill()
        caplog.set_level(logging.WARNING, logger="mooncake_core.proxy.storelookup")
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
        try:
            for _ in range(3):
                st, hdr, _ = await _post(purl + "/v1/completions", {**body, "prompt": saved})
                assert st == 200 and _decision(hdr)["store_blocks"] == "0"
        finally:
            await proxy.stop()
            for r in runners:
                await r.cleanup()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "routing without store holdings" in warnings[0].getMessage()

    asyncio.run(main())
    own.stop()


def test_text_prompts_are_tokenized_for_routing() -> None:
    """Text prompts are hashed over the ids ``/tokenize`` returns (cached); chat falls back to
    characters."""

    async def main() -> None:
        seen: list[dict[str, Any]] = []
        runners, urls = await _upstreams(seen, 3)
        proxy = ProxyServer(
            ProxyConfig(
                prefill=tuple(urls[:2]),
                decode=(urls[2],),
                port=0,
                policy="global-cache",
                policy_options=(("block_tokens", 4),),
            )
        )
        purl = await proxy.start()
        pol: Any = proxy.policy
        try:
            text = "the quick brown fox jumps over the lazy dog " * 3
            ids = [ord(c) % 400 + 3 for c in text]  # what the stub's /tokenize answers
            # instance 1 reports (as its KV events would) that it holds these token blocks
            pol.conductor.kv_stored(1, prefix_blocks(ids, 4))
            st, hdr, _ = await _post(
                purl + "/v1/completions",
                {"model": "tiny", "prompt": text + "and more", "max_tokens": 2},
            )
            assert (
                st == 200 and hdr["X-Mooncake-Prefill"] == urls[1]
            )  # characters would never match: instance 0
            assert _decision(hdr)["cached_blocks"] == str(len(ids) // 4)
            st, _, _ = await _post(
                purl + "/v1/completions",
                {"model": "tiny", "prompt": text + "and more", "max_tokens": 2},
            )
            stats = await _stats(purl)
            assert stats["tokenizer"]["calls"] == 1 and stats["tokenizer"]["cache_hits"] == 1
            # the stub cannot tokenize chat: the request is still served, hashed by characters
            st, _, _ = await _post(
                purl + "/v1/chat/completions",
                {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": text}]},
            )
            assert st == 200
            stats = await _stats(purl)
            assert (
                stats["tokenizer"]["rejected"] == 1
                and stats["policy_stats"]["char_hashed_prompts"] == 1
            )
        finally:
            await proxy.stop()
            for r in runners:
                await r.cleanup()

    asyncio.run(main())
