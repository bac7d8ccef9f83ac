"""The master's metadata: clients, segments, objects, leases, pins, eviction, SSD tier.

Contract:

- :class:`MasterState` is synchronous and single-threaded (the master's event loop owns
  it); every public method validates its arguments and raises the errors of
  :mod:`mooncake_core.store.protocol` (``InvalidArgument``, ``ObjectBusy``, ...) or of
  :mod:`mooncake_core.errors` (``ObjectNotFound``, ``ObjectExists``, ``NoSpace``).
- Results are plain lists/dicts/tuples ready for msgpack.
- Every change other masters must know (client and segment registry, committed
  objects, removals, replica changes) is emitted through ``on_change(entry)``; a
  standby replays entries with :meth:`apply`. Pending puts and leases are not
  replicated: a new leader treats unfinished puts as revoked and grants every object a
  fresh lease.
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
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mooncake_core.config import StoreConfig, format_size
from mooncake_core.errors import NoSpace, ObjectExists, ObjectNotFound
from mooncake_core.store.allocator import STRATEGIES, OffsetAllocator, align, place
from mooncake_core.store.eviction import candidates
from mooncake_core.store.protocol import (
    MAX_BATCH,
    MAX_KEY,
    InvalidArgument,
    ObjectBusy,
    ReplicaCfg,
    RetryLater,
    UnknownClient,
    code_of,
)

__all__ = ["MasterState", "Segment", "ClientInfo", "Obj", "Reservation", "check_key", "RESERVE_MAX_OBJECT"]

logger = logging.getLogger(__name__)

SliceT = tuple[str, int, int]  # (segment name, offset inside the segment, length)


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidArgument("key must be a non-empty string")
    if len(key) > MAX_KEY and len(key.encode()) > MAX_KEY:
        raise InvalidArgument(f"key is {len(key.encode())} bytes; the limit is {MAX_KEY}")
    return key


def _check_batch(keys: list[str]) -> None:
    if len(keys) > MAX_BATCH:
        raise InvalidArgument(f"batch of {len(keys)} keys exceeds the limit of {MAX_BATCH}")


RESERVE_MAX_OBJECT = 4 << 20  # objects up to this size may be put through a reservation
_RESERVE_MIN, _RESERVE_MAX = 4 << 20, 32 << 20  # extent size bounds (and at most 1/16 of the segment)
_RESERVE_PER_CLIENT = 8


@dataclass(slots=True)
class Reservation:
    """An extent of one segment lent to one client; ``blocks`` are the parts not yet committed."""

    rid: int
    client_id: str
    segment: str
    blocks: dict[int, int]  # offset -> size, each an allocated range of the segment's allocator
    deadline: float

    def block_holding(self, offset: int, need: int) -> int | None:
        """The start of the uncommitted block that contains ``[offset, offset+need)``, if any."""
        return next((b for b, n in self.blocks.items() if b <= offset and offset + need <= b + n), None)


@dataclass
class Segment:
    name: str
    client_id: str
    peer: str
    host: str
    base: int
    size: int
    allocator: OffsetAllocator
    keys: set[str] = field(default_factory=set)


@dataclass
class ClientInfo:
    client_id: str
    host: str
    peer: str
    ssd: bool
    last_seen: float
    segments: set[str] = field(default_factory=set)
    tasks: deque[dict[str, Any]] = field(default_factory=deque)
    disk_keys: set[str] = field(default_factory=set)


@dataclass(slots=True)
class Obj:
    key: str
    size: int
    replicas: list[list[SliceT]]
    complete: bool = False
    token: int = 0
    owner: str = ""
    deadline: float = 0.0  # pending puts: reclaimed after this
    lease_until: float = 0.0
    soft_pin_until: float = 0.0
    hard_pin: bool = False
    disk: str = ""  # client id holding an SSD copy
    offloading: int = 0  # token of an offload in flight
    offload_seg: str = ""
    promoting: int = 0  # token of a promotion in flight
    promo_replica: list[SliceT] | None = None
    early: bool = False  # committed before its write was confirmed: readers wait for put_confirm

    @property
    def busy(self) -> bool:
        return bool(self.offloading or self.promoting)


class MasterState:
    """All master metadata (see module doc)."""

    def __init__(self, cfg: StoreConfig, *, rng: random.Random | None = None) -> None:
        self.cfg = cfg
        self.rng = rng or random.Random()
        self.clients: dict[str, ClientInfo] = {}
        self.segments: dict[str, Segment] = {}
        self.objects: dict[str, Obj] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()
        self.early: dict[str, int] = {}  # key -> token of objects committed early, awaiting put_confirm
        # tokens double as object versions (see module doc): never reused, even by a restarted master
        self._token = int.from_bytes(os.urandom(5), "big") << 20
        self.offload_pending: dict[str, int] = {}  # segment -> bytes queued for SSD offload
        self.reservations: dict[int, Reservation] = {}
        self._rid = 0
        self.on_change: Callable[[tuple[Any, ...]], None] | None = None
        self.on_task: Callable[[str], None] | None = None
        self.counters: dict[str, int] = {"evictions": 0, "evicted_bytes": 0, "offloads": 0, "promotions": 0,
                                         "expired_clients": 0, "reclaimed_puts": 0, "reservations_granted": 0,
                                         "reserved_puts": 0, "reservations_reclaimed": 0}

    # ------------------------------------------------------------------ helpers
    def _emit(self, *entry: Any) -> None:
        if self.on_change is not None:
            self.on_change(entry)

    def _get_obj(self, key: str) -> Obj | None:
        return self.objects.get(key)

    def _next_token(self) -> int:
        self._token += 1
        return self._token

    def _client(self, client_id: str, now: float) -> ClientInfo:
        c = self.clients.get(client_id)
        if c is None:
            raise UnknownClient(f"unknown client id {client_id!r}: register (mount) first; it may have expired")
        c.last_seen = now
        return c

    def touch(self, client_id: str, now: float) -> None:
        self._client(client_id, now)

    def _slices_out(self, rep: list[SliceT]) -> list[tuple[str, str, int, int, str]]:
        out = []
        for name, off, n in rep:
            s = self.segments[name]
            out.append((name, s.peer, s.base + off, n, s.host))
        return out

    def _free_replica(self, key: str, rep: list[SliceT]) -> None:
        for name, off, _n in rep:
            s = self.segments.get(name)
            if s is not None:
                s.allocator.release(off)
                s.keys.discard(key)

    def _index_replica(self, key: str, rep: list[SliceT]) -> None:
        for name, _o, _n in rep:
            self.segments[name].keys.add(key)

    def _drop_object(self, o: Obj, *, emit: bool = True) -> None:
        if o.offloading:
            self._settle_offload(o)
            o.offloading = 0
        for rep in o.replicas:
            self._free_replica(o.key, rep)
        if o.promo_replica:
            self._free_replica(o.key, o.promo_replica)
        o.replicas = []
        self.objects.pop(o.key, None)
        self.lru.pop(o.key, None)
        if o.early and self.early.get(o.key) == o.token:
            del self.early[o.key]
        if o.disk:
            c = self.clients.get(o.disk)
            if c is not None:
                c.disk_keys.discard(o.key)
                self._push(c, {"kind": "delete_disk", "key": o.key, "token": 0})
        if emit and o.complete:
            self._emit("del", o.key)

    def _settle_offload(self, o: Obj) -> None:
        left = self.offload_pending.get(o.offload_seg, 0) - o.size
        if left > 0:
            self.offload_pending[o.offload_seg] = left
        else:
            self.offload_pending.pop(o.offload_seg, None)
        o.offload_seg = ""

    def _push(self, c: ClientInfo, task: dict[str, Any]) -> None:
        c.tasks.append(task)
        if self.on_task is not None:
            self.on_task(c.client_id)

    def _obj_entry(self, o: Obj) -> tuple[Any, ...]:
        return ("obj", o.key, o.size, o.replicas, o.disk, o.hard_pin, o.soft_pin_until)

    # ------------------------------------------------------------------ clients and segments
    def register_client(self, client_id: str, host: str, peer: str, ssd: bool, now: float) -> dict[str, Any]:
        if not client_id:
            raise InvalidArgument("client_id must be a non-empty string")
        c = self.clients.get(client_id)
        if c is None:
            c = self.clients[client_id] = ClientInfo(client_id, host, peer, ssd, now)
        else:
            c.host, c.peer, c.ssd, c.last_seen = host, peer, ssd, now
        self._emit("client", client_id, host, peer, ssd)
        return {"segments": sorted(c.segments), "ttl_s": self.cfg.client_ttl_s,
                "heartbeat_s": self.cfg.heartbeat_interval_s, "lease_ttl_s": self.cfg.lease_ttl_s}

    def mount(self, client_id: str, name: str, peer: str, base: int, size: int, host: str, now: float) -> None:
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
            raise InvalidArgument(f"segment {name!r} is already mounted by client {old.client_id!r}")
        self.segments[name] = Segment(name, client_id, peer, host, base, size, OffsetAllocator(size))
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
        c = self.clients.pop(client_id, None)
        if c is None:
            return
        logger.warning("client %s expired: unmounting %d segment(s)", client_id, len(c.segments))
        self.counters["expired_clients"] += 1
        # its reservations stay until they expire: a client we only thought dead may still be writing
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

    # ------------------------------------------------------------------ put
    def put_start(self, client_id: str, key: str, size: int, cfg: ReplicaCfg, now: float) -> tuple[int, list[Any]]:
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
        if not self.segments:
            raise NoSpace(f"put {key!r}: no segment is mounted; start a store node or give clients a segment")
        total = sum(s.size for s in self.segments.values())
        if size > total:
            raise InvalidArgument(f"put {key!r}: {format_size(size)} is larger than all mounted segments together "
                                  f"({format_size(total)})")
        reps = self._place(key, size, cfg, strategy, client_id)
        if not reps:
            self._reclaim_zombies(now)
            reps = self._place(key, size, cfg, strategy, client_id)
        while not reps and self.evict_for(size, now) > 0:  # fragmentation may need more than one round
            reps = self._place(key, size, cfg, strategy, client_id)
        if not reps:
            if any(o.offloading for o in self.objects.values()):
                raise RetryLater(f"put {key!r}: waiting for SSD offloads to free memory")
            largest = max(s.allocator.largest_free() for s in self.segments.values())
            raise NoSpace(f"put {key!r} needs {format_size(size)}; largest free extent is {format_size(largest)} "
                          f"and nothing more can be evicted (leased or pinned); raise global_segment_size")
        o = Obj(key, size, reps, token=self._next_token(), owner=client_id, deadline=now + self.cfg.put_timeout_s,
                hard_pin=cfg.hard_pin, soft_pin_until=(now + cfg.soft_pin_ttl_s) if cfg.soft_pin_ttl_s else 0.0)
        self.objects[key] = o
        for rep in reps:
            self._index_replica(key, rep)
        return o.token, [self._slices_out(rep) for rep in reps]

    def _strategy(self, cfg: ReplicaCfg, what: str) -> str:
        """The placement strategy ``cfg`` asks for (or the master's default), validated."""
        strategy = cfg.strategy or self.cfg.placement
        if strategy not in STRATEGIES:
            raise InvalidArgument(f"{what}: unknown placement {strategy!r} (use one of {', '.join(STRATEGIES)})")
        return strategy

    def _claim_key(self, key: str, now: float) -> None:
        """Make way for a new object ``key``: refuse an existing or in-progress one (an expired
        unfinished put is dropped), and make room at the object cap."""
        old = self.objects.get(key)
        if old is not None:
            if old.complete:
                raise ObjectExists(f"put {key!r}: the key already exists (remove it first)")
            if now < old.deadline:
                raise ObjectBusy(f"put {key!r}: another put of this key is in progress")
            self._drop_object(old, emit=False)
            self.counters["reclaimed_puts"] += 1
        if len(self.objects) >= self.cfg.max_objects:
            self._make_room_for_object(key, now)

    def _place(self, key: str, size: int, cfg: ReplicaCfg, strategy: str, client_id: str) -> list[list[SliceT]]:
        if cfg.preferred_segment and cfg.preferred_segment not in self.segments:
            raise InvalidArgument(f"put {key!r}: preferred segment {cfg.preferred_segment!r} is not mounted")
        got = place(list(self.segments.values()), size, min(cfg.replica_num, len(self.segments)), strategy=strategy,
                    client_id=client_id, preferred=cfg.preferred_segment, rng=self.rng)
        return [[(s.name, off, n) for s, off, n in rep] for rep in got]

    # ------------------------------------------------------------------ reservations (one-RPC puts)
    def reserve(self, client_id: str, size: int, cfg: ReplicaCfg, release: list[int],
                now: float, count: int = 0) -> tuple[int, list[Any], float]:
        """Release the client's listed reservations, then lend it an extent for objects of about ``size``.

        Returns ``(rid, [segment, peer, base address, offset, length, host], ttl_s)``, or
        ``(0, [], 0.0)`` when none is granted (the client then puts in two phases): no
        segment has a free extent that keeps it under the eviction watermark, the client
        holds the maximum, or ``size`` is 0 (release only). Reservations never evict.
        """
        self._client(client_id, now)
        for rid in release:
            r = self.reservations.get(rid)
            if r is not None and r.client_id == client_id:
                self._release_reservation(r)
        if size == 0:
            return 0, [], 0.0
        if size < 0 or size > RESERVE_MAX_OBJECT:
            raise InvalidArgument(f"reserve: size must be 0..{RESERVE_MAX_OBJECT}, got {size}")
        if cfg.replica_num != 1:
            raise InvalidArgument(f"reserve: reservations hold single-replica objects, got replica_num={cfg.replica_num}")
        strategy = self._strategy(cfg, "reserve")
        if cfg.preferred_segment and cfg.preferred_segment not in self.segments:
            raise InvalidArgument(f"reserve: preferred segment {cfg.preferred_segment!r} is not mounted")
        if sum(1 for r in self.reservations.values() if r.client_id == client_id) >= _RESERVE_PER_CLIENT:
            return 0, [], 0.0
        if count < 0:
            raise InvalidArgument(f"reserve: count must not be negative, got {count}")
        want = min(max(max(16, min(count, 1 << 16)) * align(size), _RESERVE_MIN), _RESERVE_MAX)
        hw = self.cfg.eviction_high_watermark

        def extent(sg: Segment) -> int:
            return min(want, sg.size // 16)

        fits = [sg for sg in self.segments.values()
                if extent(sg) >= 2 * align(size) and sg.allocator.used + extent(sg) <= hw * sg.size
                and sg.allocator.largest_free() >= extent(sg)]
        # the segments a two-phase put would try first must be the ones lending: a preference
        # (preferred segment, the writer's own segments) is never traded for an extent elsewhere
        if cfg.preferred_segment:
            fits = [sg for sg in fits if sg.name == cfg.preferred_segment]
        elif strategy == "local-first" and any(sg.client_id == client_id for sg in self.segments.values()):
            fits = [sg for sg in fits if sg.client_id == client_id]
        if strategy == "free-ratio-first":
            fits.sort(key=lambda sg: sg.allocator.free / sg.size, reverse=True)
        else:
            self.rng.shuffle(fits)
        for sg in fits:
            off = sg.allocator.allocate(extent(sg))
            if off is not None:
                n = align(extent(sg))  # what the allocator really took
                break
        else:
            return 0, [], 0.0
        self._rid += 1
        r = Reservation(self._rid, client_id, sg.name, {off: n}, now + self.cfg.put_timeout_s)
        self.reservations[r.rid] = r
        self.counters["reservations_granted"] += 1
        self._emit("res", r.rid, client_id, sg.name, [[off, n]], self.cfg.put_timeout_s)
        return r.rid, [sg.name, sg.peer, sg.base, off, n, sg.host], self.cfg.put_timeout_s

    def put_commit(self, client_id: str, key: str, rid: int, offset: int, size: int, cfg: ReplicaCfg,
                   now: float, *, early: bool = False) -> tuple[float, int]:
        """Commit ``key`` = the ``size`` bytes the client wrote at ``offset`` inside reservation ``rid``.

        Returns the reservation's renewed ttl and the object's version token. The range is
        carved out of the reservation and belongs to the object from now on.

        ``early``: the client sends the commit while its write is still in flight. The object
        then exists but is not complete (``self.early``) until :meth:`put_confirm`; an early
        commit never confirmed is dropped after ``put_timeout_s`` (the master also drops it
        when the committing connection closes). Early commits are not logged (no HA).
        """
        self._client(client_id, now)
        check_key(key)
        if size <= 0:
            raise InvalidArgument(f"put {key!r}: size must be positive, got {size}")
        if cfg.soft_pin_ttl_s < 0:
            raise InvalidArgument(f"put {key!r}: soft_pin_ttl_s must not be negative")
        r = self.reservations.get(rid)
        if r is None or r.client_id != client_id or now >= r.deadline:
            raise InvalidArgument(f"put {key!r}: reservation {rid} is unknown or expired for client {client_id!r}; "
                                  f"put again")
        old = self.objects.get(key)
        if old is not None and old.complete:  # before the range check: a retried commit that already landed
            raise ObjectExists(f"put {key!r}: the key already exists (remove it first)")
        need = align(size)
        block = r.block_holding(offset, need)
        if block is None:
            raise InvalidArgument(f"put {key!r}: [{offset}, {offset + need}) is not a free part of reservation {rid}")
        self._claim_key(key, now)
        if r.rid not in self.reservations:  # making room reclaimed expired reservations: not this live one
            raise InvalidArgument(f"put {key!r}: reservation {rid} was reclaimed; put again")
        self._carve(r, block, offset, need, release=False)
        rep: list[SliceT] = [(r.segment, offset, size)]
        o = Obj(key, size, [rep], complete=not early, token=self._next_token(), owner=client_id,
                hard_pin=cfg.hard_pin, soft_pin_until=(now + cfg.soft_pin_ttl_s) if cfg.soft_pin_ttl_s else 0.0,
                early=early, deadline=(now + self.cfg.put_timeout_s) if early else 0.0)
        self.objects[key] = o
        self._index_replica(key, rep)
        r.deadline = now + self.cfg.put_timeout_s
        self.counters["reserved_puts"] += 1
        self._emit("carve", r.rid, offset, need)
        if early:
            self.early[key] = o.token
        else:
            self.lru[key] = None
            self._emit(*self._obj_entry(o))
        return self.cfg.put_timeout_s, o.token

    def put_confirm(self, client_id: str, key: str, token: int, ok: bool, now: float) -> None:
        """Complete (``ok``) or drop an early commit of ``key`` once its writer knows how the write went."""
        o = self.objects.get(key)
        if o is None or not o.early or o.token != token or o.owner != client_id:
            raise InvalidArgument(f"put_confirm {key!r}: no early commit with this token (it timed out after "
                                  f"{self.cfg.put_timeout_s:.0f}s or its connection closed); put again")
        c = self.clients.get(client_id)
        if c is not None:
            c.last_seen = now
        if not ok:
            self._drop_object(o, emit=False)
            return
        if not o.replicas:
            self._drop_object(o, emit=False)
            raise NoSpace(f"put_confirm {key!r}: its segment went away during the write; put again")
        o.early = False
        o.complete = True
        o.deadline = 0.0
        del self.early[key]
        self.lru[key] = None
        self._emit(*self._obj_entry(o))

    def _carve(self, r: Reservation, block: int, offset: int, need: int, *, release: bool) -> None:
        """Take ``[offset, offset+need)`` out of ``r``'s block at ``block`` (an allocated range of its own after)."""
        alloc = self.segments[r.segment].allocator
        bsize = r.blocks.pop(block)
        if offset > block:
            alloc.split(block, offset)
            r.blocks[block] = offset - block
        if offset + need < block + bsize:
            alloc.split(offset, offset + need)
            r.blocks[offset + need] = block + bsize - offset - need
        if release:  # replaying a carve: the object entry that follows allocates the range again
            alloc.release(offset)
        if not r.blocks:
            del self.reservations[r.rid]

    def _release_reservation(self, r: Reservation, *, emit: bool = True) -> None:
        self.reservations.pop(r.rid, None)
        s = self.segments.get(r.segment)
        if s is not None:
            for b in r.blocks:
                s.allocator.release(b)
        r.blocks = {}
        if emit:
            self._emit("unres", r.rid)

    def put_end(self, client_id: str, key: str, token: int, now: float) -> None:
        self._client(client_id, now)
        o = self.objects.get(key)
        if o is None or o.token != token or o.complete:
            raise InvalidArgument(f"put_end {key!r}: no put in progress with this token (it timed out, was revoked, "
                                  f"or the leader changed); put again")
        if not o.replicas:
            self._drop_object(o, emit=False)
            raise NoSpace(f"put_end {key!r}: every replica's segment went away during the write; put again")
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
            logger.info("reclaiming reservation %d of client %s (unused for %.0fs)", r.rid, r.client_id,
                        self.cfg.put_timeout_s)
            self._release_reservation(r)
            self.counters["reservations_reclaimed"] += 1
        dead = [o for o in self.objects.values() if not o.complete and o.deadline and now >= o.deadline]
        for o in dead:
            logger.info("reclaiming unfinished put of %r (no put_end within %.0fs)", o.key, self.cfg.put_timeout_s)
            self._drop_object(o, emit=False)
        self.counters["reclaimed_puts"] += len(dead)
        return len(dead)

    # ------------------------------------------------------------------ get
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
        o.lease_until = now + self.cfg.lease_ttl_s
        self.lru.move_to_end(key)
        return o.size, [self._slices_out(rep) for rep in o.replicas], self.cfg.lease_ttl_s, o.token

    def batch_get_replica_list(self, keys: list[str], now: float) -> list[Any]:
        _check_batch(keys)
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
        return True

    def batch_exists(self, keys: list[str], now: float) -> list[bool]:
        _check_batch(keys)
        return [self.exists(k, now) for k in keys]

    def get_size(self, key: str) -> int:
        return self._complete(key).size

    # ------------------------------------------------------------------ remove
    def remove(self, key: str, force: bool, now: float) -> None:
        o = self._complete(key)
        if not force:
            if o.hard_pin:
                raise ObjectBusy(f"remove {key!r}: the object is hard-pinned; use force")
            if o.lease_until > now:
                raise ObjectBusy(f"remove {key!r}: the object is leased for {o.lease_until - now:.1f}s more "
                                 f"(a reader holds it); retry later or force")
        self._drop_object(o)

    def batch_remove(self, keys: list[str], force: bool, now: float) -> list[int]:
        _check_batch(keys)
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

    def keys_by_regex(self, pattern: str) -> list[str]:
        rx = self._regex(pattern)
        return [k for k, o in self.objects.items() if o.complete and rx.search(k)]

    def remove_by_regex(self, pattern: str, force: bool, now: float) -> int:
        n = 0
        for k in self.keys_by_regex(pattern):
            o = self.objects[k]
            if not force and (o.lease_until > now or o.hard_pin):
                continue
            self._drop_object(o)
            n += 1
        return n

    def remove_all(self, force: bool, now: float) -> int:
        return self.remove_by_regex("", force, now)

    # ------------------------------------------------------------------ eviction
    def usage(self) -> tuple[int, int]:
        used = sum(s.allocator.used for s in self.segments.values())
        return used, sum(s.size for s in self.segments.values())

    def evict_for(self, nbytes: int, now: float) -> int:
        """Free about ``max(nbytes, eviction_ratio * total)`` bytes anywhere; returns bytes freed."""
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
            logger.info("object cap %d reached: evicted %d least recently used objects", cap, dropped)
        if len(self.objects) >= cap:
            raise NoSpace(f"put {key!r}: the master already tracks {len(self.objects)} objects (store.max_objects = "
                          f"{cap}) and none can be evicted (leased, pinned or in flight); raise max_objects")

    def _evict(self, goal: int, now: float, segment: str | None) -> int:
        """Drop (or queue for SSD offload) LRU replicas worth ``goal`` bytes; returns bytes freed now."""
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
            rep = next((r for r in o.replicas if segment is None or any(x[0] == segment for x in r)), o.replicas[0])
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

    # ------------------------------------------------------------------ SSD tier
    def _offload(self, o: Obj, rep: list[SliceT]) -> bool:
        """Queue an SSD offload of ``rep`` (single-slice, holder with SSD, no copy yet)."""
        if o.disk or len(o.replicas) > 1 or len(rep) != 1:
            return False
        s = self.segments.get(rep[0][0])
        c = self.clients.get(s.client_id) if s is not None else None
        if c is None or not c.ssd or s is None:
            return False
        o.offloading = self._next_token()
        o.offload_seg = s.name
        self.offload_pending[s.name] = self.offload_pending.get(s.name, 0) + rep[0][2]
        self._push(c, {"kind": "offload", "key": o.key, "token": o.offloading,
                       "offset": rep[0][1], "length": rep[0][2], "segment": s.name})
        return True

    def _promote(self, o: Obj, now: float) -> None:
        """Start loading a disk-only object back into memory; raises RetryLater."""
        if not o.disk or o.disk not in self.clients:
            self._drop_object(o)
            raise ObjectNotFound(f"no object {o.key!r} (its only copy was on a node that went away)")
        if not o.promoting:
            c = self.clients[o.disk]
            cfg = ReplicaCfg(replica_num=1, strategy="local-first")
            reps = self._place(o.key, o.size, cfg, "local-first", c.client_id)
            if not reps:
                self.evict_for(o.size, now)
                reps = self._place(o.key, o.size, cfg, "local-first", c.client_id)
            if not reps:
                if any(x.offloading or (x.replicas and not x.hard_pin and x.lease_until > now)
                       for x in self.objects.values()):
                    raise RetryLater(f"get {o.key!r}: waiting for leases to expire or offloads to finish to free "
                                     f"memory for its promotion")
                raise NoSpace(f"get {o.key!r}: no memory to promote it from SSD ({format_size(o.size)})")
            o.promoting = self._next_token()
            o.promo_replica = reps[0]
            self._index_replica(o.key, reps[0])
            self._push(c, {"kind": "promote", "key": o.key, "token": o.promoting,
                           "slices": self._slices_out(reps[0])})
            self.counters["promotions"] += 1
        raise RetryLater(f"get {o.key!r}: promoting from SSD, retry shortly")

    def task_done(self, client_id: str, kind: str, key: str, token: int, ok: bool, detail: str, now: float) -> None:
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
                if all(self.segments.get(x[0]) is not None and self.segments[x[0]].client_id == client_id for x in rep):
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
        else:
            raise InvalidArgument(f"task_done: unknown task kind {kind!r}")

    def take_tasks(self, client_id: str, now: float) -> list[dict[str, Any]]:
        c = self._client(client_id, now)
        out = list(c.tasks)
        c.tasks.clear()
        return out

    # ------------------------------------------------------------------ queries
    def query_key(self, key: str) -> dict[str, Any]:
        o = self.objects.get(check_key(key))
        if o is None:
            raise ObjectNotFound(f"no object {key!r}")
        now = time.monotonic()
        return {"key": key, "size": o.size, "complete": o.complete,
                "replicas": [[{"segment": n, "client": self.segments[n].client_id if n in self.segments else "",
                               "offset": off, "length": ln} for n, off, ln in rep] for rep in o.replicas],
                "ssd": o.disk, "lease_s": max(0.0, o.lease_until - now), "hard_pin": o.hard_pin,
                "soft_pin_s": max(0.0, o.soft_pin_until - now)}

    def stats(self) -> dict[str, Any]:
        used, total = self.usage()
        return {"objects": sum(1 for o in self.objects.values() if o.complete), "pending_puts":
                sum(1 for o in self.objects.values() if not o.complete), "bytes": sum(o.size for o in self.objects.values()
                                                                                      if o.complete),
                "used": used, "capacity": total, "clients": len(self.clients), "segments": len(self.segments),
                "reservations": len(self.reservations),
                "reserved_bytes": sum(n for r in self.reservations.values() for n in r.blocks.values()),
                **self.counters}

    # ------------------------------------------------------------------ replication
    def apply(self, entry: tuple[Any, ...] | list[Any], now: float) -> None:
        """Replay one change emitted by a leader (standbys; rebuild after takeover)."""
        kind = entry[0]
        if kind == "client":
            _, cid, host, peer, ssd = entry
            c = self.clients.get(cid)
            if c is None:
                self.clients[cid] = ClientInfo(cid, host, peer, bool(ssd), now)
            else:
                c.host, c.peer, c.ssd = host, peer, bool(ssd)
        elif kind == "unclient":
            c = self.clients.pop(entry[1], None)
            if c is not None:
                for name in list(c.segments):
                    s = self.segments.get(name)
                    if s is not None:
                        self._unmount(s)
        elif kind == "seg":
            _, cid, name, peer, base, size, host = entry
            if name not in self.segments:
                self.segments[name] = Segment(name, cid, peer, host, base, size, OffsetAllocator(size))
            c = self.clients.get(cid) or self.clients.setdefault(cid, ClientInfo(cid, host, peer, False, now))
            c.segments.add(name)
        elif kind == "unseg":
            s = self.segments.get(entry[1])
            if s is not None:
                self._unmount(s)
                c = self.clients.get(s.client_id)
                if c is not None:
                    c.segments.discard(s.name)
        elif kind == "obj":
            _, key, size, replicas, disk, hard_pin, soft_pin_until = entry
            old = self.objects.get(key)
            if old is not None:
                for rep in old.replicas:
                    self._free_replica(key, rep)
            reps: list[list[SliceT]] = []
            for rep in replicas:
                rr = [(str(n), int(off), int(ln)) for n, off, ln in rep]
                if all(x[0] in self.segments and self.segments[x[0]].allocator.reserve(x[1], x[2]) for x in rr):
                    reps.append(rr)
                    self._index_replica(key, rr)
            o = Obj(key, size, reps, complete=True, token=self._next_token(), hard_pin=bool(hard_pin),
                    soft_pin_until=float(soft_pin_until), disk=str(disk), lease_until=now + self.cfg.lease_ttl_s)
            if disk and disk in self.clients:
                self.clients[disk].disk_keys.add(key)
            if reps or o.disk:
                self.objects[key] = o
                self.lru[key] = None
                self.lru.move_to_end(key)
            else:
                self.objects.pop(key, None)
                self.lru.pop(key, None)
        elif kind == "res":
            _, rid, cid, seg, blocks, ttl = entry
            sg = self.segments.get(seg)
            if sg is not None:
                kept = {int(b): int(n) for b, n in blocks if sg.allocator.reserve(int(b), int(n))}
                if kept:
                    self.reservations[int(rid)] = Reservation(int(rid), str(cid), str(seg), kept, now + float(ttl))
            self._rid = max(self._rid, int(rid))
        elif kind == "carve":
            _, rid, offset, need = entry
            r = self.reservations.get(int(rid))
            if r is not None:
                block = r.block_holding(int(offset), int(need))
                if block is not None:
                    self._carve(r, block, int(offset), int(need), release=True)
                r.deadline = max(r.deadline, now + self.cfg.put_timeout_s)
        elif kind == "unres":
            r = self.reservations.get(int(entry[1]))
            if r is not None:
                self._release_reservation(r, emit=False)
        elif kind == "del":
            gone = self.objects.get(entry[1])
            if gone is not None:
                for rep in gone.replicas:
                    self._free_replica(gone.key, rep)
                self.objects.pop(gone.key, None)
                self.lru.pop(gone.key, None)
        else:
            raise InvalidArgument(f"unknown oplog entry kind {kind!r}")

    def export(self) -> list[tuple[Any, ...]]:
        """Entries that rebuild the replicated state with :meth:`apply` (a snapshot)."""
        out: list[tuple[Any, ...]] = [("client", c.client_id, c.host, c.peer, c.ssd) for c in self.clients.values()]
        out += [("seg", s.client_id, s.name, s.peer, s.base, s.size, s.host) for s in self.segments.values()]
        out += [self._obj_entry(o) for o in self.objects.values() if o.complete]
        out += [("res", r.rid, r.client_id, r.segment, [[b, n] for b, n in sorted(r.blocks.items())],
                 self.cfg.put_timeout_s) for r in self.reservations.values()]
        return out

    def on_takeover(self, now: float) -> None:
        """A new leader: every client gets a fresh liveness period, every object a lease."""
        for c in self.clients.values():
            c.last_seen = now
        for o in self.objects.values():
            o.lease_until = max(o.lease_until, now + self.cfg.lease_ttl_s)
        for r in self.reservations.values():  # a client may still be writing into them
            r.deadline = max(r.deadline, now + self.cfg.put_timeout_s)


def error_tuple(exc: BaseException) -> tuple[int, str]:
    return int(code_of(exc)), str(exc) if str(exc) else type(exc).__name__

