"""Elastic EP benchmark (same as ``mooncake-core bench ep [--json]``)."""

import sys

from mooncake_core.bench.ep import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
