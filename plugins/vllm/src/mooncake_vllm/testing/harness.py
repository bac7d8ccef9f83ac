"""Conformance harness for the vLLM store connector (``MooncakeCoreStoreConnector``).

Drives the connector's scheduler half (``_StoreScheduler``) and worker half
(``_StoreWorker``) in the order vLLM's scheduler and worker call them, on CPU.

What is real: vLLM's own KV-cache allocation for its CPU attention backend
(``vllm.v1.worker.utils.allocate_kv_cache`` with a real ``KVCacheConfig`` /
``FullAttentionSpec`` and the layout ``CPUAttentionBackend.supported_kv_cache_layouts()``
names, ``LBHNC``: per layer a ``[num_blocks, kv_heads, block_size, K|V]`` view, one
layer-contiguous region each), the connector classes and the store. What is a stand-in:
``vllm_config`` (a namespace with just ``model_config.model``/``model_config.dtype`` and
``cache_config.block_size``, the fields the connector reads; a real ``ModelConfig``
needs a model's HF config), and the request, block-list and scheduler-output objects
(only the attributes the connector reads). No model runs.

Mapping onto the suite: slot = vLLM block id (the cache holds ``num_slots + 1`` blocks;
the last one is the block of the one prompt token vLLM always computes). A prompt is the
full pages of ``tokens`` plus one token, because the connector leaves at least one
prompt token to compute. ``lookup`` is ``get_num_new_matched_tokens``; ``save`` is a
prefill the engine computes itself (the store match is declined: ``update_state_after_alloc``
with 0 external tokens) followed by ``build_connector_meta`` -> ``submit_saves`` and a wait
for ``finished_saves``; vLLM's connector reports completion, not success, so ``save``
counts the leading pages whose every layer object is in the store afterwards (asked with
the worker's own client). ``load`` is the hit path: lookup, ``update_state_after_alloc``
with the matched tokens, a one-token first chunk (so no page completes and nothing is
saved), ``start_load`` -> ``wait_for_layer_load`` per layer -> ``finish_loads``; pages
before the first block in ``load_errors()`` count as loaded.

Slot checks (count, range) are the harness's: in vLLM block ids come from its own
allocator, and the connector does not check them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

from mooncake_conformance.harness import EngineHarness, HarnessSpec

if TYPE_CHECKING:
    import torch

    from mooncake_vllm.store_keys import StoreKeyScheme

__all__ = ["VLLMStoreHarness", "make_harness", "allocate_cpu_kv_caches", "preload"]

_ids = itertools.count()


def preload() -> None:
    """Import what a harness needs (about 10 s of CPU), so the conformance suite's worker
    processes fork from one process that did it (see ``mooncake_conformance.worker``)."""
    import torch  # noqa: F401
    import vllm.v1.attention.backends.cpu_attn  # noqa: F401
    import vllm.v1.kv_cache_interface  # noqa: F401
    import vllm.v1.worker.utils  # noqa: F401

    import mooncake_vllm.store_connector  # noqa: F401


def allocate_cpu_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """Per-layer KV caches as vLLM's CPU worker allocates them (one backing buffer)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    page = spec.page_size_bytes
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks * num_layers,
                layers=names,
                layer_stride=page * num_blocks,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    layout = CPUAttentionBackend.supported_kv_cache_layouts()[0]
    return allocate_kv_cache(cfg, torch.device("cpu"), layout)


class _Blocks:
    """vLLM's ``KVCacheBlocks`` as the connector reads it (one KV cache group)."""

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self._ids),)


class _OneRankScheme:
    """The scheduler's key scheme with its lookup narrowed to one TP rank's shard.

    Everything else (seed, page hashes, layer keys) is the real scheme's.
    """

    def __init__(self, scheme: Any, rank: int) -> None:
        self._scheme = scheme
        self._rank = rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheme, name)

    def exists_keys(self, pages: Sequence[str]) -> list[str]:
        return self._scheme.layer_keys(pages, self._rank, 0)  # type: ignore[no-any-return]

    def held_pages(self, exists: Sequence[bool]) -> int:
        n = 0
        while n < len(exists) and exists[n]:
            n += 1
        return n


