"""Hot-key replication: keys read often get extra memory replicas, and lose them when they cool.

Contract (master side, :class:`HotKeys`, a part of ``MasterState``; on when
``store.hot_key_replicas`` > 1):

- Every replica lookup (``get_replica_list``, also inside a batch) counts one read of its key
  in a :class:`WindowCounter`: reads over a sliding window of ``hot_key_window_s``
  (the current window's count plus the previous one's, weighted by how much of it still
  overlaps). Memory is bounded: at most ``max_keys`` keys are counted per window; reads of
  further keys are only counted in ``untracked``.
- A key whose count reaches ``hot_key_reads`` becomes a candidate. Every tick the master
  gives each candidate still that hot, hottest first, one more memory replica on a segment
  that holds none of it, until it has ``hot_key_replicas`` replicas. The extra replicas of all
  keys together stay within ``hot_key_max_bytes``; each hot key reserves the bytes of all the
  copies it still needs before a cooler key gets any.
- The copy is done by a client: the owner of the destination segment gets a ``copy`` task
  (source slices, destination slices; :func:`run_copy_task`), reads the source through the
  transfer engine and writes its own segment, and reports with ``task_done``. Only then is
  the replica listed, under a new version token (a client that remembered a replica reads
  again from the new answer). A copy whose object changed meanwhile (removed, source
  replica gone) is discarded; one not reported within ``put_timeout_s`` is freed.
- A key whose count falls below half the threshold has cooled: once no read lease is left on
  it, its extra replicas are freed (never its last replica).
- HA: which replicas are extra is replicated too. Each change of a key's replicas made here
  is logged as its ``obj`` entry followed by a ``hot`` entry (:data:`HotEntry`: the key and
  its extra replicas now listed, none when they were dropped); snapshots carry one ``hot``
  entry per key that has extras. A new leader therefore cools a key's extras as the old one
  would have: its read counts start at zero, so once the takeover lease and the replicated
  read leases end, a key no longer read loses its extras; one still read stays hot. The
  lease a copy sets on its source is marked for replication like a read lease. Copies in
  flight are not replicated: a new leader gives a key that is still hot a new copy (a copy
  takes milliseconds; a takeover waits out the old leader's etcd lease, seconds).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from mooncake_core.errors import StoreError, TransportError
from mooncake_core.store.buffers import LocalBuffer
from mooncake_core.store.protocol import SliceW
from mooncake_core.store.state_core import Obj, Segment, SliceT, StateCore

if TYPE_CHECKING:
    from mooncake_core.store.client_core import ClientCore

__all__ = ["HotEntry", "HotKeys", "WindowCounter", "run_copy_task"]

logger = logging.getLogger(__name__)


class WindowCounter:
    """Reads per key over a sliding window, in bounded memory (see module doc)."""

    def __init__(self, window_s: float, max_keys: int = 65536) -> None:
        self.window = max(1e-3, float(window_s))
        self.max_keys = max_keys
        self.cur: dict[str, int] = {}
        self.prev: dict[str, int] = {}
        self.start = 0.0
        self.untracked = 0

    def _roll(self, now: float) -> None:
        if now - self.start >= 2 * self.window:
            self.prev, self.cur, self.start = {}, {}, now
        else:
            self.prev, self.cur, self.start = self.cur, {}, self.start + self.window

    def hit(self, key: str, now: float) -> int:
        """Count one read of ``key``; returns its count in the current window."""
        if now - self.start >= self.window:
            self._roll(now)
        c = self.cur
        n = c.get(key)
        if n is None:
            if len(c) >= self.max_keys:
                self.untracked += 1
                return 0
            n = 0
        c[key] = n + 1
        return n + 1 + self.prev.get(key, 0)

    def rate(self, key: str, now: float) -> float:
        """Estimated reads of ``key`` within the last window."""
        while now - self.start >= self.window:
            self._roll(now)
        left = max(0.0, 1.0 - (now - self.start) / self.window)
        return self.cur.get(key, 0) + self.prev.get(key, 0) * left

    def forget(self, key: str) -> None:
        self.cur.pop(key, None)
        self.prev.pop(key, None)


class HotEntry(NamedTuple):
    """(HA) the extra replicas a hot key has now (logged after its ``obj`` entry)."""

    kind: str  # "hot"
    key: str
    extra: list[list[SliceT]]


@dataclass(slots=True)
class _Copy:
    obj: Obj
    obj_token: int
    src: list[SliceT]
    dst: list[SliceT]
    seg: Segment
    deadline: float


class HotKeys(StateCore):
    """Extra memory replicas for keys read often (see module doc)."""

    hot_reads: WindowCounter
    hot_candidates: set[str]
    hot_extra: dict[str, tuple[Obj, list[list[SliceT]]]]  # key -> (object, its extra replicas)
    hot_copies: dict[int, _Copy]  # task token -> copy in flight

    def _hot_init(self) -> None:
        self.hot_on = self.cfg.hot_key_replicas > 1
        self.hot_reads = WindowCounter(self.cfg.hot_key_window_s)
        self.hot_candidates = set()
        self.hot_extra = {}
        self.hot_copies = {}
        for k in ("hot_replicas_added", "hot_replicas_dropped", "hot_copies_failed"):
            self.counters[k] = 0

    def _hot_hit(self, key: str, now: float) -> None:
        """One read of ``key`` (called by ``get_replica_list`` when hot keys are on)."""
        if self.hot_reads.hit(key, now) >= self.cfg.hot_key_reads:
            self.hot_candidates.add(key)

    def hot_bytes(self) -> int:
        """Bytes of the extra replicas now listed, plus copies in flight."""
        n = sum(
            o.size * sum(1 for r in reps if r in o.replicas) for o, reps in self.hot_extra.values()
        )
        return n + sum(c.obj.size for c in self.hot_copies.values())

    def hot_tick(self, now: float) -> None:
        """Grow hot keys' replicas, drop cooled ones' extras, expire lost copies."""
        for tok, cp in list(self.hot_copies.items()):
            if now >= cp.deadline:
                del self.hot_copies[tok]
                self._hot_free(cp)
                self.counters["hot_copies_failed"] += 1
        if not self.hot_candidates:
            return
        busy = {cp.obj.key for cp in self.hot_copies.values()}
        budget = self.cfg.hot_key_max_bytes - self.hot_bytes()
        threshold = self.cfg.hot_key_reads
        ranked = sorted(
            ((self.hot_reads.rate(k, now), k) for k in self.hot_candidates), reverse=True
        )
        for rate, key in ranked:
            o = self.objects.get(key)
            if o is None or not o.complete:
                self._hot_forget(key)
                continue
            if rate >= threshold:
                # hottest first: each hot key reserves the bytes of every copy it still needs,
                # so the hottest reach the cap before cooler ones get any
                inflight = key in busy
                need = self.cfg.hot_key_replicas - len(o.replicas) - inflight
                if need <= 0 or o.size > budget:
                    continue
                if not inflight and not o.busy and o.replicas:
                    self._hot_copy(o, now)
                budget -= o.size * need
            elif rate < threshold / 2 and key not in busy:
                if self._hot_cool(key, o, now):
                    self._hot_forget(key)

    def _hot_forget(self, key: str) -> None:
        self.hot_candidates.discard(key)
        self.hot_extra.pop(key, None)

    def _hot_copy(self, o: Obj, now: float) -> bool:
        held = {x[0] for rep in o.replicas for x in rep}
        segs = sorted(
            (
                s
                for s in self.segments.values()
                if s.name not in held and s.client_id in self.clients
            ),
            key=lambda s: s.allocator.used / s.size,
        )
        for s in segs:
            off = s.allocator.allocate(o.size)
            if off is None:
                continue
            tok = self._next_token()
            src, dst = o.replicas[0], [(s.name, off, o.size)]
            self.hot_copies[tok] = _Copy(o, o.token, src, dst, s, now + self.cfg.put_timeout_s)
            self._hold(o, now + self.cfg.lease_ttl_s)  # the source must stay while it is read
            self._push(
                self.clients[s.client_id],
                {
                    "kind": "copy",
                    "key": o.key,
                    "token": tok,
                    "src": self._slices_out(src),
                    "dst": self._slices_out(dst),
                },
            )
            return True
        return False

    def _hot_free(self, cp: _Copy) -> None:
        if self.segments.get(cp.seg.name) is cp.seg:
            cp.seg.allocator.release(cp.dst[0][1])

    def hot_copy_done(self, token: int, ok: bool, detail: str) -> None:
        """A client finished a ``copy`` task: list the new replica if the object is unchanged."""
        cp = self.hot_copies.pop(token, None)
        if cp is None:
            return
        o = cp.obj
        alive = self.objects.get(o.key) is o and o.token == cp.obj_token and cp.src in o.replicas
        if not ok or not alive or self.segments.get(cp.seg.name) is not cp.seg:
            if not ok:
                logger.warning("hot-key copy of %r failed: %s", o.key, detail)
                self.counters["hot_copies_failed"] += 1
            self._hot_free(cp)
            return
        o.replicas.append(cp.dst)
        self._index_replica(o.key, cp.dst)
        o.token = self._next_token()  # a new memory replica: a new version
        ent = self.hot_extra.get(o.key)
        if ent is None or ent[0] is not o:
            ent = self.hot_extra[o.key] = (o, [])
        ent[1].append(cp.dst)
        self.counters["hot_replicas_added"] += 1
        self._emit(*self._obj_entry(o))
        self._emit(*self._hot_entry(o.key, ent))

    def _hot_cool(self, key: str, o: Obj, now: float) -> bool:
        """Free the extra replicas of a cooled key; True when none is left."""
        ent = self.hot_extra.get(key)
        if ent is None or ent[0] is not o:
            return True
        if o.lease_until > now or o.busy:
            return False
        dropped = 0
        for rep in list(ent[1]):
            if rep in o.replicas and len(o.replicas) > 1:
                o.replicas.remove(rep)
                self._free_replica(key, rep)
                dropped += 1
        self.counters["hot_replicas_dropped"] += dropped
        if dropped:
            self._emit(*self._obj_entry(o))
            self._emit("hot", key, [])
            logger.debug("hot key %r cooled: dropped %d extra replica(s)", key, dropped)
        return True

    @staticmethod
    def _hot_entry(key: str, ent: tuple[Obj, list[list[SliceT]]]) -> HotEntry:
        return HotEntry("hot", key, [r for r in ent[1] if r in ent[0].replicas])

    def hot_apply(self, entry: tuple[Any, ...] | list[Any]) -> None:
        """(Standby) replay a ``hot`` entry: mark the key's extra replicas, or unmark it."""
        he = HotEntry._make(entry)
        o = self.objects.get(he.key)
        extra = [[(str(n), int(off), int(ln)) for n, off, ln in rep] for rep in he.extra]
        keep = [r for r in extra if o is not None and r in o.replicas]
        if o is None or not keep:
            self._hot_forget(he.key)
            return
        self.hot_extra[he.key] = (o, keep)
        self.hot_candidates.add(he.key)  # a new leader's tick cools it unless it is read

    def hot_export(self) -> list[HotEntry]:
        """``hot`` entries for a snapshot (after the ``obj`` entries)."""
        return [
            self._hot_entry(k, ent)
            for k, ent in self.hot_extra.items()
            if self.objects.get(k) is ent[0]
        ]

    def hot_stats(self) -> dict[str, Any]:
        return {
            "hot_keys": len(self.hot_candidates),
            "hot_bytes": self.hot_bytes(),
            "hot_copies_in_flight": len(self.hot_copies),
            "hot_untracked_reads": self.hot_reads.untracked,
        }


def run_copy_task(client: ClientCore, t: dict[str, Any]) -> tuple[bool, str]:
    """Client side of a ``copy`` task: read the source replica, write the destination."""
    src = [SliceW._make(s) for s in t["src"]]
    dst = [SliceW._make(s) for s in t["dst"]]
    staging = bytearray(sum(s.length for s in src))
    try:
        client._move("read", [(LocalBuffer(staging, None, True), src)])
        client._move("write", [(LocalBuffer(staging, None, False), dst)])
    except (TransportError, StoreError, OSError) as exc:
        return False, str(exc)
    return True, ""
