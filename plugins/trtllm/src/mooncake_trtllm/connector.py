"""A KV-cache store connector for TensorRT-LLM on the mooncake-core store.

Interface: TensorRT-LLM 1.2's KV cache connector (``KvCacheConnectorScheduler`` and
``KvCacheConnectorWorker``, see :mod:`mooncake_trtllm.base`). Select it with
``kv_connector_config`` (LLM API or ``trtllm-serve --extra_llm_api_options`` YAML)::

    kv_connector_config:
      connector_module: mooncake_trtllm.connector
      connector_scheduler_class: MooncakeStoreConnectorScheduler
      connector_worker_class: MooncakeStoreConnectorWorker

Keys (:mod:`mooncake_trtllm.keys`): one object per (page, TP rank) holding the page's
whole block of the block-major primary pool (every layer, K and V), named by a prefix
hash chain, the layout, dtype, page size and TP rank/size.

Scheduler (rank 0): ``get_num_new_matched_tokens`` asks the store how many consecutive
full prompt pages past the device's own prefix hit it holds for every TP rank (at least
one prompt token is left to compute) and answers ``(tokens, False)``: loads are
synchronous within the next forward, layer 0 waits for them. A failing master counts
as a miss (one log line; lookups pause for ``retry_after_s``).
``update_state_after_alloc`` / ``build_connector_meta`` turn hits into loads into the
request's blocks and every prompt page a step completes into a save (pages found on the
device or loaded are not saved again). ``request_finished`` returns True while a
request's saves may be in flight: TensorRT-LLM keeps its blocks until every rank's
``get_finished`` reports it saved.

Worker (every rank): ``register_kv_caches`` registers the pool with the store
(zero-copy for a host pool; a device pool goes through a host staging buffer).
``start_load_kv`` starts the step's loads in the background; ``wait_for_layer_load``
waits for them before layer 0; ``wait_for_save`` hands the step's saves to a
background thread once the forward's work is done, so saving never blocks the forward.
A page that fails to load (gone, wrong size, store down) falls back to recompute: its
block is reported by :meth:`MooncakeStoreConnectorWorker.get_block_ids_with_load_errors`
and not counted as loaded (``load_failure_policy: fail`` raises instead).

Options: the ``options=`` argument (tests), else ``MOONCAKE_TRTLLM_<NAME>`` environment
variables; store settings come from mooncake-core's config (``MOONCAKE_MASTER``,
``MOONCAKE_CONFIG_PATH``, ...). See docs/trtllm.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mooncake_core.config import MooncakeConfig, env_str, load_config, parse_size
from mooncake_trtllm.base import TRTLLM_INTERFACE, SchedulerBase, WorkerBase
from mooncake_trtllm.keys import TrtllmKeyScheme

__all__ = [
    "MooncakeStoreConnectorScheduler",
    "MooncakeStoreConnectorWorker",
    "StoreConnectorMetadata",
    "PageJob",
    "OPTIONS",
    "scheme_from_llm_args",
    "TRTLLM_INTERFACE",
]

logger = logging.getLogger(__name__)

OPTIONS: dict[str, Any] = {
    "lookup_timeout_s": 2.0,  # how long a lookup waits for an absent master
    "retry_after_s": 10.0,  # pause of lookups / saves after the store failed
    "segment_size": None,  # memory a worker lends to the pool (default: config's)
    "load_failure_policy": "recompute",  # or "fail"
    "staging_blocks": 64,  # host staging buffer (blocks) for a device pool
    "staging": "auto",  # auto: only for a device pool; always; never
    "tp_rank": None,  # this worker's TP rank (default: from TensorRT-LLM's MPI rank)
    "mooncake": None,  # dict of mooncake-core config overrides
}


def options_from(given: Mapping[str, Any] | None) -> dict[str, Any]:
    """Options: ``given`` wins, then ``MOONCAKE_TRTLLM_<NAME>``, then the default."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown mooncake_trtllm option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}"
        )
    out: dict[str, Any] = {}
    for name, default in OPTIONS.items():
        if name in given:
            out[name] = given[name]
            continue
        raw = env_str(f"MOONCAKE_TRTLLM_{name.upper()}") if name != "mooncake" else ""
        if raw:
            out[name] = type(default)(raw) if isinstance(default, (int, float)) else raw
        else:
            out[name] = default
    if out["load_failure_policy"] not in ("recompute", "fail"):
        raise ValueError(
            f"load_failure_policy must be 'recompute' or 'fail', got {out['load_failure_policy']!r}"
        )
    if out["staging"] not in ("auto", "always", "never"):
        raise ValueError(f"staging must be 'auto', 'always' or 'never', got {out['staging']!r}")
    return out


