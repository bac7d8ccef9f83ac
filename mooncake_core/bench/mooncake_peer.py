"""Moved to ``benchmarks/published/mooncake_peer.py`` (out of the runtime package).

This name stays for existing imports and re-exports that module's API; it needs the
source checkout (see :mod:`mooncake_core.bench.published`). New code: use
``mooncake_core.bench.published.peer()``.
"""

from __future__ import annotations

from mooncake_core.bench.published import peer as _peer

_mod = _peer()

run_mooncake_transfer_bench = _mod.run_mooncake_transfer_bench
run_mooncake_store_bench = _mod.run_mooncake_store_bench
mooncake_env = _mod.mooncake_env
default_peer_python = _mod.default_peer_python
free_port = _mod.free_port
TRANSFER_SCRIPT = _mod.TRANSFER_SCRIPT
STORE_SCRIPT = _mod.STORE_SCRIPT

__all__ = ["run_mooncake_transfer_bench", "run_mooncake_store_bench", "mooncake_env", "default_peer_python",
           "free_port", "TRANSFER_SCRIPT", "STORE_SCRIPT"]
