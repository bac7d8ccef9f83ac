"""The master's metadata: clients, segments, objects, leases, pins, eviction, SSD tier.

``MasterState`` is the front; its parts live next to what they extend:
:mod:`~mooncake_core.store.state_core` (records and shared helpers),
:mod:`~mooncake_core.store.reservations` (one-RPC puts), :mod:`~mooncake_core.store.eviction`
(the eviction driver), :mod:`~mooncake_core.store.tiering` (the SSD tier, master side) and
:mod:`~mooncake_core.store.replication` (the change log, next to :mod:`~mooncake_core.store.ha`).

Contract:

- :class:`MasterState` is synchronous and single-threaded (the master's event loop owns
  it); every public method validates its arguments and raises the errors of
  :mod:`mooncake_core.store.protocol` (``InvalidArgument``, ``ObjectBusy``, ...) or of
  :mod:`mooncake_core.errors` (``ObjectNotFound``, ``ObjectExists``, ``NoSpace``).
- Results are plain lists/dicts/tuples ready for msgpack.
- Every change other masters must know (client and segment registry, committed
  objects, removals, replica changes) is emitted through ``on_change(entry)``; a
  standby replays entries with :meth:`apply`. Pending puts are not replicated: a new
  leader treats unfinished puts as revoked. Leases are, coarsely and off the read path
  (:mod:`~mooncake_core.store.replication`).
- Tasks for clients (SSD offload, promotion, deleting an SSD copy) are queued per
  client and delivered by the ``poll`` RPC.
- Reservations (one-RPC puts): a client may hold a few extents of a segment
  (:meth:`reserve`), allocate objects inside them itself, write the bytes, and commit each
  object with one call (:meth:`put_commit`), which carves the object's range out of the
  extent. Grants, carves and releases are replicated, so a new leader knows which ranges a
  client may still be writing; an extent unused for ``put_timeout_s`` is reclaimed.
- Object versions: every object (and every new memory replica of it) gets a token that
  this master never gave before (a random base per master, then counting), and
  :meth:`get_replica_list` returns it. A client that remembers (token, replica) from an
  earlier answer may read that replica while asking again: if the answer still lists the
  replica under the same token, the object lived there, unchanged, since it was
  remembered, so the bytes read are the object's.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_core.config import StoreConfig, format_size
from mooncake_core.errors import NoSpace, ObjectNotFound
from mooncake_core.store.allocator import OffsetAllocator
from mooncake_core.store.eviction import EvictionDriver
from mooncake_core.store.hotkeys import HotKeys
from mooncake_core.store.protocol import (
    MAX_KEY,
    InvalidArgument,
    ObjectBusy,
    ReplicaCfg,
    RetryLater,
    code_of,
)
from mooncake_core.store.replica_tasks import ReplicaTasks
from mooncake_core.store.replication import Replication
from mooncake_core.store.reservations import RESERVE_MAX_OBJECT, Reservations
from mooncake_core.store.state_core import (
    ClientInfo,
    Obj,
    Reservation,
    Segment,
    SliceT,
    check_batch,
    check_key,
)
from mooncake_core.store.tenants import SEP, Quota, TenantQuotas
from mooncake_core.store.tiering import SsdTiering

__all__ = [
    "MasterState",
    "Segment",
    "ClientInfo",
    "Obj",
    "Reservation",
    "check_key",
    "RESERVE_MAX_OBJECT",
    "SliceT",
    "error_tuple",
]

logger = logging.getLogger(__name__)


class MasterState(
    Reservations, EvictionDriver, SsdTiering, HotKeys, ReplicaTasks, Replication, TenantQuotas
):
    """All master metadata (see module doc)."""

    def __init__(self, cfg: StoreConfig, *, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.rng = rng or random.Random()
        self.clients: dict[str, ClientInfo] = {}
        self.segments: dict[str, Segment] = {}
        # a plain dict; a TenantObjects (bytes per tenant) while quotas are set (tenants.py)
        self.objects: dict[str, Obj] = {}
        self.tenant_quotas: dict[str, Quota] = {}
        self.tenant_counters: dict[str, dict[str, int]] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()
        self.early: dict[
            str, int
        ] = {}  # key -> token of objects committed early, awaiting put_confirm
        # tokens double as object versions (see module doc): never reused, even by a restarted
        # master
        self._token = int.from_bytes(os.urandom(5), "big") << 20
        self.offload_pending: dict[str, int] = {}  # segment -> bytes queued for SSD offload
        self.reservations: dict[int, Reservation] = {}
        self._rid = 0
        self.suspects: dict[str, float] = {}
        self.on_change: Callable[[tuple[Any, ...]], None] | None = None
        self.on_task: Callable[[str], None] | None = None
        self.counters: dict[str, int] = {
            "evictions": 0,
            "evicted_bytes": 0,
            "offloads": 0,
            "promotions": 0,
            "expired_clients": 0,
            "reclaimed_puts": 0,
            "reservations_granted": 0,
            "reserved_puts": 0,
            "reservations_reclaimed": 0,
            "suspect_marks": 0,  # holders marked suspect: a writer could not reach them
        }
        self._tier_init()  # SSD tier moves and hot keys (tiering.py, hotkeys.py)
        self._hot_init()
        self._rtask_init()  # replica copy/move tasks (replica_tasks.py)

    def register_client(
        self, client_id: str, host: str, peer: str, ssd: bool, now: float
    ) -> dict[str, Any]:
        if not client_id:
            raise InvalidArgument("client_id must be a non-empty string")
        c = self.clients.get(client_id)
        if c is None:
            c = self.clients[client_id] = ClientInfo(client_id, host, peer, ssd, now)
        else:
            c.host, c.peer, c.ssd, c.last_seen = host, peer, ssd, now
        self._emit("client", client_id, host, peer, ssd)
        return {
            "segments": sorted(c.segments),
            "ttl_s": self.cfg.client_ttl_s,
            "heartbeat_s": self.cfg.heartbeat_interval_s,
            "lease_ttl_s": self.cfg.lease_ttl_s,
        }

    def mount(
        self, client_id: str, name: str, peer: str, base: int, size: int, host: str, now: float
    ) -> None:
        c = self._client(client_id, now)
        if not name:
            raise InvalidArgument("segment name must not be empty")
        if size <= 0:
            raise InvalidArgument(f"segment {name!r}: size must be positive, got {size}")
        if base <= 0:
            raise InvalidArgument(f"segment {name!r}: base address must be positive, got {base}")
        old = self.segments.get(name)
        if old is not None:
            if old.client_id == client_id and old.base == base and old.size == size:
                old.peer, old.host = peer, host  # re-mount after a leader change: keep contents
                return
            raise InvalidArgument(
                f"segment {name!r} is already mounted by client {old.client_id!r}"
            )
        self.segments[name] = Segment(
            name, client_id, peer, host, base, size, OffsetAllocator(size)
        )
        c.segments.add(name)
        self._emit("seg", client_id, name, peer, base, size, host)
        logger.info("mounted segment %s (%s) of client %s", name, format_size(size), client_id)

    def unmount(self, client_id: str, name: str, now: float) -> None:
        c = self._client(client_id, now)
        s = self.segments.get(name)
        if s is None or s.client_id != client_id:
            raise InvalidArgument(f"client {client_id!r} has no mounted segment {name!r}")
        self._unmount(s)
        c.segments.discard(name)

    def _unmount(self, s: Segment) -> None:
        for key in list(s.keys):
            o = self.objects.get(key)
            if o is None:
                continue
            hit = [rep for rep in o.replicas if any(x[0] == s.name for x in rep)]
            if not o.complete:
                self._drop_object(o, emit=False)
                continue
            if o.promo_replica and any(x[0] == s.name for x in o.promo_replica):
                self._free_replica(key, o.promo_replica)
                o.promo_replica, o.promoting = None, 0
            for rep in hit:
                o.replicas.remove(rep)
                self._free_replica(key, rep)
            if not o.replicas and not o.disk:
                self._drop_object(o, emit=False)
        for r in [r for r in self.reservations.values() if r.segment == s.name]:
            del self.reservations[r.rid]
        self.segments.pop(s.name, None)
        self.offload_pending.pop(s.name, None)
        self._emit("unseg", s.name)
        logger.info("unmounted segment %s of client %s", s.name, s.client_id)

    def expire_clients(self, now: float) -> list[str]:
        """Drop clients silent for longer than ``client_ttl_s``; returns their ids."""
        dead = [c for c in self.clients.values() if now - c.last_seen > self.cfg.client_ttl_s]
        for c in dead:
            self.drop_client(c.client_id)
        return [c.client_id for c in dead]

    def drop_client(self, client_id: str) -> None:
        self.suspects.pop(client_id, None)
        c = self.clients.pop(client_id, None)
        if c is None:
            return
        logger.warning("client %s expired: unmounting %d segment(s)", client_id, len(c.segments))
        self.counters["expired_clients"] += 1
        # its reservations stay until they expire: a client we only thought dead may still be
        # writing
        for name in list(c.segments):
            s = self.segments.get(name)
            if s is not None:
                self._unmount(s)
        for key in list(c.disk_keys):
            o = self.objects.get(key)
            if o is not None and o.disk == client_id:
                o.disk = ""
                if not o.replicas:
                    self._drop_object(o, emit=False)
                else:
                    self._emit(*self._obj_entry(o))
        self._emit("unclient", client_id)

    def report_unreachable(self, client_id: str, segments: Sequence[str], now: float) -> None:
        """``client_id`` could not write into ``segments``: mark their holders suspect.

        Placement (:meth:`_place`, :meth:`reserve`) then avoids every segment of a suspect holder,
        for every writer, until the holder sends any request (its heartbeat comes every
        ``heartbeat_interval_s``), or for ``client_ttl_s`` at most, after which a holder that
        stayed silent is dropped anyway. So a holder that died stops getting new objects at the
        first failed write instead of at its TTL, and a live one that a single writer cannot
        reach (that writer's network trouble) is avoided for about one heartbeat only. The marks
        are the leader's alone, not replicated: a new leader starts without them and learns
        them again from the next failed write.
        """
        for name in segments:
            s = self.segments.get(name)
            if s is None or s.client_id == client_id:
                continue
            if s.client_id not in self.suspects:
                self.counters["suspect_marks"] += 1
                logger.warning(
                    "client %s could not write into segment %s: avoiding the segments of its "
                    "holder %s until it heartbeats",
                    client_id,
                    name,
                    s.client_id,
                )
            self.suspects[s.client_id] = now

    def heartbeat_lost(self, client_id: str, now: float) -> None:
        """The connection ``client_id``'s heartbeat polls came on closed: mark it suspect (as
        :meth:`report_unreachable` does), so a holder that died (its kernel closes its sockets)
        gets no new objects from its death on, before any write into it fails. A live client
        whose connection merely closed clears the mark with its next request."""
        if (
            not self.cfg.suspect_on_disconnect
            or client_id not in self.clients
            or client_id in self.suspects
        ):
            return
        self.counters["suspect_marks"] += 1
        logger.info(
            "the heartbeat connection of client %s closed: avoiding its segments until it is "
            "heard from again",
            client_id,
        )
        self.suspects[client_id] = now

    def take_tasks_after_wait(self, client_id: str, now: float) -> list[dict[str, Any]]:
        """:meth:`take_tasks` at the end of a long poll: it keeps the client registered, but it
        is no sign of life after the poll arrived (the client may have died while it waited), so a
        suspect mark made meanwhile stays."""
        since = self.suspects.get(client_id)
        tasks = self.take_tasks(client_id, now)
        if since is not None:
            self.suspects[client_id] = since
        return tasks

    def put_start(
        self,
        client_id: str,
        key: str,
        size: int,
        cfg: ReplicaCfg,
        now: float,
        exclude: Sequence[str] = (),
    ) -> tuple[int, list[Any]]:
        """Place a new object; ``exclude``: segments its writer could not write (a put placed
        again): never used for it, and their holders are marked suspect
        (:meth:`report_unreachable`)."""
        self._client(client_id, now)
        check_key(key)
        if size <= 0:
            raise InvalidArgument(f"put {key!r}: size must be positive, got {size}")
        if cfg.replica_num < 1 or cfg.replica_num > 16:
            raise InvalidArgument(f"put {key!r}: replica_num must be 1..16, got {cfg.replica_num}")
        if cfg.soft_pin_ttl_s < 0:
            raise InvalidArgument(f"put {key!r}: soft_pin_ttl_s must not be negative")
        strategy = self._strategy(cfg, f"put {key!r}")
        self._claim_key(key, now)
        self._admit(key, size, now)
        if not self.segments:
            raise NoSpace(
                f"put {key!r}: no segment is mounted; start a store node or give clients a segment"
            )
        total = sum(s.size for s in self.segments.values())
        if size > total:
            raise InvalidArgument(
                f"put {key!r}: {format_size(size)} is larger than all mounted segments together "
                f"({format_size(total)})"
            )
        if exclude:
            self.report_unreachable(client_id, exclude, now)
            if size > sum(s.size for s in self._candidates(exclude)):
                # (nor evict for it: what eviction frees there cannot be used)
                raise NoSpace(
                    f"put {key!r}: no segment but the {len(exclude)} this client could not write "
                    f"can hold {format_size(size)}"
                )
        reps = self._place(key, size, cfg, strategy, client_id, exclude, now)
        if not reps:
            self._reclaim_zombies(now)
            reps = self._place(key, size, cfg, strategy, client_id, exclude, now)
        while (
            not reps and self.evict_for(size, now) > 0
        ):  # fragmentation may need more than one round
            reps = self._place(key, size, cfg, strategy, client_id, exclude, now)
        if not reps:
            if any(o.offloading for o in self.objects.values()):
                raise RetryLater(f"put {key!r}: waiting for SSD offloads to free memory")
            largest = max(s.allocator.largest_free() for s in self._candidates(exclude))
            raise NoSpace(
                f"put {key!r} needs {format_size(size)}; "
                f"largest free extent is {format_size(largest)} "
                f"and nothing more can be evicted (leased or pinned); raise global_segment_size"
            )
        o = Obj(
            key,
            size,
            reps,
            token=self._next_token(),
            owner=client_id,
            deadline=now + self.cfg.put_timeout_s,
            hard_pin=cfg.hard_pin,
            soft_pin_until=(now + cfg.soft_pin_ttl_s) if cfg.soft_pin_ttl_s else 0.0,
        )
        self.objects[key] = o
        for rep in reps:
            self._index_replica(key, rep)
        return o.token, [self._slices_out(rep) for rep in reps]

    def put_end(self, client_id: str, key: str, token: int, now: float) -> None:
        self._client(client_id, now)
        o = self.objects.get(key)
        if o is None or o.token != token or o.complete:
            raise InvalidArgument(
                f"put_end {key!r}: no put in progress with this token (it timed out, was revoked, "
                f"or the leader changed); put again"
            )
        if not o.replicas:
            self._drop_object(o, emit=False)
            raise NoSpace(
                f"put_end {key!r}: every replica's segment went away during the write; put again"
            )
        o.complete = True
        o.deadline = 0.0
        self.lru[key] = None
        self._emit(*self._obj_entry(o))

    def put_revoke(self, client_id: str, key: str, token: int, now: float) -> None:
        self._client(client_id, now)
        o = self.objects.get(key)
        if o is None or o.token != token or o.complete:
            return
        self._drop_object(o, emit=False)

    def reclaim(self, now: float) -> int:
        return self._reclaim_zombies(now)

    def _reclaim_zombies(self, now: float) -> int:
        for r in [r for r in self.reservations.values() if now >= r.deadline]:
            logger.info(
                "reclaiming reservation %d of client %s (unused for %.0fs)",
                r.rid,
                r.client_id,
                self.cfg.put_timeout_s,
            )
            self._release_reservation(r)
            self.counters["reservations_reclaimed"] += 1
        dead = [
            o for o in self.objects.values() if not o.complete and o.deadline and now >= o.deadline
        ]
        for o in dead:
            logger.info(
                "reclaiming unfinished put of %r (no put_end within %.0fs)",
                o.key,
                self.cfg.put_timeout_s,
            )
            self._drop_object(o, emit=False)
        self.counters["reclaimed_puts"] += len(dead)
        return len(dead)

    def _complete(self, key: str) -> Obj:
        check_key(key)
        o = self.objects.get(key)
        if o is None or not o.complete:
            raise ObjectNotFound(f"no object {key!r}")
        return o

    def get_replica_list(self, key: str, now: float) -> tuple[int, list[Any], float, int]:
        """(size, replicas, lease ttl, version token) of a complete object; grants a lease."""
        o = self._complete(key)
        if not o.replicas:
            self._promote(o, now)
        if self.hot_on:
            self._hot_hit(key, now)
        if self.promo_transient and key in self.promo_transient:
            self._admit_read(key, now)
        o.lease_until = now + self.cfg.lease_ttl_s
        if o.lease_until > o.lease_rep and self.lease_dirty is not None:
            self._lease_mark(o)  # HA: standbys learn this lease on the next tick
        self.lru.move_to_end(key)
        return o.size, [self._slices_out(rep) for rep in o.replicas], self.cfg.lease_ttl_s, o.token

    def batch_get_replica_list(self, keys: list[str], now: float) -> list[Any]:
        check_batch(keys)
        out: list[Any] = []
        for k in keys:
            try:
                size, reps, ttl, token = self.get_replica_list(k, now)
                out.append((0, size, reps, ttl, token))
            except Exception as exc:  # per-key errors travel as codes
                out.append((int(code_of(exc)), str(exc), [], 0.0, 0))
        return out

    def exists(self, key: str, now: float) -> bool:
        check_key(key)
        o = self.objects.get(key)
        if o is None or not o.complete:
            return False
        o.lease_until = now + self.cfg.lease_ttl_s
        if o.lease_until > o.lease_rep and self.lease_dirty is not None:
            self._lease_mark(o)
        return True

    def batch_exists(self, keys: list[str], now: float) -> list[bool]:
        check_batch(keys)
        return [self.exists(k, now) for k in keys]

    def get_size(self, key: str, now: float) -> int:
        """The object's size; leases it as a read does (the published master's query does)."""
        o = self._complete(key)
        o.lease_until = max(o.lease_until, now + self.cfg.lease_ttl_s)
        if o.lease_until > o.lease_rep and self.lease_dirty is not None:
            self._lease_mark(o)
        return o.size

    def remove(self, key: str, force: bool, now: float) -> None:
        o = self._complete(key)
        if not force:
            if o.hard_pin:
                raise ObjectBusy(f"remove {key!r}: the object is hard-pinned; use force")
            if o.lease_until > now:
                raise ObjectBusy(
                    f"remove {key!r}: the object is leased for {o.lease_until - now:.1f}s more "
                    f"(a reader holds it); retry later or force"
                )
        self._drop_object(o)

    def batch_remove(self, keys: list[str], force: bool, now: float) -> list[int]:
        check_batch(keys)
        out = []
        for k in keys:
            try:
                self.remove(k, force, now)
                out.append(0)
            except Exception as exc:
                out.append(int(code_of(exc)))
        return out

    def _regex(self, pattern: str) -> re.Pattern[str]:
        if not isinstance(pattern, str) or len(pattern) > MAX_KEY:
            raise InvalidArgument("regex must be a string of at most 4096 characters")
        try:
            return re.compile(pattern)
        except re.error as exc:
            raise InvalidArgument(f"invalid regex {pattern!r}: {exc}") from None

    def keys_by_regex(self, pattern: str, tenant: str = "") -> list[str]:
        """Complete keys of ``tenant`` whose key (without the tenant prefix) matches."""
        rx = self._regex(pattern)
        if not tenant:  # the default tenant: keys without a tenant prefix
            objs = self.objects.items()
            return [k for k, o in objs if o.complete and SEP not in k and rx.search(k)]
        prefix = tenant + SEP
        cut = len(prefix)
        return [
            k
            for k, o in self.objects.items()
            if o.complete and k.startswith(prefix) and rx.search(k[cut:])
        ]

    def remove_by_regex(self, pattern: str, force: bool, now: float, tenant: str = "") -> int:
        n = 0
        for k in self.keys_by_regex(pattern, tenant):
            o = self.objects[k]
            if not force and (o.lease_until > now or o.hard_pin):
                continue
            self._drop_object(o)
            n += 1
        return n

    def remove_all(self, force: bool, now: float, tenant: str = "") -> int:
        return self.remove_by_regex("", force, now, tenant)

    def query_key(self, key: str) -> dict[str, Any]:
        o = self.objects.get(check_key(key))
        if o is None:
            raise ObjectNotFound(f"no object {key!r}")
        now = time.monotonic()
        return {
            "key": key,
            "size": o.size,
            "complete": o.complete,
            "owner": o.owner,  # the client that put it (compat batch_replica_clear)
            "replicas": [
                [
                    {
                        "segment": n,
                        "client": self.segments[n].client_id if n in self.segments else "",
                        "offset": off,
                        "length": ln,
                    }
                    for n, off, ln in rep
                ]
                for rep in o.replicas
            ],
            "ssd": o.disk,
            "lease_s": max(0.0, o.lease_until - now),
            "hard_pin": o.hard_pin,
            "soft_pin_s": max(0.0, o.soft_pin_until - now),
        }

    def stats(self) -> dict[str, Any]:
        used, total = self.usage()
        return {
            "objects": sum(1 for o in self.objects.values() if o.complete),
            "pending_puts": sum(1 for o in self.objects.values() if not o.complete),
            "bytes": sum(o.size for o in self.objects.values() if o.complete),
            "used": used,
            "capacity": total,
            "clients": len(self.clients),
            "segments": len(self.segments),
            "reservations": len(self.reservations),
            "reserved_bytes": sum(n for r in self.reservations.values() for n in r.blocks.values()),
            "suspect_holders": len(self.suspects),
            **self.counters,
            **self.hot_stats(),
            "tenants": self.tenant_stats(),
        }


def error_tuple(exc: BaseException) -> tuple[int, str]:
    return int(code_of(exc)), str(exc) if str(exc) else type(exc).__name__
