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

Worker side (worker process): ``handle_preemptions`` (vLLM's first call of a step, before it
prepares the step's inputs; ``start_load_kv`` where vLLM zeroes new blocks) submits one
batch per layer in layer order, read one at a time per CPU the I/O threads have besides the
forward's (four at once where nothing is bound); ``wait_for_layer_load`` waits for that
layer only (the forward overlaps the rest);
``wait_for_save`` hands this step's saves to a background thread (zero-copy from the KV
cache into the pool); ``get_transfer_results`` reports requests whose saves finished;
``get_block_ids_with_load_errors`` reports pages that failed to load (vLLM's
``kv_load_failure_policy`` then recomputes or fails them).

Options (``kv_connector_extra_config``): ``mooncake`` (config overrides, e.g.
``master_server_address``), ``segment_size`` (memory this instance lends to the pool,
default the config's ``global_segment_size``; ``0`` lends none), ``stats_dir``,
``lookup_timeout_s`` (2), ``retry_after_s`` (10), ``warm_up`` (true), ``tenant`` (the
store tenant whose namespace and quota this instance's pages use; default none: see
docs/store.md, "Tenants and quotas").

Start-up does the first-use work, so the first store hit costs what later ones do: the
scheduler connects to the master when the engine starts (not at its first lookup); the
worker, once its KV cache is registered, starts its load and save threads and sends one
probe page through the whole path (exists, put, get, remove), which opens the master
connections, the local transport and the code paths a hit takes (``warm_up: false``
leaves all of it to the first request, as before).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from mooncake_core.config import parse_bool
from mooncake_vllm.common import Counters, config_from_engine, option
from mooncake_vllm.stats import ConnectorStatsMixin, lookup_outcome
from mooncake_vllm.store_keys import StoreKeyScheme, key_prefix, page_chain, rank_dir

__all__ = ["MooncakeCoreStoreConnector", "page_chain", "scheme_of"]

logger = logging.getLogger(__name__)

_WARM_PREFIX = "mcv-warm-up"  # keys of the start-up probe (never a KV page: no "mcv/")
_LOAD_THREADS = 4  # load threads (batches read at once: see _StoreWorker._load_streams)
_LOAD_BATCHES = 0  # default of the load_batches option (0: one batch per layer)
_IO_CPUS = "spare"  # default of the io_cpus option
_SAVE_NICE = 10  # niceness of the save thread


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


def _tp_size(vllm_config: Any) -> int:
    return int(
        getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1
    )


def _rank_dir(rank: int, size: int) -> str:
    return rank_dir(rank, size)


def tenant_of_config(extra: dict[str, Any]) -> str:
    """The ``tenant`` option, checked (a bad name stops the engine with one clear line)."""
    from mooncake_core.store.tenants import check_tenant

    return check_tenant(str(option(extra, "tenant", "") or ""), "kv_connector_extra_config.tenant")


def scheme_of(vllm_config: Any) -> StoreKeyScheme:
    """The key scheme of this vLLM engine (model, dtype, block size, TP size)."""
    mc = vllm_config.model_config
    return StoreKeyScheme(
        str(getattr(mc, "model", "?")),
        str(getattr(mc, "dtype", "?")),
        int(vllm_config.cache_config.block_size),
        _tp_size(vllm_config),
    )


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
            self._connect().batch_exists([f"{_WARM_PREFIX}/lookup"])
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


_IO_CPU_MODES = ("spare", "any", "engine")


def _io_cpus(extra: dict[str, Any]) -> str:
    """The ``io_cpus`` option, checked: where the connector's I/O threads may run.

    - ``spare`` (the default): on the CPUs of the process's cpuset that vLLM did not bind its
      compute to (a page copy then never takes the forward's core); where vLLM bound nothing,
      or bound every CPU, the threads stay where they are.
    - ``any``: on any CPU of the cpuset, the forward's included.
    - ``engine``: on the cores vLLM binds its compute threads to (they inherit that binding).
    """
    how = str(option(extra, "io_cpus", _IO_CPUS))
    if how not in _IO_CPU_MODES:
        raise ValueError(
            f"kv_connector_extra_config.io_cpus must be 'spare', 'any' or 'engine', got {how!r}"
        )
    return how


def _resolve_io_cpus(how: str, engine: set[int] | None) -> set[int] | None:
    """The CPU set of ``how`` for the I/O threads, given the forward thread's CPUs ``engine``
    (:func:`_binding`; None: the platform cannot bind). None: keep the inherited binding."""
    if how == "engine" or engine is None:
        return None
    every = set(range(os.cpu_count() or 1))  # the kernel keeps them inside the cgroup's cpuset
    if how == "any":
        return every
    return (every - engine) or None


def _binding() -> set[int] | None:
    """The calling thread's CPUs (None where the platform cannot say)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _set_cpus(tid: int, cpus: set[int] | None) -> None:
    if cpus is None:
        return
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError as exc:  # not allowed: the thread stays where it is
        logger.debug("thread %d keeps its CPUs: %s", tid, exc)


def _lower_priority(cpus: set[int] | None = None) -> None:
    """Run the calling thread at nice 10 or lower priority (Linux: per thread)."""
    _set_cpus(0, cpus)
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(_SAVE_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: run as is
        logger.debug("save thread keeps its priority: %s", exc)


class _StoreWorker:
    def __init__(
        self, vllm_config: Any, extra: dict[str, Any], engine_id: str, tp_rank: int
    ) -> None:
        self.extra = extra
        self.tenant = tenant_of_config(extra)
        self.scheme = scheme_of(vllm_config)
        self.tp_rank = tp_rank
        self.counters = Counters(
            f"store-worker-{engine_id}-tp{tp_rank}", option(extra, "stats_dir", None)
        )
        self.client: Any = None
        self.layers: list[tuple[str, Any]] = []
        self.block_bytes = 0
        # layer -> [(future of its group's batch, offset and count of its keys there, blocks)]
        self._loading: dict[str, list[tuple[Future[list[Any]], int, int, list[int]]]] = {}
        self.load_batches = int(option(extra, "load_batches", _LOAD_BATCHES))
        if self.load_batches < 0:
            raise ValueError(
                f"kv_connector_extra_config.load_batches must be >= 0, got {self.load_batches}"
            )
        self._load_secs = 0.0  # this step's load-thread seconds (added to the counters once)
        self._load_meta: dict[str, float] = {}
        self._load_errors: set[int] = set()
        self.io_cpu_mode = _io_cpus(extra)
        # resolved when the KV caches are registered, once vLLM has bound its compute threads;
        # the pools' threads start later and read it then
        self.io_cpus: set[int] | None = None
        self._engine_cpus: set[int] | None = None  # the forward thread's CPUs when resolved
        # saves are off the critical path: the save thread yields the core to the forward
        self._save_pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="mc-vllm-save",
            initializer=lambda: _lower_priority(self.io_cpus),
        )
        self._load_pool = ThreadPoolExecutor(
            max_workers=_LOAD_THREADS,
            thread_name_prefix="mc-vllm-load",
            initializer=lambda: _set_cpus(0, self.io_cpus),
        )
        self.warm = parse_bool(option(extra, "warm_up", True), "warm_up")
        self.warm_up_s: float | None = None  # how long the start-up probe took (None: not run)
        self._load_t0 = 0.0
        self._load_waited = 0.0
        self._loads_logged = 0
        self._saves: dict[str, list[Future[None]]] = {}
        self._finished_waiting: set[str] = set()
        self._lock = threading.Lock()
        self._save_down_logged = False
        self._save_down_until = 0.0
        self.retry_timeout_s = float(option(extra, "lookup_timeout_s", 2.0))
        self.retry_after_s = float(option(extra, "retry_after_s", 10.0))

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        from mooncake_core.config import parse_size
        from mooncake_core.store.client import StoreClient

        cfg = config_from_engine(self.extra)
        seg = self.extra.get("segment_size")
        size = int(cfg.global_segment_size) if seg is None else int(parse_size(seg))
        self._engine_cpus = _binding()  # vLLM's main thread, bound to its compute cores by now
        self.io_cpus = _resolve_io_cpus(self.io_cpu_mode, self._engine_cpus)
        try:
            self.client = StoreClient(
                cfg, segment_size=size, failover_timeout_s=self.retry_timeout_s, tenant=self.tenant
            ).start()
        except Exception as exc:  # serve without the pool rather than not at all
            logger.warning(
                "mooncake_vllm: cannot reach the KV store master %s (%s); this instance runs "
                "without the shared KV pool",
                cfg.master_server_address,
                exc,
            )
            self.client = None
            return
        for name, t in kv_caches.items():
            self.client.register_buffer(t)
            self.layers.append((name, t))
            self.block_bytes = int(t.stride(0)) * int(t.element_size())
        logger.info(
            "mooncake_vllm: store worker on %s, %d layers x %d bytes per page, lends %d bytes; "
            "keys %s..., seed %r",
            self.client.hostname,
            len(self.layers),
            self.block_bytes,
            size,
            self.scheme.rank_prefix(self.tp_rank),
            self.scheme.seed,
        )
        self._free_io_threads()
        if self.warm and self.layers:
            self.warm_up()
            self._free_io_threads()  # threads the warm-up started

    def _follow_binding(self) -> None:
        """Re-resolve ``io_cpus`` when the forward's thread was bound anew since (an operator's
        ``taskset -a`` after start-up moves every thread, ours too, onto the engine's cores)."""
        if self.io_cpu_mode == "engine":
            return
        now = _binding()
        if now == self._engine_cpus:
            return
        self._engine_cpus = now
        self.io_cpus = _resolve_io_cpus(self.io_cpu_mode, now)
        logger.info(
            "mooncake_vllm: the engine now runs on CPUs %s; I/O threads move to %s",
            sorted(now or ()),
            "its CPUs" if self.io_cpus is None else sorted(self.io_cpus),
        )
        self._free_io_threads(now if self.io_cpus is None else self.io_cpus)

    def _free_io_threads(self, cpus: set[int] | None = None) -> None:
        """Let the store client's threads (started by vLLM's bound main thread, so bound to
        its compute cores) run on ``io_cpus`` (or ``cpus``); threads they start inherit that."""
        cpus = self.io_cpus if cpus is None else cpus
        if cpus is None:
            return
        for t in threading.enumerate():
            if t.name.startswith("mc-") and t.native_id is not None:
                _set_cpus(t.native_id, cpus)

    def warm_up(self) -> None:
        """Do at start-up what the first hit would otherwise pay for.

        Starts the load and save threads and sends one probe page through the whole path
        (exists, put, get, remove): the master connections, the local transport and the
        code a hit runs are then in place. A failing probe is logged, never fatal.
        """
        import torch

        assert self.client is not None
        t0 = time.monotonic()
        n = self.block_bytes
        probe = torch.empty(2 * n, dtype=torch.uint8)
        probe[:n] = torch.randint(0, 256, (n,), dtype=torch.uint8)
        key = f"{_WARM_PREFIX}/{self.client.client_id}"
        src, dst = int(probe.data_ptr()), int(probe.data_ptr()) + n
        together = threading.Barrier(_LOAD_THREADS)

        def ask() -> None:  # all load threads at once: one master connection each
            with contextlib.suppress(threading.BrokenBarrierError):
                together.wait(5.0)
            self.client.batch_exists([key])

        try:
            for f in [self._load_pool.submit(ask) for _ in range(_LOAD_THREADS)]:
                f.result()
            self._save_pool.submit(time.sleep, 0).result()
            self.client.register_buffer(probe)
            try:
                self.client.batch_exists([key])
                put = self.client.batch_put_from([key], [src], [n])
                if put[0] is not None and type(put[0]).__name__ != "ObjectExists":
                    raise put[0]
                got = self._load_pool.submit(self.client.batch_get_into, [key], [dst], [n])
                res = got.result()
                if isinstance(res[0], BaseException):
                    raise res[0]
                if not torch.equal(probe[:n], probe[n:]):
                    raise RuntimeError("the probe page came back changed")
                self.client.batch_remove([key], force=True)
            finally:
                self.client.unregister_buffer(probe)
        except Exception as exc:
            logger.warning(
                "mooncake_vllm: start-up probe of the KV store failed (%s); the first hit "
                "sets up what is missing",
                exc,
            )
            return
        self.warm_up_s = time.monotonic() - t0
        logger.info(
            "mooncake_vllm: store worker warmed up in %.0f ms (threads, master, transport)",
            self.warm_up_s * 1e3,
        )

    def _keys(self, pages: list[str], layer: int) -> list[str]:
        return self.scheme.layer_keys(pages, self.tp_rank, layer)

    # ------------------------------------------------------------------ loads
    def _layer_groups(self) -> list[list[int]]:
        """The layers split into ``load_batches`` consecutive groups (0: one per layer)."""
        n = len(self.layers)
        k = n if self.load_batches <= 0 else min(self.load_batches, n)
        return [list(range(i * n // k, (i + 1) * n // k)) for i in range(k)]

    def start_load(self, meta: StoreMetadata) -> None:
        """Start this step's loads: one ``batch_get_into`` per group of layers, in layer order,
        on the load threads; :meth:`wait_for_layer_load` waits for a layer's group.

        The forward's thread only plans (which layer's pages lie where in which batch); the
        keys and addresses are built on the load threads. The groups are read in
        :meth:`_load_streams` chains at once, each in layer order: where the I/O threads have
        one spare CPU, four batches at once would share it and the first layer, which the
        forward needs first, would arrive only with the fourth."""
        if not meta.loads or self.client is None:
            return
        self._follow_binding()
        bb = self.block_bytes
        self._load_t0 = time.monotonic()
        self._load_waited = 0.0
        self._load_secs = 0.0
        pages = sum(len(j.pages) for j in meta.loads)
        plan: list[tuple[list[int], Future[list[Any]]]] = []
        for group in self._layer_groups():
            fut: Future[list[Any]] = Future()
            off = 0
            for li in group:
                name = self.layers[li][0]
                for job in meta.loads:
                    self._loading.setdefault(name, []).append(
                        (fut, off, len(job.pages), job.block_ids)
                    )
                    off += len(job.pages)
            plan.append((group, fut))
        streams = self._load_streams()
        for k in range(streams):
            self._load_pool.submit(self._load_chain, plan[k::streams], meta.loads)
        # counted with the waits when the last layer is in (one counters write per load)
        self._load_meta = {
            "load_requests": len(meta.loads),
            "load_pages": pages,
            "load_bytes": pages * bb * len(self.layers),
        }

    def _load_streams(self) -> int:
        """How many batches are read at once: one per CPU the I/O threads have besides the
        forward's (at most the load threads); all the load threads where the forward is not
        bound to some CPUs only (no CPU is then the forward's alone)."""
        spare = None if self.io_cpus is None else self.io_cpus - (self._engine_cpus or set())
        return min(_LOAD_THREADS, len(spare)) if spare else _LOAD_THREADS

    def _load_chain(
        self, chain: list[tuple[list[int], Future[list[Any]]]], jobs: list[PageJob]
    ) -> None:
        """Read the groups of ``chain`` one after the other (a load thread)."""
        bb = self.block_bytes
        for group, fut in chain:
            keys: list[str] = []
            addrs: list[int] = []
            try:
                for li in group:
                    base = int(self.layers[li][1].data_ptr())
                    for job in jobs:
                        keys += self._keys(job.pages, li)
                        addrs += [base + b * bb for b in job.block_ids]
            except BaseException as exc:  # the forward must not wait for it forever
                fut.set_exception(exc)
                continue
            self._read(keys, addrs, fut)

    def _read(self, keys: list[str], addrs: list[int], fut: Future[list[Any]]) -> None:
        try:
            t0 = time.monotonic()
            res = self.client.batch_get_into(keys, addrs, [self.block_bytes] * len(keys))
            with self._lock:
                self._load_secs += time.monotonic() - t0
            fut.set_result(res)
        except BaseException as exc:
            fut.set_exception(exc)

    def _save_pool_free_load(self, keys: list[str], addrs: list[int]) -> Future[list[Any]]:
        """Start one batch of reads on the load threads (the save thread may be busy)."""
        fut: Future[list[Any]] = Future()
        self._load_pool.submit(self._read, keys, addrs, fut)
        return fut

    def wait_for_layer_load(self, layer_name: str) -> None:
        jobs = self._loading.pop(layer_name, None)
        if not jobs:
            return
        t0 = time.monotonic()
        self._wait_layer(layer_name, jobs)
        self._load_waited += time.monotonic() - t0
        if not self._loading:  # the last layer of this step's loads
            took = time.monotonic() - self._load_t0
            with self._lock:
                secs, self._load_secs = self._load_secs, 0.0
            self.counters.add(
                load_wait_seconds=self._load_waited, load_seconds=secs, **self._load_meta
            )
            self._load_meta = {}
            self._loads_logged += 1
            logger.log(
                logging.INFO if self._loads_logged <= 3 else logging.DEBUG,
                "mooncake_vllm: store load %d: %d layers in %d batch(es), %.1f ms, "
                "the forward waited %.1f ms",
                self._loads_logged,
                len(self.layers),
                len(self._layer_groups()),
                took * 1e3,
                self._load_waited * 1e3,
            )

    def _wait_layer(
        self, layer_name: str, jobs: list[tuple[Future[list[Any]], int, int, list[int]]]
    ) -> None:
        for fut, off, n, blocks in jobs:
            try:
                res = fut.result()[off : off + n]
                bad = [b for b, r in zip(blocks, res, strict=True) if isinstance(r, BaseException)]
                first = next((r for r in res if isinstance(r, BaseException)), None)
            except BaseException as exc:
                bad, first = list(blocks), exc
            if bad:
                self._load_errors.update(bad)
                self.counters.add(load_failures=1)
                logger.warning(
                    "mooncake_vllm: loading %d KV page(s) of layer %s from the store failed (%s); "
                    "vLLM's kv_load_failure_policy decides (recompute: computed here)",
                    len(bad),
                    layer_name,
                    first,
                )

    def finish_loads(self) -> None:
        for name in list(self._loading):
            self.wait_for_layer_load(name)

    def load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # ------------------------------------------------------------------ saves
    def submit_saves(self, meta: StoreMetadata) -> None:
        if not meta.saves or self.client is None:
            return
        bb = self.block_bytes
        for job in meta.saves:
            keys: list[str] = []
            addrs: list[int] = []
            for li, (_, t) in enumerate(self.layers):
                base = int(t.data_ptr())
                keys += self._keys(job.pages, li)
                addrs += [base + b * bb for b in job.block_ids]
            fut = self._save_pool.submit(self._save, keys, addrs)
            with self._lock:
                self._saves.setdefault(job.request_id, []).append(fut)

    def _save(self, keys: list[str], addrs: list[int]) -> None:
        t0 = time.monotonic()
        if t0 < self._save_down_until:  # the store failed recently: drop, do not queue up
            self.counters.add(save_skipped=len(keys))
            return
        try:
            res = self.client.batch_put_from(keys, addrs, [self.block_bytes] * len(keys))
        except Exception as exc:
            res = [exc] * len(keys)
        errs = [r for r in res if r is not None and type(r).__name__ != "ObjectExists"]
        stored = sum(1 for r in res if r is None)
        self.counters.add(
            save_objects=stored,
            save_bytes=stored * self.block_bytes,
            save_seconds=time.monotonic() - t0,
            save_failures=1 if errs else 0,
        )
        if errs:
            self._save_down_until = time.monotonic() + self.retry_after_s
        if errs and not self._save_down_logged:
            self._save_down_logged = True
            logger.warning(
                "mooncake_vllm: saving KV pages to the store failed (%s); serving continues "
                "without saving",
                errs[0],
            )
        elif not errs:
            self._save_down_logged = False

    def finished_saves(self, finished_req_ids: set[str]) -> set[str]:
        out: set[str] = set()
        with self._lock:
            self._finished_waiting |= {r for r in finished_req_ids if r in self._saves}
            for rid in list(self._finished_waiting):
                futs = self._saves.get(rid, [])
                if all(f.done() for f in futs):
                    out.add(rid)
                    self._finished_waiting.discard(rid)
                    self._saves.pop(rid, None)
        return out

    def close(self) -> None:
        self._save_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        if self.client is not None:
            self.client.close()


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
