"""vLLM benchmark: same as ``mooncake-core bench vllm [--json]``."""

import sys

from mooncake_core.bench.vllm import main

raise SystemExit(main(sys.argv[1:]))
