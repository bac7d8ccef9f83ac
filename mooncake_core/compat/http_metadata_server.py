"""``mooncake.http_metadata_server`` drop-in: the published HTTP metadata server class.

``KVBootstrapServer(port, host)`` serves the Mooncake HTTP metadata protocol at
``/metadata?key=K`` (GET, PUT, DELETE) from a background thread: ``run()`` starts it,
``poll()`` says ``KVPoll.Success`` while it runs (``Failed`` before ``run()`` and after it
stopped), ``close()`` stops it. Status codes as the published server: 400 without a key,
404 for a missing key, 400 for a second PUT of an ``rpc_meta`` key, 405 for other methods.

Differs on purpose: ``host`` defaults to ``127.0.0.1`` (ours binds loopback by default; the
published binds ``0.0.0.0``). The metadata server our master embeds is
:class:`mooncake_core.metadata.http.MetadataServer`; this class exists for code written
against the published module.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import logging
import signal
import threading
import time
from typing import Any

from aiohttp import web

__all__ = ["KVBootstrapServer", "KVPoll", "main", "parse_args"]

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"


class KVPoll(enum.Enum):
    """Server state as ``poll()`` reports it (the published values)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


def _reply(text: str, status: int) -> web.Response:
    return web.Response(text=text, status=status, content_type="application/json")


class KVBootstrapServer:
    """The metadata protocol over HTTP, in a background thread (published API)."""

    def __init__(self, port: int, host: str = DEFAULT_HOST) -> None:
        self.port = port
        self.host = host
        self.store: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.app = web.Application()
        self.app.router.add_route("*", "/metadata", self._handle)
        self.thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        key = request.query.get("key", "").strip()
        if not key:
            return _reply("metadata key is required", 400)
        if request.method == "GET":
            with self.lock:
                value = self.store.get(key)
            if value is None:
                return _reply("metadata not found", 404)
            return web.Response(body=value, content_type="application/json")
        if request.method == "PUT":
            data = await request.read()
            with self.lock:
                if "rpc_meta" in key and key in self.store:
                    return _reply("Duplicate rpc_meta key not allowed", 400)
                self.store[key] = data
            return _reply("metadata updated", 200)
        if request.method == "DELETE":
            with self.lock:
                found = self.store.pop(key, None) is not None
            return _reply("metadata deleted", 200) if found else _reply("metadata not found", 404)
        return _reply("Method not allowed", 405)

    def run(self) -> threading.Thread:
        """Start serving in a daemon thread (returned). A bind failure is logged and
        ``poll()`` then reports ``KVPoll.Failed``."""
        self.thread = threading.Thread(target=self._serve, name="mc-kv-bootstrap", daemon=True)
        self.thread.start()
        logger.info("HTTP metadata server starting on %s:%d", self.host, self.port)
        return self.thread

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        runner = web.AppRunner(self.app, access_log=None)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, self.host, self.port).start())
            loop.run_forever()
        except OSError as exc:
            logger.error("HTTP metadata server on %s:%d: %s", self.host, self.port, exc)
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def close(self) -> None:
        """Stop the server and wait (up to 2 s) for its thread."""
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        if self.thread is not None and self.thread.is_alive():
            self.thread.join(timeout=2)

    def poll(self) -> KVPoll:
        """``KVPoll.Success`` while the server thread runs, else ``KVPoll.Failed``."""
        if self.thread is None or not self.thread.is_alive():
            return KVPoll.Failed
        return KVPoll.Success


def parse_args() -> argparse.Namespace:
    """The command line (``sys.argv``): ``--port`` (8080), ``--host`` (127.0.0.1),
    ``--log-level`` (INFO)."""
    parser = argparse.ArgumentParser(
        description="HTTP metadata server for Mooncake",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to bind")
    parser.add_argument(
        "--log-level",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        default="INFO",
        help="logging level",
    )
    return parser.parse_args()


def main() -> int:
    """Run the server until SIGINT/SIGTERM; 1 if it could not start."""
    args = parse_args()
    logging.basicConfig(level=getattr(logging, args.log_level))
    server = KVBootstrapServer(args.port, args.host)
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    server.run()
    time.sleep(0.2)
    if server.poll() is not KVPoll.Success:
        logger.error("the HTTP metadata server did not start on %s:%d", args.host, args.port)
        return 1
    while not stop.wait(0.5):
        if server.poll() is not KVPoll.Success:
            return 1
    server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
