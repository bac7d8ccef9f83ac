"""Segments mounted at run time: ``allocate_and_mount_segment`` / ``unmount_and_free_segment``.

The published store lends more memory to the pool after ``setup`` with
``allocate_and_mount_segment(size)`` and withdraws it with ``unmount_and_free_segment(ids)``;
ours does the same with :meth:`StoreClient.mount_segment` / ``unmount_segment``. As
published: the size is rounded up to a multiple of 16 MiB, a zero size answers ``ret`` -1,
and only segments this method allocated can be freed (an unknown id answers -1). Objects
whose only replica was on a freed segment disappear. ``protocol`` and ``location`` (a
NUMA/device hint) do not change where our memory comes from; they are accepted and logged.

``mount_segment(path, size, offset=0)`` lends ``size`` bytes of an existing file from
``offset`` (a page multiple) instead: the file is mapped shared (:class:`FileSegment`), so
objects stored there land in the file, and same-host peers map the file's descriptor as
they map a memfd; ``unmount_segment(ids)`` withdraws such segments (their objects
disappear, the file keeps its bytes). As published (checked by running the 0.3.13 wheel):
``{"ret": 0, "segment_ids": [id]}`` without ``allocated_size``; size 0 mounts nothing and
answers ``ret`` 0; a missing file, a directory, an offset that is not page-aligned or a range
past the end of the file answer ``ret`` -1; the size is not rounded; negative numbers raise
``TypeError``; ``unmount_segment`` answers -1 when one of the ids was not mounted by
``mount_segment`` (the others are still withdrawn), ``allocate_and_mount_segment`` ids
included (and ``unmount_and_free_segment`` refuses ``mount_segment`` ids); a store that is
not set up answers -1.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import stat
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from mooncake_core.errors import SegmentError
from mooncake_core.store.ssd_withdraw import withdraw_ssd_tier
from mooncake_core.transfer.memory import ManagedBuffer

if TYPE_CHECKING:
    from mooncake_core.store import StoreClient

__all__ = ["FileSegment", "SegmentMethods"]

logger = logging.getLogger("mooncake_core.compat.store")
T = TypeVar("T")
_ALIGN = 16 << 20


class FileSegment(ManagedBuffer):
    """``size`` bytes of the regular file ``path`` from ``offset``, mapped shared (writes
    land in the file); ``fd`` stays open so that same-host peers can map it too."""

    def __init__(self, path: str, size: int, offset: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise SegmentError(f"{path!r} is not a regular file")
            if offset % mmap.PAGESIZE:
                raise SegmentError(f"offset {offset} is not page-aligned ({mmap.PAGESIZE})")
            if offset + size > info.st_size:
                raise SegmentError(
                    f"[{offset}, {offset + size}) is past the end of {path!r}"
                    f" ({info.st_size} bytes)"
                )
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, offset=offset)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.length, self.offset, self.path = fd, size, offset, path
        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        self.addr = ctypes.addressof(self._anchor)
        self.view = memoryview(self._mmap)


def _check_count(method: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"{method}(): {name} must be a non-negative int, got {value!r}")
    return value


class SegmentMethods:
    """Run-time segments, mixed into the store."""

    if TYPE_CHECKING:  # provided by MooncakeDistributedStore

        def _run(self, what: str, fn: Callable[[StoreClient], T]) -> T | int: ...

    def _file_segments(self) -> set[str]:
        found: set[str] | None = getattr(self, "_mounted_files", None)
        if found is None:
            found = set()
            self._mounted_files = found
        return found

    def _allocated_segments(self) -> set[str]:
        found: set[str] | None = getattr(self, "_mounted_at_run_time", None)
        if found is None:
            found = set()
            self._mounted_at_run_time = found
        return found

    def allocate_and_mount_segment(
        self, size: int, protocol: str = "tcp", location: str = ""
    ) -> dict[str, Any]:
        """Lend ``size`` more bytes (rounded up to 16 MiB) to the pool: ``{"ret": 0 or a
        negative code, "segment_ids": [id], "allocated_size": bytes}``."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise TypeError(
                f"allocate_and_mount_segment(): size must be a non-negative int, got {size!r}"
            )
        failed: dict[str, Any] = {"ret": -1, "segment_ids": [], "allocated_size": 0}
        if size == 0:
            logger.error("allocate_and_mount_segment: size is 0")
            return failed
        if protocol != "tcp" or location:
            logger.info(
                "allocate_and_mount_segment: protocol %r / location %r do not change where "
                "the memory comes from here",
                protocol,
                location,
            )
        rounded = -(-size // _ALIGN) * _ALIGN
        res = self._run("allocate_and_mount_segment", lambda c: c.mount_segment(rounded))
        if isinstance(res, int):
            return dict(failed, ret=res)
        self._allocated_segments().add(res)
        return {"ret": 0, "segment_ids": [res], "allocated_size": rounded}

    def unmount_and_free_segment(
        self, segment_ids: list[str], grace_period_seconds: int = 0
    ) -> int:
        """Withdraw segments :meth:`allocate_and_mount_segment` lent, after waiting
        ``grace_period_seconds``; 0, or -1 when an id is not one of them (nothing is
        withdrawn then) or the master refused."""
        mine = self._allocated_segments()
        unknown = [s for s in segment_ids if s not in mine]
        if unknown:
            logger.error("unmount_and_free_segment: not allocated here: %s", ", ".join(unknown))
            return -1
        if grace_period_seconds > 0:
            time.sleep(grace_period_seconds)
        for seg in segment_ids:
            if isinstance(self._run(f"unmount_and_free_segment {seg!r}", _unmounter(seg)), int):
                return -1
            mine.discard(seg)
        return 0

    def mount_segment(
        self, path: str, size: int, offset: int = 0, protocol: str = "tcp", location: str = ""
    ) -> dict[str, Any]:
        """Lend ``size`` bytes of the existing file ``path`` from ``offset`` to the pool:
        ``{"ret": 0 or -1, "segment_ids": [id] (none for size 0)}``."""
        if not isinstance(path, (str, bytes)):
            raise TypeError(f"mount_segment(): path must be a str, got {type(path).__name__}")
        _check_count("mount_segment", "size", size)
        _check_count("mount_segment", "offset", offset)
        failed: dict[str, Any] = {"ret": -1, "segment_ids": []}
        if getattr(self, "_client", None) is None:
            logger.error("mount_segment: the store is not set up (call setup() first)")
            return failed
        if size == 0:
            return {"ret": 0, "segment_ids": []}
        if protocol != "tcp" or location:
            logger.info("mount_segment: protocol %r / location %r are not used", protocol, location)
        where = os.fsdecode(path)
        try:
            seg = FileSegment(where, size, offset)
        except (OSError, SegmentError, ValueError) as exc:
            logger.error("mount_segment %r: %s", where, getattr(exc, "strerror", None) or exc)
            return failed
        res = self._run(
            f"mount_segment {where!r}", lambda c: c.mount_segment(size, memory=seg, offset=offset)
        )
        if isinstance(res, int):
            seg.close()  # the client closed it already when the master refused; idempotent
            return failed
        self._file_segments().add(res)
        return {"ret": 0, "segment_ids": [res]}

    def unmount_segment(self, segment_ids: list[str], grace_period_seconds: int = 0) -> int:
        """Withdraw segments :meth:`mount_segment` lent, after ``grace_period_seconds``: 0,
        or -1 when an id was not one of them or the master refused (the rest are still
        withdrawn)."""
        if not isinstance(segment_ids, list) or not all(isinstance(s, str) for s in segment_ids):
            raise TypeError("unmount_segment(): segment_ids must be a list of str")
        _check_count("unmount_segment", "grace_period_seconds", grace_period_seconds)
        if getattr(self, "_client", None) is None:
            logger.error("unmount_segment: the store is not set up (call setup() first)")
            return -1
        if grace_period_seconds > 0:
            time.sleep(grace_period_seconds)
        mine, rc = self._file_segments(), 0
        for seg in segment_ids:
            if seg not in mine:
                logger.error("unmount_segment: %r was not mounted by mount_segment", seg)
                rc = -1
            elif isinstance(self._run(f"unmount_segment {seg!r}", _unmounter(seg)), int):
                rc = -1
            else:
                mine.discard(seg)
        return rc

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """Withdraw this client's SSD tier (local disk) after ``grace_period_seconds``: no
        more offloads, and the master drops its disk copies (objects whose only copy was
        there are gone). 0, also without a tier or when called again; -1 when not set up,
        closed, or the master refused."""
        _check_count("unmount_local_disk_segment", "grace_period_seconds", grace_period_seconds)
        if getattr(self, "_client", None) is None:
            logger.error("unmount_local_disk_segment: the store is not set up (call setup() first)")
            return -1
        if grace_period_seconds > 0:
            time.sleep(grace_period_seconds)
        res = self._run("unmount_local_disk_segment", withdraw_ssd_tier)
        return 0 if res >= 0 else -1


def _unmounter(name: str) -> Callable[[StoreClient], None]:
    def run(c: StoreClient) -> None:
        c.unmount_segment(name)

    return run
