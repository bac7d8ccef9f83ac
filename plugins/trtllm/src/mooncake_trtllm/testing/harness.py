"""Conformance harness for the TensorRT-LLM store connector, in TensorRT-LLM's call order.

FAKE: TensorRT-LLM cannot run here (no CUDA, and its wheel comes from NVIDIA's index),
so no TensorRT-LLM code runs. What is real: the connector's two classes
(:class:`~mooncake_trtllm.connector.MooncakeStoreConnectorScheduler` and
:class:`~mooncake_trtllm.connector.MooncakeStoreConnectorWorker`), the store (a
master and a memory node, each a process) and the pool tensor in TensorRT-LLM's
block-major primary-pool shape ``[num_blocks, num_layers, kv_factor, tokens_per_block *
kv_heads * head_dim]``. What is a stand-in: ``llm_args``, the request and the scheduler
output (:mod:`mooncake_trtllm.testing.standins`, the smallest types with the fields
the connector reads), and the forward pass (nothing is computed: the suite fills
blocks itself).

:func:`engine_step` makes the calls of one TensorRT-LLM 1.2 step for one context
request the way ``KvCacheConnectorManager`` does: ``get_num_new_matched_tokens`` ->
``update_state_after_alloc`` -> ``build_connector_meta`` -> ``bind_connector_meta`` ->
``start_load_kv`` -> per layer ``wait_for_layer_load`` / (the layer) / ``save_kv_layer``
-> ``wait_for_save`` -> ``request_finished`` -> ``get_finished`` until the request is
reported saved.

Mapping onto the suite: slot = block id (the pool holds ``num_slots + 1`` blocks; the
last is the block of the one prompt token always computed). A prompt is the full pages
of ``tokens`` plus one token. ``lookup`` = ``get_num_new_matched_tokens``. ``save`` = a
prefill of the whole prompt (pages the store already holds are loaded, the rest computed
and saved), then the leading pages whose objects exist, asked with the worker's client
(TensorRT-LLM's ``get_finished`` reports completion, not success). ``load`` = a prefill
whose first chunk is one token (no page completes, nothing is saved); pages before the
first block in ``get_block_ids_with_load_errors()`` count as loaded. The scheduler of
a TP rank's harness asks for that rank's shards only (in TensorRT-LLM one scheduler
on rank 0 asks for every rank's; the suite counts hits per rank).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_conformance.harness import EngineHarness, HarnessSpec

from mooncake_trtllm.testing.standins import (
    FakeKvCacheConfig,
    FakeLlmArgs,
    FakeLlmRequest,
    FakeRequestData,
    FakeSchedulerOutput,
)

__all__ = [
    "TrtllmStoreHarness",
    "make_harness",
    "engine_step",
    "StepResult",
    "make_pool",
    "preload",
]


def preload() -> None:
    """Import what a harness needs (torch, the connector), so the conformance suite's worker
    processes fork from one process that did it (see ``mooncake_conformance.worker``)."""
    import torch  # noqa: F401

    import mooncake_trtllm.connector  # noqa: F401


_ids = itertools.count(1)


def make_pool(
    num_blocks: int, num_layers: int, kv_factor: int, block_elems: int, dtype: Any
) -> Any:
    """A primary pool as ``get_unique_primary_pool()`` shapes it (on the CPU)."""
    import torch

    return torch.zeros((num_blocks, num_layers, kv_factor, block_elems), dtype=dtype)


@dataclass
class StepResult:
    matched_tokens: int
    load_errors: set[int]
    saving: bool
    saved: bool


def engine_step(
    sched: Any,
    worker: Any,
    request: FakeLlmRequest,
    blocks: Sequence[int],
    *,
    num_layers: int,
    num_computed_tokens: int = 0,
    chunk: int | None = None,
    save_wait_s: float = 60.0,
) -> StepResult:
    """One context step of ``request`` (first chunk: ``chunk`` tokens, default the rest)."""
    rid = request.request_id
    prompt = request.get_tokens(0)
    matched, is_async = sched.get_num_new_matched_tokens(request, num_computed_tokens)
    assert not is_async and matched >= 0
    sched.update_state_after_alloc(request, list(blocks))
    computed = num_computed_tokens + matched
    scheduled = len(prompt) - computed if chunk is None else chunk
    out = FakeSchedulerOutput(
        new_requests=[FakeRequestData(rid, list(prompt), list(blocks), computed, scheduled)]
    )
    worker.bind_connector_meta(sched.build_connector_meta(out))
    worker.start_load_kv(None)
    for layer in range(num_layers):
        worker.wait_for_layer_load(layer, None)
        worker.save_kv_layer(layer, None)
    worker.wait_for_save(None)
    worker._clear_connector_meta()
    errors = worker.get_block_ids_with_load_errors()
    saving = bool(sched.request_finished(request, list(blocks)))
    saved = not saving
    if saving:
        deadline = time.monotonic() + save_wait_s
        ids = [rid]
        while True:
            done, _ = worker.get_finished(ids, [])
            ids = []
            if rid in done:
                saved = True
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
    return StepResult(matched, errors, saving, saved)


class TrtllmStoreHarness(EngineHarness):
    """One TensorRT-LLM TP rank: a primary pool and the connector's two halves.

    Options: the connector's (``lookup_timeout_s``, ``retry_after_s``, ``staging``, ...;
    ``segment_size`` defaults to 0 so pages live on the store node), plus ``kv_factor``
    (2; 1 is TensorRT-LLM's K-only cache) and ``save_wait_s`` (harness).
    """

    def __init__(self, spec: HarnessSpec) -> None:
        import torch

        from mooncake_trtllm.connector import (
            MooncakeStoreConnectorScheduler,
            MooncakeStoreConnectorWorker,
        )

        super().__init__(spec)
        lay = spec.layout
        if lay.mla:
            raise ValueError(
                "the TensorRT-LLM connector keeps one copy per TP rank; MLA single-copy layouts "
                "are not offered"
            )
        opts = dict(spec.options)
        self.save_wait_s = float(opts.pop("save_wait_s", 60.0))
        kv_factor = int(opts.pop("kv_factor", 2))
        options: dict[str, Any] = {
            "mooncake": {"master_server_address": spec.master},
            "segment_size": 0,
            "lookup_timeout_s": 2.0,
            "retry_after_s": 1.0,
            "tp_rank": spec.rank,
        }
        options.update(opts)
        self.dtype = getattr(torch, lay.dtype)
        self.llm_args = FakeLlmArgs(
            model=spec.model,
            dtype=lay.dtype,
            tensor_parallel_size=lay.tp_size,
            kv_cache_config=FakeKvCacheConfig(tokens_per_block=lay.page_size),
        )
        heads = lay.num_kv_heads // lay.tp_size
        self.pool = make_pool(
            lay.num_slots + 1,
            lay.num_layers,
            kv_factor,
            lay.page_size * heads * lay.head_dim,
            self.dtype,
        )
        self.spare = lay.num_slots
        self.options = options
        self.sched = MooncakeStoreConnectorScheduler(self.llm_args, options=options)
        self.sched.lookup_ranks = [spec.rank]  # see the module doc
        self.worker = MooncakeStoreConnectorWorker(self.llm_args, options=options)
        self.worker.register_kv_caches(self.pool)
        if self.worker.client is None:
            raise RuntimeError(f"the connector worker could not reach the master {spec.master}")

    # ------------------------------------------------------------------ engine memory
    def fill(self, slot: int, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(
            (seed * 1_000_003 + self.spec.rank) & 0x7FFF_FFFF_FFFF_FFFF
        )
        block = self.pool[slot]
        data = torch.randint(-(2**15), 2**15, tuple(block.shape), generator=g, dtype=torch.int16)
        block.copy_(data.view(torch.bfloat16) if self.dtype == torch.bfloat16 else data)

    def read(self, slot: int) -> bytes:
        import torch

        return bytes(self.pool[slot].contiguous().view(-1).view(torch.uint8).numpy().tobytes())

    # ------------------------------------------------------------------ helpers
    def _request(self, tokens: Sequence[int]) -> FakeLlmRequest:
        n = len(tokens) // self.page_size
        return FakeLlmRequest(next(_ids), [int(t) for t in tokens[: n * self.page_size]] + [0])

    def _blocks(self, tokens: Sequence[int], slots: Sequence[int]) -> list[int]:
        n = len(tokens) // self.page_size
        if len(slots) < n:
            raise ValueError(f"{n} full pages but only {len(slots)} block ids")
        for s in slots:
            if not 0 <= int(s) < self.num_slots:
                raise IndexError(f"block id {s} is outside the pool's {self.num_slots} blocks")
        return [int(s) for s in slots[:n]] + [self.spare]

    def _stored_prefix(self, keys: list[list[str]]) -> int:
        try:
            found = self.worker.client.batch_exists([k for page in keys for k in page])
        except Exception:
            return 0
        n = 0
        while n < len(keys) and found[n]:
            n += 1
        return n

    # ------------------------------------------------------------------ adapter calls
    def page_keys(self, tokens: Sequence[int]) -> list[list[str]]:
        pages = self.worker.scheme.pages([int(t) for t in tokens])
        return [[k] for k in self.worker.scheme.keys(pages, self.worker.tp_rank)]

    def lookup(self, tokens: Sequence[int]) -> int:
        req = self._request(tokens)
        matched, _ = self.sched.get_num_new_matched_tokens(req, 0)
        self.sched.request_finished(req, [])
        return int(matched) // self.page_size

    def save(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        blocks = self._blocks(tokens, slots)
        if len(blocks) == 1:
            return 0
        r = engine_step(
            self.sched,
            self.worker,
            self._request(tokens),
            blocks,
            num_layers=self.spec.layout.num_layers,
            save_wait_s=self.save_wait_s,
        )
        if not r.saved:
            raise TimeoutError(f"a save did not finish in {self.save_wait_s:.0f} s")
        return self._stored_prefix(self.page_keys(tokens))

    def load(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        blocks = self._blocks(tokens, slots)
        if len(blocks) == 1:
            return 0
        r = engine_step(
            self.sched,
            self.worker,
            self._request(tokens),
            blocks,
            num_layers=self.spec.layout.num_layers,
            chunk=1,
            save_wait_s=self.save_wait_s,
        )
        hit = r.matched_tokens // self.page_size
        for i, b in enumerate(blocks[:hit]):
            if b in r.load_errors:
                return i
        return hit

    def expected_objects(
        self, tokens: Sequence[int], slots: Sequence[int]
    ) -> dict[str, bytes] | None:
        """One object per page: the whole block (every layer, K then V), as the pool has it."""
        return {
            keys[0]: self.read(slot)
            for keys, slot in zip(self.page_keys(tokens), slots, strict=False)
        }

    def bad_inputs(self) -> dict[str, Callable[[], object]]:
        import torch

        from mooncake_trtllm.connector import MooncakeStoreConnectorWorker

        def worker(**extra: Any) -> MooncakeStoreConnectorWorker:
            return MooncakeStoreConnectorWorker(self.llm_args, options={**self.options, **extra})

        def misspelt() -> object:
            return worker(lookup_timout_s=1.0)

        def bad_policy() -> object:
            return worker(load_failure_policy="ignore")

        def flat_pool() -> object:
            w = worker()
            try:
                w.register_kv_caches(torch.zeros(16))
            finally:
                w.close()
            return w

        def twice() -> object:
            self.worker.register_kv_caches(self.pool)
            return self.worker

        def strided_pool() -> object:
            w = worker()
            try:
                w.register_kv_caches(self.pool.transpose(0, 1))
            finally:
                w.close()
            return w

        return {
            "a misspelt connector option": misspelt,
            "an unknown load_failure_policy": bad_policy,
            "a pool that is not block-major [num_blocks, ...]": flat_pool,
            "a pool that is not contiguous": strided_pool,
            "register_kv_caches twice": twice,
        }

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


def make_harness(spec: HarnessSpec) -> TrtllmStoreHarness:
    """Factory for ``HarnessSpec.factory = "mooncake_trtllm.testing.harness:make_harness"``."""
    return TrtllmStoreHarness(spec)
