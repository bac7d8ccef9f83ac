"""Choosing what to evict: approximate LRU that respects leases and pins.

Contract: :func:`candidates` walks objects from least to most recently used and yields
those that may lose a memory replica now: complete, not hard-pinned, lease expired, no
offload or promotion in flight. Soft-pinned objects come only in a second pass, after
every unpinned candidate, and only when ``allow_soft`` is set. The caller decides what
eviction means (drop a replica, or offload it to SSD first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

__all__ = ["Evictable", "candidates"]


class Evictable(Protocol):
    @property
    def complete(self) -> bool: ...
    @property
    def hard_pin(self) -> bool: ...
    @property
    def lease_until(self) -> float: ...
    @property
    def soft_pin_until(self) -> float: ...
    @property
    def busy(self) -> bool: ...


def candidates(
    lru: OrderedDict[str, None],
    get: Callable[[str], Evictable | None],
    now: float,
    *,
    allow_soft: bool = True,
    accept: Callable[[str, Evictable], bool] | None = None,
) -> Iterator[str]:
    """Keys that may be evicted now, least recently used first (see module doc)."""
    soft: list[str] = []
    for key in list(lru):
        o = get(key)
        if o is None or not o.complete or o.hard_pin or o.busy or o.lease_until > now:
            continue
        if accept is not None and not accept(key, o):
            continue
        if o.soft_pin_until > now:
            soft.append(key)
            continue
        yield key
    if allow_soft:
        for key in soft:
            o = get(key)
            if o is not None and o.complete and not o.busy and o.lease_until <= now:
                yield key
