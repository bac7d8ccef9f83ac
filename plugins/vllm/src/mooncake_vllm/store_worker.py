"""The worker-process half of :mod:`mooncake_vllm.store_connector`.

``_StoreWorker`` registers the KV cache with the store (and lends it a segment), warms the
path a hit takes up at start-up, loads pages layer by layer, saves them, and places its I/O
threads on CPUs (the ``io_cpus`` option); ``MooncakeCoreStoreConnector`` calls it in the
worker process.

``handle_preemptions`` (vLLM's first call of a step, before it prepares the step's inputs;
``start_load_kv`` where vLLM zeroes new blocks) submits one batch per layer in layer order,
read one at a time per CPU the I/O threads have besides the forward's (four at once where
nothing is bound); ``wait_for_layer_load`` waits for that layer only (the forward overlaps
the rest); ``wait_for_save`` hands this step's saves to a background thread (zero-copy from
the KV cache into the pool); ``get_transfer_results`` reports requests whose saves finished;
``get_block_ids_with_load_errors`` reports pages that failed to load (vLLM's
``kv_load_failure_policy`` then recomputes or fails them).

Once its KV cache is registered, the worker starts its load and save threads and sends one
probe page through the whole path (exists, put, get, remove), which opens the master
connections, the local transport and the code paths a hit takes (``warm_up: false`` leaves
all of it to the first request).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from mooncake_core.config import parse_bool
from mooncake_vllm.common import Counters, config_from_engine, option, tenant_of_config
from mooncake_vllm.store_keys import WARM_PREFIX, scheme_of

if TYPE_CHECKING:
    from mooncake_vllm.store_connector import PageJob, StoreMetadata

# the connector's logger: the worker's log lines keep the name they had in store_connector
logger = logging.getLogger("mooncake_vllm.store_connector")

_LOAD_THREADS = 4  # load threads (batches read at once: see _StoreWorker._load_streams)
_LOAD_BATCHES = 0  # default of the load_batches option (0: one batch per layer)
_IO_CPUS = "spare"  # default of the io_cpus option
_SAVE_NICE = 10  # niceness of the save thread


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
        # the scheduler side's module imports this one (a top-level import would be a cycle)

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
        key = f"{WARM_PREFIX}/{self.client.client_id}"
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
