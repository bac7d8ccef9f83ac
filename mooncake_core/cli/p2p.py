"""``mooncake-core p2p``: seed, get, list and remove blobs in the P2P store.

::

    mooncake-core p2p --etcd etcd://10.0.0.1:2379 seed /ckpt/step100 --name llama/step100
    mooncake-core p2p --etcd etcd://10.0.0.1:2379 get llama/step100 /local/step100
    mooncake-core p2p --etcd etcd://10.0.0.1:2379 ls
    mooncake-core p2p --etcd etcd://10.0.0.1:2379 rm llama/step100

``seed`` publishes a file or a directory (every file under it, e.g. safetensors shards)
and serves it until interrupted or until the name is removed. ``get`` fetches it from the
swarm with a progress bar (bytes, rate, ETA, peers), writes it (a directory seed back as
a directory) and, with ``--serve``, keeps serving it to later readers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mooncake_core.config import load_config
from mooncake_core.errors import ConfigError
from mooncake_core.p2p import P2PStore, Progress
from mooncake_core.p2p.errors import BadName
from mooncake_core.p2p.meta import check_name, check_shard_size

__all__ = ["add_arguments", "run"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--etcd",
        default=None,
        help="etcd://host:port[,host:port] coordinating the swarm "
        "(default: metadata_server when it is an etcd URL); without etcd, for one seeder "
        "and one reader: P2PHANDSHAKE on the seeder, the p2p://host:port it prints on the "
        "reader",
    )
    parser.add_argument(
        "--config", default=None, help="mooncake.json (default $MOONCAKE_CONFIG_PATH)"
    )
    parser.add_argument(
        "--local-hostname",
        default=None,
        help="address other hosts reach this process at (default the config's local_hostname)",
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("seed", help="publish a file or directory and serve it")
    p.add_argument("path", metavar="PATH", help="a file or a directory (e.g. safetensors files)")
    p.add_argument("--name", required=True, help="name to publish it under")
    p.add_argument("--shard-size", default="64MB", help="largest shard (default 64MB)")
    p.add_argument("--force", action="store_true", help="replace an existing name")
    p.add_argument("--ready-file", default=None, help="write {name, version, segment} here")
    p = sub.add_parser("get", help="fetch a name from the swarm into OUT")
    p.add_argument("name", metavar="NAME")
    p.add_argument("out", metavar="OUT", help="file (or directory, for a directory seed)")
    p.add_argument("--serve", action="store_true", help="keep serving it after writing OUT")
    p.add_argument("--concurrency", type=int, default=8, help="shards fetched at once (default 8)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p = sub.add_parser("ls", help="list registered names and their live holders")
    p.add_argument("prefix", nargs="?", default="", metavar="PREFIX")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p = sub.add_parser("rm", help="unregister a name (for every holder)")
    p.add_argument("name", metavar="NAME")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class Bar:
    """A one-line progress bar on stderr (a line per quarter when stderr is not a terminal)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.quarter = -1
        self.lock = threading.Lock()

    def __call__(self, p: Progress) -> None:
        if not self.enabled:
            return
        rate = p.done / p.elapsed_s if p.elapsed_s > 0 else 0.0
        eta = (p.total - p.done) / rate if rate > 0 else float("inf")
        frac = p.done / p.total if p.total else 1.0
        width = 24
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        eta_text = f"{eta:.0f}s" if eta != float("inf") else "?"
        line = (
            f"{p.name} [{bar}] {_human(p.done)}/{_human(p.total)} {_human(rate)}/s "
            f"ETA {eta_text} peers {p.peers}" + (f" retries {p.retries}" if p.retries else "")
        )
        with self.lock:
            if self.tty:
                sys.stderr.write("\r" + line + "\x1b[K")
                if p.done >= p.total:
                    sys.stderr.write("\n")
            elif int(frac * 4) > self.quarter:
                self.quarter = int(frac * 4)
                sys.stderr.write(line + "\n")
            sys.stderr.flush()


def _store(args: argparse.Namespace) -> P2PStore:
    cfg = load_config(args.config)
    if args.local_hostname:
        cfg = cfg.replace(local_hostname=args.local_hostname)
    url = args.etcd
    if not url:
        ms = cfg.metadata_server.strip()
        if ms.lower().startswith("etcd://"):
            url = ms
        else:
            raise ConfigError(
                "p2p: give --etcd etcd://host:port (or set metadata_server to an etcd URL)"
            )
    # P2PHANDSHAKE (a seeder without etcd) serves its records where its engine is reached
    return P2PStore(url, config=cfg, listen=f"{cfg.local_hostname}:0")