def _config(opts: Mapping[str, Any]) -> MooncakeConfig:
    cfg = load_config()
    over = opts.get("mooncake") or {}
    if not isinstance(over, Mapping):
        raise ValueError(f"option 'mooncake' must be a mapping of config keys, got {over!r}")
    return cfg.replace(**dict(over)) if over else cfg


def scheme_from_llm_args(llm_args: Any) -> TrtllmKeyScheme:
    """The key scheme of a TensorRT-LLM deployment, from its ``llm_args`` (TorchLlmArgs).

    Reads ``model``, ``kv_cache_config.tokens_per_block`` (default 32),
    ``kv_cache_config.dtype`` (else ``dtype``; default ``auto``) and
    ``tensor_parallel_size`` (default 1).
    """
    kvc = getattr(llm_args, "kv_cache_config", None)
    tpb = getattr(kvc, "tokens_per_block", None) or 32
    dtype = getattr(kvc, "dtype", None)
    if not dtype or str(dtype) == "auto":
        dtype = getattr(llm_args, "dtype", None) or "auto"
    tp: Any = getattr(llm_args, "tensor_parallel_size", None)
    if tp is None:
        tp = getattr(getattr(llm_args, "parallel_config", None), "tp_size", None) or 1
    return TrtllmKeyScheme(str(getattr(llm_args, "model", "model")), str(dtype), int(tpb), int(tp))


@dataclass
class PageJob:
    """Pages of one request to move: page hashes and the blocks that hold them."""

    request_id: int
    pages: list[str]
    block_ids: list[int]


@dataclass
class StoreConnectorMetadata:
    """What the scheduler tells every worker for one step."""

    loads: list[PageJob] = field(default_factory=list)
    saves: list[PageJob] = field(default_factory=list)


@dataclass
class _Req:
    pages: list[str]  # every full prompt page
    lookup_pages: int  # pages a lookup may report (one prompt token is always computed)
    start: int = 0  # pages found on the device
    hit: int = 0  # pages the store will load after them
    blocks: list[int] = field(default_factory=list)
    load_planned: bool = False
    saved_upto: int = 0
    saving: bool = False


def _prompt(request: Any) -> list[int]:
    tokens = list(request.get_tokens(0))
    n = getattr(request, "prompt_len", None)
    return [int(t) for t in (tokens[: int(n)] if isinstance(n, int) else tokens)]


