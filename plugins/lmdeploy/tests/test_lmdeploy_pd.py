"""LMDeploy's PD migration path on our backend: two processes, LMDeploy's real cache engine.

Each rank is a process (``python -m mooncake_lmdeploy.testing``) holding a real LMDeploy
``CacheEngine`` whose block pools are CPU tensors from LMDeploy's own block-cache plan
(only ``CacheEngine.__init__``, which allocates on CUDA, is bypassed). The ranks are linked
the way LMDeploy's proxy links a prefill and a decode engine, and the decode rank runs
``await CacheEngine.migrate(...)``: LMDeploy builds the assignments
(``build_cache_pool_assignments``) and calls the backend registered as ``Mooncake``,
which must be ours in every process without any setup (``mooncake_lmdeploy.pth``).
Transport: TCP (shared memory off), the path between hosts without RDMA.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip(
    "lmdeploy.pytorch.disagg.backend", reason="lmdeploy is not installed (scripts/setup.sh)"
)

from mooncake_conformance import KVLayout, MigrationContract, adapter_fixtures  # noqa: E402
from mooncake_lmdeploy.migration import migration_deadline_s  # noqa: E402
from mooncake_lmdeploy.testing import RankError, RankPair, RankProcess, link_pair  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

P_ID = "http://127.0.0.1:23333"
P_BLOCKS, D_BLOCKS = 32, 24
TIMEOUT_S = 2.0
# 4 layers x 16 tokens x 2 KV heads x 64 dims x K,V x bf16 = 8 KiB per layer and block
BLOCK_BYTES = 4 * 16 * 2 * 64 * 2 * 2
ZERO = hashlib.sha256(bytes(BLOCK_BYTES)).hexdigest()


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[RankProcess, RankProcess, dict[str, Any], dict[str, Any]]]:
    env = {"MOONCAKE_TRANSFER_SHM": "0", "MOONCAKE_LMDEPLOY_MIGRATION_TIMEOUT_S": str(TIMEOUT_S)}
    p = RankProcess("prefill", env)
    d = RankProcess("decode", env)
    try:
        sp = p.call("setup", blocks=P_BLOCKS)
        sd = d.call("setup", blocks=D_BLOCKS)
        link_pair(p, d, blocks_p=P_BLOCKS, blocks_d=D_BLOCKS)
        yield p, d, sp, sd
    finally:
        p.resume()
        p.close()
        d.close()


def _batch(pairs: list[tuple[int, int]]) -> dict[str, Any]:
    from lmdeploy.pytorch.disagg.conn.protocol import MigrationProtocol

    return {
        "protocol": MigrationProtocol.RDMA.value,
        "requests": [[P_ID, [list(x) for x in pairs]]],
    }


def _migrate_and_check(
    p: RankProcess, d: RankProcess, pairs: list[tuple[int, int]], seed: int
) -> None:
    p.call("fill", blocks=list(range(P_BLOCKS)), seed=seed)
    d.call("zero")
    d.call("migrate", batch=_batch(pairs))
    src, dst = [a for a, _ in pairs], [b for _, b in pairs]
    assert p.call("digest", blocks=src)["sha"] == d.call("digest", blocks=dst)["sha"]
    rest = [b for b in range(D_BLOCKS) if b not in dst]
    assert set(d.call("digest", blocks=rest)["sha"]) == {ZERO}, "bytes landed outside the blocks"


def test_backend_is_ours_in_every_lmdeploy_process(pair: Any) -> None:
    """No setup in the ranks: mooncake_lmdeploy.pth registered our class under 'Mooncake',
    and mooncake.store (LMDeploy's store connector import) is our compat store."""
    p, d, sp, sd = pair
    for out in (sp, sd):
        assert out["backend"] == "mooncake_lmdeploy.migration.MooncakeCoreBackend"
        assert out["pools"] and out["pools"][0][0] == 4  # LMDeploy's packed [layers, blocks, bytes]
    assert d.call("modules")["mooncake.store"] == "mooncake_core.compat.store"


def test_autoload_off_keeps_lmdeploys_backend() -> None:
    code = (
        "from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS as R;"
        "c = R.module_dict['Mooncake']; print(c.__module__ + '.' + c.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "MOONCAKE_LMDEPLOY_AUTOLOAD": "0"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split()[-1] == "lmdeploy.pytorch.disagg.backend.mooncake.MooncakeBackend"


def test_migration_moves_lmdeploys_assignments_byte_for_byte(pair: Any) -> None:
    p, d, _, _ = pair
    # scattered pairs, a contiguous run (merged into one read per layer), a reversed run
    pairs = [(3, 0), (4, 1), (5, 2), (17, 20), (9, 7), (31, 23), (30, 22), (0, 11)]
    before = d.call("stats")["stats"]
    _migrate_and_check(p, d, pairs, seed=1)
    after = d.call("stats")["stats"]
    assert after["bytes"] - before["bytes"] == len(pairs) * BLOCK_BYTES
    # LMDeploy emits one segment per layer and block (32 here); neighbours are merged
    assert after["requests"] - before["requests"] < 4 * len(pairs)


def test_bad_block_ids_fail_clearly_and_the_link_keeps_working(pair: Any) -> None:
    p, d, _, _ = pair
    with pytest.raises(RankError, match="outside cache pool"):
        d.call("migrate", batch=_batch([(P_BLOCKS + 5, 0)]))
    _migrate_and_check(p, d, [(1, 1), (2, 2)], seed=2)


def test_stalled_prefill_times_out_then_the_link_recovers(pair: Any) -> None:
    p, d, _, _ = pair
    # the link in use first (both connections of the batch open): a stall is then a
    # transfer that times out, whatever ran before (a first contact would fail in the
    # handshake instead)
    _migrate_and_check(p, d, [(6, 6), (7, 9)], seed=3)
    # stop() returns only once every thread of the prefill rank is stopped: a bare SIGSTOP
    # left its transfer listener serving for a moment on a loaded machine, and the
    # "stalled" migration then succeeded (an intermittent DID NOT RAISE in CI)
    p.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(RankError, match="MigrationError.*timed out"):
            d.call("migrate", batch=_batch([(6, 6), (7, 9)]))
        took = time.monotonic() - t0
    finally:
        p.resume()
    assert TIMEOUT_S - 0.5 < took < TIMEOUT_S + 6, f"migration took {took:.1f} s to fail"
    _migrate_and_check(p, d, [(6, 6), (7, 9)], seed=4)


def test_lmdeploys_decode_loop_fails_only_the_request_whose_migration_failed(pair: Any) -> None:
    """LMDeploy's real decode EngineLoop.migration_loop and Scheduler in the decode rank
    (mooncake_lmdeploy.loop_harness) over the linked cache engine: a migration refused by
    the prefill (a corrupt descriptor of its pool) and one from a stalled prefill each fail
    their own request (INTERNAL_ENGINE_ERROR, blocks back, the prefill told), the loop
    keeps running, and the next request's blocks arrive byte for byte. (The stalled case
    once stopped the loop: the engine's timeout was taken for an overrun.)"""
    p, d, _, _ = pair
    info = d.call("loop_start", blocks=D_BLOCKS)
    assert info["loop_running"] and info["patched"], info
    free = info["free_blocks"]
    p.call("fill", blocks=list(range(P_BLOCKS)), seed=5)
    d.call("zero")

    def request(session: int, blocks: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = d.call(
            "loop_request", session_id=session, remote_engine_id=P_ID, blocks=blocks, tokens=40
        )
        if out["response"] == "SUCCESS":
            assert len(out["decode_blocks"]) == len(blocks) and out["free_after_end"] == free
            want = p.call("digest", blocks=blocks)["sha"]
            assert d.call("digest", blocks=out["decode_blocks"])["sha"] == want
        return out

    first = request(10, [13, 2, 20])  # the link in use before the stall (see above)
    assert first["response"] == "SUCCESS", first
    d.call("corrupt_link", remote_engine_id=P_ID, delta=1 << 40)
    try:
        refused = request(11, [3, 4, 5])
    finally:
        d.call("corrupt_link", remote_engine_id=P_ID, delta=0)
    p.stop()
    try:
        stalled = request(12, [6, 7, 8])
    finally:
        p.resume()
    for out, why in ((refused, "failed"), (stalled, "timed out")):
        assert out["response"] == "INTERNAL_ENGINE_ERROR", out
        assert why in out["error"], out
        assert out["loop_running"] and out["loop_error"] is None, out
        assert out["blocks_held"] == 0 and out["free_blocks"] == free, out
    assert {11, 12} <= set(stalled["told_prefill"])
    good = request(13, [9, 10, 11])
    assert good["response"] == "SUCCESS" and good["loop_running"], good


# the conformance status is LMDeploy's (the store checks run in test_lmdeploy_conformance.py)
_Fixtures = adapter_fixtures(
    "lmdeploy",
    "mooncake_lmdeploy.store_harness:make_harness",
    [KVLayout("packed", num_layers=4, page_size=16, num_kv_heads=2, head_dim=64)],
    adapter_package="mooncake_lmdeploy",
)


class TestLMDeployMigration(MigrationContract, _Fixtures):  # type: ignore[valid-type,misc]
    """The conformance suite's PD migration checks on this module's two rank processes:
    LMDeploy's CacheEngine.migrate and its decode EngineLoop, our backend underneath."""

    @pytest.fixture
    def migration_pair(self, pair: Any, monkeypatch: pytest.MonkeyPatch) -> RankPair:
        p, d, _, _ = pair
        monkeypatch.setenv("MOONCAKE_LMDEPLOY_MIGRATION_TIMEOUT_S", str(TIMEOUT_S))
        return RankPair(
            p,
            d,
            prefill_blocks=P_BLOCKS,
            decode_blocks=D_BLOCKS,
            block_bytes=BLOCK_BYTES,
            deadline_s=migration_deadline_s(),
        )


def test_dead_prefill_fails_fast(pair: Any) -> None:
    p, d, _, _ = pair
    p.proc.kill()
    p.proc.wait()
    t0 = time.monotonic()
    with pytest.raises(RankError, match="MigrationError.*failed"):
        d.call("migrate", batch=_batch([(1, 2)]))
    assert time.monotonic() - t0 < TIMEOUT_S + 6
