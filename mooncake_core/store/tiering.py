"""The SSD tier, master side: offloading replicas to clients' SSDs and promoting them back.

The client side is :mod:`mooncake_core.store.ssd` (files) and the client's task runner. The
master queues tasks for a client (delivered by its ``poll``): ``offload`` (write this replica
to your SSD), ``promote`` (read your SSD copy into these slices), ``delete_disk``. The client
reports with ``task_done``; only then does the master drop the memory replica (offload) or
list the new one (promotion, under a new version token).

Tier moves (issue 21):

- Offload on eviction is bounded: at most ``store.ssd_offload_queue`` bytes of offloads are in
  flight; beyond that an evicted replica is dropped instead, and counted (``offload_dropped``).
- Promotion on hit is admitted by reads: a read of an SSD-only object always loads it into
  memory (the reader needs the bytes there), but below ``store.ssd_promote_after`` reads within
  ``store.ssd_promote_window_s`` that memory copy is transient: it is freed again once no read
  lease is left on it (``promotions_transient``). The read that reaches the threshold admits it
  (``promotions_admitted``); from then on it is an ordinary memory replica.
- ``tier_tick`` (every master tick) frees transient copies and runs the hot-key part
  (:mod:`~mooncake_core.store.hotkeys`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from mooncake_core.config import format_size
from mooncake_core.errors import NoSpace, ObjectNotFound
from mooncake_core.store.hotkeys import WindowCounter
from mooncake_core.store.protocol import InvalidArgument, ReplicaCfg, RetryLater
from mooncake_core.store.state_core import Obj, SliceT, StateCore

__all__ = ["SsdTiering"]

logger = logging.getLogger(__name__)


class SsdTiering(StateCore):
    """Offloads to and promotions from clients' SSD tiers (see module doc)."""

    promo_reads: WindowCounter
    promo_transient: dict[str, list[Any]]  # key -> [object, skip the next read]
    hot_on: bool
    hot_copies: dict[int, Any]
    hot_extra: dict[str, Any]

    if TYPE_CHECKING:  # provided by HotKeys and ReplicaTasks

        def hot_tick(self, now: float) -> None: ...
        def hot_copy_done(self, token: int, ok: bool, detail: str) -> None: ...
        def replica_task_done(self, token: int, ok: bool, detail: str, now: float) -> bool: ...

    def _tier_init(self) -> None:
        self.promo_reads = WindowCounter(self.cfg.ssd_promote_window_s)
        self.promo_transient = {}
        for k in ("offload_dropped", "promotions_admitted", "promotions_transient"):
            self.counters[k] = 0

    def _admit_read(self, key: str, now: float) -> None:
        """A read of a transient promoted copy: admit it at the threshold."""
        ent = self.promo_transient[key]
        if ent[1]:  # the read that started the promotion, retried
            ent[1] = False
            return
        if self.promo_reads.hit(key, now) >= self.cfg.ssd_promote_after:
            del self.promo_transient[key]
            self.counters["promotions_admitted"] += 1

    def tier_tick(self, now: float) -> None:
        """Free transient promoted copies nobody reads any more; hot-key replication."""
        for key, ent in list(self.promo_transient.items()):
            o: Obj = ent[0]
            if self.objects.get(key) is not o or not o.disk:
                del self.promo_transient[key]
            elif not o.busy and o.lease_until <= now:
                del self.promo_transient[key]
                if o.replicas and o.disk in self.clients:
                    for rep in o.replicas:
                        self._free_replica(key, rep)
                    o.replicas = []
                    self.counters["promotions_transient"] += 1
                    self._emit(*self._obj_entry(o))
        # extras marked by a replicated log cool even on a leader with hot keys off
        if self.hot_on or self.hot_copies or self.hot_extra:
            self.hot_tick(now)

    def _offload(self, o: Obj, rep: list[SliceT]) -> bool:
        """Queue an SSD offload of ``rep`` (single-slice, holder with SSD, no copy yet)."""
        if o.disk or len(o.replicas) > 1 or len(rep) != 1:
            return False
        s = self.segments.get(rep[0][0])
        c = self.clients.get(s.client_id) if s is not None else None
        if c is None or not c.ssd or s is None:
            return False
        pending = sum(self.offload_pending.values())
        if pending and pending + rep[0][2] > self.cfg.ssd_offload_queue:
            self.counters["offload_dropped"] += 1  # the queue is full: the caller drops it
            return False
        o.offloading = self._next_token()
        o.offload_seg = s.name
        self.offload_pending[s.name] = self.offload_pending.get(s.name, 0) + rep[0][2]
        self._push(
            c,
            {
                "kind": "offload",
                "key": o.key,
                "token": o.offloading,
                "offset": rep[0][1],
                "length": rep[0][2],
                "segment": s.name,
            },
        )
        return True

    def _promote(self, o: Obj, now: float) -> None:
        """Start loading a disk-only object back into memory; raises RetryLater."""
        if not o.disk or o.disk not in self.clients:
            self._drop_object(o)
            raise ObjectNotFound(
                f"no object {o.key!r} (its only copy was on a node that went away)"
            )
        if not o.promoting:
            c = self.clients[o.disk]
            cfg = ReplicaCfg(replica_num=1, strategy="local-first")
            reps = self._place(o.key, o.size, cfg, "local-first", c.client_id)
            if not reps:
                self.evict_for(o.size, now)
                reps = self._place(o.key, o.size, cfg, "local-first", c.client_id)
            if not reps:
                if any(
                    x.offloading or (x.replicas and not x.hard_pin and x.lease_until > now)
                    for x in self.objects.values()
                ):
                    raise RetryLater(
                        f"get {o.key!r}: waiting for leases to expire or offloads to finish "
                        f"to free memory for its promotion"
                    )
                raise NoSpace(
                    f"get {o.key!r}: no memory to promote it from SSD ({format_size(o.size)})"
                )
            if self.promo_reads.hit(o.key, now) < self.cfg.ssd_promote_after:
                self.promo_transient[o.key] = [o, True]
            else:
                self.promo_transient.pop(o.key, None)
                self.counters["promotions_admitted"] += 1
            o.promoting = self._next_token()
            o.promo_replica = reps[0]
            self._index_replica(o.key, reps[0])
            self._push(
                c,
                {
                    "kind": "promote",
                    "key": o.key,
                    "token": o.promoting,
                    "slices": self._slices_out(reps[0]),
                },
            )
            self.counters["promotions"] += 1
        raise RetryLater(f"get {o.key!r}: promoting from SSD, retry shortly")

    def task_done(
        self, client_id: str, kind: str, key: str, token: int, ok: bool, detail: str, now: float
    ) -> None:
        c = self._client(client_id, now)
        o = self.objects.get(key)
        if kind == "offload":
            if o is not None and o.offloading == token:
                self._settle_offload(o)
            if o is None or o.offloading != token:
                if ok:
                    self._push(c, {"kind": "delete_disk", "key": key, "token": 0})
                return
            o.offloading = 0
            if not ok:
                logger.warning("SSD offload of %r on %s failed: %s", key, client_id, detail)
                return
            o.disk = client_id
            c.disk_keys.add(key)
            for rep in list(o.replicas):
                if all(
                    self.segments.get(x[0]) is not None
                    and self.segments[x[0]].client_id == client_id
                    for x in rep
                ):
                    o.replicas.remove(rep)
                    self._free_replica(key, rep)
                    self.counters["evicted_bytes"] += sum(x[2] for x in rep)
                    break
            self.counters["evictions"] += 1
            self.counters["offloads"] += 1
            self._emit(*self._obj_entry(o))
        elif kind == "promote":
            if o is None or o.promoting != token or o.promo_replica is None:
                return
            rep, o.promo_replica, o.promoting = o.promo_replica, None, 0
            if not ok:
                self._free_replica(key, rep)
                logger.warning("promotion of %r from SSD on %s failed: %s", key, client_id, detail)
                if "missing" in detail:
                    o.disk = ""
                    c.disk_keys.discard(key)
                    if not o.replicas:
                        self._drop_object(o)
                return
            o.replicas.append(rep)
            o.token = token  # a new memory replica: a new version (never seen by any client)
            self._emit(*self._obj_entry(o))
        elif kind == "copy":  # a replica task's (replica_tasks.py), else a hot key's
            if not self.replica_task_done(token, ok, detail, now):
                self.hot_copy_done(token, ok, detail)
        else:
            raise InvalidArgument(f"task_done: unknown task kind {kind!r}")

    def drop_disk(self, client_id: str, now: float) -> int:
        """Withdraw ``client_id``'s SSD tier: no more offloads to it (queued ones are called
        off, the memory replica stays), and its disk copies leave the metadata; an object
        left with no replica at all is removed. Returns how many disk copies were dropped."""
        c = self._client(client_id, now)
        if c.ssd:
            c.ssd = False
            self._emit("client", client_id, c.host, c.peer, False)
        for o in self.objects.values():
            if o.offloading and o.offload_seg in c.segments:
                self._settle_offload(o)
                o.offloading = 0
        dropped = 0
        for key in sorted(c.disk_keys):
            d = self.objects.get(key)
            if d is None or d.disk != client_id:
                continue
            dropped += 1
            d.disk = ""
            self.promo_transient.pop(key, None)
            if d.promo_replica is not None:  # a promotion in flight reads the copy we drop
                self._free_replica(key, d.promo_replica)
                d.promo_replica, d.promoting = None, 0
            if d.replicas:
                self._emit(*self._obj_entry(d))
            else:
                self._drop_object(d)
        c.disk_keys.clear()
        if dropped:
            logger.info(
                "client %s withdrew its SSD tier: %d disk copies dropped", client_id, dropped
            )
        return dropped

    def take_tasks(self, client_id: str, now: float) -> list[dict[str, Any]]:
        c = self._client(client_id, now)
        out = list(c.tasks)
        c.tasks.clear()
        return out