class MooncakeStoreConnectorScheduler(SchedulerBase):  # type: ignore[misc]
    """Rank 0's half: store lookups and per-step load/save plans."""

    def __init__(self, llm_args: Any, *, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(llm_args)
        from mooncake_core.store.client import StoreClient

        self.opts = options_from(options)
        self.scheme = scheme_from_llm_args(llm_args)
        self.page = self.scheme.tokens_per_block
        self.lookup_ranks: list[int] = list(range(self.scheme.tp_size))
        cfg = _config(self.opts)
        timeout = float(self.opts["lookup_timeout_s"])
        self._make_client: Any = lambda: StoreClient(
            cfg, segment_size=0, failover_timeout_s=timeout
        )
        self.client: Any = None
        self._down_until = 0.0
        self.reqs: dict[int, _Req] = {}
        self.stats = {"lookups": 0, "hit_pages": 0, "lookup_failures": 0, "saves_planned": 0}

    def _lookup(self, pages: list[str]) -> int:
        if not pages or time.monotonic() < self._down_until:
            return 0
        try:
            if self.client is None:
                client = self._make_client()
                client.start()
                self.client = client
            ranks = self.lookup_ranks
            found = self.client.batch_exists(self.scheme.exists_keys(pages, ranks))
            return self.scheme.held_pages(found, len(ranks))
        except Exception as exc:
            self._down_until = time.monotonic() + float(self.opts["retry_after_s"])
            self.stats["lookup_failures"] += 1
            logger.warning(
                "mooncake_trtllm: KV store lookup failed (%s); computing prompts locally, next "
                "try in %.0f s",
                exc,
                float(self.opts["retry_after_s"]),
            )
            return 0

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` the store can provide; loads are synchronous."""
        rid = request.request_id
        prompt = _prompt(request)
        pages = self.scheme.pages(prompt)
        st = _Req(pages, max(0, (len(prompt) - 1) // self.page))
        self.reqs[rid] = st
        if num_computed_tokens % self.page:  # the device hit ends inside a block
            st.start = st.saved_upto = -(-num_computed_tokens // self.page)
            return 0, False
        st.start = num_computed_tokens // self.page
        if st.start < st.lookup_pages:
            st.hit = self._lookup(pages[st.start : st.lookup_pages])
            self.stats["lookups"] += 1
            self.stats["hit_pages"] += st.hit
        st.saved_upto = st.start + st.hit
        return st.hit * self.page, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        st = self.reqs.get(request.request_id)
        if st is not None and block_ids:
            st.blocks = [int(b) for b in block_ids]

    def build_connector_meta(self, scheduler_output: Any) -> StoreConnectorMetadata:
        meta = StoreConnectorMetadata()
        done: dict[int, int] = {}
        for rd in getattr(scheduler_output, "new_requests", None) or []:
            st = self.reqs.get(rd.request_id)
            if st is None:
                continue
            if rd.new_block_ids:
                st.blocks = [int(b) for b in rd.new_block_ids]
            done[rd.request_id] = int(rd.computed_position) + int(rd.num_scheduled_tokens)
        for rd in getattr(scheduler_output, "cached_requests", None) or []:
            st = self.reqs.get(rd.request_id)
            if st is None:
                continue
            st.blocks += [int(b) for b in rd.new_block_ids or []]
            done[rd.request_id] = int(rd.computed_position) + int(rd.num_scheduled_tokens)
        for rid, st in self.reqs.items():
            if st.hit and not st.load_planned and (rid in done or st.blocks):
                st.load_planned = True
                end = st.start + st.hit
                if len(st.blocks) < end:
                    logger.warning(
                        "mooncake_trtllm: request %s has %d blocks, %d pages to load; loading none",
                        rid,
                        len(st.blocks),
                        end,
                    )
                    continue
                meta.loads.append(PageJob(rid, st.pages[st.start : end], st.blocks[st.start : end]))
        for rid, computed in done.items():
            st = self.reqs[rid]
            upto = min(computed // self.page, len(st.pages), len(st.blocks))
            if upto > st.saved_upto:
                meta.saves.append(
                    PageJob(rid, st.pages[st.saved_upto : upto], st.blocks[st.saved_upto : upto])
                )
                self.stats["saves_planned"] += upto - st.saved_upto
                st.saved_upto = upto
                st.saving = True
        return meta

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """True while saves of this request may be in flight (keep its blocks)."""
        st = self.reqs.pop(request.request_id, None)
        return st is not None and st.saving

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def _tp_rank(opts: Mapping[str, Any], tp_size: int) -> int:
    if opts.get("tp_rank") is not None:
        rank = int(opts["tp_rank"])
    else:
        try:
            from tensorrt_llm._utils import mpi_rank  # TensorRT-LLM runs one process per rank

            rank = int(mpi_rank())
        except ImportError:
            rank = 0
    if not 0 <= rank:
        raise ValueError(f"tp_rank must not be negative, got {rank}")
    return rank % tp_size


class MooncakeStoreConnectorWorker(WorkerBase):  # type: ignore[misc]
    """Every rank's half: moves its shard of the pool's blocks to and from the store."""

    def __init__(self, llm_args: Any, *, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(llm_args)
        self.opts = options_from(options)
        self.scheme = scheme_from_llm_args(llm_args)
        self.tp_rank = _tp_rank(self.opts, self.scheme.tp_size)
        self.client: Any = None
        self.pool: Any = None
        self.block_bytes = 0
        self.num_blocks = 0
        self._staging: Any = None  # host tensor [n, block_bytes] uint8 for a device pool
        self._staging_lock = threading.Lock()
        self._load_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mc-trtllm-load")
        self._save_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mc-trtllm-save")
        self._loading: list[tuple[Future[list[bool]], list[int]]] = []
        self._load_errors: set[int] = set()
        self._saves: dict[int, list[Future[None]]] = {}
        self._awaiting: set[int] = set()
        self._lock = threading.Lock()
        self._save_down_until = 0.0
        self._save_down_logged = False
        self.stats = {
            "loaded_pages": 0,
            "load_failures": 0,
            "saved_pages": 0,
            "save_failures": 0,
            "saves_skipped": 0,
        }

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """Take the block-major primary pool ``[num_blocks, num_layers, kv_factor, ...]``."""
        import torch

        from mooncake_core.store.client import StoreClient

        t = kv_cache_tensor
        if self.pool is not None:
            raise ValueError("register_kv_caches: a KV cache pool is already registered")
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise ValueError(
                "register_kv_caches expects the block-major primary pool, a tensor "
                f"[num_blocks, num_layers, kv_factor, block elements]; got {type(t).__name__} "
                f"of shape {tuple(getattr(t, 'shape', ()))}"
            )
        if not t.is_contiguous() or t.shape[0] == 0:
            raise ValueError(
                f"register_kv_caches: the pool of shape {tuple(t.shape)} must be contiguous "
                "and hold at least one block"
            )
        cfg = _config(self.opts)
        seg = self.opts["segment_size"]
        size = int(cfg.global_segment_size) if seg is None else int(parse_size(seg))
        self.pool = t
        self.num_blocks = int(t.shape[0])
        self.block_bytes = int(t[0].numel()) * int(t.element_size())
        staged = self.opts["staging"] == "always" or (
            self.opts["staging"] == "auto" and t.device.type != "cpu"
        )
        try:
            client = StoreClient(
                cfg, segment_size=size, failover_timeout_s=float(self.opts["lookup_timeout_s"])
            ).start()
        except Exception as exc:  # serve without the pool rather than not at all
            logger.warning(
                "mooncake_trtllm: cannot reach the KV store master %s (%s); this rank runs "
                "without the shared KV pool",
                cfg.master_server_address,
                exc,
            )
            return
        if staged:
            n = max(1, int(self.opts["staging_blocks"]))
            pin = t.device.type == "cuda"
            self._staging = torch.empty((n, self.block_bytes), dtype=torch.uint8, pin_memory=pin)
            client.register_buffer(self._staging)
        else:
            client.register_buffer(t)
        self.client = client
        logger.info(
            "mooncake_trtllm: worker rank %d/%d, %d blocks x %d bytes (%s), keys %s..., "
            "lends %d bytes; interface %s",
            self.tp_rank,
            self.scheme.tp_size,
            self.num_blocks,
            self.block_bytes,
            "staged" if staged else "zero-copy",
            self.scheme.rank_prefix(self.tp_rank),
            size,
            TRTLLM_INTERFACE,
        )

    def _check_blocks(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if not 0 <= int(b) < self.num_blocks:
                raise IndexError(f"block id {b} is outside the pool's {self.num_blocks} blocks")

    # ------------------------------------------------------------------ moving pages
    def _addr(self, block: int) -> int:
        return int(self.pool.data_ptr()) + int(block) * self.block_bytes

    def _block_bytes_view(self, block: int) -> Any:
        import torch

        return self.pool[block].view(-1).view(torch.uint8)

    def _get(self, keys: list[str], blocks: list[int]) -> list[bool]:
        """Read ``keys`` into ``blocks``; per block, whether it now holds the object."""
        if self._staging is None:
            res = self.client.batch_get_into(
                keys, [self._addr(b) for b in blocks], [self.block_bytes] * len(keys)
            )
            return [isinstance(r, int) and r == self.block_bytes for r in res]
        ok: list[bool] = []
        step = int(self._staging.shape[0])
        with self._staging_lock:
            for i in range(0, len(keys), step):
                ks, bs = keys[i : i + step], blocks[i : i + step]
                addrs = [int(self._staging[j].data_ptr()) for j in range(len(ks))]
                res = self.client.batch_get_into(ks, addrs, [self.block_bytes] * len(ks))
                good = [isinstance(r, int) and r == self.block_bytes for r in res]
                for j, (b, g) in enumerate(zip(bs, good, strict=True)):
                    if g:
                        self._block_bytes_view(b).copy_(self._staging[j])
                _sync(self.pool)
                ok += good
        return ok

    def _put(self, keys: list[str], blocks: list[int]) -> list[BaseException | None]:
        if self._staging is None:
            return list(
                self.client.batch_put_from(
                    keys, [self._addr(b) for b in blocks], [self.block_bytes] * len(keys)
                )
            )
        out: list[BaseException | None] = []
        step = int(self._staging.shape[0])
        with self._staging_lock:
            for i in range(0, len(keys), step):
                ks, bs = keys[i : i + step], blocks[i : i + step]
                for j, b in enumerate(bs):
                    self._staging[j].copy_(self._block_bytes_view(b))
                _sync(self.pool)
                addrs = [int(self._staging[j].data_ptr()) for j in range(len(ks))]
                out += self.client.batch_put_from(ks, addrs, [self.block_bytes] * len(ks))
        return out

    # ------------------------------------------------------------------ loads
    def start_load_kv(self, stream: Any) -> None:
        """Start this step's loads in the background (layer 0 waits for them)."""
        meta = self._get_connector_meta()
        if not isinstance(meta, StoreConnectorMetadata) or not meta.loads:
            return
        for job in meta.loads:
            self._check_blocks(job.block_ids)
            if self.client is None:
                self._fail_load(job.block_ids, "the store is not connected")
                continue
            keys = self.scheme.keys(job.pages, self.tp_rank)
            blocks = list(job.block_ids)
            self._loading.append((self._load_pool.submit(self._get, keys, blocks), blocks))

    def _fail_load(self, blocks: list[int], why: object) -> None:
        self._load_errors.update(blocks)
        self.stats["load_failures"] += len(blocks)
        logger.warning(
            "mooncake_trtllm: loading %d KV block(s) from the store failed (%s); %s",
            len(blocks),
            why,
            "failing the step (load_failure_policy: fail)"
            if self.opts["load_failure_policy"] == "fail"
            else "reported as not loaded, to recompute",
        )
        if self.opts["load_failure_policy"] == "fail":
            raise RuntimeError(
                f"mooncake_trtllm: {len(blocks)} KV block(s) could not be loaded from the store "
                f"({why}); load_failure_policy is 'fail'"
            )

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Before a layer runs: every load of this step is complete (they hold every layer)."""
        jobs, self._loading = self._loading, []
        failed: list[int] = []
        first: object = None
        for fut, blocks in jobs:
            try:
                good = fut.result()
            except Exception as exc:
                good, first = [False] * len(blocks), first or exc
            failed += [b for b, g in zip(blocks, good, strict=True) if not g]
            self.stats["loaded_pages"] += sum(good)
        if failed:
            self._fail_load(failed, first or "missing, evicted or of another size")

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call: not loaded, to be recomputed."""
        out, self._load_errors = self._load_errors, set()
        return out

    # ------------------------------------------------------------------ saves
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Nothing per layer: a page's object holds every layer; saved after the forward."""

    def wait_for_save(self, stream: Any) -> None:
        """Hand this step's saves to the background thread (the forward is not waited on
        here: the save thread waits for this step's GPU work before reading blocks)."""
        if self._loading:  # a model without layer hooks: the loads still complete first
            self.wait_for_layer_load(0, stream)
        meta = self._get_connector_meta()
        if not isinstance(meta, StoreConnectorMetadata) or not meta.saves:
            return
        event = _record(stream, self.pool)
        for job in meta.saves:
            self._check_blocks(job.block_ids)
            if self.client is None:
                continue
            keys = self.scheme.keys(job.pages, self.tp_rank)
            fut = self._save_pool.submit(self._save, keys, list(job.block_ids), event)
            with self._lock:
                self._saves.setdefault(job.request_id, []).append(fut)

    def _save(self, keys: list[str], blocks: list[int], event: Any) -> None:
        if event is not None:
            event.synchronize()
        if time.monotonic() < self._save_down_until:  # failed recently: drop, do not queue up
            self.stats["saves_skipped"] += len(keys)
            return
        try:
            res = self._put(keys, blocks)
        except Exception as exc:
            res = [exc] * len(keys)
        errs = [r for r in res if r is not None and type(r).__name__ != "ObjectExists"]
        self.stats["saved_pages"] += sum(1 for r in res if r is None)
        if errs:
            self.stats["save_failures"] += len(errs)
            self._save_down_until = time.monotonic() + float(self.opts["retry_after_s"])
            if not self._save_down_logged:
                self._save_down_logged = True
                logger.warning(
                    "mooncake_trtllm: saving KV pages to the store failed (%s); serving "
                    "continues without saving for %.0f s",
                    errs[0],
                    float(self.opts["retry_after_s"]),
                )
        else:
            self._save_down_logged = False

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """(requests whose saves are all done, requests whose async loads are done).

        Loads are synchronous (``get_num_new_matched_tokens`` answers ``False``), so
        any request TensorRT-LLM says started loading is done.
        """
        saved: list[int] = []
        with self._lock:
            self._awaiting.update(finished_gen_req_ids)
            for rid in list(self._awaiting):
                if all(f.done() for f in self._saves.get(rid, [])):
                    saved.append(rid)
                    self._awaiting.discard(rid)
                    self._saves.pop(rid, None)
        return saved, list(started_loading_req_ids)

    def close(self) -> None:
        self._load_pool.shutdown(wait=True)
        self._save_pool.shutdown(wait=True)
        if self.client is not None:
            self.client.close()
            self.client = None


def _record(stream: Any, pool: Any) -> Any:
    """An event marking the end of the step's work on ``stream`` (None on the CPU)."""
    if pool is None or pool.device.type != "cuda":
        return None
    import torch

    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ev.record(stream if stream is not None else torch.cuda.current_stream(pool.device))
    return ev


def _sync(pool: Any) -> None:
    if pool is not None and pool.device.type == "cuda":
        import torch

        torch.cuda.current_stream(pool.device).synchronize()
