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
into the holders' segments -> ``put_end``; a failed write revokes. Get asks the master
for the replica list (granting a read lease), reads from the best replica (own segment
by memcpy, same host by shared memory, else TCP) and fails with ``LeaseExpired`` if the
read outlived the lease. Errors are :mod:`mooncake_core.errors` classes.

Location cache (``store.location_cache`` keys): a client remembers, per key it put or
read, the replica and the object's version token. A get of such a key sends the
replica-list request, reads the remembered replica while the master answers, and keeps
the bytes only if the answer lists that replica under the same token (the object then sat
there unchanged since it was remembered, and is now leased); otherwise it reads again
from the answer. So a hit costs one transfer with the master round trip hidden behind it.
A miss or stale entry costs a wasted read, and a failed ``get_into`` may leave the
remembered object's old bytes in the buffer.
"""

from __future__ import annotations

import json
import logging
import random
import struct
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mooncake_core.config import MooncakeConfig, load_config
from mooncake_core.errors import (
    LeaseExpired,
    MasterUnavailable,
    MooncakeError,
    ObjectExists,
    SegmentError,
    StoreError,
    TransportError,
)
from mooncake_core.store import protocol as P
from mooncake_core.store.allocator import align
from mooncake_core.store.protocol import ReplicaCfg
from mooncake_core.store.rpc import MasterRPC, Pending
from mooncake_core.store.ssd import SsdTier
from mooncake_core.store.state import RESERVE_MAX_OBJECT
from mooncake_core.transfer import TransferEngine, TransferRequest
from mooncake_core.transfer.memory import ManagedBuffer, Region, buffer_address, host_view, memmove

__all__ = ["StoreClient", "ReplicaCfg"]

logger = logging.getLogger(__name__)

_CLOSE_WAIT_S = 2.0  # close(): at most this long for the goodbye RPCs (reservations, unmounts)

T = TypeVar("T")

_TMAGIC = b"MCT1"
_THDR = struct.Struct("<4sI")
SliceW = tuple[str, str, int, int, str]  # segment, peer, absolute addr, length, host


def _as_view(obj: Any, writable: bool) -> tuple[memoryview, Any]:
    """A flat byte memoryview of ``obj`` (plus an object to keep alive)."""
    if isinstance(obj, memoryview):
        mv = obj
    elif isinstance(obj, (bytes, bytearray)):
        mv = memoryview(obj)
    else:
        try:
            addr, n, kind = buffer_address(obj, writable=writable)
        except SegmentError as exc:
            raise P.InvalidArgument(str(exc)) from None
        if kind != "host":
            raise P.InvalidArgument("device memory is not supported by the store client; copy it to the host first")
        return host_view(addr, n), obj
    if mv.readonly and writable:
        raise P.InvalidArgument(f"{type(obj).__name__} is read-only; get_into needs a writable buffer")
    if not mv.contiguous:
        raise P.InvalidArgument("buffer must be contiguous")
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")
    return mv, obj


@dataclass(slots=True)
class _Lent:
    """A reservation the master lent us: we allocate from ``next`` up to ``end`` ourselves."""

    rid: int
    segment: str
    peer: str
    base: int
    host: str
    next: int
    end: int
    expires: float  # local monotonic time after which we stop starting writes into it
    generation: int  # the master connection's generation when it was lent (see MasterRPC.generation)
    inflight: int = 0
    dead: bool = False  # a write or commit failed: never use again
    retired: bool = False  # replaced by a newer one
    released: bool = False


class _Local:
    """The local side of one object: a memoryview or an address in registered memory."""

    __slots__ = ("view", "addr", "length", "keep", "_a")

    def __init__(self, obj: Any, size: int | None, writable: bool) -> None:
        self.keep: Any = obj
        if isinstance(obj, int) and not isinstance(obj, bool):
            if size is None or size <= 0:
                raise P.InvalidArgument(f"an address needs a positive size, got {size!r}")
            self.view: memoryview | None = None
            self.addr = obj
            self.length = size
            return
        mv, self.keep = _as_view(obj, writable)
        if size is not None:
            if size <= 0 or size > len(mv):
                raise P.InvalidArgument(f"size {size} must be 1..{len(mv)} (the buffer's length)")
            mv = mv[:size]
        self.view = mv
        self.addr = 0
        self.length = len(mv)

    def part(self, off: int, n: int) -> Any:
        return self.view[off : off + n] if self.view is not None else self.addr + off

    def address(self) -> int:
        if self.view is None:
            return self.addr
        a: int = getattr(self, "_a", 0)
        if not a:
            a = self._a = buffer_address(self.view, writable=False)[0]
        return a


@dataclass(slots=True)
class _Answer:
    """The master's answer to ``get_replica_list`` and when (and under which rpc generation) it was asked."""

    size: int
    replicas: list[list[SliceW]]
    ttl: float
    sent: float
    token: int
    gen: int


