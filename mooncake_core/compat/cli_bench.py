"""``mooncake.cli_bench`` drop-in: ``main()`` runs the published ``transfer_engine_bench``
command line on our engine (see :func:`mooncake_core.compat.cli_tools.bench_main`)."""

from __future__ import annotations

import sys

from mooncake_core.compat.cli_tools import bench_main

__all__ = ["main"]


def main() -> int:
    """The exit status of the benchmark run with the flags in :data:`sys.argv`."""
    return bench_main()


if __name__ == "__main__":
    sys.exit(main())
