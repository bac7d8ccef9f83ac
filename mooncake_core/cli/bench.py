"""``mooncake-core bench NAME [options]``: run one of the benchmarks.

Each benchmark module defines ``main(argv) -> int``, prints a table and, with
``--json``, one JSON object as its last line. The core's are below; engine adapters add
theirs (``bench vllm``, ``bench sglang``) through entry points ``bench.NAME`` of the group
``mooncake_core.cli`` (:mod:`mooncake_core.cli.extensions`).
"""

from __future__ import annotations

import argparse
import importlib

from mooncake_core.cli import extensions
from mooncake_core.errors import ConfigError, MissingDependency

__all__ = ["BENCHES", "add_arguments", "available", "run"]

BENCHES: dict[str, str] = {
    "transfer": "mooncake_core.bench.transfer",
    "store": "mooncake_core.bench.store",
    "conductor": "mooncake_core.bench.conductor",
    "ep": "mooncake_core.bench.ep",
    "p2p": "mooncake_core.bench.p2p",
    "soak": "mooncake_core.bench.soak",
}


def available() -> dict[str, str]:
    """Every benchmark: the core's and the installed adapters' (name -> module)."""
    out = dict(BENCHES)
    for name, mod in extensions.benches().items():
        out.setdefault(name, mod)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ", ".join(sorted(available()))
    parser.add_argument("name", metavar="NAME", help=f"which benchmark: {names}")
    parser.add_argument(
        "rest", nargs=argparse.REMAINDER, help="options of that benchmark (see NAME --help)"
    )


def run(args: argparse.Namespace) -> int:
    table = available()
    if args.name not in table:
        raise ConfigError(
            f"no benchmark {args.name!r}; available: {', '.join(sorted(table))} "
            "(engine benchmarks come with their adapters)"
        )
    try:
        mod = importlib.import_module(table[args.name])
    except ModuleNotFoundError as exc:  # an optional package (torch for ep), named with its extra
        raise MissingDependency(exc.name or str(exc), f"bench {args.name}") from None
    try:
        return int(mod.main(list(args.rest)) or 0)
    except ModuleNotFoundError as exc:  # imported late by the benchmark
        raise MissingDependency(exc.name or str(exc), f"bench {args.name}") from None
