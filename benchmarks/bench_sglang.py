"""SGLang HiCache backend benchmark (same as ``mooncake-core bench sglang``)."""

import sys

from mooncake_core.bench.sglang import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
