"""Segments mounted at run time: ``allocate_and_mount_segment`` / ``unmount_and_free_segment``.

The published store lends more memory to the pool after ``setup`` with
``allocate_and_mount_segment(size)`` and withdraws it with ``unmount_and_free_segment(ids)``;
ours does the same with :meth:`StoreClient.mount_segment` / ``unmount_segment``. As
published: the size is rounded up to a multiple of 16 MiB, a zero size answers ``ret`` -1,
and only segments this method allocated can be freed (an unknown id answers -1). Objects
whose only replica was on a freed segment disappear. ``protocol`` and ``location`` (a
NUMA/device hint) do not change where our memory comes from; they are accepted and logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from mooncake_core.store import StoreClient

__all__ = ["SegmentMethods"]

logger = logging.getLogger("mooncake_core.compat.store")
T = TypeVar("T")
_ALIGN = 16 << 20


class SegmentMethods:
    """Run-time segments, mixed into the store."""

    if TYPE_CHECKING:  # provided by MooncakeDistributedStore

        def _run(self, what: str, fn: Callable[[StoreClient], T]) -> T | int: ...

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


def _unmounter(name: str) -> Callable[[StoreClient], None]:
    def run(c: StoreClient) -> None:
        c.unmount_segment(name)

    return run
