"""Conductor benchmark: same as ``mooncake-core bench conductor [--json]``."""

import sys

from mooncake_core.bench.conductor import main

raise SystemExit(main(sys.argv[1:]))
