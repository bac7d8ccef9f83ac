"""The master's records, and the base every part of ``MasterState`` shares.

- Records: :class:`ClientInfo` (a registered client, its segments, tasks and SSD keys),
  :class:`Segment` (mounted memory and its allocator), :class:`Obj` (an object: replicas as
  :data:`SliceT` lists, version token, lease, pins, SSD copy), :class:`Reservation` (an
  extent lent to one client).
- :class:`StateCore`: the attributes ``MasterState.__init__`` sets and the helpers every
  part uses (emitting replicated changes, tokens, freeing and indexing replicas, dropping an
  object, placing a new one). The parts: :mod:`~mooncake_core.store.reservations`,
  :mod:`~mooncake_core.store.eviction` (the eviction driver),
  :mod:`~mooncake_core.store.tiering` (the SSD tier, master side),
  :mod:`~mooncake_core.store.replication`.
"""

from __future__ import annotations

import random
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mooncake_core.config import StoreConfig
from mooncake_core.errors import ObjectExists
from mooncake_core.store.allocator import STRATEGIES, OffsetAllocator, place
from mooncake_core.store.protocol import (
    MAX_BATCH,
    MAX_KEY,
    InvalidArgument,
    ObjectBusy,
    ReplicaCfg,
    UnknownClient,
)

__all__ = [
    "ClientInfo",
    "Obj",
    "Reservation",
    "Segment",
    "SliceT",
    "StateCore",
    "check_batch",
    "check_key",
]


SliceT = tuple[str, int, int]  # (segment name, offset inside the segment, length)


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidArgument("key must be a non-empty string")
    if len(key) > MAX_KEY and len(key.encode()) > MAX_KEY:
        raise InvalidArgument(f"key is {len(key.encode())} bytes; the limit is {MAX_KEY}")
    if "\x00" in key:  # only as a tenant separator
        check_tenant_key(key)
    return key


_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_tenant_key(key: str) -> None:
    """Refuse a NUL anywhere but as one tenant separator after a valid tenant name
    (:mod:`mooncake_core.store.tenants`)."""
    i = key.find("\x00")
    if i <= 0 or "\x00" in key[i + 1 :] or i + 1 == len(key) or not _TENANT.match(key[:i]):
        raise InvalidArgument(
            f"key {key!r}: a NUL character is only allowed as the tenant separator "
            "(set a tenant on the client instead)"
        )


def check_batch(keys: list[str]) -> None:
    if len(keys) > MAX_BATCH:
        raise InvalidArgument(f"batch of {len(keys)} keys exceeds the limit of {MAX_BATCH}")


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
        return next(
            (b for b, n in self.blocks.items() if b <= offset and offset + need <= b + n), None
        )


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
    lease_rep: float = 0.0  # (HA) lease deadline logged for standbys; see replication.py
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


