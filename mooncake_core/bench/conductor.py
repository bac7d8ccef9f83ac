"""``mooncake-core bench conductor [--json]``: conductor decision latency and replay speed.

Measures:

- ``decide_us_<N>``: mean wall time of one ``Conductor.decide`` (global-cache, the most
  expensive policy, committing) with N = 8, 64 and 512 prefill instances (N/2 decode),
  after warming the caches with the first part of the trace.
- ``replay_req_per_s``: simulated requests per wall second replaying the trace with
  global-cache on the default cluster.
- ``mean_ttft_s_<policy>`` (and p90, hit rate, wall time): each policy on the trace with the
  default cluster, no rejection. Keys use ``_`` for the ``-`` in policy names; the mean
  TTFT is also given under the exact policy name (``mean_ttft_s_global-cache``).

The trace is ``--trace``, else ``$MOONCAKE_TRACE_DIR/conversation_trace.jsonl``, else the
shared copy next to the repository (``../shared/traces``), else the shipped test excerpt.
Prints a table; with ``--json`` one JSON object on the last line.

``--live`` (``--quick`` for the short variant) instead replays a slice of the trace through
``mooncake-core proxy`` on real engine instances, ``global-cache`` against ``least-load``
(:mod:`mooncake_core.bench.conductor_live`; the engines come from an installed adapter).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from mooncake_core import config
from mooncake_core.bench import conductor_live
from mooncake_core.conductor.policy import POLICIES
from mooncake_core.conductor.scheduler import Conductor, ConductorConfig
from mooncake_core.conductor.simulator import DEFAULT_CLUSTER, simulate
from mooncake_core.conductor.trace import Request, load_trace

__all__ = ["main", "find_trace"]

_NAME = "conversation_trace.jsonl"


def find_trace() -> Path | None:
    """Locate the conversation trace (see the module docstring); None if nowhere."""
    repo = Path(__file__).resolve().parents[2]
    cands = []
    trace_dir = config.env_str("MOONCAKE_TRACE_DIR")
    if trace_dir:
        cands.append(Path(trace_dir) / _NAME)
    cands += [
        Path.cwd().parent / "shared" / "traces" / _NAME,
        repo.parent / "shared" / "traces" / _NAME,
        repo / "tests" / "data" / "conversation_excerpt.jsonl",
    ]
    return next((p for p in cands if p.is_file()), None)


def _decide_us(reqs: list[Request], n: int, warm: int, timed: int) -> float:
    d = DEFAULT_CLUSTER
    cond = Conductor(
        ConductorConfig(n, max(n // 2, 1), "global-cache", cache_blocks=d.cache_blocks)
    )
    total = 0.0
    count = 0
    for k, r in enumerate(reqs[: warm + timed]):
        t0 = time.perf_counter()
        dec = cond.decide(r, r.arrival_s)
        if k >= warm:
            total += time.perf_counter() - t0
            count += 1
        # Complete prefills at once so caches fill up like in a steady state.
        cond.prefill_done(dec, r.blocks, r.arrival_s)
    return 1e6 * total / max(count, 1)


def main(argv: list[str]) -> int:
    """Run the benchmark; returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="mooncake-core bench conductor", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    ap.add_argument("--trace", default=None, help="trace to use (default: see module docstring)")
    ap.add_argument(
        "--decisions", type=int, default=2000, help="timed decisions per size (default 2000)"
    )
    conductor_live.add_live_arguments(ap)
    args = ap.parse_args(argv)
    path = Path(args.trace) if args.trace else find_trace()
    if path is None:
        print("mooncake-core bench conductor: no trace found; pass --trace FILE")
        return 2
    if args.live:  # real engines behind the proxy (mooncake_core.bench.conductor_live)
        return conductor_live.run_live(args, path)
    reqs = load_trace(path)
    out: dict[str, Any] = {"trace": str(path), "requests": len(reqs)}
    warm = min(len(reqs) // 2, 3000)
    timed = min(args.decisions, len(reqs) - warm)
    print(f"conductor bench on {path} ({len(reqs)} requests)")
    print(f"{'instances':>10} {'decide us':>10}")
    for n in (8, 64, 512):
        us = _decide_us(reqs, n, warm, timed)
        out[f"decide_us_{n}"] = round(us, 2)
        print(f"{n:>10} {us:>10.1f}")
    d = DEFAULT_CLUSTER
    print(
        f"\n{'policy':<13} {'TTFT mean':>9} {'p90':>8} {'hit':>6} {'wall s':>7} {'req/s':>8}"
        f"   ({d.n_prefill} prefill + {d.n_decode} decode)"
    )
    for name in POLICIES:
        cfg = ConductorConfig(
            d.n_prefill, d.n_decode, name, cache_blocks=d.cache_blocks, store_blocks=d.store_blocks
        )
        res = simulate(reqs, cfg)
        m = res.metrics()
        rps = len(reqs) / res.wall_s
        key = name.replace("-", "_")
        out[f"mean_ttft_s_{name}"] = out[f"mean_ttft_s_{key}"] = round(m["mean_ttft_s"], 4)
        out[f"p90_ttft_s_{key}"] = round(m["p90_ttft_s"], 4)
        out[f"hit_rate_{key}"] = round(m["hit_rate"], 4)
        out[f"replay_wall_s_{key}"] = round(res.wall_s, 3)
        if name == "global-cache":
            out["replay_req_per_s"] = round(rps, 1)
        print(
            f"{name:<13} {m['mean_ttft_s']:>9.3f} {m['p90_ttft_s']:>8.3f} {m['hit_rate']:>6.3f} "
            f"{res.wall_s:>7.2f} {rps:>8.0f}"
        )
    if args.json:
        print(json.dumps(out))
    return 0
