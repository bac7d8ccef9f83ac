"""Choosing what to evict: approximate LRU that respects leases and pins.

Contract: :func:`candidates` walks objects from least to most recently used and yields
those that may lose a memory replica now: complete, not hard-pinned, lease expired, no
offload or promotion in flight. Soft-pinned objects come only in a second pass, after
every unpinned candidate, and only when ``allow_soft`` is set. The caller decides what
eviction means (drop a replica, or offload it to SSD first).

:class:`EvictionDriver` is that caller: the part of ``MasterState`` that frees memory (for a
put, above the high watermark, at the object cap), dropping replicas or queueing SSD offloads.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from mooncake_core.errors import NoSpace
from mooncake_core.store.state_core import StateCore

__all__ = ["Evictable", "EvictionDriver", "candidates"]

logger = logging.getLogger(__name__)


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


class EvictionDriver(StateCore):
    """Freeing master-tracked memory by evicting least recently used replicas (see module doc)."""

    def usage(self) -> tuple[int, int]:
        used = sum(s.allocator.used for s in self.segments.values())
        return used, sum(s.size for s in self.segments.values())

    def evict_for(self, nbytes: int, now: float) -> int:
        """Free about ``max(nbytes, eviction_ratio * total)`` bytes anywhere; returns bytes
        freed."""
        _used, total = self.usage()
        goal = max(nbytes, int(self.cfg.eviction_ratio * total))
        return self._evict(goal, now, None)

    def check_watermarks(self, now: float) -> int:
        """Evict on each segment above the high watermark down to watermark - ratio."""
        freed = 0
        hw, ratio = self.cfg.eviction_high_watermark, self.cfg.eviction_ratio
        for s in list(self.segments.values()):
            used = s.allocator.used - self.offload_pending.get(s.name, 0)
            if used >= hw * s.size:
                target = int(max(0.0, hw - ratio) * s.size)
                freed += self._evict(used - target, now, s.name)
        return freed

    def _make_room_for_object(self, key: str, now: float) -> None:
        """At ``max_objects``: drop LRU objects (``eviction_ratio`` of the cap) or raise NoSpace."""
        cap = self.cfg.max_objects
        self._reclaim_zombies(now)
        if len(self.objects) < cap:
            return
        goal = len(self.objects) - cap + max(1, int(self.cfg.eviction_ratio * cap))
        dropped = 0
        for k in candidates(self.lru, self._get_obj, now, allow_soft=True):
            if dropped >= goal:
                break
            o = self.objects.get(k)
            if o is None:
                continue
            nbytes = sum(x[2] for rep in o.replicas for x in rep)
            self._drop_object(o)
            dropped += 1
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += nbytes
        if dropped:
            logger.info(
                "object cap %d reached: evicted %d least recently used objects", cap, dropped
            )
        if len(self.objects) >= cap:
            raise NoSpace(
                f"put {key!r}: the master already tracks {len(self.objects)} objects "
                f"(store.max_objects = {cap}) and none can be evicted "
                f"(leased, pinned or in flight); raise max_objects"
            )

    def _evict(self, goal: int, now: float, segment: str | None) -> int:
        """Drop (or queue for SSD offload) LRU replicas worth ``goal`` bytes; returns bytes freed
        now."""
        freed = 0

        def on_seg(key: str, o: Any) -> bool:
            return segment is None or any(x[0] == segment for rep in o.replicas for x in rep)

        queued = 0
        for key in candidates(self.lru, self._get_obj, now, allow_soft=True, accept=on_seg):
            if freed + queued >= goal:
                break
            o = self.objects.get(key)
            if o is None or not o.replicas:
                continue
            rep = next(
                (r for r in o.replicas if segment is None or any(x[0] == segment for x in r)),
                o.replicas[0],
            )
            nbytes = sum(x[2] for x in rep)
            if self._offload(o, rep):  # counts toward the goal; memory is freed when it lands
                queued += nbytes
                continue
            o.replicas.remove(rep)
            self._free_replica(key, rep)
            freed += nbytes
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += nbytes
            if not o.replicas and not o.disk:
                self._drop_object(o)
            else:
                self._emit(*self._obj_entry(o))
        if freed:
            logger.debug("evicted %d bytes (goal %d) on %s", freed, goal, segment or "all segments")
        return freed
