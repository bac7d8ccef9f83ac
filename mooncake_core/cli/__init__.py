"""The ``mooncake-core`` command line (also ``python -m mooncake_core``).

Subcommands live in their own modules and are imported only when used. Each module
defines ``add_arguments(parser)`` and ``run(args) -> int``. Installed packages add
commands through the entry-point group ``mooncake_core.cli``
(:mod:`mooncake_core.cli.extensions`): engine adapters bring their demos (``pd-demo``)
and benchmarks (``bench vllm``, ``bench sglang``) that way.

``--log-level`` (before or after the command) defaults to the config's ``log.level``
(``MOONCAKE_LOG_LEVEL``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from mooncake_core.cli import extensions
from mooncake_core.errors import MooncakeError

__all__ = ["main", "COMMANDS"]

# name -> (module, one-line help); adapters add theirs through extensions
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "mooncake_core.cli.demo",
        "transfer-engine demo: two processes move KV tensors over loopback",
    ),
    "bench": (
        "mooncake_core.cli.bench",
        "run a benchmark: transfer, store, conductor, ep, and adapters' ones",
    ),
    "plugins": (
        "mooncake_core.cli.plugins_cmd",
        "list discovered transports, metadata backends and adapters",
    ),
    "metadata-server": ("mooncake_core.cli.metadata_server", "run the HTTP metadata server"),
    "master": ("mooncake_core.cli.master", "run a store master"),
    "store": ("mooncake_core.cli.store_node", "run a store node that only contributes memory"),
    "simulate": (
        "mooncake_core.cli.simulate",
        "replay a request trace through the conductor simulator",
    ),
    "conductor": ("mooncake_core.cli.conductor", "conductor tools (fit the cost model)"),
    "proxy": ("mooncake_core.cli.proxy", "OpenAI-compatible prefill/decode proxy"),
}

_LOG_HELP = "logging level (default: the config's log.level, MOONCAKE_LOG_LEVEL, else INFO)"


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _command_word(args: Sequence[str]) -> str | None:
    """The first argument that is not an option of the main parser (the command)."""
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--log-level":
            skip = True
        elif not a.startswith("-"):
            return a
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="mooncake-core", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--log-level", default=None, help=_LOG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    args_list = list(sys.argv[1:] if argv is None else argv)
    table: dict[str, tuple[str, str | None]] = dict(COMMANDS)
    for name, modpath in extensions.commands().items():
        table.setdefault(name, (modpath, None))
    word = _command_word(args_list)
    if word is not None and word not in table:
        print(
            f"mooncake-core: error: no command {word!r}; commands: {', '.join(sorted(table))} "
            "(engine adapters add theirs, e.g. pd-demo, when installed)",
            file=sys.stderr,
        )
        return 2
    # Only import the chosen subcommand's module (others may need optional packages).
    for name, (modpath, help_) in table.items():
        if help_ is None:  # an adapter's command: its docstring, read only for the listing
            help_ = extensions.summary(modpath) if word is None else ""
        p = sub.add_parser(name, help=help_, description=help_)
        if name == word:
            try:
                mod = importlib.import_module(modpath)
            except ModuleNotFoundError as exc:
                print(
                    f"mooncake-core: error: command {name!r} is not available ({exc})",
                    file=sys.stderr,
                )
                return 2
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
            if "--log-level" not in p._option_string_actions:
                p.add_argument("--log-level", default=argparse.SUPPRESS, help=_LOG_HELP)
    args = parser.parse_args(args_list)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        from mooncake_core.config import load_config

        cfg = (
            load_config()
        )  # a bad file or MOONCAKE_* variable fails here, as one line naming the key
        _setup_logging(args.log_level or cfg.log.level)
        return int(args._run(args) or 0)
    except MooncakeError as exc:
        print(f"mooncake-core: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
