"""The TensorRT-LLM store connector in TensorRT-LLM 1.2's call order, beyond the suite.

FAKE: TensorRT-LLM cannot run here; its request, scheduler-output and ``llm_args`` types
are stand-ins (``mooncake_trtllm.testing.standins``). The connector classes, the pool
tensor (TensorRT-LLM's block-major primary-pool shape) and the store (a real master and
memory node, each a process) are real.
"""

from __future__ import annotations

import hashlib
import inspect
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mooncake_conformance import HarnessSpec, KVLayout, StoreCluster  # noqa: E402
from mooncake_conformance.scenarios import expected_pages, fill_pages, make_tokens  # noqa: E402
from mooncake_conformance.worker import Worker  # noqa: E402
from mooncake_trtllm import base  # noqa: E402
from mooncake_trtllm.connector import (  # noqa: E402
    MooncakeStoreConnectorScheduler,
    MooncakeStoreConnectorWorker,
    StoreConnectorMetadata,
)
from mooncake_trtllm.testing.harness import TrtllmStoreHarness, engine_step  # noqa: E402
from mooncake_trtllm.testing.standins import (  # noqa: E402
    FakeKvCacheConfig,
    FakeLlmArgs,
    FakeLlmRequest,
    FakeRequestData,
    FakeSchedulerOutput,
)

LAYOUT = KVLayout(
    "block_major", num_layers=3, page_size=8, num_kv_heads=4, head_dim=16, num_slots=16
)
FACTORY = "mooncake_trtllm.testing.harness:make_harness"


@pytest.fixture(scope="module")
def cluster() -> Iterator[StoreCluster]:
    with StoreCluster() as c:
        yield c


def _spec(cluster: StoreCluster, model: str, rank: int = 0, **opts: Any) -> HarnessSpec:
    layout = LAYOUT.replace(tp_size=2) if rank or opts.pop("tp2", False) else LAYOUT
    return HarnessSpec(FACTORY, layout, cluster.master_address, model, rank, opts)


def _digests(pages: list[bytes]) -> list[str]:
    return [hashlib.sha256(p).hexdigest() for p in pages]


def test_classes_follow_the_connector_interface() -> None:
    """Subclasses of TensorRT-LLM's ABCs when it is importable, of the stand-alone copies
    otherwise; every abstract method is implemented with TensorRT-LLM 1.2's parameters."""
    assert issubclass(MooncakeStoreConnectorScheduler, base.SchedulerBase)
    assert issubclass(MooncakeStoreConnectorWorker, base.WorkerBase)
    if not base.USING_TRTLLM:
        assert base.SchedulerBase is base.StandaloneScheduler
    assert "1.2" in base.TRTLLM_INTERFACE
    for ours, abstract in (
        (MooncakeStoreConnectorScheduler, base.StandaloneScheduler),
        (MooncakeStoreConnectorWorker, base.StandaloneWorker),
    ):
        assert not getattr(ours, "__abstractmethods__", None)
        for name in abstract.__abstractmethods__:
            want = list(inspect.signature(getattr(abstract, name)).parameters)
            got = list(inspect.signature(getattr(ours, name)).parameters)
            assert got == want, f"{ours.__name__}.{name}{got} != {want}"


def test_two_processes_partial_hit_and_exact_bytes(cluster: StoreCluster) -> None:
    """Process A prefills 3 pages; here a 5-page prompt hits those 3 (partial hit), loads
    them byte for byte, computes and saves 2; process A then loads all 5 exactly."""
    model = "trt/two-proc"
    rng = random.Random(7)
    here = TrtllmStoreHarness(_spec(cluster, model))
    other = Worker(_spec(cluster, model))
    try:
        p = here.page_size
        tokens = make_tokens(rng, 5 * p)
        other.call("fill_pages", tokens=tokens[: 3 * p], slots=[0, 1, 2])
        assert other.call("save", tokens=tokens[: 3 * p], slots=[0, 1, 2]) == 3
        want = expected_pages(here, tokens, 5, here.num_slots - 1)
        slots = [4, 5, 6, 7, 8]
        for s in slots[:3]:
            here.fill(s, 0x5EED)  # must be overwritten by the load
        fill_pages(here, tokens, slots)  # the engine computes pages 3, 4 ...
        for s in slots[:3]:
            here.fill(s, 0x5EED)  # ... but not 0-2, which the store provides
        sched, worker = here.sched, here.worker
        r = engine_step(
            sched, worker, FakeLlmRequest(901, tokens + [1]), slots + [here.spare], num_layers=3
        )
        assert r.matched_tokens == 3 * p and not r.load_errors and r.saving and r.saved
        assert [here.read(s) for s in slots] == want, "loaded or computed bytes differ"
        assert here.lookup(tokens) == 5
        dst = [9, 10, 11, 12, 13]
        assert other.call("load", tokens=tokens, slots=dst) == 5
        assert other.call("read_digests", slots=dst) == _digests(want)
    finally:
        other.close()
        here.close()


