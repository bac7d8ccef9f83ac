"""``mooncake-core client``: a standalone store client that other processes attach to.

It holds a real store client (its segment in the pool, its transfer engine) and serves
processes on this host that called ``setup_dummy(mem_pool_size, local_buffer_size,
"HOST:PORT")`` (:mod:`mooncake_core.store.standalone_client`, docs/compat.md). The
command line is the published ``mooncake_client``'s (gflags spellings: ``--port=50052``,
``--master_server_address 127.0.0.1:50051``, ``--global_segment_size "4 GB"``, ...;
:data:`mooncake_core.compat.cli_client.PUBLISHED_FLAGS`), also reachable as
``mooncake.cli_client.main()`` after ``mooncake_core.compat.install()`` (or
``python -m mooncake_core.compat.cli_client``).

The opt-in ``mooncake_client`` console script (``pip install ./extras/mooncake-client``)
is :func:`published_main`: this command with the published command line in this process;
``--version`` names it, and flags we cannot run (the published glog/gflags extras such as
``--vmodule``, ``--flagfile``, or flags the published client does not have) end as one
line naming every one of them, exit status 2.

Differences on purpose: ``--host`` defaults to 127.0.0.1 (published: 0.0.0.0);
``--metadata_server`` defaults to our config's ``metadata_server`` (P2P handshake unless
set; published: ``http://127.0.0.1:8080/metadata``); ``--port 0`` picks a free port.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from mooncake_core import __version__
from mooncake_core.cli import gflags
from mooncake_core.cli.store_node import wait_for_master
from mooncake_core.compat.cli_client import NOT_TAKEN, PUBLISHED_FLAGS, unsupported_flags
from mooncake_core.config import load_config, parse_size
from mooncake_core.errors import ConfigError, MasterUnavailable
from mooncake_core.store.client import StoreClient
from mooncake_core.store.standalone_client import StandaloneClientService
from mooncake_core.store.tenants import check_tenant

__all__ = ["add_arguments", "run", "FLAGS", "published_main", "unsupported_flags", "NOT_TAKEN"]

logger = logging.getLogger(__name__)

VERSION = f"mooncake_client (mooncake-core {__version__}; published flags of Mooncake 0.3.13)"
FLAGS: tuple[gflags.Flag, ...] = tuple(gflags.Flag(*f) for f in PUBLISHED_FLAGS)
_WILDCARD = {"0.0.0.0", "::", ""}
_GLOG_LEVELS = {0: "INFO", 1: "WARNING", 2: "ERROR", 3: "CRITICAL"}
_WAIT_MASTER_S = 120.0  # how long to wait for an absent master, saying so every few seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", default=None, help="mooncake.json (default $MOONCAKE_CONFIG_PATH)"
    )
    parser.add_argument(
        "--ready-file", default=None, help="write {port, ipc, segment, pid} here once serving"
    )
    gflags.add_gflags(parser, FLAGS, VERSION, "mooncake_client")


def published_main(argv: Sequence[str] | None = None) -> int:
    """The ``mooncake_client`` console script: this command with the published command
    line (``--port=50052 --master_server_address=...``), run in this process."""
    args = list(sys.argv[1:] if argv is None else argv)
    head = args[: args.index("--")] if "--" in args else args
    if "--version" in head or "-version" in head:
        print(VERSION)
        return 0
    bad = unsupported_flags(args)
    if bad:
        listed = "; ".join(f"--{name} ({why})" for name, why in bad)
        print(f"mooncake_client: not supported by mooncake-core: {listed}", file=sys.stderr)
        return 2
    from mooncake_core.cli import main

    return main(["client", *args])


def resolve(given: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The published flags' values (given over published defaults) and warning lines.

    Raises:
        ConfigError: a bad value, or a flag of a feature we lack; one line naming it.
    """
    values: dict[str, Any] = {}
    warnings: list[str] = []
    for flag in FLAGS:
        default = gflags.parse_value(flag, flag.default)
        value = gflags.parse_value(flag, given[flag.name]) if flag.name in given else default
        if flag.kind == "off" and value != default:
            raise ConfigError(
                f"--{flag.name}={given[flag.name]}: not supported by mooncake-core ({flag.note}); "
                f"remove it or leave it at {flag.default!r}"
            )
        if flag.kind == "noop" and value != default:
            warnings.append(
                f"--{flag.name}: accepted for compatibility, no effect here ({flag.note})"
            )
        values[flag.name] = value
    for name in ("global_segment_size", "local_buffer_size"):
        values[name] = parse_size(values[name], f"--{name}")
    if not 0 <= int(values["port"]) < 65536:
        raise ConfigError(f"--port: {values['port']} is not a port (0 picks a free one)")
    return values, warnings


def run(args: argparse.Namespace) -> int:
    given = gflags.given_flags(args)
    values, warnings = resolve(given)
    for line in warnings:
        logger.warning("%s", line)
    if "minloglevel" in given and getattr(args, "log_level", None) is None:
        level = _GLOG_LEVELS.get(int(values["minloglevel"]), "CRITICAL")
        logging.getLogger().setLevel(level)
    host = str(values["host"]).strip() if "host" in given else "127.0.0.1"
    segment_host = host
    if host in _WILDCARD:
        segment_host = "127.0.0.1"
        logger.warning(
            "--host %r: the client's segment is published as 127.0.0.1, which other hosts "
            "cannot reach; give this host's address to serve them",
            host,
        )
    tenant = check_tenant(
        "" if values["tenant_id"] == "default" else str(values["tenant_id"]), "--tenant_id"
    )
    protocol = {"rdma": "rdma", "efa": "rdma", "barex": "rdma", "shm": "shm"}.get(
        str(values["protocol"]).strip().lower(), "tcp"
    )
    overrides: dict[str, Any] = {
        "local_hostname": segment_host,
        "protocol": protocol,
        "device_name": str(values["device_names"]),
        "master_server_address": str(values["master_server_address"]),
        "global_segment_size": int(values["global_segment_size"]),
        "local_buffer_size": int(values["local_buffer_size"]),
    }
    if "metadata_server" in given:
        overrides["metadata_server"] = str(values["metadata_server"])
    cfg = load_config(args.config, **overrides)
    # bind first: a port in use is one line before anything starts
    with StandaloneClientService(host or "127.0.0.1", int(values["port"])) as service:
        try:
            wait_for_master(cfg.master_server_address, _WAIT_MASTER_S)
        except MasterUnavailable:
            raise MasterUnavailable(
                f"client: no master listens at {cfg.master_server_address} after "
                f"{_WAIT_MASTER_S:g}s (start it, or give --master_server_address)"
            ) from None
        client = StoreClient(
            cfg,
            master=cfg.master_server_address,
            segment_size=cfg.global_segment_size,
            tenant=tenant,
        )
        client.start()
        with client:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            service.start(client)
            if args.ready_file:
                tmp = args.ready_file + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(
                        {
                            "port": service.port,
                            "ipc": "@" + service.ipc[1:],
                            "segment": client.hostname,
                            "pid": os.getpid(),
                        },
                        f,
                    )
                os.replace(tmp, args.ready_file)
            print(f"Starting real client service on {host}:{service.port}", flush=True)
            stop.wait()
            service.stop()  # before the client closes: attached processes see -900
    return 0
