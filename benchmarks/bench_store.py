"""Store benchmark (same as ``mooncake-core bench store``)."""

import sys

from mooncake_core.bench.store import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
