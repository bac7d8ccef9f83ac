"""``mooncake-core master``: run a store master (RPC + HTTP metrics/metadata), optionally HA.

Flags mirror ``mooncake_master`` where they exist (``--rpc-port 50051``,
``--http-port 9003`` = metrics port, ``--default-kv-lease-ttl``, watermarks, ...); the
rest comes from the ``store`` section of mooncake.json / ``MOONCAKE_STORE_*``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal

from mooncake_core.config import load_config
from mooncake_core.store.master import MasterServer, install_uvloop

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="mooncake.json (default $MOONCAKE_CONFIG_PATH)")
    parser.add_argument(
        "--rpc-address", "--host", dest="host", default="127.0.0.1", help="RPC listen address"
    )
    parser.add_argument(
        "--rpc-port", "--port", dest="rpc_port", type=int, default=50051, help="RPC port (0 = any)"
    )
    parser.add_argument(
        "--http-host", default=None, help="HTTP listen address (default: the RPC address)"
    )
    parser.add_argument(
        "--http-port",
        "--metrics-port",
        dest="http_port",
        type=int,
        default=9003,
        help="HTTP port for /metrics, /health, /query_key and /metadata (0 = any, -1 = off)",
    )
    parser.add_argument("--no-metadata-server", action="store_true", help="do not serve /metadata")
    parser.add_argument(
        "--advertise", default="", help="RPC address clients should use (HA; default host:port)"
    )
    parser.add_argument(
        "--ha",
        "--etcd",
        dest="ha_url",
        default=None,
        help="etcd://host:port: run with leader election and the replicated oplog",
    )
    parser.add_argument("--cluster-id", default="default", help="HA namespace in etcd")
    parser.add_argument(
        "--ha-lease-ttl", type=float, default=2.0, help="leader lease in seconds (failover time)"
    )
    parser.add_argument(
        "--ha-snapshot-every",
        type=int,
        default=2000,
        help="compact the oplog into a snapshot every N batches",
    )
    parser.add_argument(
        "--default-kv-lease-ttl",
        dest="lease_ttl",
        type=float,
        default=None,
        help="read lease in seconds (default store.lease_ttl_s, 10)",
    )
    parser.add_argument("--eviction-high-watermark", type=float, default=None)
    parser.add_argument("--eviction-ratio", type=float, default=None)
    parser.add_argument(
        "--client-ttl",
        type=float,
        default=None,
        help="seconds without heartbeat before a client is dropped",
    )
    parser.add_argument(
        "--put-timeout",
        type=float,
        default=None,
        help="seconds before an unfinished put is reclaimed",
    )
    parser.add_argument(
        "--max-objects",
        type=int,
        default=None,
        help="most objects the master tracks; more puts evict LRU objects (default 2,000,000)",
    )
    parser.add_argument(
        "--placement", choices=["random", "free-ratio-first", "local-first"], default=None
    )
    parser.add_argument(
        "--ready-file", default=None, help="write {rpc_port, http_port, pid} here once listening"
    )


def run(args: argparse.Namespace) -> int:
    store: dict[str, object] = {}
    for flag, key in (
        ("lease_ttl", "lease_ttl_s"),
        ("eviction_high_watermark", "eviction_high_watermark"),
        ("eviction_ratio", "eviction_ratio"),
        ("client_ttl", "client_ttl_s"),
        ("put_timeout", "put_timeout_s"),
        ("placement", "placement"),
        ("max_objects", "max_objects"),
    ):
        v = getattr(args, flag)
        if v is not None:
            store[key] = v
    cfg = load_config(args.config, store=store or None)
    install_uvloop()
    server = MasterServer(
        cfg.store,
        host=args.host,
        rpc_port=args.rpc_port,
        http_host=args.http_host or args.host,
        http_port=args.http_port,
        ha_url=args.ha_url,
        cluster_id=args.cluster_id,
        advertise=args.advertise,
        serve_metadata=not args.no_metadata_server,
        ha_lease_ttl_s=args.ha_lease_ttl,
        snapshot_every=args.ha_snapshot_every,
    )

    async def main() -> None:
        await server.start()
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(
                    {
                        "rpc_port": server.rpc_port,
                        "http_port": server.http_port,
                        "pid": os.getpid(),
                        "id": server.id,
                    },
                    f,
                )
            os.replace(tmp, args.ready_file)
        loop = asyncio.get_running_loop()
        assert server._stopped is not None
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, server._stopped.set)
        try:
            await server._stopped.wait()
        finally:
            await server.stop()

    asyncio.run(main())
    return 0 if server.role != "deposed" else 3
