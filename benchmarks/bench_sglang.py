"""SGLang HiCache backend benchmark (same as ``mooncake-core bench sglang``)."""

import sys

from mooncake_sglang.bench import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
