"""``python -m mooncake_core``: same as the ``mooncake-core`` console script."""

from __future__ import annotations

from mooncake_core.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
