"""``mooncake.store``'s buffer pools (and ``mooncake.buffer_pool``): ``BufferPool``
(``RegisteredBufferPool``), ``BufferLease`` (``RegisteredBufferLease``), ``BufferLeaseView``
(``RegisteredBufferLeaseView``), ``MooncakeHostMemAllocator``, ``get_alloc_func_addr``,
``get_free_func_addr``.

A :class:`BufferPool` leases pieces of host memory that is registered with its store, so
``store.put_from(key, lease.ptr, n)`` / ``store.get_into(key, lease.ptr, lease.size)`` need
no staging copy. What a caller sees follows the published wheel (0.3.13), as measured by
running it (docs/compat.md, "Buffer pools"):

- ``BufferPool(store)`` needs a set-up store (else ``RuntimeError``); the pool holds up to
  ``max_bytes`` (0: twice the store's ``local_buffer_size``). A lease larger than that is a
  ``RuntimeError`` ("requested buffer size exceeds pool capacity"); when the pool is full,
  ``acquire`` waits (``block``, default ``block_on_exhaustion``) up to ``timeout`` (default
  ``default_timeout``; None: forever), then raises "timed out waiting for buffer", or at
  once "buffer pool is exhausted" when not blocking.
- Leases are packed at 8-byte granularity; ``lease.buffer`` is a writable ``memoryview``;
  ``release()`` refuses while such a view is alive ("cannot release buffer while exported
  views exist"), is idempotent, and runs on ``with`` exit and when the lease is collected.
  After it, ``ptr`` raises "buffer lease is closed" and ``buffer`` a ``BufferError``.
- ``close()`` refuses while leases are out, and is idempotent; ``acquire`` after it raises.

Ours keeps one region per pool (an anonymous mapping of the whole capacity, registered once;
pages are only touched when used), so ``min_size_class``, ``max_size_class`` and
``max_regions`` are checked but shape nothing; the wheel rounds to size classes and grows
regions, which changes when a pool with a small ``max_bytes`` counts as full.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import sys
import threading
import time
from typing import Any

from mooncake_core.transfer.memory import map_memory, unmap_memory

__all__ = [
    "BufferPool",
    "RegisteredBufferPool",
    "BufferLease",
    "RegisteredBufferLease",
    "BufferLeaseView",
    "RegisteredBufferLeaseView",
    "MooncakeHostMemAllocator",
    "get_alloc_func_addr",
    "get_free_func_addr",
]

logger = logging.getLogger(__name__)

_GRAIN = 8
_PAGE = mmap.PAGESIZE
_NO_CTOR = object()

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _map(size: int, shared: bool) -> int:
    """An anonymous mapping of ``size`` bytes (OSError naming the size when it fails)."""
    flags = (mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | mmap.MAP_ANONYMOUS
    return map_memory(size, flags)


def _unmap(addr: int, size: int) -> None:
    unmap_memory(addr, size)


def _uint(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{name} must be a non-negative int, got {value!r}")
    return value


def _seconds(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    raise RuntimeError(f"Unable to cast Python instance of type {type(value)} to C++ type 'double'")


def _flag(value: Any) -> bool:
    if isinstance(value, (bool, int)):
        return bool(value)
    raise RuntimeError(f"Unable to cast Python instance of type {type(value)} to C++ type 'bool'")


# ---------------------------------------------------------------------------- allocator
class MooncakeHostMemAllocator:
    """Shared anonymous host memory: ``alloc(size)`` gives its address, ``free(addr)`` 0, or
    -1 for an address it did not give."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}

    def alloc(self, size: int, /) -> int:
        size = _uint("alloc(): size", size)
        if size == 0:
            raise RuntimeError("Failed to map shared memory: Invalid argument")
        try:
            addr = _map(size, shared=True)
        except OSError as exc:
            raise RuntimeError(f"Failed to map shared memory: {exc.strerror or exc}") from None
        with self._lock:
            self._sizes[addr] = size
        return addr

    def free(self, ptr: int, /) -> int:
        with self._lock:
            size = self._sizes.pop(int(ptr), None)
        if size is None:
            logger.error("Attempted to free unknown shared memory address: %d", ptr)
            return -1
        _unmap(int(ptr), size)
        return 0


