"""``mooncake-core store``: a node that only contributes memory (and optionally SSD) to the pool."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import socket
import threading
import time

from mooncake_core.config import load_config, parse_size
from mooncake_core.errors import ConfigError, MasterUnavailable
from mooncake_core.etcd import parse_etcd_url
from mooncake_core.store.client import StoreClient

logger = logging.getLogger(__name__)

_LOG_EVERY_S = 3.0  # how often the wait for an absent master says so


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="mooncake.json (default $MOONCAKE_CONFIG_PATH)")
    parser.add_argument(
        "--master",
        default=None,
        help="master host:port or etcd://host:port (default master_server_address)",
    )
    parser.add_argument(
        "--segment-size",
        default=None,
        help="memory to contribute, e.g. 4GB (default global_segment_size)",
    )
    parser.add_argument(
        "--ssd-path", default=None, help="directory for the SSD tier (offload on eviction)"
    )
    parser.add_argument("--cluster-id", default="default", help="HA namespace in etcd")
    parser.add_argument(
        "--prefault", action="store_true", help="touch every page of the segment at start"
    )
    parser.add_argument("--ready-file", default=None, help="write {segment, pid} here once mounted")
    parser.add_argument(
        "--wait-master",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="how long to wait for the master (or its etcd) to listen, saying so every few "
        "seconds (default 120; 0 = do not wait)",
    )


def _endpoints(address: str) -> tuple[str, list[tuple[str, int]]]:
    """What to wait for: ("the master", [host:port]) or ("etcd", its endpoints)."""
    text = address.strip()
    if "://" in text:  # etcd://h:p[,h:p]; parse_etcd_url names another scheme as wrong
        return "etcd", parse_etcd_url(text)
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"--master: {address!r} is not a master address; use HOST:PORT "
            "(e.g. 127.0.0.1:50051) or etcd://HOST:PORT"
        )
    return "the master", [(host, int(port))]


def _listening(endpoints: list[tuple[str, int]]) -> bool:
    for host, port in endpoints:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            continue
    return False


def wait_for_master(address: str, timeout_s: float) -> None:
    """Wait until the master (or, for ``etcd://``, one etcd endpoint) accepts connections.

    Logs "waiting for the master at X (N s)" every few seconds while it waits.

    Raises:
        ConfigError: ``address`` is malformed.
        MasterUnavailable: nothing listens there after ``timeout_s`` seconds.
    """
    what, endpoints = _endpoints(address)
    if timeout_s <= 0:
        return
    t0 = time.monotonic()
    next_log = t0
    while not _listening(endpoints):
        now = time.monotonic()
        if now - t0 >= timeout_s:
            raise MasterUnavailable(
                f"store: no {what.removeprefix('the ')} listens at {address} after "
                f"{timeout_s:g}s (start it, or give --master / --wait-master)"
            )
        if now >= next_log:
            logger.warning("waiting for %s at %s (%d s)", what, address, int(now - t0))
            next_log = now + _LOG_EVERY_S
        time.sleep(min(0.5, max(0.0, t0 + timeout_s - now)))
    if time.monotonic() - t0 >= 1.0:
        logger.info("%s at %s is up after %.0f s", what, address, time.monotonic() - t0)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    size = (
        parse_size(args.segment_size, "--segment-size") if args.segment_size is not None else None
    )
    wait_for_master(args.master or cfg.master_server_address, args.wait_master)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    client = StoreClient(
        cfg,
        master=args.master,
        segment_size=size,
        ssd_path=args.ssd_path,
        cluster_id=args.cluster_id,
        prefault=args.prefault,
    )
    try:
        client.start()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        t = cfg.transfer
        raise ConfigError(
            f"store: port {t.port} on {t.listen_host} (transfer.port) is already in use; "
            "stop what holds it or choose another port"
        ) from None
    with client:
        names = client.segment_names
        logger.info(
            "store node %s contributes %s", client.hostname, ", ".join(names) or "no memory"
        )
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"segments": names, "peer": client.hostname, "pid": os.getpid()}, f)
            os.replace(tmp, args.ready_file)
        stop.wait()
    return 0
