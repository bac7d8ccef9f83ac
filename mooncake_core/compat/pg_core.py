"""The data and membership plane of ``mooncake.pg`` (see :mod:`mooncake_core.compat.pg`).

Contract:

- A group has ``size`` fixed *seats* (Mooncake's ``max_group_size``); ``active`` is the
  seat mask, an int32 tensor updated in place (the published ``active_ranks`` mirror).
  Every collective runs among the seats active in this rank's view; every active rank
  must issue the same collectives in the same order (as with any process group).
- Data moves through our transfer engine: ``put_tensor_async`` into the peer's inbox
  under a key ``{group}/{seq}/...``, ``get_tensor`` out of ours. Peer engine names are
  exchanged through the c10d store torch gives the backend's creator.
- :meth:`Seats.exchange` is the one collective primitive, in two phases: (1) every
  participant sends one payload to every other (its own tensor, a chunk, or an empty
  tensor) and waits for theirs; (2) every participant sends the mask of peers whose
  payload it holds (a peer whose delivery failed is left out) and the members of the
  collective are the peers in *every* mask received. With one failure per collective and a
  failure detector that never suspects a live peer, every survivor computes the same
  members: a peer that died part way through phase 1 is missing from the mask of a
  survivor, and that mask reaches every survivor. Reductions then run over the members in
  rank order, so every member gets bit-identical results. Only agreed facts change the
  mask (participants that are not members leave; a peer that dies after its data went out
  leaves at the next collective; a failed send/recv raises without deactivating), so every
  rank keeps the same view and the same collective sequence.
- Failure detection: while a payload is awaited, the peer is pinged every ``PROBE_S``; a
  peer that refuses (its process is gone: loopback refuses at once) ``PING_FAILS`` times in
  a row, or whose delivery fails, has failed. A live peer that never shows up ends the
  collective with :class:`PGTimeout` after the group's timeout.
- Membership changes (:meth:`activate`, :meth:`deactivate`, :meth:`sync`) are themselves
  collectives among the active seats; a joiner (:meth:`join`) posts ``mc/join/{seat}`` in
  the store and blocks until the lowest active member publishes its admission (the
  collective sequence number, the mask and every seat's engine name).

Not handled: two ranks failing in one collective may leave survivors with different
members for that one collective; the store's host (rank 0 with ``tcp://``) is a single
point of failure, as for every torch process group; a timed-out collective leaves the group
unusable.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch

from mooncake_core.errors import MooncakeError, TransferTimeout
from mooncake_core.transfer import TransferEngine

__all__ = ["PGError", "PGTimeout", "RankFailure", "Seats"]

logger = logging.getLogger(__name__)

PROBE_S = 0.1  # how long a wait runs between liveness probes of the awaited peer
PING_FAILS = 2  # consecutive refused probes that mark a peer failed
PING_TIMEOUT_S = 2.0


class PGError(RuntimeError):
    """A ``mooncake.pg`` collective could not run (one line naming why)."""


class PGTimeout(PGError, TimeoutError):
    """A live peer did not take part within the group's timeout; the group is unusable."""


class RankFailure(PGError):
    """Ranks failed during a collective and ``auto_deactivate_on_failure`` is off, or the
    data a call needs (a broadcast root, a recv source) was on a failed rank."""