def get_alloc_func_addr() -> int:
    """The address of a C allocation function for allocator hooks (torch's pluggable
    allocators). The wheel's is its own host allocator; ours is libc's ``malloc``, which takes
    the same first argument (the size) and ignores the device and stream ones."""
    return int(ctypes.cast(_libc.malloc, ctypes.c_void_p).value or 0)


def get_free_func_addr() -> int:
    """The address of the matching release function: libc's ``free`` (see
    :func:`get_alloc_func_addr`)."""
    return int(ctypes.cast(_libc.free, ctypes.c_void_p).value or 0)


# ---------------------------------------------------------------------------- leases
class BufferLeaseView:
    """What a lease's ``buffer`` memoryview is taken from. Not constructible from Python."""

    def __init__(self, *args: Any) -> None:
        if not args or args[0] is not _NO_CTOR:
            raise TypeError("mooncake.store.BufferLeaseView: No constructor defined!")
        _, addr, size, keep = args
        arr = (ctypes.c_ubyte * max(size, 1)).from_address(addr)
        arr._mc_keep = keep  # the pool outlives its memory's views
        self._arr = arr
        self._size = size

    @property
    def buffer(self) -> memoryview:
        """A writable byte view of the leased memory."""
        return memoryview(self._arr).cast("B")[: self._size]

    def _exported(self) -> bool:
        # held by this object and getrefcount's argument; a live memoryview adds one
        return sys.getrefcount(self._arr) > 2


class BufferLease:
    """``size`` bytes at ``ptr`` leased from a :class:`BufferPool`; ``buffer`` is a
    memoryview of them. Not constructible from Python."""

    def __init__(self, *args: Any) -> None:
        if not args or args[0] is not _NO_CTOR:
            raise TypeError("mooncake.store.BufferLease: No constructor defined!")
        _, pool, offset, size, span = args
        self._pool: BufferPool | None = pool
        self._offset: int = offset
        self._size: int = size
        self._span: int = span
        self._ptr: int = pool._base + offset
        self._views: list[BufferLeaseView] = []

    @property
    def ptr(self) -> int:
        if self._pool is None:
            raise RuntimeError("buffer lease is closed")
        return self._ptr

    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> memoryview:
        if self._pool is None:
            raise BufferError("Error getting buffer")
        self._views = [v for v in self._views if v._exported()]
        view = BufferLeaseView(_NO_CTOR, self._ptr, self._size, self._pool)
        self._views.append(view)
        return view.buffer

    def release(self) -> None:
        """Give the memory back to the pool. Idempotent; refused while a view is alive."""
        pool = self._pool
        if pool is None:
            return
        if any(v._exported() for v in self._views):
            raise RuntimeError("cannot release buffer while exported views exist")
        self._views = []
        self._pool = None
        pool._give_back(self._offset, self._span)

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None and not any(v._exported() for v in self._views):
            try:
                self.release()
            except Exception:  # the collector may run this at interpreter shutdown
                pass


