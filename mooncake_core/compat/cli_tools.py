"""The published command-line tools of the ``mooncake`` wheel, on our implementation.

- :func:`master_main` is ``mooncake.cli.main`` (the wheel's ``mooncake_master`` script): it
  replaces the process (same pid, as the published one does) with ``python -m mooncake_core
  master --published-defaults ARGS``, so the published gflags spellings, units and defaults
  are parsed by our master's one parser (docs/compat.md).
- :func:`bench_main` is ``mooncake.cli_bench.main`` (``transfer_engine_bench``): the same
  two-process benchmark on our engine. ``--mode=target`` lends ``--buffer_size`` bytes as
  segment ``--local_server_name`` and waits for SIGINT/SIGTERM; ``--mode=initiator`` reads
  or writes ``--batch_size`` blocks of ``--block_size`` bytes per batch from ``--threads``
  threads into segment ``--segment_id`` for ``--duration`` seconds and prints
  ``Test completed: duration D, batch count N, throughput T UNIT``. Flags take the gflags
  spellings (``--f=v``, ``--f v``, ``-f=v``, ``--nof`` for booleans); a flag or value we do not
  support is one line and exit status 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["BENCH_FLAGS", "BenchError", "bench_main", "master_main", "parse_bench_flags"]

logger = logging.getLogger(__name__)


def master_main() -> None:
    """``mooncake_master ARGS``: exec our master with the published command line."""
    argv = [sys.executable, "-m", "mooncake_core", "master", "--published-defaults"]
    os.execv(sys.executable, argv + sys.argv[1:])


class BenchError(Exception):
    """A command line or run the benchmark refuses; the message is its one line."""


#: transfer_engine_bench's flags: name -> (type, published default, note)
BENCH_FLAGS: dict[str, tuple[type, Any, str]] = {
    "mode": (str, "initiator", "initiator or target"),
    "operation": (str, "read", "read or write"),
    "protocol": (str, "rdma", "tcp or rdma (rdma runs on TCP where there is no RDMA device)"),
    "metadata_server": (str, "192.168.3.77:2379", "etcd h:p, http://h:p/metadata, P2PHANDSHAKE"),
    "local_server_name": (str, "vm", "this engine's segment name (host or host:port)"),
    "segment_id": (str, "192.168.3.76", "the target's segment name"),
    "device_name": (str, "mlx5_2", "RDMA device names"),
    "buffer_size": (int, 1 << 30, "bytes of the registered buffer"),
    "block_size": (int, 65536, "bytes per transfer request"),
    "batch_size": (int, 128, "requests per batch"),
    "threads": (int, 12, "submitting threads"),
    "duration": (int, 10, "seconds the initiator runs"),
    "report_unit": (str, "GB", "GB|GiB|Gb|MB|MiB|Mb|KB|KiB|Kb"),
    "report_precision": (int, 2, "decimals of the throughput"),
    "backend": (str, "classic", "classic only (there is no TENT runtime here)"),
    "auto_discovery": (bool, False, "accepted; our engine always discovers its NICs"),
    "nic_priority_matrix": (str, "", "not supported: the engine picks NICs from the topology"),
}

_UNITS: dict[str, float] = {
    "GB": 1e9,
    "GiB": float(1 << 30),
    "Gb": 1e9 / 8,
    "MB": 1e6,
    "MiB": float(1 << 20),
    "Mb": 1e6 / 8,
    "KB": 1e3,
    "KiB": float(1 << 10),
    "Kb": 1e3 / 8,
}
_PROTOCOLS = {"tcp": "tcp", "rdma": "rdma", "efa": "rdma", "barex": "rdma"}
_TRUE, _FALSE = {"true", "t", "yes", "y", "1"}, {"false", "f", "no", "n", "0"}


def _value(name: str, raw: str) -> Any:
    typ = BENCH_FLAGS[name][0]
    if typ is bool:
        word = raw.strip().lower()
        if word in _TRUE | _FALSE:
            return word in _TRUE
        raise BenchError(f"--{name}: expected true or false, got {raw!r}")
    if typ is int:
        try:
            n = int(raw, 0)
        except ValueError:
            raise BenchError(f"--{name}: expected an integer, got {raw!r}") from None
        if n < 0:
            raise BenchError(f"--{name}: must not be negative, got {raw!r}")
        return n
    return raw


def parse_bench_flags(argv: Sequence[str]) -> dict[str, Any]:
    """transfer_engine_bench's command line (gflags spellings) -> {flag: value}."""
    out = {name: default for name, (_t, default, _n) in BENCH_FLAGS.items()}
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-") or arg in ("-", "--"):
            raise BenchError(f"unexpected argument {arg!r} (flags look like --name=value)")
        name, eq, raw = arg.lstrip("-").partition("=")
        if name.startswith("no") and name[2:] in BENCH_FLAGS and not eq:
            if BENCH_FLAGS[name[2:]][0] is bool:
                out[name[2:]] = False
                continue
        if name not in BENCH_FLAGS:
            raise BenchError(f"unknown command line flag {name!r} (supported: --helpshort)")
        if not eq:
            if BENCH_FLAGS[name][0] is bool:
                out[name] = True
                continue
            if i >= len(args):
                raise BenchError(f"flag --{name} is missing its value")
            raw = args[i]
            i += 1
        out[name] = _value(name, raw)
    return out