class VLLMStoreHarness(EngineHarness):
    """One vLLM TP rank: CPU KV caches, the store connector's scheduler and worker halves.

    Options (the connector's ``kv_connector_extra_config``): ``lookup_timeout_s``,
    ``retry_after_s``, ``segment_size`` (default 0: pages live on the store node);
    ``save_wait_s`` (harness: longest wait for a save to finish).
    """

    def __init__(self, spec: HarnessSpec) -> None:
        import torch

        super().__init__(spec)
        from mooncake_vllm.store_connector import _StoreScheduler
        from mooncake_vllm.store_worker import _StoreWorker

        lay = spec.layout
        if lay.mla:
            raise ValueError(
                "the vLLM store connector keeps one copy per TP rank; MLA single-copy layouts "
                "are not offered"
            )
        opts = dict(spec.options)
        self.save_wait_s = float(opts.pop("save_wait_s", 60.0))
        extra: dict[str, Any] = {
            "mooncake": {"master_server_address": spec.master},
            "segment_size": 0,
            "lookup_timeout_s": 2.0,
            "retry_after_s": 1.0,
        }
        extra.update(opts)
        self.dtype = getattr(torch, lay.dtype)
        self.heads = lay.num_kv_heads // lay.tp_size
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model=spec.model, dtype=self.dtype),
            cache_config=SimpleNamespace(block_size=lay.page_size),
            parallel_config=SimpleNamespace(tensor_parallel_size=lay.tp_size),
        )
        engine_id = f"conformance-{spec.rank}"
        self.kv = allocate_cpu_kv_caches(
            lay.num_layers, lay.num_slots + 1, lay.page_size, self.heads, lay.head_dim, self.dtype
        )
        self.spare = lay.num_slots  # block of the last prompt token (always computed)
        self.sched = _StoreScheduler(vllm_config, extra, engine_id)
        # In vLLM one scheduler asks for every TP rank's shard of a page (a hit needs all of
        # them). The suite counts hits per rank, so each rank's harness asks for its own
        # shard only: the same query, narrowed to the rank this harness plays.
        narrowed = _OneRankScheme(self.sched.scheme, spec.rank)  # duck-typed: same methods
        self.sched.scheme = cast("StoreKeyScheme", narrowed)
        self.worker = _StoreWorker(vllm_config, extra, engine_id, spec.rank)
        self.worker.register_kv_caches(self.kv)
        if self.worker.client is None:
            raise RuntimeError(f"the store worker could not reach the master {spec.master}")

    @staticmethod
    def worker_prefix(vllm_config: Any, rank: int) -> str:
        from mooncake_vllm.store_connector import _key_prefix, _rank_dir
        from mooncake_vllm.store_keys import tp_size_of

        return _key_prefix(vllm_config) + _rank_dir(rank, tp_size_of(vllm_config))

    # ------------------------------------------------------------------ engine memory
    def fill(self, slot: int, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(
            (seed * 1_000_003 + self.spec.rank) & 0x7FFF_FFFF_FFFF_FFFF
        )
        for t in self.kv.values():
            page = t[slot]
            data = torch.randint(-(2**15), 2**15, tuple(page.shape), generator=g, dtype=torch.int16)
            page.copy_(
                data.view(torch.bfloat16) if self.dtype == torch.bfloat16 else data.to(self.dtype)
            )

    def read(self, slot: int) -> bytes:
        import torch

        return b"".join(
            t[slot].contiguous().view(torch.uint8).numpy().tobytes() for t in self.kv.values()
        )

    # ------------------------------------------------------------------ helpers
    def _prompt(self, tokens: Sequence[int]) -> list[int]:
        n = len(tokens) // self.page_size
        return [int(t) for t in tokens[: n * self.page_size]] + [0]

    def _request(self, tokens: Sequence[int]) -> Any:
        return SimpleNamespace(
            request_id=f"conf-{self.spec.rank}-{next(_ids)}",
            prompt_token_ids=self._prompt(tokens),
            kv_transfer_params=None,
        )

    def _check_slots(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        n = len(tokens) // self.page_size
        if len(slots) < n:
            raise ValueError(f"{n} full pages but only {len(slots)} block ids")
        for s in slots:
            if not 0 <= int(s) < self.num_slots:
                raise IndexError(f"block id {s} is outside the KV cache's {self.num_slots} blocks")
        return n

    @staticmethod
    def _sched_output(rid: str, blocks: list[int], computed: int, scheduled: int) -> Any:
        new = SimpleNamespace(req_id=rid, block_ids=(list(blocks),), num_computed_tokens=computed)
        cached = SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        )
        return SimpleNamespace(
            scheduled_new_reqs=[new],
            scheduled_cached_reqs=cached,
            num_scheduled_tokens={rid: scheduled},
        )

    def _stored_prefix(self, keys: list[list[str]]) -> int:
        flat = [k for page in keys for k in page]
        try:
            found = self.worker.client.batch_exists(flat)
        except Exception:
            return 0
        n, i = 0, 0
        for page in keys:
            if not all(found[i : i + len(page)]):
                break
            i += len(page)
            n += 1
        return n

    # ------------------------------------------------------------------ adapter calls
    def page_keys(self, tokens: Sequence[int]) -> list[list[str]]:
        from mooncake_vllm.store_connector import page_chain

        n = len(tokens) // self.page_size
        chain = page_chain(self.sched.seed, [int(t) for t in tokens], self.page_size, n)
        return [
            [k for li in range(len(self.kv)) for k in self.worker._keys([p], li)] for p in chain
        ]

    def lookup(self, tokens: Sequence[int]) -> int:
        req = self._request(tokens)
        matched, _ = self.sched.get_num_new_matched_tokens(req, 0)
        self.sched.request_finished(req, [])
        return int(matched or 0) // self.page_size

    def save(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        n = self._check_slots(tokens, slots)
        if n == 0:
            return 0
        req = self._request(tokens)
        blocks = [int(s) for s in slots[:n]] + [self.spare]
        self.sched.get_num_new_matched_tokens(req, 0)
        self.sched.update_state_after_alloc(req, _Blocks(blocks), 0)
        meta = self.sched.build_connector_meta(
            self._sched_output(req.request_id, blocks, 0, len(req.prompt_token_ids))
        )
        self.worker.finish_loads()
        self.worker.submit_saves(meta)
        delay, _ = self.sched.request_finished(req, blocks)
        if delay:
            deadline = time.monotonic() + self.save_wait_s
            while req.request_id not in self.worker.finished_saves({req.request_id}):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"save of {req.request_id} did not finish in {self.save_wait_s:.0f} s"
                    )
                time.sleep(0.01)
        return self._stored_prefix(self.page_keys(tokens))

    def load(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        n = self._check_slots(tokens, slots)
        if n == 0:
            return 0
        req = self._request(tokens)
        blocks = [int(s) for s in slots[:n]] + [self.spare]
        matched, _ = self.sched.get_num_new_matched_tokens(req, 0)
        matched = int(matched or 0)
        self.sched.update_state_after_alloc(req, _Blocks(blocks), matched)
        meta = self.sched.build_connector_meta(
            self._sched_output(req.request_id, blocks, matched, 1)
        )
        self.sched.request_finished(req, blocks)
        self.worker.start_load(meta)
        for name in self.kv:  # the forward waits layer by layer
            self.worker.wait_for_layer_load(name)
        self.worker.finish_loads()
        bad = self.worker.load_errors()
        hit = matched // self.page_size
        for i, b in enumerate(blocks[:hit]):
            if b in bad:
                return i
        return hit

    def expected_objects(
        self, tokens: Sequence[int], slots: Sequence[int]
    ) -> dict[str, bytes] | None:
        """One object per (page, layer): that layer's block, ``[kv_heads, block_size, K|V]``
        bytes."""
        import torch

        out: dict[str, bytes] = {}
        for keys, slot in zip(self.page_keys(tokens), slots, strict=False):
            for key, t in zip(keys, self.kv.values(), strict=True):
                out[key] = bytes(t[slot].contiguous().view(torch.uint8).numpy().tobytes())
        return out

    def bad_inputs(self) -> dict[str, Callable[[], object]]:
        from mooncake_vllm.store_worker import _StoreWorker

        vc = SimpleNamespace(
            model_config=SimpleNamespace(model=self.spec.model, dtype=self.dtype),
            cache_config=SimpleNamespace(block_size=self.page_size),
            parallel_config=SimpleNamespace(tensor_parallel_size=self.spec.layout.tp_size),
        )

        def misspelt() -> object:
            w = _StoreWorker(
                vc, {"mooncake": {"master_adress": self.spec.master}}, "bad", self.spec.rank
            )
            try:
                w.register_kv_caches({})
            finally:
                w.close()
            return w

        return {"kv_connector_extra_config.mooncake with a misspelt key": misspelt}

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


def make_harness(spec: HarnessSpec) -> VLLMStoreHarness:
    """Harness factory for
    ``HarnessSpec.factory = "mooncake_vllm.testing.harness:make_harness"``."""
    return VLLMStoreHarness(spec)
