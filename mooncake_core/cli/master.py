"""``mooncake-core master``: run a store master (RPC + HTTP metrics/metadata), optionally HA.

Two spellings of the same options:

- ours, dashed (``--rpc-port 50051``, ``--http-port 9003`` = metrics port,
  ``--default-kv-lease-ttl`` in seconds, ...); the rest comes from the ``store`` section of
  mooncake.json / ``MOONCAKE_STORE_*``;
- the published ``mooncake_master`` command line, unchanged (gflags spellings, units and
  defaults: ``--rpc_port=50051 --enable_http_metadata_server --http_metadata_server_port
  8080 --default_kv_lease_ttl=5s``, ``--config_path master.json``, ``--flagfile``, ...;
  the table is :data:`mooncake_core.cli.gflags.MASTER_FLAGS`). A published flag of a
  feature we lack is refused with one line naming it; a tuning flag with no effect here
  is accepted with one warning line.

With published spellings (or through the ``mooncake_master`` console script) the
published defaults apply: no HTTP metadata server unless ``--enable_http_metadata_server``
(then on its own port, 8080 by default, not on the metrics port), ``--client_ttl`` 10 s,
``--allocation_strategy random``, ``--cluster_id mooncake_cluster``. One difference on
purpose: every server binds loopback unless an address is given (the published master
binds 0.0.0.0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mooncake_core import __version__
from mooncake_core.cli import gflags
from mooncake_core.config import load_config, parse_size
from mooncake_core.errors import ConfigError
from mooncake_core.store.master import MasterServer, install_uvloop

__all__ = [
    "add_arguments",
    "run",
    "resolve_published",
    "published_from_args",
    "Published",
    "published_main",
]

logger = logging.getLogger(__name__)

VERSION = f"mooncake_master (mooncake-core {__version__}; published flags of Mooncake 0.3.13)"

_WILDCARD = {"0.0.0.0", "::", ""}
_STRATEGIES = {
    "random": "random",
    "free_ratio_first": "free-ratio-first",
    "local_first": "local-first",
}
#: other published spellings of config-file keys
_FILE_ALIASES = {"client_live_ttl_sec": "client_ttl"}
_GLOG_LEVELS = {0: "INFO", 1: "WARNING", 2: "ERROR", 3: "CRITICAL"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s [options] (ours dashed, or the published mooncake_master flags)"
    parser.add_argument("--config", help="mooncake.json (default $MOONCAKE_CONFIG_PATH)")
    parser.add_argument(
        "--rpc-address", "--host", dest="host", default=None, help="RPC listen address"
    )
    parser.add_argument(
        "--rpc-port", "--port", dest="rpc_port", type=int, default=None, help="RPC port (0 = any)"
    )
    parser.add_argument(
        "--http-host", default=None, help="HTTP listen address (default: the RPC address)"
    )
    parser.add_argument(
        "--http-port",
        "--metrics-port",
        dest="http_port",
        type=int,
        default=None,
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
    parser.add_argument("--cluster-id", default=None, help="HA namespace in etcd")
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
        "--ha-takeover-lease",
        type=float,
        default=None,
        metavar="S",
        help="lease every object gets when this master takes over, on top of the replicated "
        "leases (default: the read lease)",
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
    hot = parser.add_argument_group(
        "hot keys", "extra memory replicas of often-read keys (docs/store.md; store.hot_key_*)"
    )
    hot.add_argument(
        "--hot-key-replicas",
        type=_count_arg,
        default=None,
        metavar="N",
        help="most memory replicas of a hot key, the first included (0 or 1: off; default 0)",
    )
    hot.add_argument(
        "--hot-key-reads",
        type=_positive(int),
        default=None,
        metavar="N",
        help="reads within the window that make a key hot (64)",
    )
    hot.add_argument(
        "--hot-key-window",
        type=_positive(float),
        default=None,
        metavar="S",
        help="the window of the read counts in seconds (2)",
    )
    hot.add_argument(
        "--hot-key-max-bytes",
        type=_size_arg,
        default=None,
        metavar="SIZE",
        help="all extra hot-key replicas together (256MiB)",
    )
    parser.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish KV events of stored/evicted/removed objects on this ZMQ endpoint "
        "(tcp://127.0.0.1:5557; vLLM's event format)",
    )
    parser.add_argument(
        "--kv-events-queue",
        type=int,
        default=None,
        help="most KV events waiting to be sent; the oldest are dropped beyond (65536)",
    )
    parser.add_argument(
        "--tenant-quota",
        action="append",
        default=[],
        metavar="NAME=SIZE",
        help="byte quota of a tenant (64MB; NAME=SIZE:refuse refuses puts over it instead of "
        "evicting the tenant's own LRU objects; NAME * = every other tenant); repeatable",
    )
    parser.add_argument(
        "--tenant-quotas",
        default=None,
        metavar="FILE",
        help='tenant quotas from a JSON file {"NAME": "64MB", ...}',
    )
    parser.add_argument(
        "--snapshot-dir",
        default=None,
        metavar="DIR",
        help="write metadata snapshots here and restore the newest at start (no HA)",
    )
    parser.add_argument(
        "--snapshot-interval",
        type=float,
        default=None,
        help="seconds between snapshots (600; with --ha: into etcd, when the oplog grew)",
    )
    parser.add_argument("--snapshot-retention", type=int, default=None, help="snapshots kept (2)")
    parser.add_argument(
        "--no-snapshot-restore", action="store_true", help="with --snapshot-dir: start empty"
    )
    parser.add_argument(
        "--ready-file",
        default=None,
        help="write {rpc_port, http_port, metadata_port, pid} here once listening",
    )
    parser.add_argument(
        "--published-defaults",
        action="store_true",
        help=argparse.SUPPRESS,  # set by the mooncake_master console script
    )
    gflags.add_gflags(parser, gflags.MASTER_FLAGS, VERSION)


def _count_arg(value: str) -> int:
    """An argparse type: an integer >= 0."""
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return n


def _positive(kind: type[int] | type[float]) -> Any:
    """An argparse type: a number (``kind``) > 0."""

    def parse(value: str) -> int | float:
        x = kind(value)
        if not x > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {value}")
        return x

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value" errors
    return parse


def _size_arg(value: str) -> int:
    """An argparse type: ``256MiB`` / ``1048576`` in bytes (a bad value: one line naming it)."""
    try:
        return parse_size(value, "size")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass
class Published:
    """What a published ``mooncake_master`` command line asks for, in our terms.

    ``None`` means "not given": the caller's (dashed or default) value stands.
    """

    host: str | None = None
    rpc_port: int | None = None
    http_host: str | None = None
    http_port: int | None = None
    metadata: bool = False
    metadata_host: str | None = None
    metadata_port: int = 8080
    ha_url: str | None = None
    cluster_id: str | None = None
    store: dict[str, Any] = field(default_factory=dict)
    kv_events_endpoint: str = ""
    kv_events_queue: int | None = None
    kv_events_backend_id: str = ""
    tenant_quota_file: str = ""
    snapshot_dir: str = ""
    snapshot_interval_s: float | None = None
    snapshot_retention: int | None = None
    snapshot_restore: bool = False
    log_level: str | None = None
    warnings: list[str] = field(default_factory=list)


def _interface_address(name: str) -> str:
    from mooncake_core.transfer.topology import interface_ipv4

    ip = interface_ipv4(name)
    if not ip:
        raise ConfigError(f"--rpc_interface: interface {name!r} has no IPv4 address")
    return ip


def resolve_published(
    given: Mapping[str, str], config_path_values: Mapping[str, Any] | None = None
) -> Published:
    """Turn published flags into our settings (command line over the ``--config_path`` file).

    Args:
        given: flag name -> raw value, from the command line (and flagfiles, env).
        config_path_values: flag name -> value from the published master.json.

    Raises:
        ConfigError: a bad value, or a flag of a feature we lack; one line naming the flag.
    """
    flags = {f.name: f for f in gflags.MASTER_FLAGS}
    raw: dict[str, Any] = dict(config_path_values or {})
    raw.update(given)
    values: dict[str, Any] = {}
    for name, value in raw.items():
        flag = flags[name]
        values[name] = gflags.parse_value(flag, value)
    out = Published()
    for name, value in values.items():
        flag = flags[name]
        default = gflags.parse_value(flag, flag.default)
        if flag.kind == "off" and value != default:
            raise ConfigError(
                f"--{name}={raw[name]}: not supported by mooncake-core ({flag.note}); "
                f"remove it or leave it at {flag.default!r}"
            )
        if flag.kind == "noop" and value != default:
            out.warnings.append(
                f"--{name}: accepted for compatibility, no effect here ({flag.note})"
            )
    v = values.get
    if v("rpc_interface"):
        out.host = _interface_address(str(v("rpc_interface")))
    elif "rpc_address" in values:
        out.host = str(v("rpc_address"))
    rpc_port = v("rpc_port", 0) or v("port")
    if rpc_port is not None:
        if not 0 < int(rpc_port) <= 65535:
            raise ConfigError(f"--rpc_port: must be 1..65535, got {rpc_port}")
        out.rpc_port = int(rpc_port)
    if "metrics_port" in values:
        out.http_port = int(values["metrics_port"])
    if "metrics_host" in values:
        out.http_host = str(values["metrics_host"])
    out.metadata = bool(v("enable_http_metadata_server", False))
    if "http_metadata_server_host" in values:
        out.metadata_host = str(values["http_metadata_server_host"])
    out.metadata_port = int(v("http_metadata_server_port", 8080))
    for port_flag in ("metrics_port", "http_metadata_server_port"):
        if port_flag in values and not 0 <= int(values[port_flag]) <= 65535:
            raise ConfigError(f"--{port_flag}: must be 0..65535, got {values[port_flag]}")
    if "cluster_id" in values:
        out.cluster_id = str(values["cluster_id"])
    backend = str(v("ha_backend_type", "etcd")).lower()
    endpoints = str(v("ha_backend_connstring", "") or v("etcd_endpoints", "") or "")
    if v("enable_ha", False):
        if backend != "etcd":
            raise ConfigError(
                f"--ha_backend_type={backend}: not supported by mooncake-core (etcd only)"
            )
        items = [e.strip() for e in endpoints.replace(",", ";").split(";") if e.strip()]
        if not items:
            raise ConfigError("--enable_ha: needs --etcd_endpoints (host:port;host:port)")
        items = [e[len("etcd://") :] if e.startswith("etcd://") else e for e in items]
        out.ha_url = "etcd://" + ",".join(items)
    elif endpoints:
        out.warnings.append("--etcd_endpoints: no effect without --enable_ha")
    store: dict[str, Any] = {}
    if "default_kv_lease_ttl" in values:
        store["lease_ttl_s"] = float(values["default_kv_lease_ttl"]) / 1000.0
    if "eviction_high_watermark_ratio" in values:
        store["eviction_high_watermark"] = values["eviction_high_watermark_ratio"]
    if "eviction_ratio" in values:
        store["eviction_ratio"] = values["eviction_ratio"]
    if "client_ttl" in values:
        if values["client_ttl"] <= 0:
            raise ConfigError(f"--client_ttl: must be positive, got {values['client_ttl']}")
        store["client_ttl_s"] = float(values["client_ttl"])
    if "put_start_discard_timeout_sec" in values:
        store["put_timeout_s"] = float(values["put_start_discard_timeout_sec"])
    if "allocation_strategy" in values:
        strategy = str(values["allocation_strategy"])
        if strategy not in _STRATEGIES:
            raise ConfigError(
                f"--allocation_strategy={strategy}: not supported by mooncake-core "
                f"(use one of {', '.join(sorted(_STRATEGIES))})"
            )
        store["placement"] = _STRATEGIES[strategy]
    out.store = store
    if v("enable_kv_events", False):
        # published default binds every interface; ours loopback unless an address is given
        out.kv_events_endpoint = str(v("kv_events_bind_endpoint", "") or "tcp://127.0.0.1:5557")
    elif v("kv_events_bind_endpoint", ""):
        out.warnings.append("--kv_events_bind_endpoint: no effect without --enable_kv_events")
    if "kv_events_queue_capacity" in values:
        out.kv_events_queue = int(values["kv_events_queue_capacity"])
    out.kv_events_backend_id = str(v("kv_events_backend_id", "") or "")
    if v("enable_snapshot", False):
        out.snapshot_dir = str(v("snapshot_backup_dir", "") or "")
        if not out.snapshot_dir:
            raise ConfigError(
                "--enable_snapshot: needs --snapshot_backup_dir=DIR (mooncake-core writes local "
                "snapshot files only)"
            )
        out.snapshot_restore = bool(v("enable_snapshot_restore", False))
    if "snapshot_interval_seconds" in values:
        out.snapshot_interval_s = float(values["snapshot_interval_seconds"])
    if "snapshot_retention_count" in values:
        out.snapshot_retention = int(values["snapshot_retention_count"])
    if v("enable_multi_tenants", False):
        kind = str(v("tenant_quota_connector_type", "file") or "file")
        if kind != "file":
            raise ConfigError(
                f"--tenant_quota_connector_type={kind}: not supported by mooncake-core (file only)"
            )
        out.tenant_quota_file = str(v("tenant_quota_connector_uri", "") or "")
        if out.tenant_quota_file.startswith("file://"):
            out.tenant_quota_file = out.tenant_quota_file[len("file://") :]
    if "minloglevel" in values:
        out.log_level = _GLOG_LEVELS.get(min(max(int(values["minloglevel"]), 0), 3), "INFO")
    if int(v("v", 0) or 0) > 0:
        out.log_level = "DEBUG"
    return out


def published_from_args(args: argparse.Namespace) -> tuple[Published, bool]:
    """The published flags of ``args`` resolved, and whether published defaults apply."""
    given = gflags.given_flags(args)
    expanded: dict[str, str] = {}
    for name, value in given.items():
        if name in ("fromenv", "tryfromenv"):
            for n, val in gflags.from_env(value, required=name == "fromenv"):
                expanded[n] = val
        else:
            expanded[name] = value
    path = expanded.get("config_path", "")
    file_values = gflags.read_config_file(path, _FILE_ALIASES) if path else {}
    file_values.pop("config_path", None)
    published = resolve_published(expanded, file_values)
    return published, bool(given) or bool(args.published_defaults)


def run(args: argparse.Namespace) -> int:
    pub, published_mode = published_from_args(args)
    for line in pub.warnings:
        logger.warning("%s", line)
    if pub.log_level:
        logging.getLogger().setLevel(pub.log_level)
    store: dict[str, object] = {}
    for flag, key in (
        ("lease_ttl", "lease_ttl_s"),
        ("eviction_high_watermark", "eviction_high_watermark"),
        ("eviction_ratio", "eviction_ratio"),
        ("client_ttl", "client_ttl_s"),
        ("put_timeout", "put_timeout_s"),
        ("placement", "placement"),
        ("max_objects", "max_objects"),
        ("hot_key_replicas", "hot_key_replicas"),
        ("hot_key_reads", "hot_key_reads"),
        ("hot_key_window", "hot_key_window_s"),
        ("hot_key_max_bytes", "hot_key_max_bytes"),
    ):
        v = getattr(args, flag)
        if v is not None:
            store[key] = v
    store = {**pub.store, **store}
    # published defaults sit below the environment and mooncake.json, above ours
    defaults = {"store": {"client_ttl_s": 10.0, "placement": "random"}} if published_mode else None
    cfg = load_config(args.config, defaults=defaults, store=store or None)
    host = args.host or pub.host or "127.0.0.1"
    rpc_port = args.rpc_port if args.rpc_port is not None else (pub.rpc_port or 50051)
    http_port = args.http_port if args.http_port is not None else pub.http_port
    http_host = args.http_host or pub.http_host or host
    # published: metadata only with --enable_http_metadata_server, on its own port
    separate_metadata = pub.metadata
    serve_metadata = not args.no_metadata_server and not published_mode
    cluster_id = args.cluster_id or pub.cluster_id
    if cluster_id is None:
        cluster_id = "mooncake_cluster" if published_mode else "default"
    if (pub.ha_url or args.ha_url) and host in _WILDCARD and not args.advertise:
        logger.warning("HA with a wildcard RPC address: set --rpc_address to this host's address")
    from mooncake_core.store.tenants import parse_quotas, read_quota_file

    quota_file = args.tenant_quotas or pub.tenant_quota_file
    quotas = read_quota_file(quota_file) if quota_file else {}
    quotas.update(parse_quotas(args.tenant_quota))
    snapshots = None
    snap_dir = args.snapshot_dir or pub.snapshot_dir
    if snap_dir and (pub.ha_url or args.ha_url):
        if args.snapshot_dir:
            raise ConfigError("--snapshot-dir: not with HA (snapshots go into etcd with --ha)")
        logger.warning("--snapshot_backup_dir ignored with HA: snapshots go into etcd")
        snap_dir = ""
    if snap_dir:
        from mooncake_core.store.snapshots import SnapshotService

        snapshots = SnapshotService(
            snap_dir,
            args.snapshot_interval or pub.snapshot_interval_s or 600.0,
            args.snapshot_retention or pub.snapshot_retention or 2,
            restore=not args.no_snapshot_restore
            and (bool(args.snapshot_dir) or pub.snapshot_restore),
        )
    install_uvloop()
    server = MasterServer(
        cfg.store,
        host=host,
        rpc_port=rpc_port,
        http_host=http_host,
        http_port=9003 if http_port is None else http_port,
        ha_url=args.ha_url or pub.ha_url,
        cluster_id=cluster_id,
        advertise=args.advertise,
        serve_metadata=serve_metadata,
        ha_lease_ttl_s=args.ha_lease_ttl,
        snapshot_every=args.ha_snapshot_every,
        snapshot_interval_s=args.snapshot_interval or pub.snapshot_interval_s or 0.0,
        snapshot_retention=args.snapshot_retention or pub.snapshot_retention or 2,
        takeover_lease_s=args.ha_takeover_lease,
        kv_events_endpoint=args.kv_events_endpoint or pub.kv_events_endpoint,
        kv_events_queue=(
            args.kv_events_queue
            if args.kv_events_queue is not None
            else (pub.kv_events_queue if pub.kv_events_queue is not None else 65536)
        ),
        kv_events_backend_id=pub.kv_events_backend_id,
        tenant_quotas=quotas,
    )
    server.snapshots = snapshots
    metadata_host = pub.metadata_host or host
    metadata_port = pub.metadata_port
    from mooncake_core.metrics.memtrace import start_from_env, start_heap_trimmer

    start_from_env()  # MOONCAKE_MEMTRACE: opt-in allocation-growth reports (leak hunting)
    start_heap_trimmer()  # freed C-heap pages back to the system (MOONCAKE_MALLOC_TRIM_S)

    async def main() -> None:
        await server.start()
        runner = None
        bound_metadata = -1
        try:
            if separate_metadata:
                runner, bound_metadata = await _start_metadata(metadata_host, metadata_port)
            if args.ready_file:
                _write_ready(args.ready_file, server, bound_metadata)
            loop = asyncio.get_running_loop()
            assert server._stopped is not None
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError):
                    loop.add_signal_handler(sig, on_signal, sig)
            await server._stopped.wait()
        finally:
            if runner is not None:
                await runner.cleanup()
            await server.stop()

    signalled: list[int] = []

    def on_signal(sig: int) -> None:
        """Stop serving; a shutdown stuck (an etcd call that never returns) is cut short."""
        signalled.append(sig)
        assert server._stopped is not None
        server._stopped.set()
        timer = threading.Timer(SIGNAL_GRACE_S, _exit_now, (128 + sig,))
        timer.daemon = True
        timer.start()

    asyncio.run(main())
    code = 0 if server.role != "deposed" else 3
    if signalled:  # stopped cleanly on a signal: skip the interpreter's slow finalization
        _exit_now(code)
    return code


#: Seconds a signalled master has to shut down before it exits regardless.
SIGNAL_GRACE_S = 5.0


def _exit_now(code: int) -> None:
    """Flush logs and exit at once. Tearing down the interpreter (module and thread
    finalization) took seconds on a loaded host, long after the master had stopped serving, so
    supervisors and tests waiting for SIGTERM saw a master that seemed to ignore it."""
    logging.shutdown()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


async def _start_metadata(host: str, port: int) -> tuple[Any, int]:
    """The HTTP metadata server on its own port (published ``--enable_http_metadata_server``)."""
    from aiohttp import web

    from mooncake_core.metadata.http import MAX_VALUE, add_metadata_routes

    app = web.Application(client_max_size=MAX_VALUE)
    add_metadata_routes(app)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    srv: Any = site._server
    bound = int(srv.sockets[0].getsockname()[1])
    logger.info("HTTP metadata server on http://%s:%d/metadata", host, bound)
    return runner, bound


def _write_ready(path: str, server: MasterServer, metadata_port: int) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(
            {
                "rpc_port": server.rpc_port,
                "http_port": server.http_port,
                "metadata_port": metadata_port,
                "pid": os.getpid(),
                "id": server.id,
            },
            f,
        )
    os.replace(tmp, path)


def published_main(argv: Sequence[str] | None = None) -> int:
    """The ``mooncake_master`` console script: ours, with the published command line."""
    from mooncake_core.cli import main

    args = list(sys.argv[1:] if argv is None else argv)
    return main(["master", "--published-defaults", *args])