# ---------------------------------------------------------------------------- pool
class BufferPool:
    """Leases of host memory registered with ``store`` (a set-up ``MooncakeDistributedStore``)
    for zero-copy ``put_from`` / ``get_into``."""

    def __init__(
        self,
        store: object,
        max_bytes: int = 0,
        min_size_class: int = 65536,
        max_size_class: object = None,
        alignment: int = 8388608,
        block_on_exhaustion: bool = True,
        default_timeout: object = None,
        max_regions: object = None,
        prewarm_size: object = None,
        prewarm_count: int = 0,
    ) -> None:
        self._base = 0
        self._closed = True
        for name, value in [
            ("max_bytes", max_bytes),
            ("min_size_class", min_size_class),
            ("alignment", alignment),
            ("prewarm_count", prewarm_count),
        ]:
            _uint(f"BufferPool(): {name}", value)
        for opt_name, opt in [
            ("max_size_class", max_size_class),
            ("max_regions", max_regions),
            ("prewarm_size", prewarm_size),
        ]:
            if opt is not None:
                _uint(f"BufferPool(): {opt_name}", opt)
        self._block = _flag(block_on_exhaustion)
        self._timeout = _seconds(default_timeout)
        if store is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        get_client = getattr(store, "get_client", None)
        if get_client is None or not hasattr(store, "register_buffer"):
            raise RuntimeError("BufferPool store parameter must be a MooncakeDistributedStore")
        if get_client() is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if min_size_class <= 0 or alignment <= 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment & (alignment - 1) or alignment < ctypes.sizeof(ctypes.c_void_p):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        local = int(getattr(store, "_local_buffer_size", 0))
        self.capacity = int(max_bytes) or 2 * local
        self._store: Any = store
        self._cond = threading.Condition()
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []
        self._leased = 0
        self._span = -(-max(self.capacity, 1) // _PAGE) * _PAGE
        try:
            self._base = _map(self._span, shared=False)
        except OSError as exc:
            raise RuntimeError(f"BufferPool: {exc}") from None
        rc = store.register_buffer(self._base, self._span)
        if rc != 0:
            _unmap(self._base, self._span)
            self._base = 0
            raise RuntimeError(f"BufferPool: registering {self._span} bytes with the store: {rc}")
        self._closed = False
        if prewarm_size and prewarm_count:
            self.prewarm(_uint("prewarm_size", prewarm_size), prewarm_count)

    # ------------------------------------------------------------------ leasing
    def acquire(self, size: int, block: object = None, timeout: object = None) -> BufferLease:
        """A lease of ``size`` bytes; waits for room when blocking (see the module doc)."""
        size = _uint("acquire(): size", size)
        wait = self._block if block is None else _flag(block)
        limit = _seconds(timeout) if timeout is not None else self._timeout
        if self._closed:
            raise RuntimeError("buffer pool is closed")
        if size > self.capacity:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        span = -(-size // _GRAIN) * _GRAIN
        deadline = None if limit is None else time.monotonic() + limit
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("buffer pool is closed")
                offset = self._take(span)
                if offset is not None or not span:
                    self._leased += 1
                    return BufferLease(_NO_CTOR, self, offset or 0, size, span)
                if not wait:
                    raise RuntimeError("buffer pool is exhausted")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cond.wait(left)

    def buffer(self, size: int, block: object = None, timeout: object = None) -> BufferLease:
        """:meth:`acquire` for a ``with`` block: the lease is released when it ends."""
        return self.acquire(size, block, timeout)

    def prewarm(self, size: int, count: int) -> None:
        """Touch the pages of ``count`` leases of ``size`` bytes (as many as fit) so that the
        first real use does not fault them in."""
        size, count = _uint("prewarm(): size", size), _uint("prewarm(): count", count)
        if self._closed or not size or size > self.capacity:
            return
        span = -(-size // _GRAIN) * _GRAIN
        with self._cond:
            taken = []
            for _ in range(count):
                offset = self._take(span)
                if offset is None:
                    break
                taken.append(offset)
            for offset in taken:
                for page in range(offset - offset % _PAGE, offset + span, _PAGE):
                    ctypes.memset(self._base + max(page, offset), 0, 1)
            for offset in taken:
                self._put_back(offset, span)

    def close(self) -> None:
        """Unregister and unmap the pool's memory. Refused while leases are out; idempotent."""
        with self._cond:
            if self._closed:
                return
            if self._leased:
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            self._cond.notify_all()
        self._drop()

    def _drop(self) -> None:
        base, self._base = self._base, 0
        if not base:
            return
        try:
            self._store.unregister_buffer(base)
        except Exception as exc:  # a closed store: nothing left to unregister from
            logger.debug("BufferPool: unregister: %s", exc)
        _unmap(base, self._span)

    # ------------------------------------------------------------------ free list
    def _take(self, span: int) -> int | None:
        for i, (offset, length) in enumerate(self._free):
            if length >= span:
                if length == span:
                    del self._free[i]
                else:
                    self._free[i] = (offset + span, length - span)
                return offset
        return None

    def _put_back(self, offset: int, span: int) -> None:
        free = self._free
        free.append((offset, span))
        free.sort()
        merged: list[tuple[int, int]] = []
        for off, length in free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((off, length))
        self._free[:] = merged

    def _give_back(self, offset: int, span: int) -> None:
        with self._cond:
            if span:
                self._put_back(offset, span)
            self._leased -= 1
            self._cond.notify_all()

    def __del__(self) -> None:
        if not self._closed and not getattr(self, "_leased", 0):
            self._closed = True
            try:
                self._drop()
            except Exception:  # interpreter shutdown
                pass


#: the published names of the same classes
RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView
