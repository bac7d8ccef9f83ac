"""vLLM benchmark: same as ``mooncake-core bench vllm [--json]``."""

import sys

from mooncake_vllm.bench import main

raise SystemExit(main(sys.argv[1:]))
