"""``StoreClient``: the Pythonic store client, which also lends its memory to the pool.

Contract (every method is *Blocking* and *Thread-safe*):

- Bytes: :meth:`put` / :meth:`get`; any buffer (bytes, bytearray, memoryview, numpy
  array, CPU torch tensor) is stored as its raw bytes.
- Zero-copy: :meth:`put_from` / :meth:`get_into` move bytes straight between the
  caller's buffer (or an address inside memory registered with
  :meth:`register_buffer`) and the holders' segments: no staging copy.
- Batches: :meth:`put_batch`, :meth:`get_batch`, :meth:`batch_put_from`,
  :meth:`batch_get_into` issue one master RPC per phase and one transfer batch; they
  return one entry per key (``None``/bytes/int on success, the exception otherwise).
- Typed: :meth:`put_array` / :meth:`get_array` (numpy), :meth:`put_tensor` /
  :meth:`get_tensor` (torch) keep dtype and shape in a small header.
- Metadata: :meth:`exists`, :meth:`batch_exists`, :meth:`get_size`, :meth:`remove`,
  :meth:`remove_by_regex`, :meth:`remove_all`, :meth:`query`.

Put is ``put_start`` (master allocates replicas) -> writes through the transfer engine
into the holders' segments -> ``put_end``; a failed write revokes, and one that failed on a
holder's side (a holder that died) is placed again on other segments. Get asks the master
for the replica list (granting a read lease), reads from the best replica (own segment
by memcpy, same host by shared memory, else TCP) and fails with ``LeaseExpired`` if the
read outlived the lease. Errors are :mod:`mooncake_core.errors` classes.

Where things live: this module is the front (lifecycle, heartbeat and SSD tasks, put and get,
metadata); :mod:`~mooncake_core.store.client_core` the shared base (master calls, moving bytes),
:mod:`~mooncake_core.store.lending` one-RPC puts through reservations,
:mod:`~mooncake_core.store.placement_retry` two-phase puts (placed again when a holder fails),
:mod:`~mooncake_core.store.locations` the location cache (``store.location_cache`` keys) and
:mod:`~mooncake_core.store.reads` the reads of remembered replicas,
:mod:`~mooncake_core.store.buffers` the caller's buffers,
:mod:`~mooncake_core.store.values` typed values.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_core.config import MooncakeConfig, load_config
from mooncake_core.errors import LeaseExpired, MasterUnavailable, StoreError, TransportError
from mooncake_core.store import protocol as P
from mooncake_core.store import values
from mooncake_core.store.buffers import LocalBuffer, as_view
from mooncake_core.store.client_core import HolderUnreachable, Job
from mooncake_core.store.hotkeys import run_copy_task
from mooncake_core.store.lending import ReservationLending
from mooncake_core.store.locations import LocationCache, ReplicaAnswer
from mooncake_core.store.placement_retry import PlacementRetry, PutLost
from mooncake_core.store.protocol import ReplicaCfg, SliceW
from mooncake_core.store.reads import RememberedReads
from mooncake_core.store.rpc import MasterRPC
from mooncake_core.store.ssd import SsdTier
from mooncake_core.store.state import RESERVE_MAX_OBJECT
from mooncake_core.store.tenants import check_tenant, user_key
from mooncake_core.transfer import TransferEngine
from mooncake_core.transfer.memory import ManagedBuffer, Region

__all__ = ["StoreClient", "ReplicaCfg", "SliceW"]

logger = logging.getLogger(__name__)

_CLOSE_WAIT_S = 2.0  # close(): at most this long for the goodbye RPCs (reservations, unmounts)


class StoreClient(ReservationLending, RememberedReads, PlacementRetry):
    """A store client (see module doc).

    Args:
        config: configuration (defaults to :func:`load_config`).
        master: master address ``host:port`` or ``etcd://host:port`` (default
            ``config.master_server_address``).
        segment_size: bytes of memory to contribute (default ``config.global_segment_size``;
            0 contributes none).
        engine: a started or unstarted :class:`TransferEngine` to use (not closed by us).
        ssd_path: directory for the SSD tier (default ``config.store.ssd_path``; "" = off).
        transport: force ``"tcp"`` or ``"shm"`` for transfers (default: best available).
        cluster_id: HA namespace in etcd.
        failover_timeout_s: how long calls keep retrying while no master answers.
    """

    def __init__(
        self,
        config: MooncakeConfig | None = None,
        *,
        master: str | None = None,
        segment_size: int | None = None,
        engine: TransferEngine | None = None,
        ssd_path: str | None = None,
        transport: str | None = None,
        cluster_id: str = "default",
        failover_timeout_s: float = 15.0,
        prefault: bool = False,
        tenant: str = "",
        **overrides: Any,
    ) -> None:
        self.config = config if config is not None else load_config(**overrides)
        if config is not None and overrides:
            self.config = config.replace(**overrides)
        self.master_address = master or self.config.master_server_address
        self.segment_size = int(
            self.config.global_segment_size if segment_size is None else segment_size
        )
        if self.segment_size < 0:
            raise P.InvalidArgument(f"segment_size must not be negative, got {self.segment_size}")
        if transport not in (None, "tcp", "shm"):
            raise P.InvalidArgument(f"transport must be 'tcp' or 'shm', got {transport!r}")
        self.transport = transport
        self.client_id = uuid.uuid4().hex
        self._own_engine = engine is None
        self.engine = engine if engine is not None else TransferEngine(self.config)
        path = self.config.store.ssd_path if ssd_path is None else ssd_path
        self.ssd = SsdTier(path) if path else None
        self.rpc = MasterRPC(
            self.master_address,
            cluster_id=cluster_id,
            timeout_s=self.config.transfer.timeout_s,
            failover_timeout_s=failover_timeout_s,
            spin_us=self.config.store.rpc_spin_us,
        )
        self._prefault = prefault
        # keys live in this tenant's namespace; quotas per tenant (mooncake_core.store.tenants)
        self.tenant = check_tenant(tenant)
        self.rpc.tenant = self.tenant
        self._segments: dict[str, ManagedBuffer] = {}
        self._caller_mem: set[int] = set()  # addresses of segments whose memory the caller lent
        self._seg_names: list[str] = []
        self._mounts = 0  # segments ever mounted: names are never reused after an unmount
        self._started = False
        self._closed = False
        self._start_lock = threading.RLock()
        self._starting = False
        self.rpc.before_use = self._start_on_first_use
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._mount_lock = threading.Lock()
        self.reservations = self.config.store.client_reservations
        self._early = False  # the master takes early commits (set at registration)
        self._lent_lock = threading.Lock()
        self._lent = {}
        self._lent_release = []
        self._lent_refused = {}
        self.lease_ttl_s = self.config.store.lease_ttl_s
        self.heartbeat_s = self.config.store.heartbeat_interval_s
        self._where = LocationCache(
            self.config.store.location_cache
        )  # see mooncake_core.store.locations
        self._where_max = self._where.capacity
        self.location_hits = 0  # gets served by the remembered replica
        self.reads_by_segment: dict[str, int] = {}  # slices read, per segment read from
        self._failed_peers: dict[str, float] = {}  # peer -> when a remembered read from it failed
        self.location_misses = (
            0  # gets that read a remembered replica in vain (stale, or its holder failed)
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> StoreClient:
        """Start the engine, register with the master, mount the segment. Idempotent.

        A client that was not started starts itself on its first operation.
        """
        with self._start_lock:  # other threads' first operations wait here until the start is over
            if self._closed:
                raise MasterUnavailable("the store client is closed")
            if self._started:
                return self
            self._starting = True
            try:
                self.engine.start()
                self._register()
                if self.segment_size > 0:
                    self.mount_segment(self.segment_size)
            except BaseException:
                self.close()
                raise
            finally:
                self._starting = False
            self._started = True
            self.rpc.before_use = None
            self._poller = threading.Thread(
                target=self._poll_loop, name="mc-store-poll", daemon=True
            )
            self._poller.start()
        return self

    def _start_on_first_use(self) -> None:
        with self._start_lock:
            # _starting: this thread's own start() is asking the master (the lock is re-entrant)
            if not (self._started or self._closed or self._starting):
                logger.debug("store client %s starts on its first operation", self.client_id)
                self.start()

    def __enter__(self) -> StoreClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def mount_segment(
        self, size: int, *, memory: ManagedBuffer | None = None, offset: int = 0
    ) -> str:
        """Allocate ``size`` bytes of shared memory and lend them to the pool; returns its name.
        ``memory``: lend that mapping instead (e.g. a file's, ``size`` its length), registered
        here (same-host peers map its ``fd`` at ``offset``), closed when it is unmounted."""
        if size <= 0:
            raise P.InvalidArgument(f"segment size must be positive, got {size}")
        with self._mount_lock:
            # the first segment is named after the engine, later ones #1, #2, ... by a
            # counter that never goes back, so no name is ever given twice by this client
            # (an unmounted segment's name may still be in flight in readers' caches)
            seq = self._mounts
            self._mounts += 1
            name = self.engine.name if seq == 0 else f"{self.engine.name}#{seq}"
            if memory is None:
                buf = self.engine.allocate(size, name=f"store-{seq}", prefault=self._prefault)
            else:
                buf = memory
                region = Region(buf.addr, size, f"store-{seq}", owner=buf, memfd=buf.fd)
                region.memfd_offset = offset
                self.engine.segments.add(region)
                self._caller_mem.add(buf.addr)
            try:
                self.rpc.call(
                    "mount",
                    (self.client_id, name, self.engine.name, buf.addr, size, self.engine.host_id),
                )
            except BaseException:
                self._release(buf)
                raise
            self._segments[name] = buf
            self._seg_names.append(name)
        return name

    def unmount_segment(self, name: str) -> None:
        """Withdraw a segment: objects with no other replica disappear."""
        with self._mount_lock:
            buf = self._segments.get(name)
            if buf is None:
                raise P.InvalidArgument(f"this client has no segment {name!r}")
            self._call("unmount", (self.client_id, name))
            self._seg_names.remove(name)
            del self._segments[name]
            self._release(buf)

    def _release(self, buf: ManagedBuffer) -> None:
        if buf.addr in self._caller_mem:  # the caller's (mount_segment(memory=...))
            self._caller_mem.discard(buf.addr)
            self.engine.segments.remove(buf.addr)
            buf.close()
        else:
            self.engine.free(buf)

    @property
    def segment_names(self) -> list[str]:
        return list(self._seg_names)

    def close(self) -> None:
        """Unmount our segments, stop the engine (if ours), drop master connections."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._started:
            # saying goodbye is a courtesy (a master that hears nothing expires us): bounded, so a
            # master that is gone cannot hold close() (or a finalizer that calls it) for long
            end = time.monotonic() + _CLOSE_WAIT_S
            self._release_reservations(end)
            for name in list(self._seg_names):
                left = end - time.monotonic()
                if left <= 0:
                    logger.debug("no time left to unmount %s at close", name)
                    break
                try:
                    self.rpc.call("unmount", (self.client_id, name), timeout=left, failover_s=left)
                except (StoreError, OSError) as exc:
                    logger.debug("unmount %s at close: %s", name, exc)
        self.rpc.close()  # also wakes the heartbeat thread if it waits for an answer
        if self._poller is not None:
            self._poller.join(timeout=2 * self.heartbeat_s + 1)
        for buf in self._segments.values():
            if not self._own_engine or buf.addr in self._caller_mem:
                self._release(buf)
        if self._own_engine:
            self.engine.close()
        self._segments.clear()

    # ------------------------------------------------------------------ heartbeat and tasks
    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                tasks = self.rpc.call(
                    "poll", (self.client_id, self.heartbeat_s), timeout=self.heartbeat_s + 10
                )
            except P.UnknownClient:
                try:
                    self._remount()
                except (StoreError, OSError) as exc:
                    logger.warning("re-registering failed: %s", exc)
                    self._stop.wait(self.heartbeat_s)
                continue
            except (StoreError, OSError) as exc:
                if not self._stop.is_set():
                    logger.debug("heartbeat failed: %s", exc)
                    self._stop.wait(min(self.heartbeat_s, 0.5))
                continue
            for t in tasks:
                try:
                    self._run_task(t)
                except Exception as exc:  # a task must never kill the heartbeat
                    logger.warning(
                        "store task %s for %r failed: %s", t.get("kind"), t.get("key"), exc
                    )

    def _run_task(self, t: dict[str, Any]) -> None:
        kind, key, token = str(t["kind"]), str(t["key"]), int(t["token"])
        if kind == "delete_disk":
            if self.ssd is not None:
                self.ssd.delete(key)
            return
        if kind == "copy":  # an extra replica of a hot key (store/hotkeys.py)
            ok, detail = run_copy_task(self, t)
            self._call("task_done", (self.client_id, kind, key, token, ok, detail))
            return
        if self.ssd is None:
            self._call(
                "task_done", (self.client_id, kind, key, token, False, "no SSD tier on this client")
            )
            return
        if kind == "offload":
            buf = self._segments.get(str(t["segment"]))
            if buf is None:
                self._call("task_done", (self.client_id, kind, key, token, False, "segment gone"))
                return
            off, n = int(t["offset"]), int(t["length"])
            self.ssd.write(key, buf.view[off : off + n])
            self._call("task_done", (self.client_id, kind, key, token, True, ""))
        elif kind == "promote":
            slices = [SliceW._make(s) for s in t["slices"]]
            size = sum(s.length for s in slices)
            staging = bytearray(size)
            if not self.ssd.read_into(key, memoryview(staging)):
                self._call(
                    "task_done", (self.client_id, kind, key, token, False, "SSD copy missing")
                )
                return
            try:
                self._move("write", [(LocalBuffer(staging, None, False), slices)])
            except (TransportError, StoreError) as exc:
                self._call("task_done", (self.client_id, kind, key, token, False, str(exc)))
                return
            self._call("task_done", (self.client_id, kind, key, token, True, ""))

    # ------------------------------------------------------------------ put
    def _cfg(
        self,
        replica_num: int | None,
        preferred_segment: str,
        hard_pin: bool,
        soft_pin_ttl_s: float,
        strategy: str,
    ) -> ReplicaCfg:
        return ReplicaCfg(
            replica_num=self.config.store.replica_num if replica_num is None else replica_num,
            preferred_segment=preferred_segment,
            hard_pin=hard_pin,
            soft_pin_ttl_s=soft_pin_ttl_s,
            strategy=strategy,
        )

    # ------------------------------------------------------------ one-RPC puts through reservations
    def _put_local(self, key: str, local: LocalBuffer, cfg: ReplicaCfg) -> None:
        failed: HolderUnreachable | None = None  # the reservation's holder could not be written
        if (
            self.reservations
            and cfg.replica_num == 1
            and 0 < local.length <= RESERVE_MAX_OBJECT
            and isinstance(key, str)
            and 0 < len(key) <= P.MAX_KEY // 4
        ):  # odd input: the master's checks
            try:
                if self._put_reserved(key, local, cfg):
                    return
            except HolderUnreachable as exc:
                logger.info("put %r: %s; placing it on other segments", key, exc)
                failed = exc
        try:
            self._put_once(key, local, cfg, failed)
        except PutLost:
            logger.info("put %r was lost in a leader change; putting it again", key)
            self._put_once(key, local, cfg)

    def put(
        self,
        key: str,
        value: Any,
        *,
        replica_num: int | None = None,
        preferred_segment: str = "",
        hard_pin: bool = False,
        soft_pin_ttl_s: float = 0.0,
        strategy: str = "",
    ) -> None:
        """Store ``value`` (any buffer) under ``key``; ``ObjectExists`` if the key exists."""
        self.put_from(
            key,
            value,
            None,
            replica_num=replica_num,
            preferred_segment=preferred_segment,
            hard_pin=hard_pin,
            soft_pin_ttl_s=soft_pin_ttl_s,
            strategy=strategy,
        )

    def put_from(
        self,
        key: str,
        buf: Any,
        size: int | None = None,
        *,
        replica_num: int | None = None,
        preferred_segment: str = "",
        hard_pin: bool = False,
        soft_pin_ttl_s: float = 0.0,
        strategy: str = "",
    ) -> None:
        """Zero-copy put from a buffer or an address in registered memory (``size`` bytes)."""
        local = LocalBuffer(buf, size, writable=False)
        self._put_local(
            key,
            local,
            self._cfg(replica_num, preferred_segment, hard_pin, soft_pin_ttl_s, strategy),
        )

    def put_parts(self, key: str, *parts: Any, replica_num: int | None = None) -> None:
        """Store the concatenation of ``parts`` (one staging copy)."""
        views = [as_view(p, False)[0] for p in parts]
        if not views:
            raise P.InvalidArgument("put_parts needs at least one part")
        self.put(key, b"".join(views), replica_num=replica_num)

    def batch_put_from(
        self,
        keys: Sequence[str],
        bufs: Sequence[Any],
        sizes: Sequence[int] | None = None,
        *,
        replica_num: int | None = None,
        preferred_segment: str = "",
        hard_pin: bool = False,
        soft_pin_ttl_s: float = 0.0,
        strategy: str = "",
    ) -> list[BaseException | None]:
        """Put many objects: one ``batch_put_start``, one transfer batch, one ``batch_put_end``.

        Returns one entry per key: None on success, else the exception for that key.
        """
        if len(keys) != len(bufs) or (sizes is not None and len(sizes) != len(keys)):
            raise P.InvalidArgument("keys, buffers and sizes must have the same length")
        if not keys:
            return []
        locals_ = [
            LocalBuffer(b, None if sizes is None else sizes[i], writable=False)
            for i, b in enumerate(bufs)
        ]
        cfg = self._cfg(replica_num, preferred_segment, hard_pin, soft_pin_ttl_s, strategy)
        if (
            self.reservations
            and cfg.replica_num == 1
            and all(0 < x.length <= RESERVE_MAX_OBJECT for x in locals_)
            and all(isinstance(k, str) and 0 < len(k) <= P.MAX_KEY // 4 for k in keys)
        ):  # odd input: the master
            out: list[BaseException | None] = [None] * len(keys)
            failed: dict[int, HolderUnreachable] = {}  # reserved writes whose holder failed
            rest = self._batch_put_reserved(keys, locals_, cfg, out, failed)
            if rest:
                sub = self._batch_put_two_phase(
                    [keys[i] for i in rest],
                    [locals_[i] for i in rest],
                    cfg,
                    {j: failed[i] for j, i in enumerate(rest) if i in failed},
                )
                for i, r in zip(rest, sub, strict=True):
                    out[i] = r
            return out
        return self._batch_put_two_phase(keys, locals_, cfg)

    def put_batch(
        self,
        keys: Sequence[str],
        values: Sequence[Any],
        *,
        replica_num: int | None = None,
        **kw: Any,
    ) -> list[BaseException | None]:
        """Put many buffers; one entry per key: None on success, else the exception."""
        return self.batch_put_from(keys, values, None, replica_num=replica_num, **kw)

    # ------------------------------------------------------------------ get
    def _replicas(self, key: str) -> ReplicaAnswer:
        """The master's answer for ``key``, with the time the granting request was sent."""
        sent = [0.0]
        gen = self.rpc.generation()

        def once() -> Any:
            sent[0] = time.monotonic()
            return self._call("get_replica_list", (key,))

        size, reps, ttl, token = self._answer(self._retrying(once, f"get {key!r}"))
        return ReplicaAnswer(size, reps, ttl, sent[0], token, gen)

    def _read(self, key: str, local_for: Callable[[int], LocalBuffer]) -> int:
        last: BaseException | None = None
        first = self._read_remembered(key, local_for) if self._where_max > 0 else None
        if isinstance(first, int):
            return first
        for _attempt in range(2):
            a = first if first is not None else self._replicas(key)
            first = None
            local = local_for(a.size)
            for rep in self._rank(a.replicas):
                try:
                    self._move("read", [(local, rep)])
                except TransportError as exc:
                    last = exc
                    logger.debug("reading %r from %s failed: %s", key, rep[0].peer, exc)
                    continue
                if time.monotonic() - a.sent > a.ttl:
                    raise LeaseExpired(
                        f"get {key!r}: the read took longer than the {a.ttl:.1f}s lease; retry"
                    )
                self._where.remember(key, a.gen, a.token, a.size, rep)
                return a.size
            time.sleep(0.05)  # the master may be about to drop the dead holder's replicas
        raise TransportError(f"get {key!r}: every replica failed: {last}") from last

    def get(self, key: str) -> bytes:
        """The object's bytes (``ObjectNotFound`` if missing)."""
        holder: list[bytearray] = []

        def mk(size: int) -> LocalBuffer:
            holder.append(bytearray(size))
            return LocalBuffer(holder[-1], None, True)

        self._read(key, mk)
        return bytes(holder[-1])

    def get_into(self, key: str, buf: Any, size: int | None = None) -> int:
        """Read the object into ``buf`` (or an address in registered memory); returns its size."""
        probe = LocalBuffer(buf, size, writable=True)

        def mk(n: int) -> LocalBuffer:
            if n > probe.length:
                raise P.InvalidArgument(
                    f"get_into {key!r}: object is {n} bytes but the buffer holds {probe.length}"
                )
            if n == probe.length:
                return probe
            return probe.first(n, buf)

        return self._read(key, mk)

    def batch_get_into(
        self, keys: Sequence[str], bufs: Sequence[Any], sizes: Sequence[int] | None = None
    ) -> list[int | BaseException]:
        """Read many objects into buffers; one entry per key: bytes read, or the exception."""
        if len(keys) != len(bufs) or (sizes is not None and len(sizes) != len(keys)):
            raise P.InvalidArgument("keys, buffers and sizes must have the same length")
        if not keys:
            return []
        t0 = time.monotonic()
        gen = self.rpc.generation()
        early = self._batch_read_remembered(keys, bufs, sizes, gen) if self._where_max > 0 else None
        if early is not None:
            res, hit = early
        else:
            res, hit = self._call("batch_get_replica_list", (list(keys),)), {}
        answered = time.monotonic()
        out: list[int | BaseException] = [0] * len(keys)
        jobs: list[Job] = []
        chosen: dict[int, tuple[LocalBuffer, list[list[SliceW]]]] = {}
        ttl = self.lease_ttl_s
        for i, row in enumerate(res):
            code, size, reps, lttl = row[0], row[1], row[2], row[3]  # then the token (MasterState)
            if i in hit:
                out[i] = hit[i]
                ttl = min(ttl, float(lttl))
                continue
            if code != 0:
                if code == P.Code.RETRY:
                    try:
                        out[i] = self.get_into(
                            keys[i], bufs[i], None if sizes is None else sizes[i]
                        )
                    except (StoreError, TransportError) as exc:
                        out[i] = exc
                    continue
                out[i] = P.error_for(code, str(size))
                continue
            ttl = min(ttl, float(lttl))
            try:
                local = LocalBuffer(bufs[i], None if sizes is None else sizes[i], writable=True)
                if size > local.length:
                    raise P.InvalidArgument(
                        f"get {keys[i]!r}: object is {size} bytes but the buffer holds "
                        f"{local.length}"
                    )
                local = local.first(size, bufs[i])
            except StoreError as exc:
                out[i] = exc
                continue
            ranked = self._rank([[SliceW._make(s) for s in rep] for rep in reps])
            chosen[i] = (local, ranked)
            out[i] = int(size)
            jobs.append((i, local, ranked[0]))
        failed = self._batch_move("read", jobs, None)
        for i in failed:  # fall back to the other replicas, one key at a time
            local, ranked = chosen[i]
            for rep in ranked[1:]:
                try:
                    self._move("read", [(local, rep)])
                    break
                except TransportError as exc:
                    out[i] = exc
            else:
                if len(ranked) == 1:
                    out[i] = TransportError(f"get {keys[i]!r}: its only replica could not be read")
        done = time.monotonic()
        if done - t0 > ttl:
            return [
                LeaseExpired(
                    f"batch get: the reads took longer than the {ttl:.1f}s lease "
                    f"(the master answered after {answered - t0:.2f}s, "
                    f"the reads took {done - answered:.2f}s); retry"
                )
                if isinstance(x, int)
                else x
                for x in out
            ]
        if self._where_max > 0:
            for i, (_local, ranked) in chosen.items():
                if isinstance(out[i], int) and i not in failed and len(res[i]) > 4:
                    self._where.remember(keys[i], gen, int(res[i][4]), int(res[i][1]), ranked[0])
        return out

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """The objects' bytes; None for keys that are missing or failed."""
        if not keys:
            return []
        sizes = self._call("batch_get_replica_list", (list(keys),))
        bufs = [bytearray(int(s[1]) if s[0] == 0 else 1) for s in sizes]
        res = self.batch_get_into(keys, bufs)
        return [
            bytes(b[:r]) if isinstance(r, int) and not isinstance(r, bool) else None
            for b, r in zip(bufs, res, strict=True)
        ]

    # ------------------------------------------------------------------ typed values
    def put_array(self, key: str, arr: Any, **kw: Any) -> None:
        """Store a numpy array with its dtype and shape (read back with :meth:`get_array`)."""
        self.put(key, values.pack_array(arr), **kw)

    def get_array(self, key: str) -> Any:
        return values.unpack_array(key, self.get(key))

    def put_tensor(self, key: str, tensor: Any, **kw: Any) -> None:
        """Store a torch tensor (moved to the CPU if needed) with its dtype and shape."""
        self.put(key, values.pack_tensor(tensor), **kw)

    def get_tensor(self, key: str) -> Any:
        return values.unpack_tensor(key, self.get(key))

    # ------------------------------------------------------------------ metadata
    def exists(self, key: str) -> bool:
        return bool(self._call("exists", (key,)))

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return list(self._call("batch_exists", (list(keys),)))

    def get_size(self, key: str) -> int:
        return int(self._call("get_size", (key,)))

    def remove(self, key: str, *, force: bool = False) -> None:
        """Remove ``key``; ``ObjectBusy`` while it is leased or hard-pinned unless ``force``."""
        self._forget([key])
        self._call("remove", (key, force))

    def batch_remove(
        self, keys: Sequence[str], *, force: bool = False
    ) -> list[BaseException | None]:
        self._forget(keys)
        codes = self._call("batch_remove", (list(keys), force))
        return [
            None if c == 0 else P.error_for(c, f"remove {k!r} failed")
            for k, c in zip(keys, codes, strict=True)
        ]

    def remove_by_regex(self, pattern: str, *, force: bool = False) -> int:
        """Remove every key matching ``pattern`` (``re.search``); returns how many."""
        self._forget(None)
        return int(self._call("remove_by_regex", (pattern, force)))

    def keys_by_regex(self, pattern: str) -> list[str]:
        """Keys (of this client's tenant) matching ``pattern`` (``re.search``)."""
        keys = self._call("keys_by_regex", (pattern, False))
        return [user_key(k) for k in keys] if self.tenant else list(keys)

    def remove_all(self, *, force: bool = False) -> int:
        self._forget(None)
        return int(self._call("remove_all", (force,)))

    def replicas(self, key: str) -> tuple[int, list[list[SliceW]]]:
        """``(size, replicas)`` of ``key`` as a read sees them: per replica its slices
        (segment, peer, absolute address, length, host). Grants a read lease, as a get does."""
        ans = self._replicas(key)
        return ans.size, ans.replicas

    def query(self, key: str) -> dict[str, Any]:
        """The master's view of ``key``: size, replicas (segment, client, offset), pins, lease."""
        out = dict(self._call("query_key", (key,)))
        if self.tenant:
            out["key"] = user_key(str(out["key"]))
        return out

    def stats(self) -> dict[str, Any]:
        return dict(self._call("stats", ()))

    # ------------------------------------------------------------------ registered memory
    def register_buffer(self, buf: Any, size: int | None = None) -> Region:
        """Register a buffer (or ``addr`` + ``size``) so zero-copy calls may use addresses in it."""
        if isinstance(buf, int) and not isinstance(buf, bool):
            if size is None:
                raise P.InvalidArgument("register_buffer(addr) needs a size")
            return self.engine.register_memory(buf, size)
        return self.engine.register(buf)

    def unregister_buffer(self, buf: Any) -> None:
        self.engine.unregister(buf)

    @property
    def hostname(self) -> str:
        return self.engine.name
