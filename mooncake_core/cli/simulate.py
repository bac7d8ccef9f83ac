"""``mooncake-core simulate``: replay a Mooncake-format trace through the conductor.

Prints one table row per policy (or JSON with ``--json``) and, with ``--plot DIR``, writes
PNG plots. ``--policy`` takes one name, a comma-separated list, or ``all``.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from mooncake_core.conductor.costmodel import load_profile
from mooncake_core.conductor.plots import write_plots
from mooncake_core.conductor.policy import POLICIES
from mooncake_core.conductor.scheduler import DEFAULT_SLO_TBT_S, DEFAULT_SLO_TTFT_S, ConductorConfig
from mooncake_core.conductor.simulator import DEFAULT_CLUSTER, SimResult, simulate
from mooncake_core.conductor.trace import load_trace
from mooncake_core.errors import ConfigError, MissingDependency

__all__ = ["add_arguments", "run", "format_table"]

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DEFAULT_CLUSTER
    parser.add_argument("--trace", required=True, help="Mooncake-format JSONL trace")
    parser.add_argument(
        "--policy",
        default="global-cache",
        help=f"policy: {', '.join(POLICIES)}; a comma-separated list or 'all'",
    )
    parser.add_argument(
        "--prefill",
        type=int,
        default=d.n_prefill,
        help=f"prefill instances (default {d.n_prefill})",
    )
    parser.add_argument(
        "--decode", type=int, default=d.n_decode, help=f"decode instances (default {d.n_decode})"
    )
    parser.add_argument(
        "--cache-blocks",
        type=int,
        default=d.cache_blocks,
        help=f"KV blocks each prefill instance keeps (LRU; default {d.cache_blocks})",
    )
    parser.add_argument(
        "--store-blocks",
        type=int,
        default=d.store_blocks,
        help=f"shared store pool in blocks, fed by evictions (default {d.store_blocks})",
    )
    parser.add_argument(
        "--slo-ttft",
        type=float,
        default=DEFAULT_SLO_TTFT_S,
        help=f"TTFT SLO in seconds (default {DEFAULT_SLO_TTFT_S:g})",
    )
    parser.add_argument(
        "--slo-tbt",
        type=float,
        default=DEFAULT_SLO_TBT_S,
        help=f"TBT SLO in seconds (default {DEFAULT_SLO_TBT_S:g})",
    )
    parser.add_argument(
        "--speedup", type=float, default=1.0, help="replay K times faster (default 1)"
    )
    parser.add_argument(
        "--reject",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="early rejection (default off)",
    )
    parser.add_argument(
        "--threshold",
        type=int,
        default=2,
        help="fetch a remote prefix only if longer than the local one by more than this many "
        "blocks",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    parser.add_argument(
        "--profile", default=None, help="cost-model profile JSON (default: shipped A800 profile)"
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument(
        "--json", action="store_true", help="print JSON (one object on the last line)"
    )
    parser.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")


def _policies(spec: str) -> list[str]:
    names = list(POLICIES) if spec == "all" else [p.strip() for p in spec.split(",") if p.strip()]
    if not names:
        raise ConfigError("--policy is empty")
    for n in names:
        if n not in POLICIES:
            raise ConfigError(f"unknown policy {n!r}; choose one of {', '.join(POLICIES)} or 'all'")
    return names


_COLUMNS: tuple[tuple[str, str, int, str], ...] = (
    ("policy", "policy", -13, ""),
    ("reject", "rej", -5, ""),
    ("mean_ttft_s", "TTFT mean", 9, ".3f"),
    ("p90_ttft_s", "p90", 8, ".3f"),
    ("p99_ttft_s", "p99", 8, ".3f"),
    ("mean_tbt_s", "TBT mean", 8, ".4f"),
    ("p90_tbt_s", "p90", 7, ".4f"),
    ("slo_attainment", "SLO att", 7, ".3f"),
    ("goodput_rps", "goodput", 7, ".3f"),
    ("hit_rate", "hit", 5, ".3f"),
    ("rejected", "rejected", 8, "d"),
    ("prefill_utilization", "util", 5, ".2f"),
    ("wall_s", "wall s", 6, ".2f"),
)


def _cell(value: object, width: int, spec: str) -> str:
    text = format(value, spec) if spec else str(value)
    return text.ljust(-width) if width < 0 else text.rjust(width)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Format metric dicts as a fixed-width table (times in seconds, goodput in req/s)."""
    lines = [" ".join(_cell(h, w, "") for _, h, w, _ in _COLUMNS)]
    for r in rows:
        lines.append(" ".join(_cell(r[k], w, spec) for k, _, w, spec in _COLUMNS))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    names = _policies(args.policy)
    if args.plot:  # fail before the simulation, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise MissingDependency("matplotlib", "simulate --plot") from exc
    profile = load_profile(args.profile)
    reqs = load_trace(args.trace, speedup=args.speedup, limit=args.limit)
    results: list[SimResult] = []
    for name in names:
        cfg = ConductorConfig(
            n_prefill=args.prefill,
            n_decode=args.decode,
            policy=name,
            reject=args.reject,
            slo_ttft_s=args.slo_ttft,
            slo_tbt_s=args.slo_tbt,
            balance_threshold_blocks=args.threshold,
            cache_blocks=args.cache_blocks,
            store_blocks=args.store_blocks,
            seed=args.seed,
        )
        results.append(simulate(reqs, cfg, profile, speedup=args.speedup))
    rows = [r.metrics() for r in results]
    if args.plot:
        for path in write_plots(results, args.plot):
            logger.info("plot: %s", path)
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else {"runs": rows}))
    else:
        print(
            f"trace {args.trace}: {len(reqs)} requests, speedup {args.speedup:g}, "
            f"{args.prefill} prefill + {args.decode} decode, "
            f"SLO TTFT {args.slo_ttft:g} s / TBT {args.slo_tbt:g} s"
        )
        print(format_table(rows))
    return 0