def test_tp2_scheduler_needs_every_ranks_shard(cluster: StoreCluster) -> None:
    """Rank 0's scheduler asks for both ranks' shards; each rank loads its own exactly."""
    model = "trt/tp2"
    rng = random.Random(11)
    r0 = TrtllmStoreHarness(_spec(cluster, model, 0, tp2=True))
    r1 = TrtllmStoreHarness(_spec(cluster, model, 1))
    sched = MooncakeStoreConnectorScheduler(r0.llm_args, options=r0.options)
    try:
        assert sched.lookup_ranks == [0, 1]
        tokens = make_tokens(rng, 3 * r0.page_size)
        req = FakeLlmRequest(77, tokens + [5])
        fill_pages(r0, tokens, [0, 1, 2])
        fill_pages(r1, tokens, [0, 1, 2])
        assert r0.read(0) != r1.read(0), "the two ranks' shards must differ"
        assert r0.save(tokens, [0, 1, 2]) == 3
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False), (
            "a page with only rank 0's shard is not a hit"
        )
        sched.request_finished(req, [])
        assert r1.save(tokens, [0, 1, 2]) == 3
        assert sched.get_num_new_matched_tokens(req, 0) == (3 * r0.page_size, False)
        sched.request_finished(req, [])
        for h in (r0, r1):
            want = expected_pages(h, tokens, 3, h.num_slots - 1)
            assert h.load(tokens, [3, 4, 5]) == 3
            assert [h.read(s) for s in (3, 4, 5)] == want
    finally:
        sched.close()
        r1.close()
        r0.close()


def _hit_then_break(h: TrtllmStoreHarness, tokens: list[int], rid: int, breaker: Any) -> Any:
    """Lookup (3 pages hit), then ``breaker()`` changes the store, then the load."""
    blocks = [6, 7, 8, h.spare]
    req = FakeLlmRequest(rid, tokens + [3])
    matched, _ = h.sched.get_num_new_matched_tokens(req, 0)
    assert matched == 3 * h.page_size
    breaker()
    h.sched.update_state_after_alloc(req, blocks)
    meta = h.sched.build_connector_meta(
        FakeSchedulerOutput([FakeRequestData(rid, req.tokens, blocks, matched, 1)])
    )
    assert isinstance(meta, StoreConnectorMetadata) and len(meta.loads) == 1
    h.worker.bind_connector_meta(meta)
    h.worker.start_load_kv(None)
    try:
        for layer in range(LAYOUT.num_layers):
            h.worker.wait_for_layer_load(layer, None)
            h.worker.save_kv_layer(layer, None)
        h.worker.wait_for_save(None)
    finally:
        h.sched.request_finished(req, blocks)
    return h.worker.get_block_ids_with_load_errors()


def test_failed_load_reports_blocks_for_recompute(cluster: StoreCluster) -> None:
    """A page gone (or of another size) between lookup and load: its block is reported as not
    loaded (recompute), the others load exactly; policy 'fail' raises a clear error."""
    rng = random.Random(3)
    h = TrtllmStoreHarness(_spec(cluster, "trt/fail"))
    strict = TrtllmStoreHarness(_spec(cluster, "trt/fail", load_failure_policy="fail"))
    raw = cluster.client()
    try:
        tokens = make_tokens(rng, 3 * h.page_size)
        fill_pages(h, tokens, [0, 1, 2])
        assert h.save(tokens, [0, 1, 2]) == 3
        want = expected_pages(h, tokens, 3, h.num_slots - 1)
        keys = [k[0] for k in h.page_keys(tokens)]
        errors = _hit_then_break(h, tokens, 501, lambda: raw.remove(keys[2], force=True))
        assert errors == {8}, f"expected block 8 (page 2) reported, got {errors}"
        assert [h.read(6), h.read(7)] == want[:2]
        assert h.worker.stats["load_failures"] == 1
        # an object of another size under the key: not loaded either
        raw.put(keys[2], b"x" * 100)
        errors = _hit_then_break(h, tokens, 502, lambda: None)
        assert errors == {8}
        raw.remove(keys[2], force=True)
        fill_pages(h, tokens, [0, 1, 2])
        assert h.save(tokens, [0, 1, 2]) == 3  # recomputed and saved again
        with pytest.raises(RuntimeError, match="could not be loaded.*load_failure_policy"):
            _hit_then_break(strict, tokens, 503, lambda: raw.remove(keys[1], force=True))
    finally:
        raw.close()
        strict.close()
        h.close()


