"""OffsetAllocator and placement: best fit, coalescing, distinct segments, striping."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake_core.store.allocator import ALIGN, OffsetAllocator, place


def test_allocate_release_coalesces_back_to_one_extent() -> None:
    a = OffsetAllocator(1 << 20)
    offs = [a.allocate(1000) for _ in range(100)]
    assert all(o is not None for o in offs)
    assert len({o for o in offs}) == 100
    assert a.used == 100 * 1024  # 1000 rounded up to the 64-byte alignment
    for o in offs[::2] + offs[1::2]:
        assert o is not None
        a.release(o)
    assert a.used == 0 and a.largest_free() == 1 << 20


def test_best_fit_and_exhaustion() -> None:
    a = OffsetAllocator(10 * ALIGN)
    x = a.allocate(3 * ALIGN)
    y = a.allocate(ALIGN)
    z = a.allocate(6 * ALIGN)
    assert None not in (x, y, z) and a.allocate(1) is None
    assert x is not None and z is not None
    a.release(x)
    a.release(z)
    assert a.allocate(2 * ALIGN) == x  # the 3-slot hole is the best fit
    with pytest.raises(ValueError, match="not an allocated range"):
        a.release(12345)
    with pytest.raises(ValueError, match="must be positive"):
        a.allocate(0)


def test_reserve_rebuilds_layout() -> None:
    a = OffsetAllocator(1 << 16)
    assert a.reserve(4096, 100)
    assert not a.reserve(4096 + 64, 10)  # overlaps
    assert a.allocate(4096) == 0
    a.release(4096)
    assert a.used == 4096


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), max_size=80))
def test_random_alloc_free_never_overlaps(ops: list[tuple[bool, int]]) -> None:
    a = OffsetAllocator(64 << 10)
    live: dict[int, int] = {}
    rng = random.Random(0)
    for alloc, size in ops:
        if alloc or not live:
            off = a.allocate(size)
            if off is not None:
                for o, n in live.items():
                    assert off + size <= o or o + n <= off
                live[off] = size
        else:
            off = rng.choice(sorted(live))
            a.release(off)
            del live[off]
    assert a.used == sum((n + ALIGN - 1) // ALIGN * ALIGN for n in live.values())


@dataclass
class Seg:
    name: str
    client_id: str
    allocator: OffsetAllocator


def _segs(n: int, size: int = 1 << 20) -> list[Seg]:
    return [Seg(f"s{i}", f"c{i}", OffsetAllocator(size)) for i in range(n)]


@pytest.mark.parametrize("strategy", ["random", "free-ratio-first", "local-first"])
def test_replicas_on_distinct_segments(strategy: str) -> None:
    segs = _segs(4)
    for _ in range(20):
        reps = place(segs, 10_000, 3, strategy=strategy, client_id="c2", rng=random.Random(1))
        names = [s.name for rep in reps for s, _o, _n in rep]
        assert len(reps) == 3 and len(set(names)) == 3


def test_local_first_and_preferred() -> None:
    segs = _segs(3)
    reps = place(segs, 1000, 1, strategy="local-first", client_id="c1", rng=random.Random(3))
    assert reps[0][0][0].name == "s1"
    reps = place(segs, 1000, 1, strategy="random", preferred="s2", rng=random.Random(3))
    assert reps[0][0][0].name == "s2"


def test_free_ratio_first_picks_the_emptiest() -> None:
    segs = _segs(3)
    segs[0].allocator.allocate(900_000)
    segs[1].allocator.allocate(100_000)
    reps = place(segs, 1000, 1, strategy="free-ratio-first")
    assert reps[0][0][0].name == "s2"


def test_striping_when_no_segment_fits_and_best_effort_replicas() -> None:
    segs = _segs(3, 1 << 20)
    reps = place(segs, (2 << 20) + 5, 1, strategy="random", rng=random.Random(0))
    assert len(reps) == 1 and len(reps[0]) == 3 and sum(n for _s, _o, n in reps[0]) == (2 << 20) + 5
    # two replicas of 600 KiB on 3 x 1 MiB: both fit; a third would need a used segment
    segs = _segs(2, 1 << 20)
    reps = place(segs, 600 << 10, 3, strategy="random", rng=random.Random(0))
    assert len(reps) == 2
    assert place(_segs(1, 4096), 8192 + 1, 1, strategy="random") == []
