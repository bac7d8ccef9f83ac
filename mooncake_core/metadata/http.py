"""HTTP metadata: a client, and the embedded server (``mooncake-core metadata-server``).

Protocol (Mooncake's): ``GET|PUT|DELETE <url>?key=<key>``; GET answers 404 for an
unknown key. The server is an aiohttp application that other asyncio services (the
store master) can embed with :func:`add_metadata_routes`; :class:`MetadataServer` runs
it in a background thread for synchronous callers.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import threading
import urllib.parse
from typing import Any

from aiohttp import web

from mooncake_core.config import MooncakeConfig
from mooncake_core.errors import ConfigError, MetadataError
from mooncake_core.metadata.base import KVMetadataBackend
from mooncake_core.plugins import MetadataBackendInfo, hookimpl

__all__ = ["HTTPMetadata", "MetadataServer", "add_metadata_routes", "MAX_VALUE"]

logger = logging.getLogger(__name__)
MAX_VALUE = 16 << 20
MAX_KEY = 4096


class HTTPMetadata(KVMetadataBackend):
    """Client of an HTTP metadata server (keep-alive connection per thread)."""

    scheme = "http"

    def __init__(self, url: str, prefix: str = "mooncake", timeout: float = 5.0) -> None:
        super().__init__(prefix)
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"metadata_server: {url!r} is not an http(s)://host:port/path URL")
        self.url = url
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.path = u.path or "/metadata"
        self.https = u.scheme == "https"
        self.timeout = timeout
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            c = cls(self.host, self.port, timeout=self.timeout)
            self._local.conn = c
        return c

    def _call(self, method: str, key: str, body: bytes | None = None) -> tuple[int, bytes]:
        target = f"{self.path}?key={urllib.parse.quote(key, safe='')}"
        for attempt in range(2):
            conn = self._conn()
            try:
                conn.request(method, target, body=body)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                self._local.conn = None
                if attempt:
                    raise MetadataError(f"metadata server {self.url} unreachable: {exc}") from exc
        raise AssertionError("unreachable")

    def get(self, key: str) -> bytes | None:
        status, body = self._call("GET", key)
        if status == 404:
            return None
        if status != 200:
            raise MetadataError(
                f"metadata server {self.url}: GET {key!r} answered {status}: {body[:200]!r}"
            )
        return body

    def put(self, key: str, value: bytes) -> None:
        status, body = self._call("PUT", key, value)
        if status != 200:
            raise MetadataError(
                f"metadata server {self.url}: PUT {key!r} answered {status}: {body[:200]!r}"
            )

    def delete(self, key: str) -> None:
        status, body = self._call("DELETE", key)
        if status not in (200, 404):
            raise MetadataError(
                f"metadata server {self.url}: DELETE {key!r} answered {status}: {body[:200]!r}"
            )

    def close(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()


def add_metadata_routes(
    app: web.Application, path: str = "/metadata", store: dict[str, bytes] | None = None
) -> dict[str, bytes]:
    """Serve the metadata protocol on ``app`` at ``path``; returns the backing dict."""
    kv: dict[str, bytes] = {} if store is None else store

    def _key(request: web.Request) -> str:
        key = request.query.get("key", "")
        if not key:
            raise web.HTTPBadRequest(text="missing ?key= parameter\n")
        if len(key) > MAX_KEY:
            raise web.HTTPBadRequest(text=f"key longer than {MAX_KEY} bytes\n")
        return key

    async def get(request: web.Request) -> web.Response:
        key = _key(request)
        if key not in kv:
            raise web.HTTPNotFound(text=f"no metadata for key {key!r}\n")
        return web.Response(body=kv[key], content_type="application/json")

    async def put(request: web.Request) -> web.Response:
        key = _key(request)
        if request.content_length is not None and request.content_length > MAX_VALUE:
            raise web.HTTPRequestEntityTooLarge(
                max_size=MAX_VALUE, actual_size=request.content_length
            )
        kv[key] = await request.read()
        return web.Response(text="metadata updated\n")

    async def delete(request: web.Request) -> web.Response:
        key = _key(request)
        if kv.pop(key, None) is None:
            raise web.HTTPNotFound(text=f"no metadata for key {key!r}\n")
        return web.Response(text="metadata deleted\n")

    app.router.add_get(path, get)
    app.router.add_put(path, put)
    app.router.add_delete(path, delete)
    return kv


class MetadataServer:
    """The HTTP metadata server in a background thread (``with MetadataServer() as s: s.url``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.store: dict[str, bytes] = {}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metadata"

    def start(self) -> MetadataServer:
        ready = threading.Event()
        err: list[BaseException] = []

        async def boot() -> None:
            app = web.Application(client_max_size=MAX_VALUE)
            add_metadata_routes(app, store=self.store)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port)
            await site.start()
            server: Any = site._server
            self.port = server.sockets[0].getsockname()[1]

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(boot())
            except BaseException as exc:  # reported to start()
                err.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            if self._runner is not None:
                loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=main, name="mc-metadata-http", daemon=True)
        self._thread.start()
        ready.wait()
        if err:
            raise err[0]
        logger.info("HTTP metadata server on %s", self.url)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> MetadataServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _factory(url: str, config: MooncakeConfig) -> KVMetadataBackend:
    return HTTPMetadata(url, prefix=config.metadata.prefix)


@hookimpl
def mooncake_metadata_backends() -> list[MetadataBackendInfo]:
    return [
        MetadataBackendInfo(
            "http",
            ("http://", "https://"),
            _factory,
            "HTTP metadata server (mooncake-core metadata-server, or the master's)",
        )
    ]
