"""``mooncake-core metadata-server``: the HTTP metadata server (GET/PUT/DELETE ?key=)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from aiohttp import web

from mooncake_core.metadata.http import MAX_VALUE, add_metadata_routes

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)"
    )
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--path", default="/metadata", help="URL path (default /metadata)")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"mooncake-core: error: --port must be 0..65535, got {args.port}")
    app = web.Application(client_max_size=MAX_VALUE)
    add_metadata_routes(app, args.path)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app.router.add_get("/health", health)
    asyncio.run(_serve(app, args.host, args.port, args.path))
    return 0


async def _serve(app: web.Application, host: str, port: int, path: str) -> None:
    """Bind (a port in use fails here, before anything is logged), then serve until a signal."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        logger.info("metadata server on http://%s:%d%s", host, port, path)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
