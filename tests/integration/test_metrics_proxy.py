"""The PD proxy's /metrics with a real ``mooncake-core proxy`` process.

Stub upstreams stand in for vLLM (they answer as vLLM's prefill and decode instances do;
a real vLLM is exercised by the adapter's tests). The scrape must count exactly what was
sent: routed requests, a streamed and a non-streamed answer (TTFT and end-to-end
histograms), an early rejection (429) and a failing decode instance (upstream error).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from store_support import free_port

from mooncake_core.metrics import Sample, parse

pytestmark = [pytest.mark.timeout(120)]


def _stub_app(fail_decode: bool) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):  # the prefill leg
            return web.json_response(
                {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_request_id": "r"}}
            )
        if fail_decode:
            return web.json_response({"error": "boom"}, status=500)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for t in ("a", "b"):
                await resp.write(f"data: {json.dumps({'choices': [{'text': t}]})}\n\n".encode())
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return web.json_response({"choices": [{"text": "ab"}]})

    async def health(_r: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    return app


@pytest.fixture(scope="module")
def upstreams() -> Iterator[dict[str, str]]:
    """Three stub instances on one event-loop thread: prefill, decode, failing decode."""
    loop = asyncio.new_event_loop()
    urls: dict[str, str] = {}
    runners: list[web.AppRunner] = []

    async def start() -> None:
        for name, fail in (("prefill", False), ("decode", False), ("bad", True)):
            runner = web.AppRunner(_stub_app(fail), access_log=None)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            urls[name] = f"http://127.0.0.1:{port}"

    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield urls
    finally:
        for r in runners:
            asyncio.run_coroutine_threadsafe(r.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)


def _proxy(prefill: str, decode: list[str], *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake_core", "proxy", "--prefill", prefill]
        + ["--decode", *decode, "--port", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            return proc, url
        except OSError:
            assert proc.poll() is None, "the proxy exited at start"
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError("proxy did not start")


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _scrape(url: str) -> list[Sample]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        return parse(r.read().decode())


def _v(samples: list[Sample], sample: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.sample == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_proxy_metrics_count_routing_latency_rejections_and_errors(
    upstreams: dict[str, str],
) -> None:
    pre, dec, bad = upstreams["prefill"], upstreams["decode"], upstreams["bad"]
    proc, url = _proxy(pre, [dec, bad], "--policy", "round-robin")
    try:
        outcomes = [_post(url, {"prompt": [1, 2, 3], "max_tokens": 2}) for _ in range(4)]
        streamed = _post(url, {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True})
        m = _scrape(url)
        top_once, top_live = _top(url)
    finally:
        proc.terminate()
        proc.wait(10)
    codes = sorted(c for c, _ in [*outcomes, streamed])
    ok, failed = codes.count(200), codes.count(502)
    assert ok >= 2 and failed >= 2 and ok + failed == 5
    assert _v(m, "mooncake_proxy_requests_total", outcome="ok") >= ok
    assert _v(m, "mooncake_proxy_upstream_errors_total", stage="decode", instance=bad) >= failed
    assert _v(m, "mooncake_proxy_upstream_errors_total", status="502") >= failed
    assert _v(m, "mooncake_proxy_routed_total", policy="round-robin", decode=dec) >= 2
    assert _v(m, "mooncake_proxy_routed_total", decode=bad) >= 2
    assert _v(m, "mooncake_proxy_ttft_seconds_count") >= ok
    assert _v(m, "mooncake_proxy_e2e_seconds_count") >= ok
    assert _v(m, "mooncake_proxy_prefill_seconds_count", instance=pre) >= 5
    assert _v(m, "mooncake_proxy_in_flight") == 0
    assert _v(m, "process_resident_memory_bytes") > 0
    # mooncake-core top reads the same figures, once as JSON and live (frames every interval)
    assert top_once["ok"] == ok and top_once["upstream_errors"] == failed
    assert top_once["p50_ttft_s"] > 0 and top_once["in_flight"] == 0
    target = url.removeprefix("http://")
    frames = [ln for ln in top_live.splitlines() if ln.startswith(f"PROXY  {target} ok {ok} (")]
    assert len(frames) >= 2, top_live  # the second and later frames show the rate: "(0.0/s)"
    assert f"upstream errors {failed}" in frames[-1] and "TTFT p50" in top_live


def _top(url: str) -> tuple[dict[str, Any], str]:
    """``mooncake-core top --proxy``: one JSON snapshot, and the live view's first frames."""
    target = url.removeprefix("http://")
    cmd = [sys.executable, "-m", "mooncake_core", "top", "--proxy", target]
    once = subprocess.run([*cmd, "--once", "--json"], capture_output=True, text=True, timeout=60)
    assert once.returncode == 0, once.stderr
    snap = json.loads(once.stdout.strip().splitlines()[-1])[f"proxy:{target}"]
    live = subprocess.Popen([*cmd, "--interval", "0.2"], stdout=subprocess.PIPE, text=True)
    assert live.stdout is not None
    lines: list[str] = []
    try:  # read until the fourth frame has begun (or the view exits)
        while sum(ln.startswith("mooncake-core top") for ln in lines) < 4:
            line = live.stdout.readline()
            if not line:
                break
            lines.append(line)
    finally:
        live.terminate()
        live.communicate(timeout=10)
    return snap, "".join(lines)


def test_proxy_counts_early_rejections(upstreams: dict[str, str]) -> None:
    pre, dec = upstreams["prefill"], upstreams["decode"]
    proc, url = _proxy(
        pre, [dec], "--policy", "global-cache", "--reject", "--slo-ttft", "0.2", "--slo-tbt", "5"
    )
    try:
        long_prompt = {"prompt": list(range(3, 60_000)), "max_tokens": 2}
        code, _ = _post(url, long_prompt)
        small = _post(url, {"prompt": [5, 6, 7], "max_tokens": 2})
        m = _scrape(url)
    finally:
        proc.terminate()
        proc.wait(10)
    assert code == 429 and small[0] == 200
    assert _v(m, "mooncake_proxy_rejections_total", policy="global-cache") == 1
    assert _v(m, "mooncake_proxy_requests_total", outcome="rejected") == 1
    assert _v(m, "mooncake_proxy_requests_total", outcome="ok") == 1
    assert _v(m, "mooncake_proxy_routed_total") == 1
