"""``mooncake-core bench NAME [options]``: run one of the benchmarks.

Each benchmark module defines ``main(argv) -> int``, prints a table and, with
``--json``, one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import importlib

BENCHES: dict[str, str] = {
    "transfer": "mooncake_core.bench.transfer",
    "store": "mooncake_core.bench.store",
    "conductor": "mooncake_core.bench.conductor",
    "ep": "mooncake_core.bench.ep",
    "vllm": "mooncake_core.bench.vllm",
    "sglang": "mooncake_core.bench.sglang",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see NAME --help)")


def run(args: argparse.Namespace) -> int:
    try:
        mod = importlib.import_module(BENCHES[args.name])
    except ModuleNotFoundError as exc:
        raise SystemExit(f"mooncake-core: error: benchmark {args.name!r} is not available ({exc})") from None
    return int(mod.main(list(args.rest)) or 0)
