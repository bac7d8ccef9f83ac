"""The ``mooncake-core`` command line (also ``python -m mooncake_core``).

Subcommands live in their own modules and are imported only when used. Each module
defines ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

from mooncake_core.errors import MooncakeError

__all__ = ["main", "COMMANDS"]

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("mooncake_core.cli.demo", "transfer-engine demo: two processes move KV tensors over loopback"),
    "pd-demo": ("mooncake_core.cli.pd_demo", "prefill/decode demo on a real vLLM (the README's main job)"),
    "bench": ("mooncake_core.cli.bench", "run a benchmark: transfer, store, conductor, ep, ..."),
    "plugins": ("mooncake_core.cli.plugins_cmd", "list discovered transports, metadata backends and adapters"),
    "metadata-server": ("mooncake_core.cli.metadata_server", "run the HTTP metadata server"),
    "master": ("mooncake_core.cli.master", "run a store master"),
    "store": ("mooncake_core.cli.store_node", "run a store node that only contributes memory"),
    "simulate": ("mooncake_core.cli.simulate", "replay a request trace through the conductor simulator"),
    "conductor": ("mooncake_core.cli.conductor", "conductor tools (fit the cost model)"),
    "proxy": ("mooncake_core.cli.proxy", "OpenAI-compatible prefill/decode proxy"),
}


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = argparse.ArgumentParser(prog="mooncake-core", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--log-level", default=os.environ.get("MOONCAKE_LOG_LEVEL", "INFO"), help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    args_list = list(sys.argv[1:] if argv is None else argv)
    # Only import the chosen subcommand's module (others may need optional packages).
    chosen = next((a for a in args_list if a in COMMANDS), None)
    for name, (modpath, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:
            try:
                mod = importlib.import_module(modpath)
            except ModuleNotFoundError as exc:
                print(f"mooncake-core: error: command {name!r} is not available ({exc})", file=sys.stderr)
                return 2
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(args_list)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0 if args.command is None else 2
    _setup_logging(args.log_level)
    try:
        from mooncake_core.config import load_config

        load_config()  # a bad file or MOONCAKE_* variable fails here, as one line naming the key
        return int(args._run(args) or 0)
    except MooncakeError as exc:
        print(f"mooncake-core: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
