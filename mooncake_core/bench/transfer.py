"""``mooncake-core bench transfer``: our TCP and shared-memory transports against a raw
socket reference and a memcpy reference, between two processes on loopback, in one run.

The holder process owns a registered, pre-faulted buffer and also runs a plain Python
socket server (``sendall`` / ``recv_into``) for the raw-TCP reference. The measuring
process alternates raw and engine rounds so machine drift hits both; figures are
medians over rounds. With ``--json`` the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mooncake_core import config
from mooncake_core.bench import rawtcp
from mooncake_core.transfer import TransferEngine, TransferRequest

SIZES = [64 << 10, 1 << 20, 16 << 20, 64 << 20]
HOLD = 160 << 20


def _label(n: int) -> str:
    return f"{n >> 20}m" if n >= 1 << 20 else f"{n >> 10}k"


# ---------------------------------------------------------------------- holder process
def holder_main() -> None:
    eng = TransferEngine(protocol="tcp").start()
    buf = eng.allocate(HOLD, prefault=True, name="bench")
    buf.numpy()[:] = 1  # touch every page
    raw_buf = np.ones(HOLD, dtype=np.uint8)
    raw_port = rawtcp.start_server(memoryview(raw_buf.data).cast("B"))
    print(json.dumps({"name": eng.name, "addr": buf.addr, "raw_port": raw_port}), flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    eng.close()


# ---------------------------------------------------------------------- measuring side
def _rate(fn: Callable[[], None], nbytes: int, budget: int) -> float:
    iters = max(3, budget // max(nbytes, 1))
    fn()  # warm
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return iters * nbytes / (time.perf_counter() - t) / 1e9


def _batch(eng: TransferEngine, reqs: list[TransferRequest]) -> None:
    eng.transfer(reqs)


def _memcpy_rate() -> float:
    src = np.ones(256 << 20, dtype=np.uint8)
    dst = np.ones(256 << 20, dtype=np.uint8)
    return _rate(lambda: np.copyto(dst, src), 256 << 20, 1 << 30)


def _median(xs: list[float]) -> float:
    return float(np.median(np.array(xs))) if xs else float("nan")


def run(quick: bool) -> dict[str, Any]:
    env = dict(config.environment())
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake_core.bench.transfer", "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        return _measure(info, quick)
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _measure(info: dict[str, Any], quick: bool) -> dict[str, Any]:
    peer, raddr = info["name"], int(info["addr"])
    rounds = 2 if quick else 3
    budget = (96 << 20) if quick else (256 << 20)
    eng = TransferEngine(protocol="tcp").start()
    local = eng.allocate(HOLD, prefault=True)
    local.numpy()[:] = np.random.default_rng(0).integers(0, 255, HOLD, dtype=np.uint8)
    lview = local.view
    raw = rawtcp.RawClient(int(info["raw_port"]))

    def raw_write(n: int) -> None:
        raw.write(lview[:n])

    def raw_read(n: int) -> None:
        raw.read(lview[:n])

    def ours(op: str, transport: str, n: int) -> Callable[[], None]:
        req = TransferRequest(op, peer, local.addr, n, raddr, transport=transport)

        def go() -> None:
            eng.transfer(req)

        return go

    res: dict[str, list[float]] = {}
    sizes = SIZES
    for _ in range(rounds):
        for n in sizes:
            res.setdefault(f"raw_write_{_label(n)}", []).append(
                _rate(functools.partial(raw_write, n), n, budget)
            )
            res.setdefault(f"raw_read_{_label(n)}", []).append(
                _rate(functools.partial(raw_read, n), n, budget)
            )
            for tr in ("tcp", "shm"):
                res.setdefault(f"{tr}_write_{_label(n)}", []).append(
                    _rate(ours("write", tr, n), n, budget)
                )
                res.setdefault(f"{tr}_read_{_label(n)}", []).append(
                    _rate(ours("read", tr, n), n, budget)
                )
        for tr in ("tcp", "shm"):
            for op in ("write", "read"):
                reqs = [
                    TransferRequest(
                        op,
                        peer,
                        local.addr + i * (1 << 20),
                        1 << 20,
                        raddr + i * (1 << 20),
                        transport=tr,
                    )
                    for i in range(32)
                ]
                res.setdefault(f"{tr}_batch_{op}_32x1m", []).append(
                    _rate(functools.partial(_batch, eng, reqs), 32 << 20, budget)
                )
        # memcpy reference: numpy copy of 256 MiB (both arrays pre-faulted)
        res.setdefault("memcpy", []).append(_memcpy_rate())
    lat: dict[str, list[float]] = {}
    for tr in ("tcp", "shm"):
        req = TransferRequest("read", peer, local.addr, 64 << 10, raddr, transport=tr)
        xs = []
        for _ in range(300 if quick else 2000):
            t = time.perf_counter()
            eng.transfer(req)
            xs.append(time.perf_counter() - t)
        lat[tr] = xs
    raw.close()
    eng.close()
    out: dict[str, Any] = {k: round(_median(v), 3) for k, v in res.items()}
    for tr, xs in lat.items():
        arr = np.array(xs) * 1e6
        pre = "lat64k" if tr == "tcp" else "shm_lat64k"
        out[f"{pre}_p50_us"] = round(float(np.percentile(arr, 50)), 1)
        out[f"{pre}_p99_us"] = round(float(np.percentile(arr, 99)), 1)
    out["raw_tcp_gbps"] = round((out["raw_write_16m"] + out["raw_read_16m"]) / 2, 3)
    out["memcpy_gbps"] = out["memcpy"]
    for op in ("write", "read"):
        out[f"tcp_{op}_gbps_16m"] = out[f"tcp_{op}_16m"]
        out[f"shm_{op}_gbps_16m"] = out[f"shm_{op}_16m"]
    out["tcp_ratio_vs_raw_16m"] = round(
        (out["tcp_write_16m"] + out["tcp_read_16m"]) / 2 / out["raw_tcp_gbps"], 3
    )
    out["shm_ratio_vs_memcpy_16m"] = round(
        (out["shm_write_16m"] + out["shm_read_16m"]) / 2 / out["memcpy_gbps"], 3
    )
    out["rounds"] = rounds
    return out


def print_table(r: dict[str, Any]) -> None:
    print(
        f"{'size':>6} | {'raw w':>7} {'raw r':>7} | {'tcp w':>7} {'tcp r':>7} | "
        f"{'shm w':>7} {'shm r':>7}   (GB/s, median)"
    )
    for n in SIZES:
        lb = _label(n)
        print(
            f"{lb:>6} | {r[f'raw_write_{lb}']:7.2f} {r[f'raw_read_{lb}']:7.2f} | "
            f"{r[f'tcp_write_{lb}']:7.2f} {r[f'tcp_read_{lb}']:7.2f} | "
            f"{r[f'shm_write_{lb}']:7.2f} {r[f'shm_read_{lb}']:7.2f}"
        )
    print(
        f"batch 32 x 1 MiB: tcp write {r['tcp_batch_write_32x1m']:.2f} "
        f"read {r['tcp_batch_read_32x1m']:.2f} | "
        f"shm write {r['shm_batch_write_32x1m']:.2f} read {r['shm_batch_read_32x1m']:.2f} GB/s"
    )
    print(f"memcpy (numpy copy, 256 MiB): {r['memcpy_gbps']:.2f} GB/s")
    print(
        f"64 KiB read latency: tcp p50 {r['lat64k_p50_us']:.0f} us "
        f"p99 {r['lat64k_p99_us']:.0f} us | "
        f"shm p50 {r['shm_lat64k_p50_us']:.0f} us p99 {r['shm_lat64k_p99_us']:.0f} us"
    )
    print(
        f"ratios at 16 MiB: tcp/raw {r['tcp_ratio_vs_raw_16m']:.2f} (target >= 0.8), "
        f"shm/memcpy {r['shm_ratio_vs_memcpy_16m']:.2f} (target >= 0.7)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="mooncake-core bench transfer", description=__doc__.splitlines()[0] if __doc__ else ""
    )
    ap.add_argument(
        "--quick", action="store_true", help="fewer rounds and bytes (finishes within ~45 s)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument(
        "--compare-mooncake",
        metavar="PYTHON",
        default=None,
        help="also run the published Mooncake engine with this Python "
        "(scripts/setup_mooncake_peer.sh makes one) and add <key>_ratio_vs_mooncake figures",
    )
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        holder_main()
        return 0
    t0 = time.time()
    print(
        f"bench transfer: two processes on loopback ({'quick' if args.quick else 'full'}) ...",
        file=sys.stderr,
        flush=True,
    )
    r = run(args.quick)
    if args.compare_mooncake:
        from mooncake_core.bench.published import peer

        run_mooncake_transfer_bench = peer().run_mooncake_transfer_bench

        print("bench transfer: published Mooncake engine (TCP) ...", file=sys.stderr, flush=True)
        mc = run_mooncake_transfer_bench(os.path.abspath(args.compare_mooncake), args.quick)
        r2 = run(args.quick)  # ours again, after theirs: alternate so drift hits both
        for k, v in r2.items():
            if isinstance(v, float) and k in r and "lat" not in k:
                r[k] = round((r[k] + v) / 2, 3)
        for key in (
            "tcp_write_gbps_16m",
            "tcp_read_gbps_16m",
            "tcp_write_gbps_64m",
            "tcp_read_gbps_64m",
            "tcp_batch_write_32x1m",
            "tcp_batch_read_32x1m",
            "lat64k_p50_us",
            "lat64k_p99_us",
        ):
            ours_key = key.replace("_gbps_64m", "_64m")
            if key in mc and ours_key in r and mc[key]:
                r[f"mooncake_{key}"] = mc[key]
                r[f"{key}_ratio_vs_mooncake"] = round(r[ours_key] / mc[key], 3)
    r["elapsed_s"] = round(time.time() - t0, 1)
    print_table(r)
    if args.compare_mooncake:
        print(
            "vs published Mooncake (TCP, same run): "
            + ", ".join(
                f"{k.removesuffix('_ratio_vs_mooncake')} {v:.2f}x"
                for k, v in r.items()
                if k.endswith("_ratio_vs_mooncake")
            )
        )
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
