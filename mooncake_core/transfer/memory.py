"""Registered memory: regions, the segment table, engine-allocated shared buffers.

A *region* is a contiguous range of this process's memory that peers may read or write.
Regions come from:

- any writable object with the buffer protocol (``bytearray``, ``mmap``, numpy arrays),
- torch tensors (CPU; CUDA tensors are moved through a host staging copy),
- raw ``(address, length)`` pairs (the published API's ``register_memory``),
- :meth:`SharedBufferPool.allocate`: memfd-backed buffers that a peer on the same host
  maps directly (the shared-memory transport's fast path).

Every remote request is checked against the :class:`SegmentTable`: a range that is not
wholly inside one registered region is refused.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mooncake_core.errors import InvalidRequest, SegmentError, SegmentOverlap

__all__ = [
    "Region",
    "SegmentTable",
    "ManagedBuffer",
    "buffer_address",
    "host_view",
    "view_address",
    "memmove",
    "map_memory",
    "unmap_memory",
]

memmove = ctypes.memmove  # a ctypes foreign call: releases the GIL during the copy


def host_view(addr: int, length: int) -> memoryview:
    """A writable byte memoryview over ``length`` bytes at ``addr`` (caller keeps it valid)."""
    if length == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def _torch_info(obj: Any) -> tuple[int, int, str] | None:
    mod = type(obj).__module__
    if not mod.startswith("torch"):
        return None
    import torch

    if not isinstance(obj, torch.Tensor):
        return None
    if not obj.is_contiguous():
        raise SegmentError(
            "torch tensor must be contiguous to be registered or transferred (call .contiguous())"
        )
    kind = "cuda" if obj.device.type == "cuda" else "host"
    if obj.device.type not in ("cpu", "cuda"):
        raise SegmentError(
            f"torch tensors on device {obj.device} are not supported (cpu or cuda only)"
        )
    return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), kind


def buffer_address(obj: Any, *, writable: bool = True) -> tuple[int, int, str]:
    """Return ``(address, length, kind)`` of a buffer-like object.

    ``kind`` is ``"host"`` or ``"cuda"``. Raises :class:`SegmentError` when the object
    is not contiguous memory (or not writable when ``writable``).
    """
    t = _torch_info(obj)
    if t is not None:
        return t
    if hasattr(obj, "__array_interface__") and hasattr(obj, "ctypes"):
        arr = obj
        if not arr.flags["C_CONTIGUOUS"]:
            raise SegmentError("numpy array must be C-contiguous (use numpy.ascontiguousarray)")
        if writable and not arr.flags["WRITEABLE"]:
            raise SegmentError("numpy array is read-only; registered memory must be writable")
        return int(arr.ctypes.data), int(arr.nbytes), "host"
    try:
        mv = memoryview(obj)
    except TypeError:
        raise SegmentError(
            f"cannot use {type(obj).__name__} as memory: expected bytearray, memoryview, "
            "numpy array, torch tensor or (addr, length)"
        ) from None
    if not mv.contiguous:
        raise SegmentError("memory must be contiguous")
    if mv.nbytes == 0:
        raise SegmentError("memory must not be empty")
    if mv.readonly:
        if writable:
            raise SegmentError(
                f"{type(obj).__name__} is read-only; "
                "registered memory must be writable (use bytearray)"
            )
        # read-only source: copy-free address via a ctypes pointer to the buffer
        import numpy as np

        a = np.frombuffer(mv, dtype=np.uint8)
        return int(a.ctypes.data), int(a.nbytes), "host"
    # the first byte as a c_char: no array type of the buffer's length to build (3.5 -> 0.4 us)
    c = ctypes.c_char.from_buffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
    return ctypes.addressof(c), mv.nbytes, "host"


def view_address(mv: memoryview) -> int:
    """The address of the first byte of a non-empty, contiguous byte memoryview (the transfer
    hot path's shortcut of :func:`buffer_address`)."""
    if mv.readonly:
        return buffer_address(mv, writable=False)[0]
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


@dataclass
class Region:
    """One registered range of local memory."""

    addr: int
    length: int
    name: str
    kind: str = "host"  # "host" | "cuda"
    location: str = "cpu:0"
    owner: Any = None  # keeps the backing object alive
    memfd: int = -1  # memfd of engine-allocated shared buffers (peers map /proc/<pid>/fd/<fd>)
    memfd_offset: int = 0
    _view: memoryview | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.addr + self.length

    def view(self, addr: int, length: int) -> memoryview:
        """Host memoryview of ``[addr, addr+length)`` (must be inside this region)."""
        if self.kind != "host":
            raise InvalidRequest(f"region {self.name!r} is {self.kind} memory; no host view")
        if self._view is None:
            self._view = host_view(self.addr, self.length)
        off = addr - self.addr
        return self._view[off : off + length]

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "addr": self.addr,
            "length": self.length,
            "location": self.location,
        }
        if self.memfd >= 0:
            d["memfd"] = self.memfd
            d["memfd_offset"] = self.memfd_offset
        return d

    def copy_out(self, addr: int, length: int) -> memoryview:
        """Bytes of ``[addr, addr+length)`` as a host memoryview (staged for CUDA)."""
        if self.kind == "host":
            return self.view(addr, length)
        import torch

        t = self.owner.view(torch.uint8).flatten()[addr - self.addr : addr - self.addr + length]
        return memoryview(t.cpu().numpy()).cast("B")

    def copy_in(self, addr: int, data: memoryview) -> None:
        """Write ``data`` at ``addr`` (host memmove, or a host->device copy for CUDA)."""
        if self.kind == "host":
            self.view(addr, len(data))[:] = data
            return
        import numpy as np
        import torch

        src = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
        dst = self.owner.view(torch.uint8).flatten()[
            addr - self.addr : addr - self.addr + len(data)
        ]
        dst.copy_(src)