class StoreClient:
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
        **overrides: Any,
    ) -> None:
        self.config = config if config is not None else load_config(**overrides)
        if config is not None and overrides:
            self.config = config.replace(**overrides)
        self.master_address = master or self.config.master_server_address
        self.segment_size = int(self.config.global_segment_size if segment_size is None else segment_size)
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
        self.rpc = MasterRPC(self.master_address, cluster_id=cluster_id, timeout_s=self.config.transfer.timeout_s,
                             failover_timeout_s=failover_timeout_s, spin_us=self.config.store.rpc_spin_us)
        self._prefault = prefault
        self._segments: dict[str, ManagedBuffer] = {}
        self._seg_names: list[str] = []
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
        self._lent: dict[tuple[str, str], _Lent] = {}  # (preferred segment, strategy) -> current reservation
        self._lent_release: list[int] = []
        self._lent_refused: dict[tuple[str, str], float] = {}  # no reservation to ask for before this time
        self.lease_ttl_s = self.config.store.lease_ttl_s
        self.heartbeat_s = self.config.store.heartbeat_interval_s
        # key -> (rpc generation, version token, size, replica): see "Location cache" in the module doc
        self._where: OrderedDict[str, tuple[int, int, int, list[SliceW]]] = OrderedDict()
        self._where_max = self.config.store.location_cache
        self._where_lock = threading.Lock()
        self.location_hits = 0  # gets served by the remembered replica
        self.location_misses = 0  # gets that read a remembered replica in vain (stale, or its holder failed)

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
            self._poller = threading.Thread(target=self._poll_loop, name="mc-store-poll", daemon=True)
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

    def _register(self) -> None:
        info = self.rpc.call("register_client", (self.client_id, self.engine.host_id, self.engine.name,
                                                 self.ssd is not None))
        self.lease_ttl_s = float(info.get("lease_ttl_s", self.lease_ttl_s))
        self.heartbeat_s = float(info.get("heartbeat_s", self.heartbeat_s))
        self._early = self.config.store.early_commit and bool(info.get("early_commit", False))

    def _remount(self) -> None:
        """After the master forgot us (expiry): register again and re-mount our segments."""
        with self._mount_lock:
            self._register()
            for name in self._seg_names:
                buf = self._segments[name]
                try:
                    self.rpc.call("mount", (self.client_id, name, self.engine.name, buf.addr, buf.length,
                                            self.engine.host_id))
                except P.InvalidArgument as exc:
                    logger.warning("re-mounting %s failed: %s", name, exc)

    def _call(self, method: str, params: Any, typ: Any = Any) -> Any:
        try:
            return self.rpc.call(method, params, typ=typ)
        except P.UnknownClient:
            if self._closed:
                raise
            logger.warning("the master forgot client %s; registering again", self.client_id)
            self._remount()
            return self.rpc.call(method, params, typ=typ)

    def mount_segment(self, size: int) -> str:
        """Allocate ``size`` bytes of shared memory and lend them to the pool; returns its name."""
        if size <= 0:
            raise P.InvalidArgument(f"segment size must be positive, got {size}")
        with self._mount_lock:
            name = self.engine.name if not self._seg_names else f"{self.engine.name}#{len(self._seg_names)}"
            buf = self.engine.allocate(size, name=f"store-{len(self._seg_names)}", prefault=self._prefault)
            try:
                self.rpc.call("mount", (self.client_id, name, self.engine.name, buf.addr, size, self.engine.host_id))
            except BaseException:
                self.engine.free(buf)
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
        if self._own_engine:
            self.engine.close()
        else:
            for buf in self._segments.values():
                self.engine.free(buf)
        self._segments.clear()

    # ------------------------------------------------------------------ heartbeat and tasks
    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                tasks = self.rpc.call("poll", (self.client_id, self.heartbeat_s), timeout=self.heartbeat_s + 10)
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
                    logger.warning("store task %s for %r failed: %s", t.get("kind"), t.get("key"), exc)

    def _run_task(self, t: dict[str, Any]) -> None:
        kind, key, token = str(t["kind"]), str(t["key"]), int(t["token"])
        if kind == "delete_disk":
            if self.ssd is not None:
                self.ssd.delete(key)
            return
        if self.ssd is None:
            self._call("task_done", (self.client_id, kind, key, token, False, "no SSD tier on this client"))
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
            slices: list[SliceW] = [tuple(s) for s in t["slices"]]
            size = sum(s[3] for s in slices)
            staging = bytearray(size)
            if not self.ssd.read_into(key, memoryview(staging)):
                self._call("task_done", (self.client_id, kind, key, token, False, "SSD copy missing"))
                return
            try:
                self._move("write", [(_Local(staging, None, False), slices)])
            except (TransportError, StoreError) as exc:
                self._call("task_done", (self.client_id, kind, key, token, False, str(exc)))
                return
            self._call("task_done", (self.client_id, kind, key, token, True, ""))

    # ------------------------------------------------------------------ data movement
    def _own(self, s: SliceW) -> ManagedBuffer | None:
        buf = self._segments.get(s[0])
        if buf is not None and buf.addr <= s[2] and s[2] + s[3] <= buf.addr + buf.length:
            return buf
        return None

    def _move(self, op: str, jobs: Sequence[tuple[_Local, Sequence[SliceW]]]) -> None:
        """Move each local object to/from its replica slices; raises on any failure."""
        reqs = self._requests(op, jobs)
        if reqs:
            self.engine.transfer(reqs)

    def _requests(self, op: str, jobs: Sequence[tuple[_Local, Sequence[SliceW]]]) -> list[TransferRequest]:
        reqs: list[TransferRequest] = []
        for local, slices in jobs:
            off = 0
            for s in slices:
                n = s[3]
                if self._own(s) is not None:
                    la = local.address() + off
                    if op == "read":
                        memmove(la, s[2], n)
                    else:
                        memmove(s[2], la, n)
                else:
                    reqs.append(TransferRequest(op, s[1], local.part(off, n), n, s[2], transport=self.transport))
                off += n
        return reqs

    def _rank(self, replicas: list[list[SliceW]]) -> list[list[SliceW]]:
        host = self.engine.host_id

        def score(rep: list[SliceW]) -> tuple[int, float]:
            if all(self._own(s) is not None for s in rep):
                return (0, 0.0)
            if all(s[4] == host for s in rep):
                return (1, random.random())
            return (2, random.random())

        return sorted(replicas, key=score)

    # ------------------------------------------------------------------ put
    def _cfg(self, replica_num: int | None, preferred_segment: str, hard_pin: bool, soft_pin_ttl_s: float,
             strategy: str) -> ReplicaCfg:
        return ReplicaCfg(replica_num=self.config.store.replica_num if replica_num is None else replica_num,
                          preferred_segment=preferred_segment, hard_pin=hard_pin, soft_pin_ttl_s=soft_pin_ttl_s,
                          strategy=strategy)

    def _retrying(self, fn: Callable[[], T], what: str, timeout: float = 10.0) -> T:
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            try:
                return fn()
            except P.RetryLater:
                if time.monotonic() > deadline:
                    raise StoreError(f"{what}: the master kept asking to retry for {timeout:.0f}s") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    # ------------------------------------------------------------------ one-RPC puts through reservations
    def _slot(self, cfg: ReplicaCfg, size: int, count: int = 0) -> tuple[_Lent, int] | None:
        """A free range of ``size`` bytes in our reservation for ``cfg`` (asking the master for one if needed;
        ``count``: objects of about ``size`` about to follow, for the size of a new reservation)."""
        with self._lent_lock:
            return self._slot_locked(cfg, size, count, self.rpc.generation())

    def _slots(self, cfg: ReplicaCfg, sizes: Sequence[int]) -> list[tuple[_Lent, int]]:
        """Ranges for objects of ``sizes`` (a batch) while our reservations have room: a prefix of them."""
        out: list[tuple[_Lent, int]] = []
        with self._lent_lock:
            gen = self.rpc.generation()
            for i, n in enumerate(sizes):
                slot = self._slot_locked(cfg, n, len(sizes) - i, gen)
                if slot is None:
                    break
                out.append(slot)
        return out

    def _slot_locked(self, cfg: ReplicaCfg, size: int, count: int, generation: int) -> tuple[_Lent, int] | None:
        """:meth:`_slot` with ``_lent_lock`` held; ``generation``: the master connections' generation now."""
        need = align(size)
        k = (cfg.preferred_segment, cfg.strategy)
        now = time.monotonic()
        lent = self._lent.get(k)
        # a master that died may come back without knowing the extent: never write there again
        if lent is not None and generation != lent.generation:
            lent.dead = True
        if lent is not None and not lent.dead and now < lent.expires and lent.next + need <= lent.end:
            off = lent.next
            lent.next += need
            lent.inflight += 1
            return lent, off
        if lent is not None:
            del self._lent[k]
            self._retire(lent)
        if now < self._lent_refused.get(k, 0.0):
            return None
        release, self._lent_release = self._lent_release, []
        try:
            gen = self.rpc.generation()
            rid, ext, ttl = self._call("reserve", (self.client_id, size, cfg, release, count))
        except (StoreError, OSError) as exc:
            logger.debug("no reservation (%s); putting in two phases", exc)
            self._lent_release = release + self._lent_release  # hand them back with a later call
            self._lent_refused[k] = now + 1.0
            return None
        if not rid:
            self._lent_refused[k] = now + 1.0
            return None
        seg, peer, base, off0, length, host = ext
        # use it for half its ttl at most: the master keeps it for the whole ttl after each commit
        if self.rpc.generation() != gen:  # answered by a master we reconnected to during the call
            self._lent_release.append(int(rid))
            return None
        lent = _Lent(int(rid), str(seg), str(peer), int(base), str(host), int(off0) + need,
                     int(off0) + int(length), now + float(ttl) / 2, gen, inflight=1)
        self._lent[k] = lent
        return lent, int(off0)

    def _retire(self, lent: _Lent) -> None:
        """Stop using a reservation; it goes back to the master once no write into it is in flight."""
        lent.retired = True
        self._release_if_idle(lent)

    def _release_if_idle(self, lent: _Lent) -> None:
        """Queue a retired or dead reservation for release (with the next ``reserve``) when idle; once."""
        if lent.inflight == 0 and (lent.retired or lent.dead) and not lent.released:
            lent.released = True
            self._lent_release.append(lent.rid)

    def _put_reserved(self, key: str, local: _Local, cfg: ReplicaCfg) -> bool:
        """Put through a reservation: write, then one ``put_commit``. False: not done, put in two phases."""
        slot = self._slot(cfg, local.length)
        if slot is None:
            return False
        lent, off = slot
        try:
            sl = (lent.segment, lent.peer, lent.base + off, local.length, lent.host)
            if self._early:
                done = self._put_early(key, local, cfg, lent, off, sl)
                if done is not None:
                    return done
            try:
                self._move("write", [(local, [sl])])
            except BaseException:
                lent.dead = True  # the holder may be gone: do not write there again
                raise
            t0 = time.monotonic()
            gen = self.rpc.generation()
            try:
                res = self._call("put_commit", (self.client_id, key, lent.rid, off, local.length, cfg))
            except P.InvalidArgument as exc:
                if "reservation" not in str(exc):
                    raise
                if self._committed_at(key, lent.segment, off):  # a retried commit after a leader change
                    return True
                logger.info("put %r: %s; putting in two phases", key, exc)
                lent.dead = True
                return False
            except ObjectExists:
                if self._committed_at(key, lent.segment, off):  # our commit, answered by a leader that then died
                    return True
                raise
            ttl, token = (float(res[0]), int(res[1])) if isinstance(res, list) else (float(res), 0)
            with self._lent_lock:
                lent.expires = max(lent.expires, t0 + ttl / 2)
            self._remember(key, gen, token, local.length, [sl])
            return True
        finally:
            with self._lent_lock:
                lent.inflight -= 1
                self._release_if_idle(lent)

    def _put_early(self, key: str, local: _Local, cfg: ReplicaCfg, lent: _Lent, off: int,
                   sl: SliceW) -> bool | None:
        """Put through a reservation with the commit sent before the write, so the master answers
        while the bytes travel; then a one-way ``put_confirm`` on the same connection.

        Until that confirm the master keeps the object invisible and makes every request on its
        key wait; if the connection closes first, it drops the object. The put returns only when
        both the write and the commit are acknowledged and the confirm is sent, so a reader
        asking after it returns sees the object. Returns like :meth:`_put_reserved`; None: the
        commit could not be sent, commit after the write instead.
        """
        gen = self.rpc.generation()
        pend = self.rpc.start("put_commit", (self.client_id, key, lent.rid, off, local.length, cfg, True))
        if pend is None:
            return None
        try:
            self._move("write", [(local, [sl])])
        except BaseException:
            lent.dead = True  # the holder may be gone: do not write there again
            self.rpc.abandon(pend)  # closing the connection drops the early commit
            raise
        resp = self.rpc.answer(pend)
        if resp is None:  # the connection failed: an early commit it carried is dropped by the master
            lent.dead = True
            return False
        try:
            res = self.rpc.result(resp)
        except P.InvalidArgument as exc:
            self.rpc.release(pend)
            if "reservation" not in str(exc) and "early commits are off" not in str(exc):
                raise
            logger.info("put %r: %s; putting in two phases", key, exc)
            lent.dead = True
            return False
        except P.NotLeader:
            self.rpc.abandon(pend)
            lent.dead = True
            return False
        except P.UnknownClient as exc:
            self._register_again(pend, exc)
            lent.dead = True  # a reservation of the forgotten client is gone
            return False
        except BaseException:
            self.rpc.release(pend)
            raise
        ttl, token = float(res[0]), int(res[1])
        if time.monotonic() - pend.sent < ttl / 2:
            sent = self.rpc.tell(pend, "put_confirm", (self.client_id, key, token, True, False))
            if not sent:  # we cannot know whether the confirm got through
                lent.dead = True
                if self._committed_at(key, lent.segment, off):
                    return True
                return False
        else:  # a slow write: the early commit may be near its timeout, so confirm and wait for the answer
            self.rpc.release(pend)
            try:
                self._call("put_confirm", (self.client_id, key, token, True, True))
            except P.InvalidArgument:
                lent.dead = True
                return False
        with self._lent_lock:
            lent.expires = max(lent.expires, pend.sent + ttl / 2)
        self._remember(key, gen, token, local.length, [sl])
        return True

    def _committed_at(self, key: str, segment: str, offset: int) -> bool:
        try:
            info = self._call("query_key", (key,))
        except (StoreError, OSError):
            return False
        return any(len(rep) == 1 and rep[0]["segment"] == segment and rep[0]["offset"] == offset
                   for rep in info.get("replicas", []))

    def _release_reservations(self, end: float) -> None:
        with self._lent_lock:
            rids = self._lent_release + [lent.rid for lent in self._lent.values()]
            self._lent.clear()
            self._lent_release = []
        left = end - time.monotonic()
        if rids and left > 0:
            try:
                self.rpc.call("reserve", (self.client_id, 0, ReplicaCfg(), rids), timeout=left, failover_s=left)
            except (StoreError, OSError) as exc:
                logger.debug("releasing reservations at close: %s", exc)

    def _put_local(self, key: str, local: _Local, cfg: ReplicaCfg) -> None:
        if (self.reservations and cfg.replica_num == 1 and 0 < local.length <= RESERVE_MAX_OBJECT
                and isinstance(key, str) and 0 < len(key) <= P.MAX_KEY // 4):  # odd input: the master's checks
            if self._put_reserved(key, local, cfg):
                return
        try:
            self._put_once(key, local, cfg)
        except _PutLost:
            logger.info("put %r was lost in a leader change; putting it again", key)
            self._put_once(key, local, cfg)

    def _put_once(self, key: str, local: _Local, cfg: ReplicaCfg) -> None:
        P_ = (self.client_id, key, local.length, cfg)
        gen = self.rpc.generation()
        token, reps = self._retrying(lambda: self._call("put_start", P_), f"put {key!r}")
        reps = [[tuple(s) for s in rep] for rep in reps]
        try:
            self._move("write", [(local, rep) for rep in reps])
        except BaseException:
            try:
                self._call("put_revoke", (self.client_id, key, token))
            except (StoreError, OSError):
                pass
            raise
        try:
            self._call("put_end", (self.client_id, key, token))
        except P.InvalidArgument as exc:
            # the leader changed after our write: if the old leader committed it, it is there
            if self._call("exists", (key,)):
                return
            raise _PutLost(str(exc)) from exc
        if reps:
            self._remember(key, gen, int(token), local.length, self._rank(reps)[0])

    def put(self, key: str, value: Any, *, replica_num: int | None = None, preferred_segment: str = "",
            hard_pin: bool = False, soft_pin_ttl_s: float = 0.0, strategy: str = "") -> None:
        """Store ``value`` (any buffer) under ``key``; ``ObjectExists`` if the key exists."""
        self.put_from(key, value, None, replica_num=replica_num, preferred_segment=preferred_segment,
                      hard_pin=hard_pin, soft_pin_ttl_s=soft_pin_ttl_s, strategy=strategy)

    def put_from(self, key: str, buf: Any, size: int | None = None, *, replica_num: int | None = None,
                 preferred_segment: str = "", hard_pin: bool = False, soft_pin_ttl_s: float = 0.0,
                 strategy: str = "") -> None:
        """Zero-copy put from a buffer or an address in registered memory (``size`` bytes)."""
        local = _Local(buf, size, writable=False)
        self._put_local(key, local, self._cfg(replica_num, preferred_segment, hard_pin, soft_pin_ttl_s, strategy))

    def put_parts(self, key: str, *parts: Any, replica_num: int | None = None) -> None:
        """Store the concatenation of ``parts`` (one staging copy)."""
        views = [_as_view(p, False)[0] for p in parts]
        if not views:
            raise P.InvalidArgument("put_parts needs at least one part")
        self.put(key, b"".join(views), replica_num=replica_num)

    def batch_put_from(self, keys: Sequence[str], bufs: Sequence[Any], sizes: Sequence[int] | None = None, *,
                       replica_num: int | None = None, preferred_segment: str = "", hard_pin: bool = False,
                       soft_pin_ttl_s: float = 0.0, strategy: str = "") -> list[BaseException | None]:
        """Put many objects: one ``batch_put_start``, one transfer batch, one ``batch_put_end``.

        Returns one entry per key: None on success, else the exception for that key.
        """
        if len(keys) != len(bufs) or (sizes is not None and len(sizes) != len(keys)):
            raise P.InvalidArgument("keys, buffers and sizes must have the same length")
        if not keys:
            return []
        locals_ = [_Local(b, None if sizes is None else sizes[i], writable=False) for i, b in enumerate(bufs)]
        cfg = self._cfg(replica_num, preferred_segment, hard_pin, soft_pin_ttl_s, strategy)
        if (self.reservations and cfg.replica_num == 1
                and all(0 < x.length <= RESERVE_MAX_OBJECT for x in locals_)
                and all(isinstance(k, str) and 0 < len(k) <= P.MAX_KEY // 4 for k in keys)):  # odd input: the master
            out: list[BaseException | None] = [None] * len(keys)
            rest = self._batch_put_reserved(keys, locals_, cfg, out)
            if rest:
                sub = self._batch_put_two_phase([keys[i] for i in rest], [locals_[i] for i in rest], cfg)
                for i, r in zip(rest, sub, strict=True):
                    out[i] = r
            return out
        return self._batch_put_two_phase(keys, locals_, cfg)

    def _batch_put_two_phase(self, keys: Sequence[str], locals_: list[_Local],
                             cfg: ReplicaCfg) -> list[BaseException | None]:
        res = self._retrying(lambda: self._call("batch_put_start", (self.client_id, list(keys),
                                                                    [x.length for x in locals_], cfg)),
                             "batch_put_start")
        out: list[BaseException | None] = [None] * len(keys)
        jobs: list[tuple[int, _Local, list[SliceW]]] = []
        for i, (code, tok, reps) in enumerate(res):
            if code != 0:
                out[i] = _error(code, str(tok))
                continue
            for rep in reps:
                jobs.append((i, locals_[i], [tuple(s) for s in rep]))
        ok = [out[i] is None for i in range(len(keys))]
        for i in self._batch_write(jobs, out):
            ok[i] = False
        started = [i for i in range(len(keys)) if res[i][0] == 0]
        if started:
            ends = self._call("batch_put_end", (self.client_id, [keys[i] for i in started],
                                                [int(res[i][1]) for i in started], [ok[i] for i in started]))
            for i, (code, msg) in zip(started, ends, strict=True):
                if code != 0 and out[i] is None:
                    out[i] = _error(code, msg)
        return out

    def _batch_put_reserved(self, keys: Sequence[str], locals_: list[_Local], cfg: ReplicaCfg,
                            out: list[BaseException | None]) -> list[int]:
        """Put ``keys`` into our reservations: one ``batch_put_commit`` (sent before the write when the
        master takes early commits, then a one-way ``batch_put_confirm``), one transfer batch.

        Sets ``out[i]`` for the keys that failed; returns the indexes still to put in two phases.
        """
        n = len(keys)
        slots = self._slots(cfg, [x.length for x in locals_])
        gen = self.rpc.failovers  # _slots just checked the idle connections
        m = len(slots)
        rest = list(range(m, n))
        if not slots:
            return rest
        try:
            sls: list[SliceW] = [(lent.segment, lent.peer, lent.base + off, locals_[j].length, lent.host)
                                 for j, (lent, off) in enumerate(slots)]
            params = (self.client_id, list(keys[:m]), [lent.rid for lent, _ in slots], [off for _, off in slots],
                      [x.length for x in locals_[:m]], cfg)
            pend = self.rpc.start("batch_put_commit", (*params, True)) if self._early else None
            try:
                failed = self._batch_write([(j, locals_[j], [sls[j]]) for j in range(m)], out)
                wrote = [j not in failed for j in range(m)]
            except BaseException:
                if pend is not None:
                    self.rpc.abandon(pend)  # closing the connection drops the early commits
                for lent, _ in slots:
                    lent.dead = True
                raise
            for j in range(m):
                if not wrote[j]:
                    slots[j][0].dead = True  # the holder may be gone: do not write there again
            res = self._batch_commit_answer(pend) if pend is not None else self._call("batch_put_commit",
                                                                                    (*params, False))
            if res is None:  # nothing committed (the master drops the early commits of a failed connection)
                for lent, _ in slots:
                    lent.dead = True
                return [j for j in range(m) if wrote[j]] + rest
            again: list[int] = []
            confirm: list[int] = []
            ttl = float("inf")
            for j, (code, msg, _token) in enumerate(res):
                if code == 0:
                    ttl = min(ttl, float(msg))
                    confirm.append(j)
                    continue
                if not wrote[j]:
                    continue  # the write's error stands
                if code == P.Code.INVALID and "reservation" in str(msg):
                    slots[j][0].dead = True
                    again.append(j)
                elif code == P.Code.EXISTS and pend is None and self._committed_at(keys[j], slots[j][0].segment,
                                                                                  slots[j][1]):
                    continue  # our commit, answered by a leader that then died
                else:
                    out[j] = _error(int(code), str(msg))
            got = (self._batch_confirm(pend, [keys[j] for j in confirm], [int(res[j][2]) for j in confirm],
                                       [wrote[j] for j in confirm], ttl)
                   if pend is not None else [None] * len(confirm))
            for j, err in zip(confirm, got, strict=True):
                if not wrote[j]:
                    continue  # confirmed as failed; the write's error stands
                if err is not None:
                    out[j] = err
                else:
                    self._remember(keys[j], gen, int(res[j][2]), locals_[j].length, [sls[j]])
            return again + rest
        finally:
            with self._lent_lock:
                for lent, _ in slots:
                    lent.inflight -= 1
                    self._release_if_idle(lent)

    def _batch_write(self, jobs: Sequence[tuple[int, _Local, Sequence[SliceW]]],
                     out: list[BaseException | None]) -> set[int]:
        """Write each job's object ``(i, local, slices)`` in one transfer batch; returns the ``i`` whose
        bytes did not all land (``out[i]`` gets the first error)."""
        return self._batch_move("write", jobs, out)

    def _batch_move(self, op: str, jobs: Sequence[tuple[int, _Local, Sequence[SliceW]]],
                    out: list[BaseException | None] | None) -> set[int]:
        """Move each job's object ``(i, local, slices)`` in one transfer batch; returns the ``i`` whose
        bytes did not all move (``out[i]``, if given, gets the first error)."""
        reqs: list[TransferRequest] = []
        owner: list[int] = []
        for i, local, slices in jobs:
            r = self._requests(op, [(local, slices)])
            reqs.extend(r)
            owner.extend([i] * len(r))
        failed: set[int] = set()
        if reqs:
            batch = self.engine.submit(reqs)
            try:
                batch.wait()
            except (TransportError, OSError):
                for q, st in enumerate(batch.statuses):
                    if st.state != "completed":
                        i = owner[q]
                        failed.add(i)
                        if out is not None:
                            out[i] = out[i] or st.error or TransportError("transfer failed")
        return failed

    def _register_again(self, pend: Pending, exc: BaseException) -> None:
        """An early commit's answer said the master forgot us: give its connection back and register
        again (or raise ``exc`` if we are closing)."""
        self.rpc.release(pend)
        if self._closed:
            raise exc
        logger.warning("the master forgot client %s; registering again", self.client_id)
        self._remount()

    def _batch_commit_answer(self, pend: Any) -> list[Any] | None:
        """The per-key answer to an early ``batch_put_commit``; None when nothing was committed."""
        resp = self.rpc.answer(pend)
        if resp is None:
            return None
        try:
            res: list[Any] = self.rpc.result(resp)
        except P.UnknownClient as exc:
            self._register_again(pend, exc)
            return None
        except P.NotLeader:
            self.rpc.abandon(pend)
            return None
        except P.InvalidArgument as exc:
            self.rpc.release(pend)
            logger.info("batch put: %s; putting in two phases", exc)
            return None
        except BaseException:
            self.rpc.release(pend)
            raise
        return res

    def _batch_confirm(self, pend: Any, keys: list[str], tokens: list[int], ok: list[bool],
                       ttl: float) -> list[BaseException | None]:
        """Confirm (or drop, for failed writes) the early commits of a batch: one-way on the commit's
        connection, or with an answer when the write took so long that the commits may have
        expired. Per key: None, or the master's refusal (when it answered)."""
        if not keys:
            self.rpc.release(pend)
            return []
        args = (self.client_id, keys, tokens, ok)
        if time.monotonic() - pend.sent < ttl / 2:
            if self.rpc.tell(pend, "batch_put_confirm", (*args, False)):
                return [None] * len(keys)
            # we cannot know whether it got through: again, with an answer (a repeat is refused per key,
            # so a refusal of a key whose object exists means the first one landed)
        else:
            self.rpc.release(pend)
        res = self._call("batch_put_confirm", (*args, True))
        out: list[BaseException | None] = []
        for k, (code, msg) in zip(keys, res, strict=True):
            out.append(None if code == 0 or self._call("exists", (k,)) else _error(int(code), str(msg)))
        return out

    def put_batch(self, keys: Sequence[str], values: Sequence[Any], *, replica_num: int | None = None,
                  **kw: Any) -> list[BaseException | None]:
        """Put many buffers; one entry per key: None on success, else the exception."""
        return self.batch_put_from(keys, values, None, replica_num=replica_num, **kw)

    # ------------------------------------------------------------------ location cache
    def _remember(self, key: str, gen: int, token: int, size: int, rep: list[SliceW]) -> None:
        if self._where_max <= 0 or not token:
            return
        with self._where_lock:
            self._where[key] = (gen, token, size, rep)
            self._where.move_to_end(key)
            while len(self._where) > self._where_max:
                self._where.popitem(last=False)

    def _forget(self, keys: Sequence[str] | None) -> None:
        """Drop remembered locations of ``keys`` (None: all)."""
        with self._where_lock:
            if keys is None:
                self._where.clear()
            else:
                for k in keys:
                    self._where.pop(k, None)

    def _forget_peers(self, peers: set[str]) -> None:
        """Drop remembered locations on ``peers`` (a holder that failed a read may be gone)."""
        with self._where_lock:
            for k in [k for k, v in self._where.items() if any(s[1] in peers for s in v[3])]:
                del self._where[k]

    def _read_remembered(self, key: str, local_for: Callable[[int], _Local]) -> int | _Answer | None:
        """A get of a remembered key: read the remembered replica while the master answers.

        Returns the size when the bytes read are the object's, the master's answer when they
        may not be (the caller reads again from it, without asking again), or None (nothing
        usable: the caller does a plain get).
        """
        with self._where_lock:
            hit = self._where.get(key)
        if hit is None:
            return None
        gen, token, size, rep = hit
        if gen != self.rpc.generation():  # a master connection failed since: versions may repeat
            self._forget([key])
            return None
        # only holders we are connected to: a lookup or a connect must not stall a guess
        if not all(self._own(s) is not None or self.engine.is_resolved(s[1]) for s in rep):
            return None
        try:
            local = local_for(size)
        except StoreError:  # the buffer is too small for the remembered size: let the plain path say so
            return None
        pending = self.rpc.start("get_replica_list", (key,))
        if pending is None:
            return None
        try:
            self._move("read", [(local, rep)])
            moved = True
        except (MooncakeError, OSError) as exc:  # the holder may be gone: the answer tells where to read
            moved = False
            logger.debug("reading remembered %r failed (%s); forgetting what was remembered on its holders", key, exc)
            self._forget_peers({s[1] for s in rep})
        except BaseException:
            self.rpc.abandon(pending)
            raise
        try:
            size2, reps, ttl, token2 = self._answer(self.rpc.finish(pending))
        except (StoreError, OSError):
            self._forget([key])
            return None
        # failovers, not generation(): idle connections were checked above; what matters now is
        # whether the answer came over a connection that failed over since
        if moved and token2 == token and size2 == size and rep in reps and gen == self.rpc.failovers:
            if time.monotonic() - pending.sent > ttl:
                raise LeaseExpired(f"get {key!r}: the read took longer than the {ttl:.1f}s lease; retry")
            self.location_hits += 1
            with self._where_lock:
                if key in self._where:
                    self._where.move_to_end(key)
            return size
        self.location_misses += 1
        self._forget([key])
        return _Answer(size2, reps, ttl, pending.sent, token2, gen)

    # ------------------------------------------------------------------ get
    @staticmethod
    def _answer(res: Any) -> tuple[int, list[list[SliceW]], float, int]:
        """(size, replicas, lease ttl, version token) from a ``get_replica_list`` answer."""
        size, reps, ttl = res[0], res[1], res[2]
        token = int(res[3]) if len(res) > 3 else 0  # masters before versions: no token, nothing remembered
        return int(size), [[tuple(s) for s in rep] for rep in reps], float(ttl), token

    def _replicas(self, key: str) -> _Answer:
        """The master's answer for ``key``, with the time the granting request was sent."""
        sent = [0.0]
        gen = self.rpc.generation()

        def once() -> Any:
            sent[0] = time.monotonic()
            return self._call("get_replica_list", (key,))

        size, reps, ttl, token = self._answer(self._retrying(once, f"get {key!r}"))
        return _Answer(size, reps, ttl, sent[0], token, gen)

    def _read(self, key: str, local_for: Callable[[int], _Local]) -> int:
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
                    logger.debug("reading %r from %s failed: %s", key, rep[0][1], exc)
                    continue
                if time.monotonic() - a.sent > a.ttl:
                    raise LeaseExpired(f"get {key!r}: the read took longer than the {a.ttl:.1f}s lease; retry")
                self._remember(key, a.gen, a.token, a.size, rep)
                return a.size
            time.sleep(0.05)  # the master may be about to drop the dead holder's replicas
        raise TransportError(f"get {key!r}: every replica failed: {last}") from last

    def get(self, key: str) -> bytes:
        """The object's bytes (``ObjectNotFound`` if missing)."""
        holder: list[bytearray] = []

        def mk(size: int) -> _Local:
            holder.append(bytearray(size))
            return _Local(holder[-1], None, True)

        self._read(key, mk)
        return bytes(holder[-1])

    def get_into(self, key: str, buf: Any, size: int | None = None) -> int:
        """Read the object into ``buf`` (or an address in registered memory); returns its size."""
        probe = _Local(buf, size, writable=True)

        def mk(n: int) -> _Local:
            if n > probe.length:
                raise P.InvalidArgument(f"get_into {key!r}: object is {n} bytes but the buffer holds {probe.length}")
            if n == probe.length:
                return probe
            return _Local(buf, n, writable=True) if probe.view is not None else _Local(probe.addr, n, True)

        return self._read(key, mk)

    def batch_get_into(self, keys: Sequence[str], bufs: Sequence[Any],
                       sizes: Sequence[int] | None = None) -> list[int | BaseException]:
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
        jobs: list[tuple[int, _Local, Sequence[SliceW]]] = []
        chosen: dict[int, tuple[_Local, list[list[SliceW]]]] = {}
        ttl = self.lease_ttl_s
        for i, row in enumerate(res):
            code, size, reps, lttl = row[0], row[1], row[2], row[3]
            if i in hit:
                out[i] = hit[i]
                ttl = min(ttl, float(lttl))
                continue
            if code != 0:
                if code == P.Code.RETRY:
                    try:
                        out[i] = self.get_into(keys[i], bufs[i], None if sizes is None else sizes[i])
                    except (StoreError, TransportError) as exc:
                        out[i] = exc
                    continue
                out[i] = _error(code, str(size))
                continue
            ttl = min(ttl, float(lttl))
            try:
                local = _Local(bufs[i], None if sizes is None else sizes[i], writable=True)
                if size > local.length:
                    raise P.InvalidArgument(f"get {keys[i]!r}: object is {size} bytes but the buffer holds "
                                            f"{local.length}")
                local = _Local(bufs[i] if local.view is not None else local.addr, size, True)
            except StoreError as exc:
                out[i] = exc
                continue
            ranked = self._rank([[tuple(s) for s in rep] for rep in reps])
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
            return [LeaseExpired(f"batch get: the reads took longer than the {ttl:.1f}s lease (the master answered "
                                 f"after {answered - t0:.2f}s, the reads took {done - answered:.2f}s); retry")
                    if isinstance(x, int) else x for x in out]
        if self._where_max > 0:
            for i, (_local, ranked) in chosen.items():
                if isinstance(out[i], int) and i not in failed and len(res[i]) > 4:
                    self._remember(keys[i], gen, int(res[i][4]), int(res[i][1]), ranked[0])
        return out

    def _batch_read_remembered(self, keys: Sequence[str], bufs: Sequence[Any], sizes: Sequence[int] | None,
                               gen: int) -> tuple[list[Any], dict[int, int]] | None:
        """A batch get with remembered keys: read their remembered replicas while the master
        answers ``batch_get_replica_list`` (as :meth:`_read_remembered` does for one key).

        Returns the master's answer and, per key whose bytes read are the object's, its size;
        None when no key is remembered (the caller asks first).
        """
        with self._where_lock:
            entries = [self._where.get(k) for k in keys]
        picks: list[tuple[int, int, int, list[SliceW], _Local]] = []
        for i, e in enumerate(entries):
            if e is None:
                continue
            egen, token, size, rep = e
            if egen != gen or not all(self._own(s) is not None or self.engine.is_resolved(s[1]) for s in rep):
                continue
            try:
                local = _Local(bufs[i], None if sizes is None else sizes[i], writable=True)
            except StoreError:
                continue
            if size > local.length:
                continue
            picks.append((i, token, size, rep, _Local(bufs[i] if local.view is not None else local.addr, size, True)))
        if not picks:
            return None
        pending = self.rpc.start("batch_get_replica_list", (list(keys),))
        if pending is None:
            return None
        try:
            failed = self._batch_move("read", [(j, pick[4], pick[3]) for j, pick in enumerate(picks)], None)
        except BaseException:
            self.rpc.abandon(pending)
            raise
        if failed:  # their holders may be gone: forget what was remembered there
            self._forget_peers({s[1] for j in failed for s in picks[j][3]})
        res: list[Any] = self.rpc.finish(pending)
        hit: dict[int, int] = {}
        same_masters = gen == self.rpc.failovers
        for j, (i, token, size, rep, _local) in enumerate(picks):
            row = res[i]
            if (same_masters and j not in failed and row[0] == 0 and len(row) > 4 and int(row[4]) == token
                    and int(row[1]) == size and rep in [[tuple(s) for s in r] for r in row[2]]):
                hit[i] = size
            else:
                self._forget([keys[i]])
        self.location_hits += len(hit)
        self.location_misses += len(picks) - len(hit)
        return res, hit

    def get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        """The objects' bytes; None for keys that are missing or failed."""
        if not keys:
            return []
        sizes = self._call("batch_get_replica_list", (list(keys),))
        bufs = [bytearray(int(s[1]) if s[0] == 0 else 1) for s in sizes]
        res = self.batch_get_into(keys, bufs)
        return [bytes(b[: r]) if isinstance(r, int) and not isinstance(r, bool) else None
                for b, r in zip(bufs, res, strict=True)]

    # ------------------------------------------------------------------ typed values
    def put_array(self, key: str, arr: Any, **kw: Any) -> None:
        """Store a numpy array with its dtype and shape (read back with :meth:`get_array`)."""
        import numpy as np

        a = np.ascontiguousarray(arr)
        self._put_typed(key, {"kind": "numpy", "dtype": a.dtype.str, "shape": list(a.shape)}, a, **kw)

    def get_array(self, key: str) -> Any:
        import numpy as np

        meta, data = self._get_typed(key)
        return np.frombuffer(data, dtype=np.dtype(meta["dtype"])).reshape(meta["shape"])

    def put_tensor(self, key: str, tensor: Any, **kw: Any) -> None:
        """Store a torch tensor (moved to the CPU if needed) with its dtype and shape."""
        t = tensor.detach().contiguous().cpu()
        meta = {"kind": "torch", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        self._put_typed(key, meta, t, **kw)

    def get_tensor(self, key: str) -> Any:
        import torch

        meta, data = self._get_typed(key)
        dtype = getattr(torch, str(meta["dtype"]))
        if not data:
            return torch.empty(meta["shape"], dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(meta["shape"])

    def _put_typed(self, key: str, meta: dict[str, Any], data: Any, **kw: Any) -> None:
        head = json.dumps(meta).encode()
        hdr = _THDR.pack(_TMAGIC, len(head)) + head
        nbytes = len(_as_view(data, False)[0]) if _nbytes(data) else 0
        buf = bytearray(len(hdr) + nbytes)
        buf[: len(hdr)] = hdr
        if nbytes:
            mv = _as_view(data, False)[0]
            buf[len(hdr):] = mv
        self.put(key, buf, **kw)

    def _get_typed(self, key: str) -> tuple[dict[str, Any], bytearray]:
        raw = bytearray(self.get(key))
        if len(raw) < _THDR.size or raw[:4] != _TMAGIC:
            raise P.InvalidArgument(f"{key!r} was not stored with put_array/put_tensor")
        _, n = _THDR.unpack_from(raw)
        meta = json.loads(bytes(raw[_THDR.size : _THDR.size + n]))
        return meta, raw[_THDR.size + n :]

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

    def batch_remove(self, keys: Sequence[str], *, force: bool = False) -> list[BaseException | None]:
        self._forget(keys)
        codes = self._call("batch_remove", (list(keys), force))
        return [None if c == 0 else _error(c, f"remove {k!r} failed") for k, c in zip(keys, codes, strict=True)]

    def remove_by_regex(self, pattern: str, *, force: bool = False) -> int:
        """Remove every key matching ``pattern`` (``re.search``); returns how many."""
        self._forget(None)
        return int(self._call("remove_by_regex", (pattern, force)))

    def keys_by_regex(self, pattern: str) -> list[str]:
        return list(self._call("keys_by_regex", (pattern, False)))

    def remove_all(self, *, force: bool = False) -> int:
        self._forget(None)
        return int(self._call("remove_all", (force,)))

    def query(self, key: str) -> dict[str, Any]:
        """The master's view of ``key``: size, replicas (segment, client, offset), pins, lease."""
        return dict(self._call("query_key", (key,)))

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


class _PutLost(P.InvalidArgument):
    """put_end found no pending put (a new leader never saw put_start): put again."""


def _nbytes(obj: Any) -> int:
    n = getattr(obj, "nbytes", None)
    if n is None and hasattr(obj, "element_size"):
        n = obj.numel() * obj.element_size()
    return int(n) if n is not None else len(memoryview(obj).cast("B"))


def _error(code: int, msg: str) -> BaseException:
    try:
        P.raise_for(code, msg)
    except StoreError as exc:
        return exc
    return StoreError(msg)

