"""``mooncake.cli_client``: the published ``mooncake_client`` command, run by ours.

The published ``main()`` replaces the process with the wheel's ``mooncake_client``
binary (a standalone store client that ``setup_dummy`` stores attach to). Ours replaces
it with ``python -m mooncake_core client`` and the same arguments (the PID stays, as
published, so callers can stop it). A flag that the published client does not have, or
that we do not accept (:data:`UNSUPPORTED`), ends as one line on stderr, exit status 2.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["main", "PUBLISHED_FLAGS", "UNSUPPORTED", "check_flags"]

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
_OURS = {"log-level", "ready-file", "config", "help", "helpfull", "helpshort"}


def check_flags(argv: Sequence[str]) -> str | None:
    """One line naming the first flag in ``argv`` we cannot run, else None."""
    known = {f[0] for f in PUBLISHED_FLAGS}
    bools = {f[0] for f in PUBLISHED_FLAGS if f[1] == "bool"}
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
        if name in UNSUPPORTED:
            return (
                f"mooncake_client: --{name} is not supported by mooncake-core ({UNSUPPORTED[name]})"
            )
        if name.startswith("no") and name[2:] in bools and not eq:
            continue
        if name not in known and name not in _OURS:
            return (
                f"mooncake_client: unknown flag --{name} (published mooncake_client flags: "
                "mooncake-core client --help)"
            )
        skip = not eq and name not in bools and name not in {"help", "helpfull", "helpshort"}
    return None


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
