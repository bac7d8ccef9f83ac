"""Offset allocation inside one mounted segment, and replica placement across segments.

Contract:

- :class:`OffsetAllocator` hands out aligned ``[offset, offset+size)`` ranges of a
  segment of ``capacity`` bytes: best fit over a size-sorted free list, O(log n) lookup,
  neighbours coalesced on free. ``free`` of a range it did not hand out raises.
- :func:`place` picks, for each replica, segments not used by the object's other
  replicas (distinct segments), following a strategy: ``random``, ``free-ratio-first``
  or ``local-first`` (the writer's own segments, then the others). When no single
  segment can hold the object, the replica is striped over several segments.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Sequence
from typing import Protocol

__all__ = ["OffsetAllocator", "place", "align", "ALIGN", "STRATEGIES", "Placeable"]

ALIGN = 64
STRATEGIES = ("random", "free-ratio-first", "local-first")


def align(n: int) -> int:
    """``n`` rounded up to the allocation unit (what an allocation of ``n`` bytes really takes)."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class OffsetAllocator:
    """Best-fit allocator over ``[0, capacity)`` with coalescing.

    Not thread-safe: the master owns it from its event loop.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"segment capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._by_off: dict[int, int] = {0: capacity}  # free extents: offset -> size
        self._offs: list[int] = [0]  # sorted free offsets
        self._sizes: list[tuple[int, int]] = [(capacity, 0)]  # sorted (size, offset)
        self._live: dict[int, int] = {}  # allocated offset -> aligned size

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def largest_free(self) -> int:
        return self._sizes[-1][0] if self._sizes else 0

    def _take_free(self, off: int, size: int) -> None:
        del self._by_off[off]
        self._offs.pop(bisect.bisect_left(self._offs, off))
        self._sizes.pop(bisect.bisect_left(self._sizes, (size, off)))

    def _add_free(self, off: int, size: int) -> None:
        self._by_off[off] = size
        bisect.insort(self._offs, off)
        bisect.insort(self._sizes, (size, off))

    def allocate(self, size: int) -> int | None:
        """Offset of a new range of ``size`` bytes, or None when no extent fits."""
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size}")
        need = align(size)
        i = bisect.bisect_left(self._sizes, (need, -1))
        if i >= len(self._sizes):
            return None
        fsize, off = self._sizes[i]
        self._take_free(off, fsize)
        if fsize > need:
            self._add_free(off + need, fsize - need)
        self._live[off] = need
        self.used += need
        return off

    def release(self, off: int) -> None:
        """Return the range that starts at ``off``."""
        size = self._live.pop(off, None)
        if size is None:
            raise ValueError(f"offset {off} is not an allocated range of this segment")
        self.used -= size
        start, end = off, off + size
        i = bisect.bisect_left(self._offs, off)
        if i > 0:
            p = self._offs[i - 1]
            psize = self._by_off[p]
            if p + psize == start:
                self._take_free(p, psize)
                start = p
        if end in self._by_off:
            nsize = self._by_off[end]
            self._take_free(end, nsize)
            end += nsize
        self._add_free(start, end - start)

    def split(self, off: int, at: int) -> None:
        """Cut the allocated range starting at ``off`` in two at ``at`` (both stay allocated).

        Used to carve objects out of a client's reservation; ``at`` must be aligned and
        strictly inside the range.
        """
        size = self._live.get(off)
        if size is None:
            raise ValueError(f"offset {off} is not an allocated range of this segment")
        if not off < at < off + size or at % ALIGN:
            raise ValueError(f"cannot split [{off}, {off + size}) at {at}")
        self._live[off] = at - off
        self._live[at] = off + size - at

    def reserve(self, off: int, size: int) -> bool:
        """Mark ``[off, off+size)`` used (rebuilding state from a log); False if not free."""
        need = align(size)
        i = bisect.bisect_right(self._offs, off) - 1
        if i < 0:
            return False
        foff = self._offs[i]
        fsize = self._by_off[foff]
        if off + need > foff + fsize:
            return False
        self._take_free(foff, fsize)
        if off > foff:
            self._add_free(foff, off - foff)
        if foff + fsize > off + need:
            self._add_free(off + need, foff + fsize - off - need)
        self._live[off] = need
        self.used += need
        return True


class Placeable(Protocol):
    """What :func:`place` needs to know about a segment."""

    name: str
    client_id: str
    allocator: OffsetAllocator


def place(
    segments: Sequence[Placeable],
    size: int,
    replica_num: int,
    *,
    strategy: str,
    client_id: str = "",
    preferred: str = "",
    rng: random.Random | None = None,
    on_alloc: Callable[[Placeable, int, int], None] | None = None,
) -> list[list[tuple[Placeable, int, int]]]:
    """Allocate up to ``replica_num`` replicas of ``size`` bytes on distinct segments.

    Returns a list of replicas, each a list of ``(segment, offset, length)`` slices
    (one slice unless striped). Best effort: fewer replicas when space is short; an
    empty list when not even one fits. Allocations are already made on return.
    """
    r = rng or random
    segs = list(segments)
    if not segs:
        return []
    if strategy == "free-ratio-first":
        segs.sort(key=lambda s: s.allocator.free / s.allocator.capacity, reverse=True)
    else:
        start = r.randrange(len(segs))
        segs = segs[start:] + segs[:start]
    if strategy == "local-first" and client_id:
        segs.sort(key=lambda s: s.client_id != client_id)  # stable: own segments first
    if preferred:
        segs.sort(key=lambda s: s.name != preferred)
    used: set[str] = set()
    replicas: list[list[tuple[Placeable, int, int]]] = []
    for _ in range(replica_num):
        got: list[tuple[Placeable, int, int]] | None = None
        for s in segs:
            if s.name in used:
                continue
            off = s.allocator.allocate(size)
            if off is not None:
                got = [(s, off, size)]
                break
        if got is None:
            got = _stripe(segs, used, size)
        if got is None:
            break
        for s, _o, _l in got:
            used.add(s.name)
        replicas.append(got)
    return replicas


def _stripe(
    segs: list[Placeable], used: set[str], size: int, max_slices: int = 64
) -> list[tuple[Placeable, int, int]] | None:
    """Spread ``size`` bytes over the largest free extents of unused segments."""
    cands = [s for s in segs if s.name not in used]
    if sum(s.allocator.free for s in cands) < size:
        return None
    out: list[tuple[Placeable, int, int]] = []
    left = size
    while left > 0 and len(out) < max_slices:
        s = max(cands, key=lambda c: c.allocator.largest_free())
        n = min(left, s.allocator.largest_free() & ~(ALIGN - 1))
        if n <= 0:
            break
        off = s.allocator.allocate(n)
        if off is None:  # pragma: no cover - largest_free said it fits
            break
        out.append((s, off, n))
        left -= n
    if left > 0:
        for s, off, _ in out:
            s.allocator.release(off)
        return None
    return out