def _check(flags: dict[str, Any]) -> str:
    """Refuse what we cannot run; returns our protocol name."""
    if flags["mode"] not in ("initiator", "target"):
        raise BenchError(f"--mode must be initiator or target, got {flags['mode']!r}")
    if flags["operation"] not in ("read", "write"):
        raise BenchError(f"--operation must be read or write, got {flags['operation']!r}")
    if flags["backend"] != "classic":
        raise BenchError(f"--backend={flags['backend']} is not supported: there is one engine here")
    if flags["nic_priority_matrix"]:
        raise BenchError(
            "--nic_priority_matrix is not supported: our engine picks NICs from the discovered"
            " topology (transfer.interfaces in the config chooses them)"
        )
    if flags["report_unit"] not in _UNITS:
        raise BenchError(
            f"--report_unit must be one of {'|'.join(_UNITS)}, got {flags['report_unit']!r}"
        )
    proto = _PROTOCOLS.get(flags["protocol"])
    if proto is None:
        raise BenchError(
            f"--protocol={flags['protocol']} is not supported here (we have tcp and rdma;"
            " efa and barex run on rdma)"
        )
    for name in ("buffer_size", "block_size", "batch_size", "threads", "duration"):
        if flags[name] <= 0:
            raise BenchError(f"--{name} must be positive")
    return proto


def _start(flags: dict[str, Any], proto: str) -> tuple[Any, int]:
    from mooncake_core.compat.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize(
        flags["local_server_name"], flags["metadata_server"], proto, flags["device_name"]
    )
    if rc != 0:
        raise BenchError(
            f"the engine did not start as {flags['local_server_name']!r} with metadata"
            f" {flags['metadata_server']!r} (code {rc})"
        )
    addr = engine.allocate_managed_buffer(flags["buffer_size"])
    if not addr:
        engine.close()
        raise BenchError(f"cannot allocate a {flags['buffer_size']}-byte buffer")
    return engine, addr


def _run_target(flags: dict[str, Any], proto: str) -> int:
    engine, _addr = _start(flags, proto)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"target {engine.get_engine().name} ready: {flags['buffer_size']} bytes", flush=True)
    try:
        stop.wait()
    finally:
        engine.close()
    return 0


def _run_initiator(flags: dict[str, Any], proto: str) -> int:
    span = flags["batch_size"] * flags["block_size"]
    if span * flags["threads"] > flags["buffer_size"]:
        raise BenchError(
            "--buffer_size must hold threads * batch_size * block_size bytes"
            f" ({flags['threads']} * {flags['batch_size']} * {flags['block_size']})"
        )
    engine, local = _start(flags, proto)
    try:
        remote = engine.get_first_buffer_address(flags["segment_id"])
        if not remote:
            raise BenchError(f"segment {flags['segment_id']!r} has no registered buffer")
        move: Callable[..., int] = (
            engine.batch_transfer_sync_read
            if flags["operation"] == "read"
            else engine.batch_transfer_sync_write
        )
        counts = [0] * flags["threads"]
        failed: list[str] = []
        deadline = time.monotonic() + flags["duration"]

        def worker(i: int) -> None:
            offsets = [i * span + j * flags["block_size"] for j in range(flags["batch_size"])]
            mine, theirs = [local + o for o in offsets], [remote + o for o in offsets]
            sizes = [flags["block_size"]] * flags["batch_size"]
            while time.monotonic() < deadline and not failed:
                if move(flags["segment_id"], mine, theirs, sizes) != 0:
                    failed.append(f"a batch to {flags['segment_id']!r} failed")
                    return
                counts[i] += 1

        began = time.monotonic()
        workers = [threading.Thread(target=worker, args=(i,)) for i in range(flags["threads"])]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        took = time.monotonic() - began
        if failed:
            raise BenchError(failed[0])
        batches = sum(counts)
        rate = batches * span / took / _UNITS[flags["report_unit"]]
        print(
            f"Test completed: duration {took:.2f}, batch count {batches}, throughput"
            f" {rate:.{flags['report_precision']}f} {flags['report_unit']}/s",
            flush=True,
        )
        return 0
    finally:
        engine.close()


def _help() -> str:
    lines = ["transfer_engine_bench (mooncake-core): flags in gflags spellings"]
    for name, (typ, default, note) in BENCH_FLAGS.items():
        lines.append(f"  -{name} ({note}) type: {typ.__name__} default: {default!r}")
    return "\n".join(lines)


def bench_main(argv: Sequence[str] | None = None) -> int:
    """``transfer_engine_bench ARGS`` on our engine; the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a.lstrip("-") in ("help", "helpshort", "helpfull") for a in args):
        print(_help())
        return 0
    if any(a.lstrip("-") == "version" for a in args):
        from mooncake_core import __version__

        print(f"transfer_engine_bench (mooncake-core {__version__})")
        return 0
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        flags = parse_bench_flags(args)
        proto = _check(flags)
        if flags["mode"] == "target":
            return _run_target(flags, proto)
        return _run_initiator(flags, proto)
    except BenchError as exc:
        print(f"transfer_engine_bench: {exc}", file=sys.stderr)
        return 1
