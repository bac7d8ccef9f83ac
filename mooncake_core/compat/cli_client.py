"""``mooncake.cli_client``: the published ``mooncake_client`` command, run by ours.

The published ``main()`` replaces the process with the wheel's ``mooncake_client``
binary (a standalone store client that ``setup_dummy`` stores attach to). Ours replaces
it with ``python -m mooncake_core client`` and the same arguments (the PID stays, as
published, so callers can stop it). A flag that the published client does not have, or
that we do not accept (:data:`NOT_TAKEN`), ends as one line on stderr, exit status 2; the
opt-in ``mooncake_client`` console script checks with the same :func:`unsupported_flags`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = [
    "main",
    "PUBLISHED_FLAGS",
    "UNSUPPORTED",
    "NOT_TAKEN",
    "check_flags",
    "unsupported_flags",
]

_NO_OFFLOAD = "the standalone client has no SSD offload tier"
_LOG = "logs go to stderr; use --log-level"
_ARENA = "no mmap arena allocator"

#: The published ``mooncake_client`` flags (0.3.13, ``--help``): name, gflags type,
#: published default, kind (``map`` implemented, ``noop`` accepted with a warning when not
#: at the default, ``off`` refused unless at the default) and a note.
PUBLISHED_FLAGS: tuple[tuple[str, str, str, str, str], ...] = (
    ("host", "string", "0.0.0.0", "map", ""),
    ("port", "int32", "50052", "map", ""),
    ("master_server_address", "string", "127.0.0.1:50051", "map", ""),
    ("metadata_server", "string", "http://127.0.0.1:8080/metadata", "map", ""),
    ("global_segment_size", "string", "4 GB", "map", ""),
    ("local_buffer_size", "string", "0", "map", ""),
    ("protocol", "string", "tcp", "map", ""),
    ("device_names", "string", "", "map", ""),
    ("tenant_id", "string", "default", "map", ""),
    ("threads", "int32", "1", "noop", "each attached process is served on its own thread"),
    ("enable_offload", "bool", "false", "off", _NO_OFFLOAD),
    ("start_offload_rpc_server", "bool", "true", "noop", _NO_OFFLOAD),
    ("enable_http_server", "bool", "false", "off", "the client has no HTTP server"),
    ("http_port", "int32", "9300", "noop", "the client has no HTTP server"),
    ("mmap_arena_pool_size", "uint64", "8589934592", "noop", _ARENA),
    ("use_mmap_arena_allocator", "bool", "false", "noop", _ARENA),
    ("version", "bool", "false", "map", ""),
    ("minloglevel", "int32", "0", "map", ""),
    ("v", "int32", "0", "noop", _LOG),
    ("logtostderr", "bool", "false", "noop", _LOG),
    ("alsologtostderr", "bool", "false", "noop", _LOG),
    ("colorlogtostderr", "bool", "false", "noop", _LOG),
    ("stderrthreshold", "int32", "2", "noop", _LOG),
    ("log_dir", "string", "", "noop", _LOG),
)

#: Published gflags we do not accept here, and why.
UNSUPPORTED: dict[str, str] = {
    "flagfile": "give the flags on the command line",
    "fromenv": "give the flags on the command line",
    "tryfromenv": "give the flags on the command line",
    "undefok": "every published flag is known here",
}
_GLOG = "a glog setting; logs go to stderr here, use --log-level"
_GFLAGS_HELP = "a gflags help variant; use --help"
#: Flags the published ``mooncake_client --help`` (0.3.13) lists that ours does not take.
NOT_TAKEN: dict[str, str] = {
    **UNSUPPORTED,
    **{
        name: _GLOG
        for name in (
            "alsologtoemail",
            "drop_log_memory",
            "log_backtrace_at",
            "log_link",
            "log_prefix",
            "logbuflevel",
            "logbufsecs",
            "logemaillevel",
            "logfile_mode",
            "logmailer",
            "max_log_size",
            "stop_logging_if_full_disk",
            "symbolize_stacktrace",
            "vmodule",
        )
    },
    **{name: _GFLAGS_HELP for name in ("helpmatch", "helpon", "helpxml")},
    "tab_completion_columns": "no shell completion",
    "tab_completion_word": "no shell completion",
}
_NOT_TAKEN_BOOLS = frozenset(
    {"drop_log_memory", "stop_logging_if_full_disk", "symbolize_stacktrace", "helpxml"}
)
_OURS_NOARG = frozenset({"help", "helpfull", "helpshort", "helppackage", "version"})
_OURS_ARG = frozenset({"log-level", "ready-file", "config"})


def unsupported_flags(argv: Sequence[str]) -> list[tuple[str, str]]:
    """Every flag in ``argv`` that ``mooncake_client`` here cannot run: ``(name, why)``."""
    known = {f[0]: f[1] == "bool" for f in PUBLISHED_FLAGS}
    bad: list[tuple[str, str]] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--":
            break
        if not arg.startswith("-") or arg == "-":
            continue
        name, eq, _value = arg.lstrip("-").partition("=")
        if name.startswith("no") and name[2:] in _NOT_TAKEN_BOOLS and not eq:
            bad.append((name[2:], NOT_TAKEN[name[2:]]))
        elif name in NOT_TAKEN:
            bad.append((name, NOT_TAKEN[name]))
            skip = not eq and name not in _NOT_TAKEN_BOOLS
        elif name in known:
            skip = not eq and not known[name]
        elif name.startswith("no") and known.get(name[2:]) and not eq:
            pass
        elif name in _OURS_ARG:
            skip = not eq
        elif name not in _OURS_NOARG:
            bad.append((name, "not a published mooncake_client flag"))
    return bad


def check_flags(argv: Sequence[str]) -> str | None:
    """One line naming the first flag in ``argv`` we cannot run (:func:`unsupported_flags`),
    else None."""
    bad = unsupported_flags(argv)
    if not bad:
        return None
    name, why = bad[0]
    if name not in NOT_TAKEN:
        return (
            f"mooncake_client: unknown flag --{name} (published mooncake_client flags: "
            "mooncake-core client --help)"
        )
    return f"mooncake_client: --{name} is not supported by mooncake-core ({why})"


def main() -> int:
    """Run ``mooncake-core client`` with this command line's (published ``mooncake_client``)
    arguments in this process (``exec``); returns 2 after one line for a flag it cannot run."""
    args = sys.argv[1:]
    problem = check_flags(args)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "mooncake_core", "client", *args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
