"""mooncake-sglang passes the adapter conformance suite, on SGLang's real classes.

Runs SGLang's host pools, storage config, backend factory (``dynamic``) and
HiCacheController storage methods on CPU against a real master and memory node; no
SGLang server is involved (see docs/sglang.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed (scripts/setup.sh)"
)

from mooncake_conformance import AdapterContract, KVLayout, adapter_fixtures  # noqa: E402

BASE = KVLayout("page_first", num_layers=4, page_size=16, num_kv_heads=4, head_dim=32, num_slots=24)
LAYOUTS = [
    BASE,
    BASE.replace(name="page_first_direct"),
    BASE.replace(name="layer_first"),
    BASE.replace(tp_size=2),
    BASE.replace(name="layer_first", tp_size=2),
    BASE.replace(mla=True, tp_size=2),
    BASE.replace(name="page_first_direct", mla=True),
    BASE.replace(name="layer_first", mla=True, tp_size=2),
]


def _worker_env() -> dict[str, str]:
    here = str(Path(__file__).resolve().parent)
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": here + (os.pathsep + path if path else "")}


SGLangFixtures = adapter_fixtures(
    "sglang",
    # mooncake_sglang.testing.harness:make_harness, after the inert torchvision is in
    # place (worker processes do not run conftest.py)
    "sglang_worker_harness:make_harness",
    LAYOUTS,
    adapter_package="mooncake_sglang",
    harness_options={"backend": "dynamic", "interface_v1": 1},
    worker_env=_worker_env,
    no_migration_reason="SGLang's PD transfer backend (its own MooncakeKVManager on our "
    "compat engine) is checked in test_sglang_pd_mooncake.py; no migration pair for this suite yet",
)


class TestSGLang(AdapterContract, SGLangFixtures):  # type: ignore[valid-type,misc]
    """The zero-copy (``interface_v1``) path, as SGLang selects it for our dynamic backend."""
