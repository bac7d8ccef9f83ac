"""``mooncake.vllm_v1_proxy_server`` and ``mooncake.mooncake_connector_v1`` on our compat layer.

The proxy: the published one (the 0.3.13 wheel's file, run with this venv's FastAPI, httpx
and uvicorn, which vLLM brings) and ours (``python -m
mooncake_core.compat.vllm_v1_proxy_server``) are started with the same command line in
front of the same upstreams, and must send the upstreams the same requests and hand back
the same answers. The upstreams are STAND-INS for vLLM prefill and decode servers: small
aiohttp servers in this test that record what they get and answer like vLLM's
OpenAI-compatible server with a ``kv_transfer_params`` field. (A real vLLM prefill/decode
pair behind our proxy: ``test_builtin_pd_through_the_published_proxy_cli`` in
plugins/vllm/tests/test_vllm_builtin_compat.py.)

The connector module: the same objects as vLLM's built-in connector, the published
parameters where the wheel's source has the name.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from mooncake_core.bench.published import peer
from mooncake_core.compat import inventory

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED_ENV_KEY = "sk-test-key"


def _wheel_file(name: str) -> Path | None:
    real = os.environ.get("MOONCAKE_PEER_PYTHON") or peer().default_peer_python()
    if real is None:
        return None
    hits = sorted(
        Path(real).resolve().parents[1].glob(f"lib/python3*/site-packages/mooncake/{name}")
    )
    if not hits:  # the venv's python may be a symlink out of the venv
        hits = sorted(Path(real).parents[1].glob(f"lib/python3*/site-packages/mooncake/{name}"))
    return hits[0] if hits else None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class StandIns:
    """Two prefill and two decode STAND-INS (aiohttp, in a thread) that record requests."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.runners: list[web.AppRunner] = []
        self.ports: dict[str, list[int]] = {"prefill": [], "decode": []}
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        for role in ("prefill", "prefill", "decode", "decode"):
            port = asyncio.run_coroutine_threadsafe(self._start(role), self.loop).result(10)
            self.ports[role].append(port)

    async def _start(self, role: str) -> int:
        app = web.Application()
        index = len(self.ports[role])

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.seen.append(
                {
                    "role": role,
                    "index": index,
                    "path": request.path,
                    "auth": request.headers.get("Authorization"),
                    "request_id": request.headers.get("X-Request-Id"),
                    "body": body,
                }
            )
            if role == "prefill":
                return web.json_response(
                    {
                        "choices": [{"text": "p"}],
                        "kv_transfer_params": {
                            "do_remote_prefill": True,
                            "do_remote_decode": False,
                            "remote_engine_id": f"engine-{index}",
                            "remote_block_ids": [3, 4],
                            "remote_host": "127.0.0.1",
                            "remote_port": 7000 + index,
                        },
                    }
                )
            if body.get("prompt") == "fail":
                return web.json_response({"error": "boom"}, status=500)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):  # several chunks: the proxy must stream all of them
                await resp.write(f'data: {{"decode": {index}, "chunk": {i}}}\n\n'.encode())
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

        app.router.add_post("/v1/completions", handle)
        app.router.add_post("/v1/chat/completions", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        port: int = sock.getsockname()[1]
        return port

    def take(self) -> list[dict[str, Any]]:
        out, self.seen = self.seen, []
        return out

    def close(self) -> None:
        for r in self.runners:
            asyncio.run_coroutine_threadsafe(r.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def standins() -> Iterator[StandIns]:
    s = StandIns()
    yield s
    s.close()


def _cli(s: StandIns, port: int) -> list[str]:
    return [
        "--port",
        str(port),
        "--prefiller-hosts",
        "127.0.0.1",
        "127.0.0.1",
        "--prefiller-ports",
        *map(str, s.ports["prefill"]),
        "--decoder-host",  # the singular spelling, as published
        "127.0.0.1",
        "127.0.0.1",
        "--decoder-port",
        *map(str, s.ports["decode"]),
    ]


def _post(url: str, body: dict[str, Any]) -> tuple[int, str, bytes]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def _wait_health(url: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the proxy exited at start-up"
        try:
            with urllib.request.urlopen(url + "/healthcheck", timeout=5) as r:
                out: dict[str, Any] = json.loads(r.read())
                return out
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the proxy did not come up")


def _exercise(s: StandIns, url: str) -> list[Any]:
    """Three requests (two round-robin turns); what each side saw, request ids masked."""
    out: list[Any] = []
    for body in (
        {
            "model": "m",
            "prompt": "hello",
            "max_tokens": 9,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 7,
            "max_tokens": 7,
        },
        {"model": "m", "prompt": "third", "max_tokens": 5},
    ):
        api = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, ctype, data = _post(url + api, body)
        seen = s.take()
        ids = {x["request_id"] for x in seen}
        assert len(ids) == 1 and None not in ids, "prefill and decode share one X-Request-Id"
        for x in seen:
            x.pop("request_id")
        out.append({"status": status, "type": ctype.split(";")[0], "data": data, "seen": seen})
    return out


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.timeout(120)
def test_proxy_cli_routes_as_the_published_one(standins: StandIns) -> None:
    published = _wheel_file("vllm_v1_proxy_server.py")
    env = dict(os.environ, OPENAI_API_KEY=PUBLISHED_ENV_KEY, PYTHONPATH=str(ROOT))
    ours_port = _free_port()
    ours = _start(
        [
            sys.executable,
            "-m",
            "mooncake_core.compat.vllm_v1_proxy_server",
            *_cli(standins, ours_port),
        ],
        env,
    )
    theirs = None
    try:
        if published is not None:
            theirs_port = _free_port()
            theirs = _start([sys.executable, str(published), *_cli(standins, theirs_port)], env)
        health = _wait_health(f"http://127.0.0.1:{ours_port}", ours)
        assert health == {"status": "ok", "prefill_instances": 2, "decode_instances": 2}
        got = _exercise(standins, f"http://127.0.0.1:{ours_port}")
        # what the published flow sends, checked by itself (so it holds without the wheel)
        first, second, third = got
        assert [x["role"] + str(x["index"]) for r in got for x in r["seen"]] == [
            "prefill0",
            "decode0",
            "prefill1",
            "decode1",
            "prefill0",
            "decode0",
        ]
        pre, dec = first["seen"]
        assert pre["path"] == "/v1/completions" and pre["auth"] == f"Bearer {PUBLISHED_ENV_KEY}"
        assert pre["body"] == {
            "model": "m",
            "prompt": "hello",
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": dict.fromkeys(
                ["remote_engine_id", "remote_block_ids", "remote_host", "remote_port"]
            )
            | {"do_remote_decode": True, "do_remote_prefill": False},
        }
        assert dec["body"]["kv_transfer_params"]["remote_engine_id"] == "engine-0"
        assert dec["body"]["stream"] is True and dec["body"]["max_tokens"] == 9
        assert "stream_options" in dec["body"]  # only the prefill request drops it
        assert first["status"] == 200 and first["type"] == "application/json"
        assert first["data"].count(b"data: ") == 4 and first["data"].endswith(b"[DONE]\n\n")
        assert second["seen"][0]["path"] == "/v1/chat/completions"
        assert second["seen"][0]["body"]["max_completion_tokens"] == 1
        assert second["seen"][1]["body"]["max_completion_tokens"] == 7
        assert b'"decode": 1' in second["data"] and b'"decode": 0' in third["data"]
        # an upstream failure is one clear answer, and the proxy keeps serving
        status, _, data = _post(f"http://127.0.0.1:{ours_port}/v1/completions", {"prompt": "fail"})
        assert status == 502 and b"decode 127.0.0.1:" in data, data
        standins.take()
        if theirs is None:
            pytest.skip(
                "no scratch venv with the published wheel: checked against the published flow"
            )
        assert _wait_health(f"http://127.0.0.1:{theirs_port}", theirs) == health
        # the same requests through the published proxy: the same upstream traffic and answers
        # (its round robin starts afresh too)
        assert _exercise(standins, f"http://127.0.0.1:{theirs_port}") == got
    finally:
        for p in (ours, theirs):
            if p is not None:
                p.terminate()
                p.wait(10)


def test_proxy_cli_defaults_and_bad_lists_match_the_published() -> None:
    from mooncake_core.compat import vllm_v1_proxy_server as ours

    args = vars(ours.parse_args([]))
    assert args == {
        "port": 8000,
        "host": "127.0.0.1",  # loopback, as published
        "prefiller_hosts": ["localhost"],
        "prefiller_ports": [8100],
        "decoder_hosts": ["localhost"],
        "decoder_ports": [8200],
        "prefiller_instances": [("localhost", 8100)],
        "decoder_instances": [("localhost", 8200)],
    }
    published = _wheel_file("vllm_v1_proxy_server.py")
    if published is not None:  # the published parser's defaults, read from its source
        tree = ast.parse(published.read_text())
        defaults = {
            ast.literal_eval(c.args[0]): ast.literal_eval(
                next(k.value for k in c.keywords if k.arg == "default")
            )
            for c in ast.walk(tree)
            if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "add_argument"
        }
        assert {k.lstrip("-").replace("-", "_"): v for k, v in defaults.items()} == {
            k: v for k, v in args.items() if not k.endswith("_instances")
        }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mooncake_core.compat.vllm_v1_proxy_server",
            "--prefiller-hosts",
            "a",
            "b",
            "--prefiller-ports",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .endswith("Number of prefiller hosts must match number of prefiller ports")
    )
    assert "Traceback" not in out.stderr


def _published_params(src: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for node in ast.parse(src.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = [a.arg for a in node.args.args]
    return out


@pytest.mark.slow  # imports vLLM (~14 s here; shared with other in-process vLLM tests)
def test_connector_module_is_vllms_builtin_connector() -> None:
    pytest.importorskip("vllm")
    import mooncake_core.compat

    was_installed = mooncake_core.compat.installed()  # other tests may rely on it staying
    mooncake_core.compat.install(force=True)
    try:
        import importlib

        mod = importlib.import_module("mooncake.mooncake_connector_v1")
        builtin = importlib.import_module(mod.BUILTIN_MODULE)
        for name in (
            "MooncakeConnector",
            "MooncakeConnectorScheduler",
            "MooncakeConnectorWorker",
            "MooncakeConnectorMetadata",
            "SendBlockMeta",
            "group_concurrent_contiguous",
            "get_mooncake_side_channel_port",
        ):
            assert getattr(mod, name) is getattr(builtin, name), name
        # vLLM's own factory loads the class from the published module path
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cfg = KVTransferConfig(
            kv_connector="MooncakeConnector",
            kv_role="kv_producer",
            kv_connector_module_path="mooncake.mooncake_connector_v1",
        )
        assert KVConnectorFactory.get_connector_class(cfg) is builtin.MooncakeConnector
        assert mod.group_concurrent_contiguous([1, 2, 3, 7], [4, 5, 9, 10]) == (
            [[1, 2], [3], [7]],
            [[4, 5], [9], [10]],
        )
        import zmq

        addr = f"tcp://127.0.0.1:{_free_port()}"
        with mod.zmq_ctx(zmq.ROUTER, addr) as router, mod.zmq_ctx(zmq.REQ, addr) as req:
            req.send(b"ping")
            ident, _, msg = router.recv_multipart()
            assert msg == b"ping"
        with pytest.raises(ValueError, match="Unexpected socket type"):
            with mod.zmq_ctx(zmq.PUB, addr):
                pass
        src = _wheel_file("mooncake_connector_v1.py")
        if src is None:
            pytest.skip("no scratch venv with the published wheel for the parameter names")
        theirs = _published_params(src)
        for name in ("zmq_ctx", "group_concurrent_contiguous", "get_mooncake_side_channel_port"):
            params = list(inventory.parameters(getattr(mod, name)) or [])
            assert [p[0] for p in params] == theirs[name], name
        # every public name of the wheel's module is here or listed with its reason
        for name, members in inventory._from_source(src).items():
            key = f"mooncake.mooncake_connector_v1:{name}"
            if inventory.is_exempt(key):
                continue
            assert hasattr(mod, name), key
            for m in members or []:
                assert hasattr(getattr(mod, name), m) or inventory.is_exempt(f"{key}.{m}"), m
    finally:
        if not was_installed:
            mooncake_core.compat.uninstall()