def test_saves_are_async_and_hold_blocks_until_done(cluster: StoreCluster) -> None:
    """wait_for_save does not wait for the store; request_finished keeps the blocks and
    get_finished reports the request only after its pages are stored. Also: a chunked
    prefill saves each page once, in the step that completes it."""
    rng = random.Random(5)
    h = TrtllmStoreHarness(_spec(cluster, "trt/async"))
    try:
        p = h.page_size
        tokens = make_tokens(rng, 4 * p)
        fill_pages(h, tokens, [0, 1, 2, 3])
        gate = threading.Event()
        h.worker._save_pool.submit(gate.wait, 30)  # the save thread is busy elsewhere
        req = FakeLlmRequest(601, tokens + [9])
        blocks = [0, 1, 2, 3, h.spare]
        sched, worker = h.sched, h.worker
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, blocks)
        steps = [
            FakeSchedulerOutput([FakeRequestData(601, req.tokens, blocks, 0, p + p // 2)]),
            FakeSchedulerOutput(
                [], [FakeRequestData(601, [], [], p + p // 2, 4 * p + 1 - p - p // 2)]
            ),
        ]
        planned = []
        t0 = time.monotonic()
        for so in steps:
            meta = sched.build_connector_meta(so)
            planned.append([len(j.pages) for j in meta.saves])
            worker.bind_connector_meta(meta)
            worker.start_load_kv(None)
            for layer in range(LAYOUT.num_layers):
                worker.wait_for_layer_load(layer, None)
                worker.save_kv_layer(layer, None)
            worker.wait_for_save(None)
        assert time.monotonic() - t0 < 5.0
        assert planned == [[1], [3]], f"pages saved per step: {planned}"
        assert sched.request_finished(req, blocks) is True
        assert worker.get_finished([601], [42]) == ([], [42]), "reported saved too early"
        assert h.lookup(tokens) == 0
        gate.set()
        deadline = time.monotonic() + 30
        while worker.get_finished([], [])[0] != [601]:
            assert time.monotonic() < deadline, "the save never finished"
            time.sleep(0.01)
        assert h.lookup(tokens) == 4
        assert h.load(tokens, [4, 5, 6, 7]) == 4
        assert [h.read(s) for s in (4, 5, 6, 7)] == expected_pages(h, tokens, 4, h.num_slots - 1)
    finally:
        h.close()


def test_staged_pool_round_trip(cluster: StoreCluster) -> None:
    """The staging path (used for a device pool) round-trips exactly, through a staging
    buffer smaller than one request (CPU here: no GPU on this machine)."""
    rng = random.Random(9)
    h = TrtllmStoreHarness(_spec(cluster, "trt/staged", staging="always", staging_blocks=2))
    try:
        assert h.worker._staging is not None and h.worker._staging.shape[0] == 2
        tokens = make_tokens(rng, 5 * h.page_size)
        fill_pages(h, tokens, [0, 1, 2, 3, 4])
        assert h.save(tokens, [0, 1, 2, 3, 4]) == 5
        want = expected_pages(h, tokens, 5, h.num_slots - 1)
        assert h.load(tokens, [5, 6, 7, 8, 9]) == 5
        assert [h.read(s) for s in (5, 6, 7, 8, 9)] == want
    finally:
        h.close()


def test_options_and_llm_args() -> None:
    args = FakeLlmArgs(
        "org/Model-7B",
        dtype="bfloat16",
        tensor_parallel_size=2,
        kv_cache_config=FakeKvCacheConfig(tokens_per_block=64, dtype="fp8"),
    )
    w = MooncakeStoreConnectorWorker(args, options={"tp_rank": 3, "segment_size": 0})
    try:
        assert w.tp_rank == 1
        assert w.scheme.rank_prefix(1) == "mct/Model-7B/bm-fp8-t64/tp1of2/"
    finally:
        w.close()
    with pytest.raises(ValueError, match="unknown mooncake_trtllm option"):
        MooncakeStoreConnectorScheduler(args, options={"retry_after": 1})


def test_documented_yaml_builds_the_connector_as_tensorrt_llm_does() -> None:
    """The ``kv_connector_config`` YAML of docs/trtllm.md names importable classes; built the
    way TensorRT-LLM's py_executor_creator builds them (import the module, getattr each
    class, call it with ``llm_args``)."""
    import importlib
    import re
    from pathlib import Path

    yaml = pytest.importorskip("yaml")
    doc = Path(__file__).resolve().parents[3] / "docs" / "trtllm.md"
    block = re.search(r"```yaml\n(.*?)```", doc.read_text(), re.S)
    assert block is not None, "docs/trtllm.md has no yaml block"
    cfg = yaml.safe_load(block.group(1))["kv_connector_config"]
    mod = importlib.import_module(cfg["connector_module"])
    args = FakeLlmArgs("m", kv_cache_config=FakeKvCacheConfig(tokens_per_block=16))
    sched = getattr(mod, cfg["connector_scheduler_class"])(args)
    worker = getattr(mod, cfg["connector_worker_class"])(args)
    try:
        assert isinstance(sched, base.SchedulerBase) and isinstance(worker, base.WorkerBase)
        assert sched.page == 16 and worker.tp_rank == 0
    finally:
        worker.close()
        sched.close()
