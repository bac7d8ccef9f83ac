"""``mooncake.vllm_v1_proxy_server``: the published prefill/decode proxy for vLLM, on aiohttp.

The 0.3.13 wheel ships vLLM's toy disaggregation proxy (FastAPI + httpx + uvicorn). This
is our own implementation of the same command line and behaviour::

    python -m mooncake_core.compat.vllm_v1_proxy_server --port 8000 \\
        --prefiller-hosts 127.0.0.1 --prefiller-ports 8100 \\
        --decoder-hosts 127.0.0.1 --decoder-ports 8200

(``python -m mooncake.vllm_v1_proxy_server`` where ``mooncake`` is importable as ours).
Flags and defaults as published: ``--port 8000``, ``--host 127.0.0.1``,
``--prefiller-hosts/--prefiller-host`` (``localhost``), ``--prefiller-ports/--prefiller-port``
(``8100``), ``--decoder-hosts/--decoder-host`` (``localhost``),
``--decoder-ports/--decoder-port`` (``8200``); hosts and ports pair up in order.

``POST /v1/completions`` and ``POST /v1/chat/completions``: the next prefill instance
(round robin) gets the request with ``kv_transfer_params`` = ``{"do_remote_decode": true,
"do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null,
"remote_host": null, "remote_port": null}``, ``stream`` false, ``max_tokens`` 1 (and
``max_completion_tokens`` 1 when given), no ``stream_options``; the ``kv_transfer_params``
of its answer (when any) go into the original request, which the next decode instance
answers, streamed back byte for byte (``application/json``, as published). Both carry the
same ``X-Request-Id`` and ``Authorization: Bearer $OPENAI_API_KEY``. ``GET /healthcheck``:
``{"status": "ok", "prefill_instances": n, "decode_instances": m}``.

Where ours differs: an upstream error is a 502 with a one-line JSON ``error`` (the published
one raises inside the handler: a 500, or a broken stream); unequal host/port lists and a
port in use are one-line errors, not tracebacks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from typing import Any

from aiohttp import ClientResponseError, ClientSession, ClientTimeout, TCPConnector, web

from mooncake_core.config import env_str

__all__ = [
    "get_next_client",
    "handle_chat_completions",
    "handle_completions",
    "healthcheck",
    "lifespan",
    "main",
    "make_app",
    "parse_args",
    "send_request_to_service",
    "stream_service_response",
]

logger = logging.getLogger(__name__)

_ARGS = web.AppKey("args", argparse.Namespace)
_CLIENTS = web.AppKey("clients", dict)
_ITERS = web.AppKey("iterators", dict)

#: what the prefill request's ``kv_transfer_params`` are set to (published)
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The published flags (``sys.argv`` when ``argv`` is None), with
    ``prefiller_instances`` / ``decoder_instances`` as ``[(host, port), ...]``."""
    parser = argparse.ArgumentParser(prog="vllm_v1_proxy_server")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", type=str, default="127.0.0.1")
    parser.add_argument(
        "--prefiller-hosts", "--prefiller-host", type=str, nargs="+", default=["localhost"]
    )
    parser.add_argument(
        "--prefiller-ports", "--prefiller-port", type=int, nargs="+", default=[8100]
    )
    parser.add_argument(
        "--decoder-hosts", "--decoder-host", type=str, nargs="+", default=["localhost"]
    )
    parser.add_argument("--decoder-ports", "--decoder-port", type=int, nargs="+", default=[8200])
    args = parser.parse_args(argv)
    if len(args.prefiller_hosts) != len(args.prefiller_ports):
        parser.error("Number of prefiller hosts must match number of prefiller ports")
    if len(args.decoder_hosts) != len(args.decoder_ports):
        parser.error("Number of decoder hosts must match number of decoder ports")
    args.prefiller_instances = list(zip(args.prefiller_hosts, args.prefiller_ports, strict=True))
    args.decoder_instances = list(zip(args.decoder_hosts, args.decoder_ports, strict=True))
    return args


def _clients(instances: list[tuple[str, int]]) -> list[dict[str, Any]]:
    out = []
    for i, (host, port) in enumerate(instances):
        session = ClientSession(
            base_url=f"http://{host}:{port}",
            timeout=ClientTimeout(total=None),
            connector=TCPConnector(limit=0),
        )
        out.append({"client": session, "host": host, "port": port, "id": i})
    return out


async def lifespan(app: web.Application) -> AsyncIterator[None]:
    """Client pools for the prefill and decode instances while the app runs (an aiohttp
    cleanup context, as the published FastAPI lifespan)."""
    args = app[_ARGS]
    clients = {
        "prefill": _clients(args.prefiller_instances),
        "decode": _clients(args.decoder_instances),
    }
    app[_CLIENTS] = clients
    app[_ITERS] = {kind: itertools.cycle(range(len(c))) for kind, c in clients.items()}
    print(
        f"Initialized {len(clients['prefill'])} prefill clients "
        f"and {len(clients['decode'])} decode clients.",
        flush=True,
    )
    yield
    for info in [*clients["prefill"], *clients["decode"]]:
        await info["client"].close()


