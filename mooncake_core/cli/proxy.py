"""``mooncake-core proxy``: OpenAI-compatible prefill/decode proxy in front of vLLM.

Example::

    mooncake-core proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from mooncake_core.proxy import POLICIES, ProxyConfig, ProxyServer

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                   help="prefill instance base URL(s) (vLLM with kv_role kv_producer)")
    p.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                   help="decode instance base URL(s) (vLLM with kv_role kv_consumer)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000; 0 = any)")
    p.add_argument("--policy", default="least-load", choices=sorted(POLICIES), help="instance choice (default least-load)")
    p.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds to wait for a prefill answer")
    p.add_argument("--read-timeout", type=float, default=300.0, help="longest silence of a decode answer, seconds")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="connect timeout to an instance, seconds")


async def _serve(cfg: ProxyConfig) -> None:
    server = ProxyServer(cfg)
    url = await server.start()
    print(f"proxy listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop()


def run(args: argparse.Namespace) -> int:
    cfg = ProxyConfig(prefill=tuple(args.prefill), decode=tuple(args.decode), host=args.host, port=args.port,
                      policy=args.policy, connect_timeout_s=args.connect_timeout,
                      prefill_timeout_s=args.prefill_timeout, read_timeout_s=args.read_timeout)
    asyncio.run(_serve(cfg))
    return 0
