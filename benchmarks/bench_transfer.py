"""Transfer-engine benchmark (same as ``mooncake-core bench transfer``)."""

import sys

from mooncake_core.bench.transfer import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
