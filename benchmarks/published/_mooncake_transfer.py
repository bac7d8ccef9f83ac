"""Transfer benchmark for the PUBLISHED Mooncake engine (run by its own Python).

Executed by ``run_mooncake_transfer_bench`` (``mooncake_peer.py`` next to this file) with
the interpreter of a venv holding ``mooncake-transfer-engine-non-cuda`` (see
scripts/setup_mooncake_peer.sh); it imports nothing from ``mooncake_core``.

    python _mooncake_transfer.py target
        # prints {"name", "addr"}; serves until stdin closes
    python _mooncake_transfer.py initiator JSON [--quick]
        # last stdout line: results JSON

Both use metadata ``P2PHANDSHAKE`` and protocol ``tcp`` on 127.0.0.1 (set
``MC_TCP_BIND_ADDRESS=127.0.0.1``). Pages are touched before timing.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mooncake.engine import TransferEngine

HOLD = 80 << 20
SIZES = [16 << 20, 64 << 20]


def _array(addr: int, n: int) -> Any:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


def _engine() -> TransferEngine:
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"TransferEngine.initialize returned {rc}")
    return te


def target() -> None:
    te = _engine()
    addr = te.allocate_managed_buffer(HOLD)
    if not addr:
        raise SystemExit("allocate_managed_buffer failed")
    _array(addr, HOLD)[:] = 1  # touch every page
    print(json.dumps({"name": f"127.0.0.1:{te.get_rpc_port()}", "addr": addr}), flush=True)
    sys.stdin.read()


def _rate(fn: Callable[[], None], nbytes: int, budget: int) -> float:
    iters = max(3, budget // nbytes)
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return iters * nbytes / (time.perf_counter() - t) / 1e9


def initiator(info: dict[str, Any], quick: bool) -> dict[str, Any]:
    te = _engine()
    peer, raddr = str(info["name"]), int(info["addr"])
    local = te.allocate_managed_buffer(HOLD)
    _array(local, HOLD)[:] = np.random.default_rng(0).integers(0, 255, HOLD, dtype=np.uint8)
    rounds = 2 if quick else 3
    budget = (96 << 20) if quick else (256 << 20)

    def op(kind: str, n: int) -> Callable[[], None]:
        fn = te.transfer_sync_write if kind == "write" else te.transfer_sync_read

        def run() -> None:
            if fn(peer, local, raddr, n) != 0:
                raise SystemExit(f"transfer_sync_{kind} of {n} bytes failed")

        return run

    def batch(kind: str) -> Callable[[], None]:
        fn = te.batch_transfer_sync_write if kind == "write" else te.batch_transfer_sync_read
        bufs = [local + i * (1 << 20) for i in range(32)]
        remote = [raddr + i * (1 << 20) for i in range(32)]

        def run() -> None:
            if fn(peer, bufs, remote, [1 << 20] * 32) != 0:
                raise SystemExit(f"batch_transfer_sync_{kind} failed")

        return run

    res: dict[str, list[float]] = {}
    for _ in range(rounds):
        for n in SIZES:
            lb = f"{n >> 20}m"
            for kind in ("write", "read"):
                res.setdefault(f"tcp_{kind}_gbps_{lb}", []).append(_rate(op(kind, n), n, budget))
        for kind in ("write", "read"):
            res.setdefault(f"tcp_batch_{kind}_32x1m", []).append(
                _rate(batch(kind), 32 << 20, budget)
            )
    # check the bytes once: what we wrote is what we read back
    want = bytes(_array(local, 4096))
    te.transfer_sync_write(peer, local, raddr, 4096)
    _array(local, 4096)[:] = 0
    te.transfer_sync_read(peer, local, raddr, 4096)
    if bytes(_array(local, 4096)) != want:
        raise SystemExit("read-back mismatch")
    xs = []
    read = op("read", 64 << 10)
    for _ in range(300 if quick else 2000):
        t = time.perf_counter()
        read()
        xs.append(time.perf_counter() - t)
    out: dict[str, Any] = {k: round(float(np.median(v)), 3) for k, v in res.items()}
    us = np.array(xs) * 1e6
    out["lat64k_p50_us"] = round(float(np.percentile(us, 50)), 1)
    out["lat64k_p99_us"] = round(float(np.percentile(us, 99)), 1)
    out["rounds"] = rounds
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["target"]:
        target()
        return 0
    if argv[:1] == ["initiator"] and len(argv) >= 2:
        print(json.dumps(initiator(json.loads(argv[1]), "--quick" in argv)), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