class Seats:
    """One group's seats, their engine names and the collective sequence.

    Thread-safety: collectives are serialized by an internal lock; the read-only helpers
    (:meth:`active_ranks`, :meth:`peer_state`) may be called from any thread.
    """

    def __init__(
        self,
        engine: TransferEngine,
        store: Any,
        rank: int,
        active: torch.Tensor,
        *,
        gid: str,
        timeout_s: float,
        is_extension: bool,
        auto_deactivate: bool,
        auto_sync: bool,
    ) -> None:
        self.engine = engine
        self.store = store
        self.rank = rank
        self.size = int(active.numel())
        self.active = active
        self.gid = gid
        self.timeout_s = timeout_s
        self.auto_deactivate = auto_deactivate
        self.auto_sync = auto_sync
        self.peers = [""] * self.size
        self.seq = 0
        self.synced = 0
        self._p2p: dict[tuple[int, int, int], int] = {}
        self._lock = threading.RLock()
        if is_extension:
            self.active[rank] = 0  # a joiner's seat opens when an online rank admits it
            return
        if not int(self.active[rank]):
            raise PGError(
                f"rank {rank} is inactive in active_ranks: start it with "
                "MooncakeBackendOptions(..., is_extension=True) and call join_group()"
            )
        self.store.set(f"mc/addr/{rank}", engine.name)
        for r in self.members_view():
            self.peers[r] = self._store_get(f"mc/addr/{r}").decode()
        self.synced = len(self.members_view())
        logger.info("mooncake.pg group %s: rank %d of %d seats ready", gid, rank, self.size)

    # ------------------------------------------------------------------ views
    def members_view(self) -> list[int]:
        return [r for r in range(self.size) if int(self.active[r])]

    def participants(self) -> list[int]:
        parts = self.members_view()
        if self.rank not in parts:
            raise PGError(
                f"rank {self.rank} is not active in this group: a joiner calls join_group() "
                "first; a rank its peers deactivated takes no further part"
            )
        return parts

    def active_ranks(self) -> torch.Tensor:
        with self._lock:
            return self.active.clone()

    def peer_state(self, ranks: Iterable[int]) -> list[bool]:
        """True for each seat whose engine answers a ping (its process is up)."""
        out = []
        for r in ranks:
            self._check_seat(r)
            name = self.peers[r]
            out.append(r == self.rank or (bool(name) and self.engine.ping(name, PING_TIMEOUT_S)))
        return out

    def _check_seat(self, r: int) -> None:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.size:
            raise ValueError(f"rank {r!r} is not a seat of this group (0..{self.size - 1})")

    # ------------------------------------------------------------------ store
    def _store_get(self, key: str) -> bytes:
        try:
            self.store.wait([key], timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - the store raises its own error types
            raise PGTimeout(
                f"mooncake.pg: store key {key!r} did not appear within {self.timeout_s:.0f}s "
                f"({type(exc).__name__})"
            ) from None
        value: bytes = self.store.get(key)
        return value

    # ------------------------------------------------------------------ waiting
    def _wait(self, key: str, r: int, deadline: float) -> torch.Tensor | None:
        """The tensor peer ``r`` sent under ``key``, or None once ``r`` has failed."""
        refused = 0
        while True:
            left = deadline - time.monotonic()
            try:
                got: torch.Tensor = self.engine.get_tensor(
                    key, timeout=max(0.0, min(PROBE_S, left))
                )
                return got
            except TransferTimeout:
                pass
            if time.monotonic() >= deadline:
                raise PGTimeout(
                    f"mooncake.pg collective #{self.seq}: rank {r} is alive but sent nothing "
                    f"within {self.timeout_s:.0f}s (did every active rank issue it?)"
                )
            if self.engine.ping(self.peers[r], PING_TIMEOUT_S):
                refused = 0
                continue
            refused += 1
            if refused >= PING_FAILS:
                logger.warning("mooncake.pg: rank %d does not answer: failed", r)
                return None

    @staticmethod
    def _delivered(fut: concurrent.futures.Future[None], deadline: float) -> bool:
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
            return True
        except concurrent.futures.TimeoutError:
            raise PGTimeout("mooncake.pg: a send did not finish within the timeout") from None
        except (MooncakeError, OSError) as exc:
            logger.warning("mooncake.pg: delivery failed: %s", exc)
            return False

    # ------------------------------------------------------------------ the primitive
    def exchange(
        self, payloads: Mapping[int, torch.Tensor]
    ) -> tuple[dict[int, torch.Tensor], list[int]]:
        """Send ``payloads[r]`` to every participant ``r``; return what each member sent us
        and the members (see the module doc). Ranks that failed are deactivated (or
        :class:`RankFailure` raised, with ``auto_deactivate_on_failure`` off)."""
        with self._lock:
            parts = self.participants()
            received, members = self._exchange(parts, payloads)
            # only what every member agrees on changes the mask, so the views stay equal
            # (a rank that died after its data went out leaves at the next collective)
            lost = [r for r in parts if r not in members]
            if lost and not self.auto_deactivate:
                raise RankFailure(
                    f"mooncake.pg collective #{self.seq}: ranks {lost} failed "
                    "(auto_deactivate_on_failure=False: active ranks unchanged)"
                )
            for r in lost:
                self.active[r] = 0
            if lost:
                logger.warning(
                    "mooncake.pg collective #%d: ranks %s failed, deactivated; it ran among %s",
                    self.seq,
                    lost,
                    members,
                )
                if self.auto_sync:
                    self._sync()
            if self.rank not in members:
                raise RankFailure(
                    f"mooncake.pg collective #{self.seq}: rank {self.rank} was dropped by its "
                    "peers (they did not receive its data)"
                )
            return received, members

    def _exchange(
        self, parts: list[int], payloads: Mapping[int, torch.Tensor]
    ) -> tuple[dict[int, torch.Tensor], list[int]]:
        self.seq += 1
        me, eng = self.rank, self.engine
        others = [r for r in parts if r != me]
        deadline = time.monotonic() + self.timeout_s
        k1 = f"{self.gid}/{self.seq}/d/"
        puts = {r: eng.put_tensor_async(payloads[r], self.peers[r], k1 + str(me)) for r in others}
        received = {me: payloads[me]}
        failed: set[int] = set()
        for r in others:
            got = self._wait(k1 + str(r), r, deadline)
            if got is None:
                failed.add(r)
            else:
                received[r] = got
        failed |= {r for r, fut in puts.items() if not self._delivered(fut, deadline)}
        mask = torch.zeros(self.size, dtype=torch.uint8)
        for r in received:
            mask[r] = int(r not in failed)
        k2 = f"{self.gid}/{self.seq}/m/"
        alive = [r for r in others if r not in failed]
        puts = {r: eng.put_tensor_async(mask, self.peers[r], k2 + str(me)) for r in alive}
        agreed = mask.clone()
        for r in alive:
            theirs = self._wait(k2 + str(r), r, deadline)
            if theirs is not None:  # None: it died after its data went out
                agreed &= theirs
        for fut in puts.values():
            self._delivered(fut, deadline)
        members = [r for r in parts if int(agreed[r])]
        return {r: received[r] for r in members if r in received}, members

    # ------------------------------------------------------------------ membership
    def sync(self) -> int:
        """Agree on the active mask with every reachable active rank; returns how many
        ranks took part (``get_num_synced_ranks``)."""
        with self._lock:
            self.participants()
            return self._sync()

    def _sync(self) -> int:
        parts = self.participants()
        mine = self.active.to(torch.uint8)
        received, members = self._exchange(parts, {r: mine for r in parts})
        agreed = torch.zeros(self.size, dtype=torch.uint8)
        for r in members:
            agreed[r] = 1
        for r in members:
            agreed &= received[r]
        self.active.copy_(agreed.to(self.active.dtype))
        self.synced = len(members)
        return self.synced

    def deactivate(self, ranks: Iterable[int]) -> list[int]:
        """Collective: every active rank calls it; the union of the lists leaves."""
        targets = self._agree_on(ranks)
        with self._lock:
            for t in targets:
                self.active[t] = 0
        return targets

    def _agree_on(self, ranks: Iterable[int]) -> list[int]:
        want = sorted(set(ranks))
        for r in want:
            self._check_seat(r)
        req = torch.tensor(want, dtype=torch.int64)
        received, members = self.exchange({r: req for r in self.members_view()})
        return sorted({int(x) for m in members for x in received[m].tolist()})

    def activate(self, ranks: Iterable[int]) -> list[int]:
        """Collective among the active ranks: admit the joiners waiting on ``ranks``
        (each blocks in :meth:`join`). Returns the seats activated."""
        targets = [t for t in self._agree_on(ranks) if not int(self.active[t])]
        if not targets:
            return []
        with self._lock:
            members = self.members_view()
            key = f"mc/act/{self.gid}/{self.seq}"
            if self.rank == members[0]:
                peers = list(self.peers)
                admitted: dict[int, str] = {}
                for t in targets:
                    req = json.loads(self._store_get(f"mc/join/{t}"))
                    peers[t], admitted[t] = str(req["name"]), str(req["nonce"])
                mask = [int(v) for v in self.active.tolist()]
                for t in targets:
                    mask[t] = 1
                doc = json.dumps({"seq": self.seq, "active": mask, "peers": peers})
                for t, nonce in admitted.items():
                    self.store.delete_key(f"mc/join/{t}")
                    self.store.set(f"mc/admit/{t}/{nonce}", doc)
                self.store.set(key, doc)
            self._adopt(json.loads(self._store_get(key)), targets)
            logger.info("mooncake.pg group %s: ranks %s activated", self.gid, targets)
            return targets

    def join(self) -> None:
        """Block until an online rank activates this one (``join_group``)."""
        with self._lock:
            if int(self.active[self.rank]):
                raise PGError(f"rank {self.rank} is already active in this group")
            nonce = uuid.uuid4().hex
            self.store.set(
                f"mc/join/{self.rank}", json.dumps({"name": self.engine.name, "nonce": nonce})
            )
            logger.info("mooncake.pg: rank %d waits to be activated", self.rank)
            doc = json.loads(self._store_get(f"mc/admit/{self.rank}/{nonce}"))
            self.seq = int(doc["seq"])
            self._adopt(doc, [self.rank])

    def _adopt(self, doc: Mapping[str, Any], joined: list[int]) -> None:
        self.active.copy_(torch.tensor(doc["active"], dtype=self.active.dtype))
        self.peers = [str(p) for p in doc["peers"]]
        self._p2p = {
            k: v for k, v in self._p2p.items() if k[0] not in joined and k[1] not in joined
        }
        self.synced = len(self.members_view())

    # ------------------------------------------------------------------ point to point
    def _p2p_key(self, src: int, dst: int, tag: int) -> str:
        n = self._p2p.get((src, dst, tag), 0)
        self._p2p[(src, dst, tag)] = n + 1
        return f"{self.gid}/p/{src}>{dst}/{tag}/{n}"

    def _peer_for_p2p(self, r: int, what: str) -> str:
        self._check_seat(r)
        self.participants()
        if r == self.rank:
            raise ValueError(f"mooncake.pg {what}: rank {r} is this rank")
        if not int(self.active[r]):
            raise RankFailure(f"mooncake.pg {what}: rank {r} is not active")
        return self.peers[r]

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        with self._lock:
            peer = self._peer_for_p2p(dst, "send")
            fut = self.engine.put_tensor_async(tensor, peer, self._p2p_key(self.rank, dst, tag))
            if not self._delivered(fut, time.monotonic() + self.timeout_s):
                self._failed_peer(dst, "send")

    def recv(self, src: int, tag: int) -> torch.Tensor:
        with self._lock:
            self._peer_for_p2p(src, "recv")
            key = self._p2p_key(src, self.rank, tag)
        got = self._wait(key, src, time.monotonic() + self.timeout_s)
        if got is None:
            with self._lock:
                self._failed_peer(src, "recv")
        assert got is not None
        return got

    def _failed_peer(self, r: int, what: str) -> None:
        # not deactivated here, where the other ranks cannot see it: the next collective
        # finds it failed on every rank alike
        raise RankFailure(f"mooncake.pg {what}: rank {r} failed")