def get_next_client(app: web.Application, service_type: str) -> dict[str, Any]:
    """The next ``prefill`` or ``decode`` client, round robin."""
    if service_type not in ("prefill", "decode"):
        raise ValueError(f"Unknown service type: {service_type}")
    iterator: Iterator[int] = app[_ITERS][service_type]
    info: dict[str, Any] = app[_CLIENTS][service_type][next(iterator)]
    return info


def _headers(request_id: str) -> dict[str, str]:
    # as published: "Bearer None" when OPENAI_API_KEY is unset
    return {
        "Authorization": f"Bearer {env_str('OPENAI_API_KEY') or None}",
        "X-Request-Id": request_id,
    }


async def send_request_to_service(
    client_info: dict[str, Any], endpoint: str, req_data: dict[str, Any], request_id: str
) -> dict[str, Any]:
    """The prefill request (one token, not streamed; see the module text); returns the
    answer's JSON (the published one returns the httpx response)."""
    req_data = req_data.copy()
    req_data["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    req_data["stream"] = False
    req_data["max_tokens"] = 1
    if "max_completion_tokens" in req_data:
        req_data["max_completion_tokens"] = 1
    req_data.pop("stream_options", None)
    session: ClientSession = client_info["client"]
    async with session.post("/v1" + endpoint, json=req_data, headers=_headers(request_id)) as resp:
        resp.raise_for_status()
        body: dict[str, Any] = await resp.json(content_type=None)
    return body


async def stream_service_response(
    client_info: dict[str, Any], endpoint: str, req_data: dict[str, Any], request_id: str
) -> AsyncGenerator[bytes, None]:
    """The decode instance's answer to ``req_data``, chunk by chunk."""
    session: ClientSession = client_info["client"]
    async with session.post("/v1" + endpoint, json=req_data, headers=_headers(request_id)) as resp:
        resp.raise_for_status()
        async for chunk in resp.content.iter_any():
            yield chunk


def _error(status: int, text: str) -> web.Response:
    return web.json_response({"error": text}, status=status)


async def _handle_completions(api: str, request: web.Request) -> web.StreamResponse:
    try:
        req_data = await request.json()
    except json.JSONDecodeError as exc:
        return _error(400, f"request body is not JSON: {exc}")
    if not isinstance(req_data, dict):
        return _error(400, "request body must be a JSON object")
    request_id = str(uuid.uuid4())
    prefill = get_next_client(request.app, "prefill")
    where = f"prefill {prefill['host']}:{prefill['port']}"
    try:
        answer = await send_request_to_service(prefill, api, req_data, request_id)
        kv_transfer_params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if kv_transfer_params:
            req_data["kv_transfer_params"] = kv_transfer_params
        decode = get_next_client(request.app, "decode")
        where = f"decode {decode['host']}:{decode['port']}"
        logger.debug("request %s: %s then %s", request_id, prefill["id"], decode["id"])
        chunks = stream_service_response(decode, api, req_data, request_id)
        first = await anext(chunks, b"")  # upstream errors before the answer starts
    except (OSError, ClientResponseError, ValueError) as exc:
        logger.warning("request %s: %s failed: %s", request_id, where, exc)
        return _error(502, f"{where} failed: {exc}")
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    try:
        await response.write(first)
        async for chunk in chunks:
            await response.write(chunk)
    except (OSError, ClientResponseError) as exc:
        logger.warning("request %s: %s broke off: %s", request_id, where, exc)
    finally:
        await chunks.aclose()
    await response.write_eof()
    return response


async def handle_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _handle_completions("/completions", request)


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _handle_completions("/chat/completions", request)


async def healthcheck(request: web.Request) -> web.Response:
    """``GET /healthcheck``: the numbers of prefill and decode instances."""
    clients = request.app[_CLIENTS]
    return web.json_response(
        {
            "status": "ok",
            "prefill_instances": len(clients["prefill"]),
            "decode_instances": len(clients["decode"]),
        }
    )


def make_app(args: argparse.Namespace) -> web.Application:
    """The proxy's aiohttp application for ``args`` (from :func:`parse_args`)."""
    app = web.Application()
    app[_ARGS] = args
    app.cleanup_ctx.append(lifespan)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat_completions)
    app.router.add_get("/healthcheck", healthcheck)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    """Run the proxy until interrupted; 1 with one line when it cannot listen."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        web.run_app(make_app(args), host=args.host, port=args.port, print=None)
    except OSError as exc:
        print(
            f"vllm_v1_proxy_server: cannot listen on {args.host}:{args.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
