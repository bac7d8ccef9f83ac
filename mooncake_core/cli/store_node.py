"""``mooncake-core store``: a node that only contributes memory (and optionally SSD) to the pool."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading

from mooncake_core.config import load_config, parse_size
from mooncake_core.store.client import StoreClient

logger = logging.getLogger(__name__)


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


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    size = (
        parse_size(args.segment_size, "--segment-size") if args.segment_size is not None else None
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with StoreClient(
        cfg,
        master=args.master,
        segment_size=size,
        ssd_path=args.ssd_path,
        cluster_id=args.cluster_id,
        prefault=args.prefault,
    ) as client:
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
