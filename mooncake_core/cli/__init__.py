"""The ``mooncake-core`` command line (also ``python -m mooncake_core``).

Subcommands live in their own modules and are imported only when used. Each module
defines ``add_arguments(parser)`` and ``run(args) -> int``. Installed packages add
commands through the entry-point group ``mooncake_core.cli``
(:mod:`mooncake_core.cli.extensions`): engine adapters bring their demos (``pd-demo``)
and benchmarks (``bench vllm``, ``bench sglang``) that way.

``--log-level`` (before or after the command) defaults to the config's ``log.level``
(``MOONCAKE_LOG_LEVEL``); ``--version`` (before or after the command) prints the version.

What goes wrong in a command ends as one line on stderr, never a traceback: a
:class:`~mooncake_core.errors.MooncakeError`, a port already in use (exit status 2 for
both) and a missing optional package (naming the extra that brings it).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import re
import sys
from collections.abc import Sequence

from mooncake_core import __version__
from mooncake_core.cli import extensions
from mooncake_core.errors import ConfigError, MissingDependency, MooncakeError

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
    "client": (
        "mooncake_core.cli.standalone_client",
        "run a standalone store client that setup_dummy stores attach to",
    ),
    "simulate": (
        "mooncake_core.cli.simulate",
        "replay a request trace through the conductor simulator",
    ),
    "conductor": ("mooncake_core.cli.conductor", "conductor tools (fit the cost model)"),
    "proxy": ("mooncake_core.cli.proxy", "OpenAI-compatible prefill/decode proxy"),
    "p2p": ("mooncake_core.cli.p2p", "P2P store: seed, get, list and remove large blobs"),
    "top": ("mooncake_core.cli.top", "live terminal view of a cluster's metrics"),
}

_LOG_HELP = "logging level (default: the config's log.level, MOONCAKE_LOG_LEVEL, else INFO)"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_VERSION = f"mooncake-core {__version__}"
_VERSION_HELP = "print the version and exit"
_BIND_ADDRESS = re.compile(r"address \('?([^',]*)'?, (\d+)\)")


def _check_level(level: str, where: str) -> str:
    if level.upper() not in _LEVELS:
        raise ConfigError(f"{where}: unknown log level {level!r} (use one of {', '.join(_LEVELS)})")
    return level.upper()


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


def _wants_version(args: Sequence[str]) -> bool:
    """``--version`` anywhere before a ``--`` (before or after the command)."""
    for a in args:
        if a == "--":
            return False
        if a == "--version":
            return True
    return False


def _error(message: str) -> int:
    print(f"mooncake-core: error: {message}", file=sys.stderr)
    return 2


def _port_in_use(exc: OSError, command: str, args: argparse.Namespace) -> str:
    """One line for EADDRINUSE: the port (from the bind error, else the command's options)."""
    m = _BIND_ADDRESS.search(str(exc))
    if m:
        host, port = m.group(1), m.group(2)
        where = f"port {port} on {host}" if host else f"port {port}"
    else:
        ports = [
            f"--{k.replace('_', '-')} {v}"
            for k, v in sorted(vars(args).items())
            if k.endswith("port") and isinstance(v, int) and v > 0
        ]
        where = "a port it listens on" + (f" ({', '.join(ports)})" if ports else "")
    return f"{command}: {where} is already in use; stop what holds it or choose another port"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="mooncake-core", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--log-level", default=None, help=_LOG_HELP)
    parser.add_argument("--version", action="version", version=_VERSION, help=_VERSION_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    args_list = list(sys.argv[1:] if argv is None else argv)
    if _wants_version(args_list):  # every command, before its own (maybe required) options
        print(_VERSION)
        return 0
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
                return _error(str(MissingDependency(exc.name or str(exc), f"command {name!r}")))
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
            if "--log-level" not in p._option_string_actions:
                p.add_argument("--log-level", default=argparse.SUPPRESS, help=_LOG_HELP)
            if "--version" not in p._option_string_actions:
                p.add_argument("--version", action="version", version=_VERSION, help=_VERSION_HELP)
    args = parser.parse_args(args_list)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0 if args.command is None else 2
    command = str(args.command)
    try:
        if args.log_level is not None:
            _check_level(args.log_level, "--log-level")
        from mooncake_core.config import load_config

        cfg = (
            load_config()
        )  # a bad file or MOONCAKE_* variable fails here, as one line naming the key
        _setup_logging(args.log_level or cfg.log.level)
        return int(args._run(args) or 0)
    except MooncakeError as exc:
        return _error(str(exc))
    except ModuleNotFoundError as exc:  # an optional package the command needs
        return _error(str(MissingDependency(exc.name or str(exc), command)))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        return _error(_port_in_use(exc, command, args))
    except KeyboardInterrupt:
        return 130