class StateCore:
    """The shared base of ``MasterState``'s parts (see module doc); holds no state of its own."""

    cfg: StoreConfig
    rng: random.Random
    clients: dict[str, ClientInfo]
    segments: dict[str, Segment]
    objects: dict[str, Obj]
    lru: OrderedDict[str, None]
    early: dict[str, int]  # key -> token of objects committed early, awaiting put_confirm
    _token: int
    offload_pending: dict[str, int]  # segment -> bytes queued for SSD offload
    reservations: dict[int, Reservation]
    _rid: int
    on_change: Callable[[tuple[Any, ...]], None] | None
    on_task: Callable[[str], None] | None
    counters: dict[str, int]
    lease_dirty: dict[str, None] | None  # (HA) keys whose lease standbys must learn
    # holder client id -> when a writer reported one of its segments unreachable (leader-local;
    # see MasterState.report_unreachable)
    suspects: dict[str, float]

    if TYPE_CHECKING:  # provided by the other parts (MasterState and its mixins)

        def _unmount(self, s: Segment) -> None: ...
        def _reclaim_zombies(self, now: float) -> int: ...
        def _release_reservation(self, r: Reservation, *, emit: bool = True) -> None: ...
        def _carve(
            self, r: Reservation, block: int, offset: int, need: int, *, release: bool
        ) -> None: ...
        def _make_room_for_object(self, key: str, now: float) -> None: ...
        def evict_for(self, nbytes: int, now: float) -> int: ...
        def _offload(self, o: Obj, rep: list[SliceT]) -> bool: ...
        def _admit(self, key: str, size: int, now: float) -> None: ...
        def _lease_mark(self, o: Obj) -> None: ...

    def _emit(self, *entry: Any) -> None:
        if self.on_change is not None:
            self.on_change(entry)

    def _hold(self, o: Obj, until: float) -> None:
        """Lease ``o`` until ``until`` at least (a copy reads it); with HA, standbys learn the
        lease on the next tick, as they learn read leases."""
        if until > o.lease_until:
            o.lease_until = until
            if until > o.lease_rep and self.lease_dirty is not None:
                self._lease_mark(o)

    def _get_obj(self, key: str) -> Obj | None:
        return self.objects.get(key)

    def _next_token(self) -> int:
        self._token += 1
        return self._token

    def _client(self, client_id: str, now: float) -> ClientInfo:
        c = self.clients.get(client_id)
        if c is None:
            raise UnknownClient(
                f"unknown client id {client_id!r}: register (mount) first; it may have expired"
            )
        c.last_seen = now
        if self.suspects and client_id in self.suspects:
            # a request from a suspect holder: it is alive, placement may use it again
            del self.suspects[client_id]
        return c

    def _suspect(self, client_id: str, now: float) -> bool:
        """Whether placement should avoid ``client_id``'s segments: a writer reported one of them
        unreachable, the holder has sent no request since, and the mark is younger than the
        client TTL (after which a silent holder is dropped anyway)."""
        since = self.suspects.get(client_id)
        if since is None:
            return False
        if now - since > self.cfg.client_ttl_s or client_id not in self.clients:
            del self.suspects[client_id]
            return False
        return True

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
        pin = o.soft_pin_until  # replicated on the wall clock (each master's monotonic differs)
        if pin:
            pin += time.time() - time.monotonic()
        return ("obj", o.key, o.size, o.replicas, o.disk, o.hard_pin, pin)

    def _strategy(self, cfg: ReplicaCfg, what: str) -> str:
        """The placement strategy ``cfg`` asks for (or the master's default), validated."""
        strategy = cfg.strategy or self.cfg.placement
        if strategy not in STRATEGIES:
            raise InvalidArgument(
                f"{what}: unknown placement {strategy!r} (use one of {', '.join(STRATEGIES)})"
            )
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

    def _candidates(self, exclude: Collection[str]) -> list[Segment]:
        """The segments a new object may go to: all but ``exclude`` (those its writer could not
        reach)."""
        if not exclude:
            return list(self.segments.values())
        return [s for s in self.segments.values() if s.name not in exclude]

    def _place(
        self,
        key: str,
        size: int,
        cfg: ReplicaCfg,
        strategy: str,
        client_id: str,
        exclude: Collection[str] = (),
        now: float = 0.0,
    ) -> list[list[SliceT]]:
        """Replicas of a new object on the candidate segments (see :meth:`_candidates`), those of
        suspect holders (:meth:`_suspect`) only when the others have no room."""
        if cfg.preferred_segment and cfg.preferred_segment not in self.segments:
            raise InvalidArgument(
                f"put {key!r}: preferred segment {cfg.preferred_segment!r} is not mounted"
            )
        segs = self._candidates(exclude)
        got: list[Any] = []
        if self.suspects:
            trusted = [s for s in segs if not self._suspect(s.client_id, now)]
            if len(trusted) < len(segs):
                got = self._place_on(trusted, size, cfg, strategy, client_id)
        if not got:
            got = self._place_on(segs, size, cfg, strategy, client_id)
        return [[(s.name, off, n) for s, off, n in rep] for rep in got]

    def _place_on(
        self, segs: list[Segment], size: int, cfg: ReplicaCfg, strategy: str, client_id: str
    ) -> list[Any]:
        return place(
            segs,
            size,
            min(cfg.replica_num, len(segs)),
            strategy=strategy,
            client_id=client_id,
            preferred=cfg.preferred_segment,
            rng=self.rng,
        )