def _wait_stop(store: P2PStore, name: str, version: str) -> str:
    """Serve until SIGINT/SIGTERM or until ``name`` is unregistered or replaced."""
    stop = threading.Event()
    why = ["interrupted"]

    def on_signal(signum: int, _frame: Any) -> None:
        why[0] = signal.Signals(signum).name
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(1.0):
            mine = [o for o in store.list(name) if o.name == name]
            if not mine:
                why[0] = "unregistered"
                break
            if mine[0].version != version:
                why[0] = "replaced by a new version"
                break
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return why[0]


def _seed(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.exists():
        raise BadName(f"p2p seed: {args.path!r} does not exist")
    layout = "dir" if path.is_dir() else "file"
    check_name(args.name)
    check_shard_size(args.shard_size)
    with _store(args) as store:
        rep = store.register(
            args.name,
            path,
            max_shard_size=args.shard_size,
            force=args.force,
            meta={"layout": layout},
        )
        print(
            f"serving {args.name} ({_human(rep.size)} in {len(rep.buffers)} file(s), "
            f"version {rep.version[:12]}) from {store.segment}"
            + ("" if store.address == args.etcd else f" (readers: --etcd {store.address})")
            + "; Ctrl-C to stop",
            flush=True,
        )
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as fh:
                json.dump(
                    {
                        "name": args.name,
                        "version": rep.version,
                        "segment": store.segment,
                        "address": store.address,
                    },
                    fh,
                )
            os.replace(tmp, args.ready_file)
        why = _wait_stop(store, args.name, rep.version)
        print(f"stopped serving {args.name} ({why})", flush=True)
    return 0


def _write_out(out: Path, labels: list[str], buffers: list[memoryview], layout: str) -> list[Path]:
    """Write the replica to ``out`` (atomically per file); the paths written."""
    as_dir = layout == "dir" or len(buffers) > 1 or (out.is_dir() and layout != "file")
    targets: list[tuple[Path, memoryview]] = []
    if as_dir:
        root = out.resolve()
        for label, buf in zip(labels, buffers, strict=True):
            dest = (out / label).resolve()
            if not label or root not in dest.parents:
                raise BadName(f"p2p get: refusing to write file {label!r} outside {str(out)!r}")
            targets.append((dest, buf))
    else:
        dest = out / (labels[0] or "blob") if out.is_dir() else out
        targets.append((dest, buffers[0]))
    written = []
    for dest, buf in targets:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        with open(tmp, "wb") as fh:
            fh.write(buf)
        os.replace(tmp, dest)
        written.append(dest)
    return written


def _get(args: argparse.Namespace) -> int:
    out = Path(args.out)
    check_name(args.name)
    with _store(args) as store:
        bar = Bar(not args.no_progress)
        t0 = time.monotonic()
        rep = store.get_replica(args.name, concurrency=args.concurrency, progress=bar)
        dt = time.monotonic() - t0
        files = _write_out(out, rep.labels, rep.buffers, rep.meta.get("layout", ""))
        st = rep.stats
        print(
            f"fetched {args.name} ({_human(rep.size)}, {len(files)} file(s)) in {dt:.2f}s "
            f"({_human(rep.size / dt if dt > 0 else 0)}/s; {st.get('from_peers', 0)} shard(s) "
            f"from peers, {st.get('from_origin', 0)} from the seeder) -> {out}",
            flush=True,
        )
        if args.serve:
            print(f"serving {args.name} from {store.segment}; Ctrl-C to stop", flush=True)
            why = _wait_stop(store, args.name, rep.version)
            print(f"stopped serving {args.name} ({why})", flush=True)
    return 0


def _ls(args: argparse.Namespace) -> int:
    with _store(args) as store:
        objs = store.list(args.prefix)
    if args.json:
        for o in objs:
            print(
                json.dumps(
                    {
                        "name": o.name,
                        "version": o.version,
                        "size": o.size,
                        "shard_size": o.shard_size,
                        "shards": o.shards,
                        "files": o.labels,
                        "holders": o.holders,
                        "complete": o.complete,
                    }
                )
            )
        return 0
    rows = [("NAME", "SIZE", "SHARDS", "SHARD SIZE", "HOLDERS", "COMPLETE", "VERSION")]
    for o in objs:
        rows.append(
            (
                o.name,
                _human(o.size),
                str(o.shards),
                _human(o.shard_size),
                str(len(o.holders)),
                str(o.complete),
                o.version[:12],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if not objs:
        print("(no names registered)" + (f" under {args.prefix!r}" if args.prefix else ""))
    return 0


def _rm(args: argparse.Namespace) -> int:
    check_name(args.name)
    with _store(args) as store:
        store.unregister(args.name)
    print(f"unregistered {args.name}")
    return 0


def run(args: argparse.Namespace) -> int:
    actions = {"seed": _seed, "get": _get, "ls": _ls, "rm": _rm}
    with contextlib.suppress(BrokenPipeError):
        return actions[args.action](args)
    return 0
