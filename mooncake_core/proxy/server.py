"""The PD proxy: an OpenAI-compatible front over prefill and decode engine instances.

Per request (``POST /v1/completions`` or ``/v1/chat/completions``, streaming or not):

1. the policy picks a prefill and a decode instance;
2. the prefill instance gets the request as the engine splits it for prefill
   (:meth:`~mooncake_core.proxy.engine.ProxyEngine.prefill_body`; vLLM: ``max_tokens=1``,
   ``stream=false`` and ``kv_transfer_params={"do_remote_decode": true, ...}``); with
   ``store_loads`` off (``--store-loads off``) its ``kv_transfer_params`` also carry
   ``"mooncake_store_load": false``: the instances' store connector then loads nothing
   from the store for it (only their own prefix cache helps; saves go on);
3. the decode instance gets the original request plus the hand-off the prefill answered
   with (vLLM: its ``kv_transfer_params``), and its answer (a JSON body or an SSE stream)
   goes back to the client as it arrives.

What is engine-specific comes from the engine's adapter (``--engine``, default
:data:`~mooncake_core.proxy.engine.DEFAULT_ENGINE`; :mod:`mooncake_core.proxy.engine`).

Failures never hang: connecting, the prefill answer, and every streamed chunk have
timeouts. Upstream trouble becomes a JSON error ``{"error": {"message", "type",
"code"}}`` with 502 (bad or no answer), 504 (timeout), or the upstream's own 4xx
(the client's request was bad). A stream that breaks after it started ends with an
SSE ``error`` event and ``[DONE]``.

Cache-aware policies (``global-cache``) get token ids for text prompts: the proxy asks a
prefill instance's tokenizer endpoint first (:mod:`mooncake_core.proxy.tokenize`), then
calls the policy's ``prepare`` (e.g. a store lookup) and ``choose``.

Also served: ``GET /health``, ``GET /v1/models`` (from a decode instance),
``GET /proxy/stats`` (per-instance load and counters, the policy's under ``policy_stats``) and
``GET /proxy/decisions`` (the decision log: one record per recent request, oldest first: its
number, arrival ``t`` (s since the proxy started), the client's ``user`` field as ``tag``, prompt
tokens, seconds the policy's ``prepare`` took (``prepare_s``: e.g. a store lookup), the
chosen ``prefill`` / ``decode`` index, the live ``load`` (prompt tokens in flight
per prefill instance) it was chosen under, the policy's reasons (``global-cache``: matched
blocks per instance from its index and from the engines' events alone, store blocks,
predicted ``wait_s``, ``speed`` and TTFT ``predicted_s`` per instance), the prefill leg
``prefill_s`` and the proxy-side ``ttft_s``; ``?since=N`` gives records after request N).
Each record is also logged at DEBUG.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from mooncake_core.errors import ProxyError
from mooncake_core.proxy.engine import DEFAULT_ENGINE, ProxyEngine, proxy_engine
from mooncake_core.proxy.metrics import ProxyMetrics
from mooncake_core.proxy.policy import (
    Instance,
    Job,
    Placement,
    RequestRejected,
    RoutingPolicy,
    make_policy,
)
from mooncake_core.proxy.tokenize import RemoteTokenizer

__all__ = ["ProxyConfig", "ProxyServer", "UpstreamError", "DECISION_LOG_SIZE", "STORE_LOAD_KEY"]

logger = logging.getLogger(__name__)

#: decision records the proxy keeps (``GET /proxy/decisions``)
DECISION_LOG_SIZE = 4096
#: the ``kv_transfer_params`` key by which a request opts out of store loads (false)
STORE_LOAD_KEY = "mooncake_store_load"


@dataclass(frozen=True)
class ProxyConfig:
    """Proxy settings.

    Attributes:
        prefill: prefill instance base URLs.
        decode: decode instance base URLs.
        host: listen address (loopback by default).
        port: listen port (0: any free port).
        policy: instance-choice policy name.
        policy_options: keyword options of that policy (``global-cache``: reject, slo_ttft_s,
            slo_tbt_s, profile, block_tokens, kv_events, tokenize, store_master, store_dtype,
            store_model, store_tp, store_timeout_s).
        connect_timeout_s: TCP connect timeout to an instance.
        prefill_timeout_s: whole prefill answer.
        read_timeout_s: longest silence of a decode answer (per chunk when streaming).
        engine: what the instances run; an installed adapter must serve it.
        store_loads: False: every prefill request asks the instances' store connector for
            no store load (:data:`STORE_LOAD_KEY` false in its ``kv_transfer_params``).
    """

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "least-load"
    policy_options: tuple[tuple[str, Any], ...] = ()
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0
    read_timeout_s: float = 300.0
    engine: str = DEFAULT_ENGINE
    store_loads: bool = True


class UpstreamError(ProxyError):
    """An instance answered badly or not at all; carries the HTTP answer to give."""

    def __init__(self, status: int, message: str, kind: str = "upstream_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind

    def response(self) -> web.Response:
        return _error(self.status, self.message, self.kind)


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


def _prompt_of(body: dict[str, Any], chat: bool) -> tuple[Sequence[int] | str, int]:
    """(prompt key, token estimate) of a request body."""
    if chat:
        msgs = body.get("messages") or []
        text = "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
        return text, max(1, len(text) // 4)
    p = body.get("prompt", "")
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        return [int(t) for t in p], len(p)
    if isinstance(p, list):
        text = "".join(str(x) for x in p)
        return text, max(1, len(text) // 4)
    return str(p), max(1, len(str(p)) // 4)


class ProxyServer:
    """Runs the proxy's aiohttp application (see the module docstring).

    Args:
        config: the settings.
        policy: a ready policy (default: ``config.policy`` built with its options).
        engine: what the instances run (default: the adapter serving ``config.engine``;
            :class:`~mooncake_core.errors.ConfigError` when none does).
    """

    def __init__(
        self,
        config: ProxyConfig,
        policy: RoutingPolicy | None = None,
        engine: ProxyEngine | None = None,
    ) -> None:
        self.config = config
        self.engine = engine or proxy_engine(config.engine)
        self.prefill = [Instance(u.rstrip("/"), "prefill", i) for i, u in enumerate(config.prefill)]
        self.decode = [Instance(u.rstrip("/"), "decode", i) for i, u in enumerate(config.decode)]
        self.policy = policy or make_policy(
            config.policy, self.prefill, self.decode, **dict(config.policy_options)
        )
        self.policy.engine = self.engine
        self.tokenizer = (
            RemoteTokenizer(
                [i.url for i in self.prefill],
                timeout_s=config.connect_timeout_s,
                engine=self.engine,
            )
            if self.policy.wants_token_ids
            else None
        )
        self._ids = itertools.count(1)
        self._t0 = time.monotonic()
        #: recent decision records (``GET /proxy/decisions``), oldest first
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=DECISION_LOG_SIZE
        )
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.port = config.port
        self.stats: dict[str, float] = {"requests": 0, "errors": 0, "rejected": 0, "prefill_s": 0.0}
        self.app = web.Application(client_max_size=64 << 20)
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_post("/v1/chat/completions", self._chat)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/proxy/stats", self._stats)
        self.app.router.add_get("/proxy/decisions", self._decisions)
        self.metrics = ProxyMetrics(self.policy.name, [*self.prefill, *self.decode])
        self.app.router.add_get("/metrics", self.metrics.handler)
        self.app.on_cleanup.append(self._close_session)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Start the policy (KV-event sockets, store probe), then listen; returns the base URL."""
        await self.policy.start()
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        try:
            await site.start()
        except BaseException:
            await self.stop()
            raise
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        url = f"http://{self.config.host}:{self.port}"
        logger.info(
            "PD proxy on %s: prefill %s; decode %s; policy %s%s",
            url,
            ", ".join(i.url for i in self.prefill),
            ", ".join(i.url for i in self.decode),
            self.policy.name,
            "" if self.config.store_loads else "; store loads off",
        )
        return url

    async def stop(self) -> None:
        self.policy.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def run_in_thread(self) -> tuple[str, threading.Event]:
        """Serve from a daemon thread with its own event loop (demos, benchmarks).

        Returns the base URL and an event; set it to stop the proxy.
        """
        stop = threading.Event()
        ready: list[str] = []
        started = threading.Event()
        errors: list[BaseException] = []

        async def main() -> None:
            try:
                ready.append(await self.start())
            except BaseException as exc:
                errors.append(exc)
                started.set()
                return
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.1)
            await self.stop()

        threading.Thread(target=lambda: asyncio.run(main()), name="mc-proxy", daemon=True).start()
        started.wait(30)
        if errors:
            raise errors[0]
        if not ready:
            raise TimeoutError("the proxy did not start within 30 s")
        return ready[0], stop

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=self.config.connect_timeout_s,
                    sock_connect=self.config.connect_timeout_s,
                )
            )
        return self._session

    async def _close_session(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------------ small routes
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _stats(self, request: web.Request) -> web.Response:
        out: dict[str, Any] = {
            "policy": self.policy.name,
            "store_loads": self.config.store_loads,
            **self.stats,
            "prefill": [i.as_dict() for i in self.prefill],
            "decode": [i.as_dict() for i in self.decode],
            "policy_stats": self.policy.stats(),
        }
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer.stats()
        return web.json_response(out)

    async def _decisions(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return _error(400, "since must be a request number", "invalid_request_error")
        return web.json_response([r for r in self.decisions if r["rid"] > since])

    async def _models(self, request: web.Request) -> web.Response:
        inst = self.decode[0]
        try:
            async with self.session().get(
                inst.url + "/v1/models",
                timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout_s * 2),
            ) as r:
                return web.Response(
                    body=await r.read(), status=r.status, content_type="application/json"
                )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return _error(
                502,
                f"decode instance {inst.url} did not list its models: {exc!r}",
                "upstream_error",
            )

    # ------------------------------------------------------------------ main path
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions", chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions", chat=True)

    async def _handle(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        request["mc_t0"] = t0 = time.monotonic()  # TTFT and end-to-end latency start here
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.metrics.outcome("bad_request")
            return _error(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            self.metrics.outcome("bad_request")
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        key, n_tokens = _prompt_of(body, chat)
        if isinstance(key, str) and self.tokenizer is not None:
            ids = await self.tokenizer.token_ids(self.session(), body, chat)
            if ids is not None:
                key, n_tokens = ids, len(ids)
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        job = Job(next(self._ids), n_tokens, key, max_tokens)
        tag = body.get("user")
        job.log.update(
            rid=job.rid,
            t=round(t0 - self._t0, 4),
            tag=tag if isinstance(tag, str) and len(tag) <= 200 else None,
            tokens=n_tokens,
        )
        self.stats["requests"] += 1
        t_prep = time.monotonic()
        await self.policy.prepare(job)
        job.log["prepare_s"] = round(time.monotonic() - t_prep, 4)
        job.log["load"] = [i.tokens_in_flight for i in self.prefill]
        try:
            place = self.policy.choose(job)
        except RequestRejected as exc:
            self.stats["rejected"] += 1
            self.metrics.rejected()
            logger.info("request %d %s", job.rid, exc)
            job.log["rejected"] = str(exc)
            self._record(job)
            return _error(429, str(exc), "rate_limit_exceeded")
        job.log["prefill"] = place.prefill.index
        job.log["decode"] = place.decode.index
        self.metrics.routed_to(place.prefill.url, place.decode.url)
        ok = False
        stage = place.prefill
        try:
            params = await self._prefill(place.prefill, path, body, job)
            job.log["prefill_s"] = round(time.monotonic() - t0, 4)
            self.policy.prefill_done(job, place)
            stage = place.decode
            dbody = self.engine.decode_body(body, params)
            resp = await self._decode(
                request, place, path, dbody, job, stream=bool(body.get("stream"))
            )
            ok = True
            if not body.get("stream"):  # the whole answer is its first byte
                self.metrics.first_byte(time.monotonic() - t0)
                job.log["ttft_s"] = round(time.monotonic() - t0, 4)
            self.metrics.done(time.monotonic() - t0)
            self.metrics.outcome("ok")
            return resp
        except UpstreamError as exc:
            self.stats["errors"] += 1
            self.metrics.upstream_error(stage.role, stage.url, exc.status)
            self.metrics.outcome("upstream_error")
            logger.warning("request %d failed: %s", job.rid, exc.message)
            return exc.response()
        finally:
            self.policy.finished(job, place, ok)
            job.log["ok"] = ok
            self._record(job)

    def _record(self, job: Job) -> None:
        """Keep the request's decision record (and log it at DEBUG)."""
        self.decisions.append(job.log)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("decision %s", json.dumps(job.log, default=str))

    @staticmethod
    def _route_headers(place: Placement) -> dict[str, str]:
        """Where the request ran (operators' debugging; tests of the routing policies)."""
        return {
            **place.headers,
            "X-Mooncake-Prefill": place.prefill.url,
            "X-Mooncake-Decode": place.decode.url,
        }

    async def _prefill(
        self, inst: Instance, path: str, body: dict[str, Any], job: Job
    ) -> dict[str, Any]:
        pbody = self.engine.prefill_body(body)
        if not self.config.store_loads:
            params = pbody.get("kv_transfer_params")
            params = dict(params) if isinstance(params, dict) else {}
            pbody["kv_transfer_params"] = {**params, STORE_LOAD_KEY: False}
        t0 = time.monotonic()
        inst.in_flight += 1
        inst.tokens_in_flight += job.prompt_tokens
        try:
            timeout = aiohttp.ClientTimeout(
                total=self.config.prefill_timeout_s, connect=self.config.connect_timeout_s
            )
            async with self.session().post(inst.url + path, json=pbody, timeout=timeout) as r:
                raw = await r.read()
                if r.status != 200:
                    inst.errors += 1
                    raise UpstreamError(
                        r.status if 400 <= r.status < 500 else 502,
                        f"prefill instance {inst.url} answered {r.status}: {_snippet(raw)}",
                    )
            try:
                answer = json.loads(raw)
            except ValueError:
                inst.errors += 1
                raise UpstreamError(
                    502, f"prefill instance {inst.url} answered with invalid JSON: {_snippet(raw)}"
                ) from None
        except asyncio.TimeoutError:
            inst.errors += 1
            raise UpstreamError(
                504,
                f"prefill instance {inst.url} did not answer within "
                f"{self.config.prefill_timeout_s:.0f} s",
                "timeout",
            ) from None
        except aiohttp.ClientError as exc:
            inst.errors += 1
            raise UpstreamError(502, f"prefill instance {inst.url} unreachable: {exc}") from None
        finally:
            inst.in_flight -= 1
            inst.tokens_in_flight -= job.prompt_tokens
        self.stats["prefill_s"] += time.monotonic() - t0
        self.metrics.prefill.labels(inst.url).observe(time.monotonic() - t0)
        params = self.engine.handoff(answer)
        if not isinstance(params, dict):
            inst.errors += 1
            raise UpstreamError(502, f"prefill instance {inst.url} {self.engine.missing_handoff}")
        inst.served += 1
        return params

    async def _decode(
        self,
        request: web.Request,
        place: Placement,
        path: str,
        body: dict[str, Any],
        job: Job,
        stream: bool,
    ) -> web.StreamResponse:
        inst = place.decode
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.config.connect_timeout_s, sock_read=self.config.read_timeout_s
        )
        inst.in_flight += 1
        inst.tokens_in_flight += job.prompt_tokens
        out: web.StreamResponse | None = None
        try:
            async with self.session().post(inst.url + path, json=body, timeout=timeout) as r:
                if r.status != 200 or not stream:
                    raw = await r.read()
                    if r.status != 200:
                        inst.errors += 1
                        raise UpstreamError(
                            r.status if 400 <= r.status < 500 else 502,
                            f"decode instance {inst.url} answered {r.status}: {_snippet(raw)}",
                        )
                    inst.served += 1
                    return web.Response(
                        body=raw,
                        status=200,
                        content_type="application/json",
                        headers=self._route_headers(place),
                    )
                out = web.StreamResponse(
                    status=200,
                    headers={
                        "Content-Type": "text/event-stream",
                        "Cache-Control": "no-cache",
                        **self._route_headers(place),
                    },
                )
                await out.prepare(request)
                t_first = request.get("mc_t0")
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                    if t_first is not None:  # time to first token, as the client sees it
                        self.metrics.first_byte(time.monotonic() - t_first)
                        job.log["ttft_s"] = round(time.monotonic() - t_first, 4)
                        t_first = None
                await out.write_eof()
                inst.served += 1
                return out
        except asyncio.TimeoutError:
            inst.errors += 1
            msg = f"decode instance {inst.url} was silent for {self.config.read_timeout_s:.0f} s"
            if out is None:
                raise UpstreamError(504, msg, "timeout") from None
            return await _end_stream(out, msg)
        except aiohttp.ClientError as exc:
            inst.errors += 1
            msg = f"decode instance {inst.url} failed: {exc}"
            if out is None:
                raise UpstreamError(502, msg) from None
            return await _end_stream(out, msg)
        finally:
            inst.in_flight -= 1
            inst.tokens_in_flight -= job.prompt_tokens


async def _end_stream(out: web.StreamResponse, message: str) -> web.StreamResponse:
    """Close a started SSE stream with an error event (the status line is already sent)."""
    logger.warning("stream broken: %s", message)
    event = json.dumps({"error": {"message": message, "type": "upstream_error", "code": 502}})
    try:
        await out.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
        await out.write_eof()
    except (ConnectionError, RuntimeError):
        pass
    return out


def _snippet(raw: bytes, n: int = 300) -> str:
    text = raw.decode(errors="replace").strip()
    return text if len(text) <= n else text[:n] + "..."
