"""``MooncakeCoreStoreConnector``: a KV-cache pool shared by vLLM instances (``kv_both``).

Select it with::

    --kv-transfer-config '{"kv_connector":"MooncakeCoreStoreConnector","kv_role":"kv_both",
                           "kv_connector_extra_config":{"mooncake":{"master_server_address":"127.0.0.1:50051"}}}'

Keys: one object per (page, layer), ``mcv/<model>/tp<rank>of<size>/<chain>/L<layer>`` where
``chain`` is a prefix hash chained over the page tokens and seeded with the model, dtype
and page size; a page is ``block_size`` prompt tokens (only full pages are stored). The
scheme is defined once, in :mod:`mooncake_vllm.store_keys` (the PD proxy uses it too).

Scheduler side (EngineCore process):

- ``get_num_new_matched_tokens``: asks the store (``batch_exists``) how many consecutive
  pages past the local prefix-cache hit it holds; at least one prompt token is left to
  compute. A prompt is hashed into pages only when a lookup or a save needs them. A failing
  master counts as a miss (one log line; lookups pause for a while). A request whose
  ``kv_transfer_params`` has ``"mooncake_store_load": false`` is not looked up (0 tokens,
  no lookup counted); its pages are saved as any other's.
- ``update_state_after_alloc``: plans a load of those pages into the allocated blocks.
- ``build_connector_meta``: loads planned this step, and saves of prompt pages that this
  step completes (pages that were loaded are not saved again).
- ``request_finished``: keeps the blocks while the request's saves are in flight.

Worker side (worker process): see :mod:`mooncake_vllm.store_worker`.

Options (``kv_connector_extra_config``): ``mooncake`` (config overrides, e.g.
``master_server_address``), ``segment_size`` (memory this instance lends to the pool,
default the config's ``global_segment_size``; ``0`` lends none), ``stats_dir``,
``lookup_timeout_s`` (2), ``retry_after_s`` (10), ``warm_up`` (true), ``tenant`` (the
store tenant whose namespace and quota this instance's pages use; default none: see
docs/store.md, "Tenants and quotas").

Start-up does the first-use work, so the first store hit costs what later ones do: the
scheduler connects to the master when the engine starts (not at its first lookup), and the
worker warms up its side once its KV cache is registered (see
:mod:`mooncake_vllm.store_worker`); ``warm_up: false`` leaves all of it to the first
request, as before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from mooncake_core.config import parse_bool
from mooncake_vllm.common import Counters, config_from_engine, option, tenant_of_config
from mooncake_vllm.stats import ConnectorStatsMixin, lookup_outcome
from mooncake_vllm.store_keys import (
    WARM_PREFIX,
    key_prefix,
    page_chain,
    rank_dir,
    scheme_of,
)
from mooncake_vllm.store_worker import _StoreWorker

__all__ = ["MooncakeCoreStoreConnector", "page_chain", "scheme_of"]

logger = logging.getLogger(__name__)


@dataclass
class PageJob:
    """Pages of one request to move: page hashes and the local blocks that hold them."""

    request_id: str
    pages: list[str]
    block_ids: list[int]


@dataclass
class StoreMetadata(KVConnectorMetadata):
    loads: list[PageJob] = field(default_factory=list)
    saves: list[PageJob] = field(default_factory=list)
    loads_started: bool = False  # set by the worker when it starts this step's loads


@dataclass
class _Req:
    request: Any
    prompt: list[int]
    hashes: list[str] | None = None  # page hashes: computed when first needed (_pages)
    blocks: list[int] = field(default_factory=list)
    local_hit: int = 0
    looked_up: int = -1  # num_computed_tokens of the last lookup
    hit_pages: int = 0  # pages the store will load (after the local hit)
    saved_upto: int = 0  # pages [0, saved_upto) need no save
    saving: bool = False


def store_load_wanted(request: Any) -> bool:
    """False when the request opted out of store loads: ``"mooncake_store_load": false`` in
    its ``kv_transfer_params`` (vLLM's ``Request``; under MultiConnector, the same object)."""
    params = getattr(request, "kv_transfer_params", None)
    return not (isinstance(params, dict) and params.get("mooncake_store_load") is False)


def _key_prefix(vllm_config: Any) -> str:
    return key_prefix(str(getattr(vllm_config.model_config, "model", "model")))


def _rank_dir(rank: int, size: int) -> str:
    return rank_dir(rank, size)


class _StoreScheduler:
    def __init__(self, vllm_config: Any, extra: dict[str, Any], engine_id: str) -> None:
        from mooncake_core.store.client import StoreClient

        self.block_size = int(vllm_config.cache_config.block_size)
        self.scheme = scheme_of(vllm_config)
        self.seed = self.scheme.seed
        self.tp_size = self.scheme.tp_size
        self.retry_after_s = float(option(extra, "retry_after_s", 10.0))
        self.counters = Counters(f"store-sched-{engine_id}", option(extra, "stats_dir", None))
        tenant = tenant_of_config(extra)
        self._make_client: Any = lambda: StoreClient(
            config_from_engine(extra),
            segment_size=0,
            failover_timeout_s=float(option(extra, "lookup_timeout_s", 2.0)),
            tenant=tenant,
        )
        self.client: Any = None
        self._down_until = 0.0
        self.reqs: dict[str, _Req] = {}
        self._loads: list[PageJob] = []
        self._saves: list[PageJob] = []
        self.warm_up_s: float | None = None  # how long the start-up connection took
        self._counts: dict[str, float] = {}  # counter increments of this step (one write)
        if parse_bool(option(extra, "warm_up", True), "warm_up"):
            self.warm_up()

    def warm_up(self) -> None:
        """Connect to the master now and ask it once, so the first lookup pays no set-up.

        A master that does not answer is not fatal: lookups retry as before."""
        t0 = time.monotonic()
        try:
            self._connect().batch_exists([f"{WARM_PREFIX}/lookup"])
        except Exception as exc:
            logger.warning(
                "mooncake_vllm: KV store master not reachable at start-up (%s); "
                "the first lookup tries again",
                exc,
            )
            return
        self.warm_up_s = time.monotonic() - t0
        logger.info(
            "mooncake_vllm: store scheduler connected to the master in %.0f ms",
            self.warm_up_s * 1e3,
        )

    def _connect(self) -> Any:
        if self.client is None:
            client = self._make_client()
            client.start()  # closes itself when it fails
            self.client = client
        return self.client

    def _pages(self, st: _Req) -> list[str]:
        """The page hashes of ``st``'s prompt, computed at the first lookup or save that needs
        them: a prompt whose lookup pages are all in vLLM's own prefix cache and that
        completes no new page is never hashed (0.4 ms for 3136 tokens here)."""
        if st.hashes is None:
            st.hashes = self.scheme.pages(st.prompt)
        return st.hashes

    def _count(self, **deltas: float) -> None:
        """Add to the counters with this step's other increments (written once, in
        :meth:`build_connector_meta`: every counters write is a file write)."""
        for k, v in deltas.items():
            self._counts[k] = self._counts.get(k, 0) + v

    def _lookup(self, pages: list[str]) -> int:
        """How many of ``pages`` (in order) the store holds; 0 while the master is down."""
        if not pages or time.monotonic() < self._down_until:
            return 0
        t0 = time.monotonic()
        try:
            client = self._connect()
            # a page is a hit only when every TP rank's shard of it is in the store
            n = self.scheme.held_pages(client.batch_exists(self.scheme.exists_keys(pages)))
            self._count(lookup_seconds=time.monotonic() - t0)
        except Exception as exc:
            self._down_until = time.monotonic() + self.retry_after_s
            self.counters.add(lookup_failures=1)
            logger.warning(
                "mooncake_vllm: KV store lookup failed (%s); computing prompts locally, "
                "next try in %.0f s",
                exc,
                self.retry_after_s,
            )
            return 0
        return n

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        rid = request.request_id
        prompt = list(request.prompt_token_ids or [])
        bs = self.block_size
        st = self.reqs.get(rid)
        if st is None:
            st = _Req(request, prompt)
            self.reqs[rid] = st
        # leave at least one prompt token to compute
        max_pages = max(0, (len(prompt) - 1) // bs)
        start = num_computed_tokens // bs
        if st.looked_up == num_computed_tokens:  # asked again (e.g. no free blocks yet)
            return max(0, (start + st.hit_pages) * bs - num_computed_tokens), False
        st.local_hit = num_computed_tokens
        st.looked_up = num_computed_tokens
        st.hit_pages = 0
        if start >= max_pages or not store_load_wanted(request):
            return 0, False
        hit = self._lookup(self._pages(st)[start:max_pages])
        asked = max_pages - start
        self._count(lookup_requests=1, lookup_pages=asked, **lookup_outcome(hit, asked))
        st.hit_pages = hit
        tokens = (start + hit) * bs - num_computed_tokens
        return max(0, tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None:
            return
        ids = blocks.get_block_ids()
        ids = list(ids[0]) if ids and isinstance(ids[0], (list, tuple)) else list(ids or [])
        start = st.local_hit // self.block_size
        if num_external_tokens > 0 and st.hit_pages:
            n = st.hit_pages
            self._count(hit_requests=1, hit_pages=n)
            pages = self._pages(st)[start : start + n]
            self._loads.append(PageJob(request.request_id, pages, ids[start : start + n]))
        # local prefix hits and store hits are not saved again
        st.saved_upto = start + (st.hit_pages if num_external_tokens > 0 else 0)

    def build_connector_meta(self, so: Any) -> StoreMetadata:
        bs = self.block_size
        done: dict[str, int] = {}
        for nr in so.scheduled_new_reqs:
            st = self.reqs.get(nr.req_id)
            if st is None:
                continue
            b = nr.block_ids
            st.blocks = list(b[0]) if b and isinstance(b[0], (list, tuple)) else list(b or [])
            done[nr.req_id] = nr.num_computed_tokens + so.num_scheduled_tokens.get(nr.req_id, 0)
        cached = so.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if nb is not None:
                new = list(nb[0]) if nb and isinstance(nb[0], (list, tuple)) else list(nb)
                st.blocks = new if rid in resumed else st.blocks + new
            done[rid] = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)
        for rid, computed in done.items():
            st = self.reqs[rid]
            upto = min(computed // bs, len(st.prompt) // bs, len(st.blocks))
            if upto > st.saved_upto:
                pages = self._pages(st)[st.saved_upto : upto]
                self._saves.append(PageJob(rid, pages, st.blocks[st.saved_upto : upto]))
                st.saved_upto = upto
                st.saving = True
        meta = StoreMetadata(loads=self._loads, saves=self._saves)
        self._loads, self._saves = [], []
        if self._counts:
            counts, self._counts = self._counts, {}
            self.counters.add(**counts)
        return meta

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        st = self.reqs.pop(request.request_id, None)
        return (st is not None and st.saving), None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def loads_may_start_early(kv_cache_config: Any) -> bool:
    """Whether a step's loads may start in ``handle_preemptions``: not where vLLM zeroes newly
    allocated blocks while it prepares the step (Mamba layers, mixed-precision caches: a
    load could land before the zeroing), nor where the KV cache config is unknown."""
    flag = getattr(kv_cache_config, "needs_kv_cache_zeroing", None)
    return flag is False


class MooncakeCoreStoreConnector(ConnectorStatsMixin, KVConnectorBase_V1):
    """Saves prompt KV pages into the mooncake-core store and loads them on prefix hits."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        engine_id = str(ktc.engine_id)
        self.sched: _StoreScheduler | None = None
        self.worker: _StoreWorker | None = None
        self._early_loads = loads_may_start_early(kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.sched = _StoreScheduler(vllm_config, extra, engine_id)
        else:
            from mooncake_vllm.connector import _tp_rank

            self.worker = _StoreWorker(vllm_config, extra, engine_id, _tp_rank())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is only a future miss

    # ============================== scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.sched is not None
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.sched is not None
        self.sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self.sched is not None
        return self.sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self.sched is not None
        return self.sched.request_finished(request, block_ids)

    # ============================== worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM's first worker-side call of a step, with this step's metadata, before it
        prepares the step's inputs: this step's loads start here (about 1.5 ms before
        ``start_load_kv``, which layer 0's batch then need not make up), unless vLLM zeroes
        new blocks in between (see :func:`loads_may_start_early`)."""
        if self._early_loads:
            self._start_loads(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.has_connector_metadata():
            self._start_loads(self._get_connector_metadata())

    def _start_loads(self, meta: Any) -> None:
        if self.worker is None or not isinstance(meta, StoreMetadata):
            return
        if not meta.loads or meta.loads_started:
            return
        meta.loads_started = True
        self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # pages are saved after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        self.worker.finish_loads()
        meta = self._get_connector_metadata()
        if isinstance(meta, StoreMetadata):
            self.worker.submit_saves(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker is None:
            return KVConnectorTransferResults()
        return KVConnectorTransferResults(
            finished_sending=self.worker.finished_saves(finished_req_ids)
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.sched is not None:
            self.sched.close()
