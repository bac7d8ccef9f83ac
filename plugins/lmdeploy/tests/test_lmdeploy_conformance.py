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
    no_migration_reason="LMDeploy's migration checks run in test_lmdeploy_pd.py "
    "(TestLMDeployMigration), on the two rank processes that module holds",
)


class TestLMDeploy(AdapterContract, LMDeployFixtures):  # type: ignore[valid-type,misc]
    """LMDeploy's MooncakeStoreConnector, our store underneath."""

    def test_keys_carry_the_tp_size_and_a_hit_needs_every_shard(
        self, base_layout: KVLayout, make_harness: Any, rng: random.Random
    ) -> None:
        """LMDeploy 0.18.0's keys lack the TP size; mooncake_lmdeploy.store_keys adds it.
        A TP-1 engine neither hits nor loads what rank 0 of a TP-2 engine of the same
        model saved (half the KV heads), LMDeploy's own lookup (every KV-head shard of a
        block) hits only once both TP-2 ranks saved, and the TP-1 engine then saves and
        reads back its own bytes."""
        from mooncake_conformance.scenarios import expected_pages, fill_pages, verify_loaded

        pages = 4
        one = make_harness(base_layout)
        tp2 = base_layout.replace(tp_size=2)
        r0, r1 = make_harness(tp2, rank=0), make_harness(tp2, rank=1)
        tokens = [rng.randrange(32000) for _ in range(pages * one.page_size)]
        k1, k0 = one.page_keys(tokens), r0.page_keys(tokens)
        assert "@tp_size:1@tp_rank:0@" in k1[0][0] and "@tp_size:2@tp_rank:0@" in k0[0][0]
        assert {k for p in k1 for k in p}.isdisjoint(k for p in k0 for k in p)
        src, dst = list(range(pages)), list(range(pages, 2 * pages))
        fill_pages(r0, tokens, src)
        assert r0.save(tokens, src) == pages
        assert one.lookup(tokens) == 0, "a TP-1 engine hits on a TP-2 rank's shard"
        assert one.load(tokens, dst) == 0, "a TP-1 engine loaded a TP-2 rank's shard"

        def lmdeploy_lookup(h: Any) -> int:  # LMDeploy's MooncakeStoreWorker.lookup
            return int(h.worker.lookup(len(tokens), h._hashes(tokens)) // h.page_size)

        assert lmdeploy_lookup(r0) == 0, "a hit without rank 1's shard"
        fill_pages(r1, tokens, src)
        assert r1.save(tokens, src) == pages
        assert lmdeploy_lookup(r0) == lmdeploy_lookup(r1) == pages
        want = expected_pages(one, tokens, pages, one.num_slots - 1)
        fill_pages(one, tokens, src)
        assert one.save(tokens, src) == pages and one.lookup(tokens) == pages
        for s in dst:
            one.fill(s, 0x5EED)
        assert one.load(tokens, dst) == pages
        assert not verify_loaded(one, dst, want, pages), "TP-1 pages differ after the round trip"