class SegmentTable:
    """Registered regions of one engine, looked up by address; safe to read concurrently.

    Lookups use an immutable snapshot (copy-on-write), so the hot path takes no lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: tuple[int, ...] = ()
        self._regions: tuple[Region, ...] = ()
        self._names: dict[str, Region] = {}
        self.on_change: list[Callable[[], None]] = []

    def add(self, region: Region) -> Region:
        if region.length <= 0:
            raise SegmentError(
                f"cannot register {region.length} bytes at 0x{region.addr:x}: "
                "length must be positive"
            )
        if region.addr <= 0:
            raise SegmentError(f"cannot register address 0x{region.addr:x}")
        with self._lock:
            i = bisect.bisect_right(self._starts, region.addr)
            prev = self._regions[i - 1] if i > 0 else None
            nxt = self._regions[i] if i < len(self._regions) else None
            if (prev is not None and prev.end > region.addr) or (
                nxt is not None and region.end > nxt.addr
            ):
                other = prev if prev is not None and prev.end > region.addr else nxt
                assert other is not None
                raise SegmentOverlap(
                    f"memory 0x{region.addr:x}+{region.length} "
                    f"overlaps registered region {other.name!r} "
                    f"(0x{other.addr:x}+{other.length})"
                )
            if region.name in self._names:
                raise SegmentError(f"a region named {region.name!r} is already registered")
            regions = list(self._regions)
            regions.insert(i, region)
            self._regions = tuple(regions)
            self._starts = tuple(r.addr for r in regions)
            self._names[region.name] = region
        for cb in self.on_change:
            cb()
        return region

    def remove(self, addr: int) -> Region:
        with self._lock:
            i = bisect.bisect_left(self._starts, addr)
            if i >= len(self._starts) or self._starts[i] != addr:
                raise SegmentError(f"no registered memory starts at 0x{addr:x}")
            regions = list(self._regions)
            region = regions.pop(i)
            self._regions = tuple(regions)
            self._starts = tuple(r.addr for r in regions)
            self._names.pop(region.name, None)
        for cb in self.on_change:
            cb()
        return region

    def find(self, addr: int, length: int) -> Region:
        """The region wholly containing ``[addr, addr+length)``, else :class:`InvalidRequest`."""
        if length <= 0:
            raise InvalidRequest(f"length must be positive, got {length}")
        starts, regions = self._starts, self._regions
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0:
            r = regions[i]
            if addr + length <= r.end:
                return r
            if addr < r.end:
                raise InvalidRequest(
                    f"range 0x{addr:x}+{length} runs past the end of registered region {r.name!r} "
                    f"(0x{r.addr:x}+{r.length})"
                )
        raise InvalidRequest(f"address 0x{addr:x} (+{length}) is not inside any registered memory")

    def by_name(self, name: str) -> Region:
        try:
            return self._names[name]
        except KeyError:
            raise InvalidRequest(f"no registered region named {name!r}") from None

    def regions(self) -> tuple[Region, ...]:
        return self._regions

    def describe(self) -> list[dict[str, Any]]:
        return [r.describe() for r in self._regions]


class ManagedBuffer:
    """Engine-allocated memory backed by a memfd (or an unnamed file in ``directory``),
    mappable by same-host peers through ``/proc/<pid>/fd``.

    Attributes:
        addr: address of the first byte in this process.
        length: size in bytes.
        view: writable memoryview of the whole buffer.
    """

    def __init__(self, length: int, *, prefault: bool = False, directory: str = "") -> None:
        if length <= 0:
            raise SegmentError(f"cannot allocate {length} bytes: length must be positive")
        self.length = length
        if directory:  # an unnamed file there (e.g. a tmpfs mounted with huge=always: 2 MiB pages)
            try:
                self.fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise SegmentError(
                    f"cannot create shared memory in transfer.shm_dir {directory!r}: {exc.strerror}"
                ) from exc
        else:
            self.fd = os.memfd_create(f"mooncake-{os.getpid()}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, length)
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
            self._mmap = mmap.mmap(self.fd, length, flags=flags)
        except OSError as exc:
            os.close(self.fd)
            raise SegmentError(
                f"cannot allocate {length} bytes of shared memory: {exc.strerror}"
            ) from exc
        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        self.addr = ctypes.addressof(self._anchor)
        self.view = memoryview(self._mmap)

    def numpy(self) -> Any:
        """The buffer as a 1-D ``numpy.uint8`` array (no copy)."""
        import numpy as np

        return np.frombuffer(self._mmap, dtype=np.uint8)

    def close(self) -> None:
        if self.fd < 0:
            return
        self.view.release()
        del self._anchor
        try:
            self._mmap.close()
        except BufferError:  # someone still holds a view; the mapping lives until they drop it
            pass
        os.close(self.fd)
        self.fd = -1

    def __len__(self) -> int:
        return self.length


_libc = ctypes.CDLL(None, use_errno=True)  # the C library this process already has loaded
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_memory(size: int, flags: int, fd: int = -1) -> int:
    """``mmap`` ``size`` readable and writable bytes (``flags``: ``mmap.MAP_*``; ``fd`` -1 for
    anonymous memory) at an address Python does not own; OSError with errno when it fails."""
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map {size} bytes: {os.strerror(err)}")
    return int(addr)


def unmap_memory(addr: int, size: int) -> None:
    """``munmap`` what :func:`map_memory` returned."""
    _libc.munmap(addr, size)
