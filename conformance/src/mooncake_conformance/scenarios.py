"""Scenario builders shared by the checks and the worker processes (nobody overrides these).

Page content is a pure function of the model and the token prefix up to that page
(:func:`page_seed`), as real KV is: two processes saving the same prefix save the same
bytes, so any byte difference after a load is wrong data, not a race between writers.
"""

from __future__ import annotations

import hashlib
import random
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from mooncake_conformance.harness import EngineHarness

__all__ = [
    "page_seed",
    "make_tokens",
    "ChurnStats",
    "fill_pages",
    "expected_pages",
    "verify_loaded",
    "churn",
]


def page_seed(model: str, tokens: Sequence[int], page: int, page_size: int) -> int:
    """Content seed of page ``page``: a digest of the model and
    ``tokens[: (page + 1) * page_size]``."""
    h = hashlib.sha256(model.encode())
    end = (page + 1) * page_size
    h.update(struct.pack(f"<{end}I", *(t & 0xFFFFFFFF for t in tokens[:end])))
    return int.from_bytes(h.digest()[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def make_tokens(rng: random.Random, n: int, vocab: int = 32000) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def fill_pages(h: EngineHarness, tokens: Sequence[int], slots: Sequence[int]) -> None:
    """Fill ``slots`` with the content the engine would compute for these pages."""
    for i, slot in enumerate(slots):
        h.fill(slot, page_seed(h.spec.model, tokens, i, h.page_size))


def expected_pages(h: EngineHarness, tokens: Sequence[int], n: int, scratch: int) -> list[bytes]:
    """The bytes pages ``0..n-1`` must read back as (computed in slot ``scratch``)."""
    out = []
    for i in range(n):
        h.fill(scratch, page_seed(h.spec.model, tokens, i, h.page_size))
        out.append(h.read(scratch))
    return out


def verify_loaded(
    h: EngineHarness, slots: Sequence[int], expected: Sequence[bytes], n: int
) -> list[int]:
    """Indices ``< n`` whose slot does not hold the expected bytes."""
    return [i for i in range(min(n, len(slots))) if h.read(slots[i]) != expected[i]]


@dataclass
class ChurnStats:
    """What one churn loop did; ``wrong`` must stay 0 whatever happens to the store."""

    rounds: int = 0
    saved_pages: int = 0
    loaded_pages: int = 0
    hit_pages: int = 0
    wrong: int = 0
    exceptions: int = 0
    errors: list[str] = field(default_factory=list)
    last_ok: float = (
        0.0  # monotonic time of the last round whose save and load both fully succeeded
    )

    def as_dict(self) -> dict[str, object]:
        return {
            "rounds": self.rounds,
            "saved_pages": self.saved_pages,
            "loaded_pages": self.loaded_pages,
            "hit_pages": self.hit_pages,
            "wrong": self.wrong,
            "exceptions": self.exceptions,
            "errors": self.errors[:5],
        }


def churn(
    h: EngineHarness,
    shared: Sequence[int],
    seed: int,
    pages: int,
    rounds: int = 0,
    duration_s: float = 0.0,
    stop: threading.Event | None = None,
    stats: ChurnStats | None = None,
) -> ChurnStats:
    """Save and load prefixes that overlap other workers' (``shared`` tokens) and its own.

    Each round: fresh suffix tokens after ``shared``; fill, save, look up, load into the
    other half of the slots, compare. Runs ``rounds`` rounds, or until ``duration_s``
    elapsed, or until ``stop`` is set. Exceptions from the adapter are recorded as errors
    (``exceptions`` counts them). Pass ``stats`` to watch progress from another thread.
    """
    rng = random.Random(seed)
    stats = stats if stats is not None else ChurnStats()
    half = h.num_slots // 2
    pages = min(pages, half - 1)
    src = list(range(pages))
    dst = list(range(half, half + pages))
    scratch = h.num_slots - 1
    end = time.monotonic() + duration_s if duration_s else None
    while True:
        if stop is not None and stop.is_set():
            break
        if rounds and stats.rounds >= rounds:
            break
        if end is not None and time.monotonic() >= end:
            break
        if not rounds and end is None and stop is None:
            break
        shared_pages = len(shared) // h.page_size
        own = max(1, pages - shared_pages)
        tokens = list(shared[: shared_pages * h.page_size]) + make_tokens(rng, own * h.page_size)
        tokens = tokens[: pages * h.page_size]
        try:
            fill_pages(h, tokens, src)
            want = expected_pages(h, tokens, pages, scratch)
            saved = h.save(tokens, src)
            stats.saved_pages += saved
            stats.hit_pages += h.lookup(tokens)
            for s in dst:  # poison the destination so a silent no-op load is caught
                h.fill(s, 0x5EED)
            got = h.load(tokens, dst)
            stats.loaded_pages += got
            bad = verify_loaded(h, dst, want, got)
            stats.wrong += len(bad)
            if bad:
                stats.errors.append(
                    f"round {stats.rounds}: pages {bad} of {got} loaded held wrong bytes"
                )
            if saved == pages and got == pages and not bad:
                stats.last_ok = time.monotonic()
        except Exception as exc:  # an adapter must not raise on store trouble; record it
            stats.exceptions += 1
            stats.errors.append(f"round {stats.rounds}: {type(exc).__name__}: {exc}")
        stats.rounds += 1
    return stats
