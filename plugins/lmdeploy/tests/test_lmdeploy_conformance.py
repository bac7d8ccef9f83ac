"""mooncake-lmdeploy's store path passes the adapter conformance suite, on LMDeploy's code.

LMDeploy's own ``MooncakeStoreConnector`` (worker role, built by its ``build_kv_connector``)
saves and loads the blocks of a real ``CacheEngine``'s pools (on the CPU) through
``mooncake.store`` = ``mooncake_core.compat.store``, against a real master and memory
node. The harness (``mooncake_lmdeploy.store_harness``) stands in for LMDeploy's scheduler
and for the GPU (CPU rows that report ``is_cuda``, a host ``cuda.Event``); see
docs/lmdeploy.md.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip(
    "lmdeploy.pytorch.kv_connector", reason="lmdeploy is not installed (scripts/setup.sh)"
)

from mooncake_conformance import AdapterContract, KVLayout, adapter_fixtures  # noqa: E402

# LMDeploy's packed layout: one uint8 pool [layers, blocks, K|V bytes of a block]
BASE = KVLayout("packed", num_layers=4, page_size=16, num_kv_heads=4, head_dim=32, num_slots=24)
LAYOUTS = [
    BASE,
    BASE.replace(tp_size=2),
    BASE.replace(page_size=64, dtype="float16", num_layers=2),
]


LMDeployFixtures = adapter_fixtures(
    "lmdeploy",
    "mooncake_lmdeploy.store_harness:make_harness",
    LAYOUTS,
    adapter_package="mooncake_lmdeploy",
    # LMDeploy's worker calls the compat store synchronously, which waits up to 15 s per
    # call for a master: an outage blocks saves longer than the suite's budget
    supports_store_faults=False,
)


class TestLMDeploy(AdapterContract, LMDeployFixtures):  # type: ignore[valid-type,misc]
    """LMDeploy's MooncakeStoreConnector, our store underneath."""

    @pytest.mark.xfail(
        reason="LMDeploy 0.18.0's store keys carry the TP rank but not the TP size "
        "(model@tp_rank:R@group:0@hash): rank 0 of a TP-2 engine finds the TP-1 engine's "
        "whole-block objects under its own keys, skips its put and cannot load them. "
        "Workaround: a distinct kv_connector_extra_config.cache_prefix per TP size "
        "(docs/lmdeploy.md)",
        strict=True,
    )
    def test_keys_differ_across_models_and_ranks(
        self, base_layout: KVLayout, make_harness: Any, rng: random.Random
    ) -> None:
        super().test_keys_differ_across_models_and_ranks(base_layout, make_harness, rng)
