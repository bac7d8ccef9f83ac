"""Benchmark of ``mooncake.pg``: all_reduce latency per size, ours against gloo in the same
processes and the same run.

``python -m mooncake_core.compat.pg_bench [--ranks 3] [--sizes 4096,1048576] [--iters 50]
[--json]`` starts the ranks on loopback, each with a ``mooncake-cpu`` group and a gloo group
over the same processes; rank 0 prints a table (median microseconds per call) and, with
``--json``, one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

__all__ = ["main", "run_rank"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def run_rank(rank: int, ranks: int, port: int, sizes: list[int], iters: int) -> dict[str, Any]:
    """One rank: time ``iters`` all_reduces per size on both groups (median, µs)."""
    import torch
    import torch.distributed as dist

    import mooncake_core.compat

    mooncake_core.compat.install(force=True)
    from mooncake_core.compat import pg  # noqa: F401 - registers the backends

    dist.init_process_group(
        "mooncake-cpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks
    )
    gloo = dist.new_group(backend="gloo")
    out: dict[str, Any] = {"ranks": ranks, "iters": iters, "rows": []}
    for size in sizes:
        t = torch.ones(max(1, size // 4), dtype=torch.float32)
        row: dict[str, Any] = {"bytes": size}
        for name, group in (("mooncake_us", None), ("gloo_us", gloo)):
            times = []
            for i in range(iters + 3):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                dist.all_reduce(t, group=group)
                if i >= 3:  # warm-up calls are not counted
                    times.append((time.perf_counter() - t0) * 1e6)
            row[name] = round(statistics.median(times), 1)
        out["rows"].append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mooncake_core.compat.pg_bench")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--sizes", default="4096,65536,1048576,8388608", help="bytes, comma list")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.rank >= 0:
        res = run_rank(args.rank, args.ranks, args.port, sizes, args.iters)
        if args.rank == 0:
            sys.stdout.write(json.dumps(res) + "\n")
        return 0
    port = _free_port()
    cmd = [sys.executable, "-m", "mooncake_core.compat.pg_bench", *(argv or sys.argv[1:])]
    procs = [
        subprocess.Popen(
            [*cmd, "--rank", str(r), "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for r in range(args.ranks)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.stderr.write("pg_bench: a rank failed\n")
        return 1
    res = json.loads(outs[0].strip().splitlines()[-1])
    print(f"all_reduce, {args.ranks} ranks on loopback (median of {args.iters} calls)")
    print(f"{'bytes':>10} {'mooncake-cpu us':>16} {'gloo us':>10} {'ratio':>7}")
    for row in res["rows"]:
        ratio = row["mooncake_us"] / row["gloo_us"] if row["gloo_us"] else 0.0
        print(f"{row['bytes']:>10} {row['mooncake_us']:>16} {row['gloo_us']:>10} {ratio:>7.2f}")
    if args.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
