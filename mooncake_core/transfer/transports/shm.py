"""Shared-memory transport for peers on the same host: one memcpy, no sockets.

Engine-allocated buffers (memfd) are mapped from ``/proc/<pid>/fd/<fd>`` and copied with
``memmove`` (a ctypes call that releases the GIL); a copy of 2 MiB or more is split over
``transfer.shm_copy_threads`` threads (one core rarely saturates memory bandwidth, least
of all from a shared mapping with 4 KiB pages). Other registered memory is reached
with cross-memory attach (``process_vm_readv`` / ``process_vm_writev``): a single
kernel copy between the two address spaces. Both require the same host (boot id,
network and PID namespaces) and permission to access the peer (same user or root); if
the kernel refuses, the engine fails over to TCP.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from typing import Any

from mooncake_core.errors import InvalidRequest, PeerUnreachable, TransportError
from mooncake_core.plugins import TransportInfo, hookimpl
from mooncake_core.transfer.memory import memmove
from mooncake_core.transfer.procfs import start_time
from mooncake_core.transfer.topology import host_identity
from mooncake_core.transfer.transports.base import Transport
from mooncake_core.transfer.types import READ, PeerInfo, TransportHost, WorkItem

__all__ = ["ShmTransport", "host_identity"]

logger = logging.getLogger(__name__)

POPULATE_LIMIT = 8 << 20  # peers' segments up to this size are mapped with MAP_POPULATE
_PER_THREAD = 1 << 20  # a copy thread gets at least this many bytes
_CUT = 64 << 10  # copies are split at multiples of this
SWEEP_S = 1.0  # at most this often, mappings of peers that exited are dropped


def _run_copies(jobs: list[tuple[int, int, int]]) -> None:
    for dst, src, n in jobs:
        memmove(dst, src, n)


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc: Any = None
_libc_lock = threading.Lock()


def _load_libc() -> Any:
    """The C library, without ``ctypes.util.find_library``: that runs ``ldconfig -p`` (then
    gcc, then ld) in subprocesses, and forking a large process (a vLLM TP worker) held its
    memory-map lock for 30-90 s on a busy 2-core machine, stalling every thread of it."""
    for name in ("libc.so.6", None):  # glibc's soname, else the symbols already loaded
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            lib.process_vm_readv  # noqa: B018 - the symbol must be there
            return lib
        except (OSError, AttributeError):
            continue
    raise OSError("the C library has no process_vm_readv (cross-memory attach)")


def _cma() -> Any:
    global _libc
    if _libc is not None:
        return _libc
    with _libc_lock:
        if _libc is not None:
            return _libc
        lib = _load_libc()
        for fn in (lib.process_vm_readv, lib.process_vm_writev):
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [
                ctypes.c_int,
                ctypes.POINTER(_IOVec),
                ctypes.c_ulong,
                ctypes.POINTER(_IOVec),
                ctypes.c_ulong,
                ctypes.c_ulong,
            ]
        _libc = lib
        return _libc


def cma_copy(pid: int, op: int, local_addr: int, remote_addr: int, length: int) -> None:
    """Copy between our ``local_addr`` and ``remote_addr`` in process ``pid``."""
    libc = _cma()
    fn = libc.process_vm_readv if op == READ else libc.process_vm_writev
    done = 0
    while done < length:
        liov = _IOVec(local_addr + done, length - done)
        riov = _IOVec(remote_addr + done, length - done)
        n = fn(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
        if n <= 0:
            err = ctypes.get_errno()
            if err == errno.ESRCH:
                raise PeerUnreachable(f"peer process {pid} is gone")
            raise TransportError(f"cross-memory attach to pid {pid} failed: {os.strerror(err)}")
        done += n


class ShmTransport(Transport):
    """Same-host transport (memfd mapping, else cross-memory attach)."""

    name = "shm"

    def __init__(self, engine: TransportHost) -> None:
        super().__init__(engine)
        self._maps: dict[tuple[int, int, int], tuple[mmap.mmap, int]] = {}
        self._lock = threading.Lock()
        self._denied: set[int] = set()
        # A mapping is unmapped only while no copy with its peer runs: a dead peer's mappings
        # are retired first and closed when the last copy with that peer (in any thread) is
        # done. Copies with other peers do not hold them up (a busy store never has none).
        self._inflight: dict[int, int] = {}  # pid -> copies in flight
        self._retired: list[tuple[int, mmap.mmap]] = []
        # mapped peers' start times: an exited peer (or a new process that reused its pid)
        # is found by :meth:`_sweep` even when nothing is sent to it again
        self._started: dict[int, int | None] = {}
        self._next_sweep = 0.0
        n = engine.config.transfer.shm_copy_threads
        self.copy_threads = n if n > 0 else max(1, min(4, os.cpu_count() or 1))
        try:  # resolve libc's cross-memory-attach calls now, not in the first transfer
            _cma()
        except (OSError, AttributeError):
            pass  # no CMA here: cma_copy raises, and the engine fails over to TCP

    def _copy(self, jobs: list[tuple[int, int, int]]) -> None:
        """``memmove`` each (dst, src, n); large totals are cut into equal shares run in
        parallel."""
        total = sum(j[2] for j in jobs)
        k = min(self.copy_threads, total // _PER_THREAD)
        if k <= 1:
            _run_copies(jobs)
            return
        per = -(-total // k)  # ceil(total / k), rounded up to a multiple of _CUT
        share = -(-per // _CUT) * _CUT
        parts: list[list[tuple[int, int, int]]] = [[]]
        room = share
        for dst, src, n in jobs:
            off = 0
            while off < n:
                if room == 0:
                    parts.append([])
                    room = share
                take = min(n - off, room)
                parts[-1].append((dst + off, src + off, take))
                off += take
                room -= take
        futs = []
        for p in parts[1:]:
            try:
                futs.append(self.engine.io_pool.submit(_run_copies, p))
            except RuntimeError:  # the engine is shutting down its pool: copy here instead
                _run_copies(p)
        try:
            _run_copies(parts[0])
        finally:
            for f in futs:
                f.result()

    def can_reach(self, peer: PeerInfo) -> bool:
        return (
            self.engine.config.transfer.shm
            and peer.host_id == self.engine.host_id
            and peer.pid > 0
            and peer.pid != os.getpid()
            and peer.pid not in self._denied
        )

    def _map(self, peer: PeerInfo, region: dict[str, Any]) -> int:
        """Base address in our process of the peer's memfd-backed region."""
        key = (peer.pid, int(region["memfd"]), int(region["addr"]))
        with self._lock:
            hit = self._maps.get(key)
            if hit is not None:
                return hit[1]
            path = f"/proc/{peer.pid}/fd/{region['memfd']}"
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                if exc.errno in (errno.EACCES, errno.EPERM):
                    self._denied.add(peer.pid)
                raise PeerUnreachable(
                    f"cannot map shared memory of peer {peer.name!r} ({path}): {exc.strerror}"
                ) from exc
            try:
                size = int(region["memfd_offset"]) + int(region["length"])
                # A small segment's page tables are built now (MAP_POPULATE), else the first
                # copy from every page pays a minor fault. Not a large one's: that made the
                # first read from a peer wait until every page of its segment, mostly never
                # written, was allocated and mapped (0.7-2 s for 735 MiB, a store hit's first
                # read), and populating in the background held this process's mmap lock at
                # low priority (munmap in the forward stalled for seconds). Copies fault in
                # what they touch: about 4 ms more per 75 MiB read the first time.
                populate = getattr(mmap, "MAP_POPULATE", 0) if size <= POPULATE_LIMIT else 0
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
            finally:
                os.close(fd)
            base = ctypes.addressof(ctypes.c_char.from_buffer(mm)) + int(region["memfd_offset"])
            self._maps[key] = (mm, base)
            if peer.pid not in self._started:
                self._started[peer.pid] = start_time(peer.pid)
            return base

    def forget(self, pid: int) -> None:
        """Drop our mappings of ``pid``'s memory (unmapped once no copy with it is in flight)."""
        with self._lock:
            for key in [k for k in self._maps if k[0] == pid]:
                self._retired.append((pid, self._maps.pop(key)[0]))
            self._started.pop(pid, None)
        self._close_retired()

    def mapped_pids(self) -> set[int]:
        """The peers whose memory we map now."""
        with self._lock:
            return {k[0] for k in self._maps}

    def _sweep(self) -> None:
        """Drop the mappings of peers that exited (at most every :data:`SWEEP_S`)."""
        now = time.monotonic()
        if now < self._next_sweep:  # every transfer passes here: no lock until a sweep is due
            return
        with self._lock:
            if now < self._next_sweep:  # another thread took this sweep
                return
            self._next_sweep = now + SWEEP_S
            started = dict(self._started)
        for pid, t0 in started.items():
            t = start_time(pid)
            if t is None or t != t0:
                logger.debug("peer process %d exited: unmapping its shared memory", pid)
                self.forget(pid)

    def _close_retired(self) -> None:
        with self._lock:
            if not self._retired:
                return
            closable = [mm for pid, mm in self._retired if not self._inflight.get(pid)]
            self._retired = [(pid, mm) for pid, mm in self._retired if self._inflight.get(pid)]
        for mm in closable:
            try:
                mm.close()
            except BufferError:  # still exported somewhere: freed with its last reference
                logger.debug("a retired shared-memory mapping is still in use")

    def execute(self, peer: PeerInfo, items: list[WorkItem], deadline: float) -> None:
        pid = peer.pid
        with self._lock:
            self._inflight[pid] = self._inflight.get(pid, 0) + 1
        try:
            self._execute(peer, items)
        finally:
            with self._lock:
                left = self._inflight[pid] - 1
                if left:
                    self._inflight[pid] = left
                else:
                    del self._inflight[pid]
            self._close_retired()
            self._sweep()

    def _execute(self, peer: PeerInfo, items: list[WorkItem]) -> None:
        jobs: list[
            tuple[int, int, int]
        ] = []  # (dst, src, n) memmoves through mappings, run together below
        mapped: list[WorkItem] = []
        for it in items:
            if it.done or it.error is not None:
                continue
            region = peer.find_region(it.remote_addr, it.length)
            if region is None:
                it.error = InvalidRequest(
                    f"peer {peer.name!r} has no registered memory "
                    f"at 0x{it.remote_addr:x}+{it.length}"
                )
                continue
            if str(region.get("location", "")).startswith("cuda"):
                raise TransportError(
                    f"peer {peer.name!r} region {region.get('name')!r} is device memory; "
                    "not reachable by shm"
                )
            if "memfd" in region:
                base = self._map(peer, region) + (it.remote_addr - int(region["addr"]))
                jobs.append(
                    (it.local_addr, base, it.length)
                    if it.op == READ
                    else (base, it.local_addr, it.length)
                )
                mapped.append(it)
                continue
            try:
                cma_copy(peer.pid, it.op, it.local_addr, it.remote_addr, it.length)
            except PeerUnreachable:
                raise
            except TransportError:
                self._denied.add(peer.pid)
                raise
            it.done = True
        if jobs:
            self._copy(jobs)
            for it in mapped:
                it.done = True
        # Writes into the mapping of a peer that died would vanish: report them as failed.
        try:
            os.kill(peer.pid, 0)
        except ProcessLookupError:
            self.forget(peer.pid)
            for it in items:
                it.done = False
            raise PeerUnreachable(f"peer {peer.name!r} (pid {peer.pid}) is gone") from None
        except PermissionError:
            pass

    def close(self) -> None:
        with self._lock:
            self._retired.extend((k[0], mm) for k, (mm, _) in self._maps.items())
            self._maps.clear()
            self._started.clear()
        self._close_retired()


@hookimpl
def mooncake_transports() -> list[TransportInfo]:
    return [
        TransportInfo(
            "shm",
            ShmTransport,
            priority=10,
            description=(
                "shared memory on one host: memfd mapping or cross-memory attach, one memcpy"
            ),
        )
    ]
