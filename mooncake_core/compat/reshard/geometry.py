"""N-dimensional logical boxes (offset + shape): containment, overlap, exact cover.

Overlap is decided by a sweep: 1-D intervals sorted by start, 2-D rectangles with a
sweep over x and a range-add / range-max tree over compressed y coordinates, higher
ranks by a sweep over the dimension with the most distinct extents and pairwise tests
among the boxes active there, refused (``ValueError``) past a million comparisons, as
the published module does.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from math import prod
from typing import Protocol

__all__ = [
    "LogicalBox",
    "OverlapRegion",
    "box_contains",
    "boxes_exactly_cover",
    "boxes_overlap",
    "regions_exactly_cover",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]

_PAIR_BUDGET = 1_000_000


class LogicalBox(Protocol):
    """A box in a tensor's logical index space."""

    @property
    def global_offset(self) -> tuple[int, ...]: ...

    @property
    def local_shape(self) -> tuple[int, ...]: ...


class OverlapRegion(Protocol):
    """The part of a transfer region that overlaps its target."""

    @property
    def overlap_offset(self) -> tuple[int, ...]: ...

    @property
    def overlap_shape(self) -> tuple[int, ...]: ...


def _same_rank(*seqs: Sequence[int]) -> None:
    if len({len(s) for s in seqs}) > 1:
        raise ValueError("zip() arguments have different lengths")


def box_contains(
    outer_offset: tuple[int, ...],
    outer_shape: tuple[int, ...],
    inner_offset: tuple[int, ...],
    inner_shape: tuple[int, ...],
) -> bool:
    """True if the inner box lies wholly inside the outer one."""
    for a, n, b, m in zip(outer_offset, outer_shape, inner_offset, inner_shape, strict=False):
        if not (a <= b and b + m <= a + n):
            return False
    _same_rank(outer_offset, outer_shape, inner_offset, inner_shape)
    return True


def _intersect(a: Box, b: Box) -> bool:
    for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=False):
        if not (x < y + m and y < x + n):
            return False
    _same_rank(a[0], a[1], b[0], b[1])
    return True


def _overlap_1d(boxes: Sequence[Box]) -> bool:
    spans = sorted((off[0], off[0] + shape[0]) for off, shape in boxes)
    reach = spans[0][1]
    for start, end in spans[1:]:
        if start < reach:
            return True
        reach = max(reach, end)
    return False


class _MaxTree:
    """Range add, range maximum over ``size`` slots (lazy segment tree)."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError("range tree size must be positive")
        self.size = size
        self.top = [0] * (4 * size)
        self.pending = [0] * (4 * size)

    def add(self, lo: int, hi: int, delta: int, node: int = 1, a: int = 0, b: int = -1) -> None:
        b = self.size - 1 if b < 0 else b
        if lo <= a and b <= hi:
            self.top[node] += delta
            self.pending[node] += delta
            return
        mid = (a + b) // 2
        if lo <= mid:
            self.add(lo, hi, delta, 2 * node, a, mid)
        if hi > mid:
            self.add(lo, hi, delta, 2 * node + 1, mid + 1, b)
        self.top[node] = self.pending[node] + max(self.top[2 * node], self.top[2 * node + 1])

    def max(self, lo: int, hi: int, node: int = 1, a: int = 0, b: int = -1) -> int:
        b = self.size - 1 if b < 0 else b
        if lo <= a and b <= hi:
            return self.top[node]
        mid = (a + b) // 2
        best = 0
        if lo <= mid:
            best = self.max(lo, hi, 2 * node, a, mid)
        if hi > mid:
            best = max(best, self.max(lo, hi, 2 * node + 1, mid + 1, b))
        return self.pending[node] + best


def _overlap_2d(boxes: Sequence[Box]) -> bool:
    ys = sorted({y for off, shape in boxes for y in (off[1], off[1] + shape[1])})
    slot = {y: i for i, y in enumerate(ys)}
    tree = _MaxTree(len(ys) - 1)
    events = []
    for off, shape in boxes:
        lo, hi = slot[off[1]], slot[off[1] + shape[1]] - 1
        events.append((off[0] + shape[0], 0, lo, hi))  # ends sort before starts
        events.append((off[0], 1, lo, hi))
    for _, starts, lo, hi in sorted(events):
        if not starts:
            tree.add(lo, hi, -1)
        elif tree.max(lo, hi) > 0:
            return True
        else:
            tree.add(lo, hi, 1)
    return False


def _overlap_nd(boxes: Sequence[Box]) -> bool:
    rank = len(boxes[0][0])
    axis = max(
        range(rank), key=lambda d: len({(off[d], off[d] + shape[d]) for off, shape in boxes})
    )
    live: dict[int, Box] = {}
    ends: list[tuple[int, int]] = []
    compared = 0
    for index, box in sorted(enumerate(boxes), key=lambda item: item[1][0][axis]):
        start = box[0][axis]
        while ends and ends[0][0] <= start:
            live.pop(heapq.heappop(ends)[1], None)
        for other in live.values():
            if compared >= _PAIR_BUDGET:
                raise ValueError("high-dimensional overlap budget exceeded before validation")
            compared += 1
            if _intersect(other, box):
                return True
        live[index] = box
        heapq.heappush(ends, (start + box[1][axis], index))
    return False


def boxes_overlap(boxes: Sequence[Box]) -> bool:
    """True if any two of the ``(offset, shape)`` boxes share a cell."""
    if len(boxes) < 2:
        return False
    rank = len(boxes[0][0])
    if rank == 1:
        return _overlap_1d(boxes)
    if rank == 2:
        return _overlap_2d(boxes)
    return _overlap_nd(boxes)


def boxes_exactly_cover(
    container_offset: tuple[int, ...],
    container_shape: tuple[int, ...],
    boxes: Sequence[Box],
) -> bool:
    """True if ``boxes`` lie inside the container, do not overlap, and fill it."""
    if not boxes:
        return False
    for off, shape in boxes:
        if not box_contains(container_offset, container_shape, off, shape):
            return False
    if sum(prod(shape) for _, shape in boxes) != prod(container_shape):
        return False
    return not boxes_overlap(boxes)


def regions_exactly_cover(target: LogicalBox, regions: Iterable[OverlapRegion]) -> bool:
    """True if the regions' overlaps exactly fill ``target``."""
    return boxes_exactly_cover(
        target.global_offset,
        target.local_shape,
        tuple((r.overlap_offset, r.overlap_shape) for r in regions),
    )
