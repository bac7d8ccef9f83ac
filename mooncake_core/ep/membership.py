"""One versioned membership view (epoch) agreed through a shared store.

Contract:

- Every EP rank occupies a *seat* ``0..R-1``. A :class:`View` is one epoch: its members,
  its placement, the weight transfers that installing it requires, and where the rounds
  resume. Views are immutable and stored as JSON under ``{prefix}/e{epoch}/view``.
- A transition to epoch ``e`` starts on any member that sees a failure (collective error or
  timeout), a join request (signalled by the leader in a round header) or a collective
  ``rebalance()``. Each member posts :class:`AliveInfo` under ``{prefix}/e{e}/alive/{seat}``.
  Once every member of epoch ``e-1`` has either posted or is *dead* (its heartbeat is older
  than ``stale_s``, or it has not posted within ``timeout_s + stale_s``), any waiting member
  computes the next view with :func:`plan_view` and offers it with ``compare_set``; the first
  offer wins and every member adopts exactly that one. A member left out gets ``Evicted``.
- Heartbeats are wall-clock timestamps written every ``heartbeat_s`` by a daemon thread on
  its own store connection (clocks of the EP hosts must agree to well within ``stale_s``).
- Joiners write a fresh nonce to ``{prefix}/join/{seat}`` and wait for a view listing it;
  the winner of that view records it under ``{prefix}/admitted/{seat}``. Keys are only
  ever overwritten, never deleted, so a check followed by a get cannot block.

The store host must outlive the ranks (run it on the launcher or scheduler, as the Mooncake
PG coordinator is); it is the single point of failure of this design. Steps do not use it
(only the leader's periodic look for join requests, which tolerates its loss), so a layer
keeps serving while it is down; anything that needs agreement (a failure, a join, a
rebalance, start) raises :class:`MembershipStoreLost` instead of hanging.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed
from torch._C._distributed_c10d import TCPStore

from mooncake_core.ep.placement import Placement, balanced_placement, repair_placement
from mooncake_core.ep.weights import STORE, Transfer
from mooncake_core.errors import EPError

__all__ = ["AliveInfo", "Membership", "MembershipStoreLost", "View", "plan_view"]

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


class MembershipStoreLost(EPError):
    """The shared membership store cannot be reached: no membership change can be agreed."""


def _store_op(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Turn the store client's network errors into :class:`MembershipStoreLost`."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except torch.distributed.DistError as exc:
            self: Any = args[0]
            raise MembershipStoreLost(
                f"the EP membership store {self.host}:{self.port} is unreachable "
                f"({fn.__name__}): {exc}. It must outlive the ranks; steps go on without it, "
                "but failures, joins and rebalancing need it"
            ) from exc

    return wrapper


@dataclass(frozen=True)
class AliveInfo:
    """What a member reports when it enters a transition."""

    round: int
    step: int
    held: tuple[int, ...]
    load: tuple[float, ...]
    rebalance: bool = False

    def to_json(self) -> str:
        return json.dumps(
            {
                "round": self.round,
                "step": self.step,
                "held": list(self.held),
                "load": list(self.load),
                "rebalance": self.rebalance,
            }
        )

    @staticmethod
    def from_json(raw: bytes | str) -> AliveInfo:
        d = json.loads(raw)
        return AliveInfo(
            int(d["round"]),
            int(d["step"]),
            tuple(d["held"]),
            tuple(d["load"]),
            bool(d["rebalance"]),
        )


@dataclass(frozen=True)
class View:
    """One membership epoch.

    Attributes:
        epoch: version; strictly increasing.
        members: live seats, sorted; a member's group rank is its index here.
        placement: slot -> expert for this epoch.
        resume_round: the round every member continues from (the slowest survivor's).
        max_step: the most steps any survivor completed (a joiner starts there).
        transfers: expert weights to move while installing this view.
        joined: ``(seat, nonce)`` of the joiners admitted by this view.
        reason: ``"start"``, ``"failure"``, ``"join"`` or ``"rebalance"``.
    """

    epoch: int
    members: tuple[int, ...]
    placement: Placement
    resume_round: int = 0
    max_step: int = 0
    transfers: tuple[Transfer, ...] = ()
    joined: tuple[tuple[int, str], ...] = ()
    reason: str = "start"
    load: tuple[float, ...] = field(default=())

    def active_mask(self) -> torch.Tensor:
        """``[num_seats]`` int32, 1 for members."""
        mask = torch.zeros(self.placement.num_seats, dtype=torch.int32)
        mask[list(self.members)] = 1
        return mask

    def to_json(self) -> str:
        p = self.placement
        return json.dumps(
            {
                "epoch": self.epoch,
                "members": list(self.members),
                "placement": [p.num_experts, p.num_seats, p.slots_per_rank, list(p.slot_expert)],
                "resume_round": self.resume_round,
                "max_step": self.max_step,
                "transfers": [[t.expert, t.src_seat, t.dst_seat] for t in self.transfers],
                "joined": [list(j) for j in self.joined],
                "reason": self.reason,
                "load": list(self.load),
            }
        )

    @staticmethod
    def from_json(raw: bytes | str) -> View:
        d = json.loads(raw)
        e, r, s, slots = d["placement"]
        return View(
            epoch=int(d["epoch"]),
            members=tuple(d["members"]),
            placement=Placement(int(e), int(r), int(s), tuple(slots)),
            resume_round=int(d["resume_round"]),
            max_step=int(d["max_step"]),
            transfers=tuple(Transfer(int(a), int(b), int(c)) for a, b, c in d["transfers"]),
            joined=tuple((int(a), str(b)) for a, b in d["joined"]),
            reason=str(d["reason"]),
            load=tuple(float(x) for x in d["load"]),
        )


def plan_view(
    old: View,
    posted: Mapping[int, AliveInfo],
    joiners: Mapping[int, str],
    *,
    store_fallback: bool = False,
    reason: str = "failure",
) -> View:
    """The next view from what the survivors posted (pure; every rank would agree).

    Placement: a full EPLB re-balance if any survivor asked for one, else
    :func:`repair_placement` over the experts the survivors actually hold (so only what must
    move moves). Each missing replica is copied from a surviving holder (spread over
    holders) or, with ``store_fallback``, read from the weight store; an expert with neither
    stays unplaced and routing applies the policy to it.
    """
    if not posted:
        raise EPError(f"no member of epoch {old.epoch} is alive; cannot form epoch {old.epoch + 1}")
    p = old.placement
    members = tuple(sorted(set(posted) | set(joiners)))
    load = [0.0] * p.num_experts
    for info in posted.values():
        for e, x in enumerate(info.load[: p.num_experts]):
            load[e] += x
    if sum(load) <= 0:
        load = [1.0] * p.num_experts
    holders: dict[int, list[int]] = {}
    for seat in sorted(posted):
        for e in posted[seat].held:
            holders.setdefault(e, []).append(seat)
    # What survivors really hold (a failed install may have left gaps): the base for repair.
    s_per = p.slots_per_rank
    actual = [-1] * len(p.slot_expert)
    for seat, info in posted.items():
        have = set(info.held)
        for slot in range(seat * s_per, (seat + 1) * s_per):
            if p.slot_expert[slot] in have:
                actual[slot] = p.slot_expert[slot]
    base = Placement(p.num_experts, p.num_seats, s_per, tuple(actual))
    available = range(p.num_experts) if store_fallback else sorted(holders)
    if any(info.rebalance for info in posted.values()):
        reason = "rebalance"
        new = balanced_placement(
            load, members, p.num_seats, s_per, held={s: i.held for s, i in posted.items()}
        )
    else:
        new = repair_placement(base, members, load, available)
    slot_expert = list(new.slot_expert)
    transfers: list[Transfer] = []
    sent: dict[int, int] = {}
    for slot, e in enumerate(slot_expert):
        if e < 0:
            continue
        dst = slot // s_per
        if dst in posted and e in posted[dst].held:
            continue
        srcs = [s for s in holders.get(e, []) if s != dst]
        if srcs:
            src = min(srcs, key=lambda s: (sent.get(s, 0), s))
            sent[src] = sent.get(src, 0) + 1
            transfers.append(Transfer(e, src, dst))
        elif store_fallback:
            transfers.append(Transfer(e, STORE, dst))
        else:
            slot_expert[slot] = -1
    placement = Placement(p.num_experts, p.num_seats, s_per, tuple(slot_expert))
    return View(
        epoch=old.epoch + 1,
        members=members,
        placement=placement,
        resume_round=min(i.round for i in posted.values()),
        max_step=max(i.step for i in posted.values()),
        transfers=tuple(transfers),
        joined=tuple(sorted(joiners.items())),
        reason=reason,
        load=tuple(load),
    )


class Membership:
    """Store mechanics of the membership protocol for one seat.

    Thread-safety: the heartbeat runs on its own thread and store connection; the other
    methods are called from the rank's main thread only.
    """

    def __init__(
        self,
        host: str,
        port: int,
        seat: int,
        *,
        prefix: str = "mooncake/ep",
        heartbeat_s: float = 0.1,
        stale_s: float = 1.0,
        store_timeout_s: float = 30.0,
    ):
        self.host = host
        self.port = port
        self.seat = seat
        self.prefix = prefix.rstrip("/")
        self.heartbeat_s = heartbeat_s
        self.stale_s = stale_s
        self._timeout = datetime.timedelta(seconds=store_timeout_s)
        self.store = TCPStore(host, port, is_master=False, timeout=self._timeout)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- keys ------------------------------------------------------------------------------
    def _k(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    # -- heartbeat -------------------------------------------------------------------------
    @_store_op
    def start_heartbeat(self) -> None:
        if self._thread is not None:
            return
        hb_store = TCPStore(self.host, self.port, is_master=False, timeout=self._timeout)
        key = self._k("hb", self.seat)
        hb_store.set(key, repr(time.time()))

        def beat() -> None:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    hb_store.set(key, repr(time.time()))
                except Exception:  # store gone: nothing left to report to
                    logger.warning("EP heartbeat of seat %d cannot reach the store", self.seat)
                    return

        self._thread = threading.Thread(target=beat, name=f"ep-heartbeat-{self.seat}", daemon=True)
        self._thread.start()

    @_store_op
    def heartbeat_age(self, seat: int) -> float | None:
        """Seconds since ``seat`` last beat, or None if it never did."""
        key = self._k("hb", seat)
        if not self.store.check([key]):
            return None
        return time.time() - float(self.store.get(key).decode())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_s + 1.0)
            self._thread = None

    # -- views -----------------------------------------------------------------------------
    @_store_op
    def read_view(self, epoch: int) -> View | None:
        key = self._k(f"e{epoch}", "view")
        if not self.store.check([key]):
            return None
        return View.from_json(self.store.get(key))

    @_store_op
    def offer_view(self, view: View) -> View:
        """Offer ``view``; return the view that won epoch ``view.epoch`` (maybe another)."""
        raw = self.store.compare_set(self._k(f"e{view.epoch}", "view"), "", view.to_json())
        won = View.from_json(raw)
        if won == view:
            self.store.set(self._k("current"), str(view.epoch))
            for seat, nonce in view.joined:  # keys are only ever set, never deleted
                self.store.set(self._k("admitted", seat), nonce)
        return won

    @_store_op
    def current_view(self) -> View | None:
        key = self._k("current")
        if not self.store.check([key]):
            return None
        return self.read_view(int(self.store.get(key).decode()))

    @_store_op
    def post_alive(self, epoch: int, info: AliveInfo) -> None:
        self.store.set(self._k(f"e{epoch}", "alive", self.seat), info.to_json())

    @_store_op
    def read_alive(self, epoch: int, seats: Iterable[int]) -> dict[int, AliveInfo]:
        out: dict[int, AliveInfo] = {}
        for seat in seats:
            key = self._k(f"e{epoch}", "alive", seat)
            if self.store.check([key]):
                out[seat] = AliveInfo.from_json(self.store.get(key))
        return out

    # -- joins -----------------------------------------------------------------------------
    @_store_op
    def request_join(self, nonce: str) -> None:
        self.store.set(self._k("join", self.seat), nonce)

    @_store_op
    def pending_joins(self, seats: Iterable[int]) -> dict[int, str]:
        """Join requests of ``seats`` (typically the non-members)."""
        out: dict[int, str] = {}
        for seat in seats:
            key = self._k("join", seat)
            if not self.store.check([key]):
                continue
            nonce = self.store.get(key).decode()
            done = self._k("admitted", seat)
            if not self.store.check([done]) or self.store.get(done).decode() != nonce:
                out[seat] = nonce
        return out

    def any_join_pending(self, seats: Iterable[int]) -> bool:
        return bool(self.pending_joins(seats))
