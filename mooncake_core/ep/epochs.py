"""Epoch changes of an EP rank: failures, joins and rebalances become a new membership epoch.

An exchange that fails (peer reset, peer process gone, peer left the epoch) or exceeds its
timeout starts a transition (:meth:`EpochChanges._transition`, agreement in
:mod:`mooncake_core.ep.membership`): the group is dropped and the mailbox marked, survivors
agree on the next epoch, form a fresh group (:meth:`EpochChanges._install`), copy the weights
the re-plan moved, and pick the epoch's data plane (:mod:`mooncake_core.ep.rounds`); the
call that failed raises :class:`~mooncake_core.errors.RankFailure`.

:class:`EpochChanges` is the part of :class:`~mooncake_core.ep.engine.ElasticEP` that does
this; ``ElasticEP.__init__`` sets the attributes declared here.
"""

from __future__ import annotations

import logging
import time
from typing import NoReturn

import torch

from mooncake_core.ep.comm import Group, GroupFailure, open_group
from mooncake_core.ep.config import EPConfig
from mooncake_core.ep.experts import ExpertBank
from mooncake_core.ep.membership import AliveInfo, Membership, View, plan_view
from mooncake_core.ep.rounds import DISPATCH_ROW, CollectiveRound, Round, ShmRound
from mooncake_core.ep.routing import ReplicaTable
from mooncake_core.ep.shm import MAILBOX_OK, ShmPlane
from mooncake_core.ep.weights import STORE, ExpertWeightSource, FetchContext, LiveReplicaSource
from mooncake_core.errors import EPError, Evicted, MooncakeError, RankFailure

__all__ = ["EpochChanges", "abort_word"]

logger = logging.getLogger("mooncake_core.ep.engine")  # one logger for a rank's EP messages


def abort_word(epoch: int) -> int:
    """Mailbox sequence word meaning "this member left epoch ``epoch``"."""
    return -(epoch + 1)


class EpochChanges:
    """Leaving, agreeing on and installing membership epochs (see module doc)."""

    config: EPConfig
    seat: int
    bank: ExpertBank
    membership: Membership
    store_source: ExpertWeightSource | None
    live_source: LiveReplicaSource
    view: View | None
    group: Group | None
    round: int
    step: int
    load: torch.Tensor
    stats: dict[str, float]
    _transition_pending: bool
    _seat_to_member: torch.Tensor
    _replica_table: torch.Tensor
    _table: ReplicaTable | None
    _shm: ShmPlane | None
    _shm_on: bool
    _mailbox: bool
    _xchg: int  # header exchanges completed in this epoch
    _collective: CollectiveRound
    _plane: Round  # how this epoch's rounds travel

    @property
    def epoch(self) -> int:
        return -1 if self.view is None else self.view.epoch

    def _leave_mailboxes(self, epoch: int) -> None:
        """Members waiting on our mailbox for the exchange in progress fail at once (the
        shared-memory counterpart of closing the group)."""
        if self._mailbox and self._shm is not None:
            self._shm.abort_slot(self._xchg + 1, abort_word(epoch))

    def _fail(self, exc: GroupFailure) -> NoReturn:
        self._transition("failure", cause=exc)
        raise RankFailure(
            f"seat {self.seat}: membership changed during round {self.round}; "
            f"now epoch {self.epoch} with seats {list(self._require_view().members)}; redo the step"
        ) from exc

    def _transition(
        self, reason: str, rebalance: bool = False, cause: Exception | None = None
    ) -> None:
        t0 = time.monotonic()
        old = self._require_view()
        self._leave_mailboxes(old.epoch)
        if self.group is not None:
            self.group.close()
            self.group = None
        self._transition_pending = False
        epoch = old.epoch + 1
        logger.info(
            "EP seat %d: transition to epoch %d (%s) %s", self.seat, epoch, reason, cause or ""
        )
        while True:
            info = AliveInfo(
                self.round, self.step, tuple(self.bank.held()), tuple(self.load.tolist()), rebalance
            )
            self.membership.post_alive(epoch, info)
            view = self._await_view(epoch, old, reason)
            if self.seat not in view.members:
                self.view = None
                raise Evicted(
                    f"seat {self.seat} was left out of epoch {view.epoch} "
                    f"(members {list(view.members)}); call join() to come back"
                )
            try:
                self._install(view)
                break
            except GroupFailure as exc:
                logger.warning(
                    "EP seat %d: installing epoch %d failed: %s", self.seat, view.epoch, exc
                )
                if self.group is not None:
                    self.group.close()
                    self.group = None
                old, epoch = view, view.epoch + 1
        self.stats["transitions"] += 1
        self.stats["last_recover_s"] = time.monotonic() - t0

    def _await_view(self, epoch: int, old: View, reason: str) -> View:
        cfg = self.config
        start = time.monotonic()
        while True:
            view = self.membership.read_view(epoch)
            if view is not None:
                return view
            posted = self.membership.read_alive(epoch, old.members)
            # A member seat with a fresh join request was restarted: its old process is gone.
            rejoining = self.membership.pending_joins(s for s in old.members if s not in posted)
            waiting = []
            for seat in old.members:
                if seat in posted:
                    continue
                age = self.membership.heartbeat_age(seat)
                dead = (
                    seat in rejoining
                    or age is None
                    or age > cfg.stale_s
                    or time.monotonic() - start > cfg.timeout_s + cfg.stale_s
                )
                if not dead:
                    waiting.append(seat)
            if not waiting:
                outside = [s for s in range(cfg.num_seats) if s not in posted]
                joiners = self.membership.pending_joins(outside)
                proposal = plan_view(
                    old,
                    posted,
                    joiners,
                    store_fallback=self.store_source is not None,
                    reason=reason,
                )
                won = self.membership.offer_view(proposal)
                if won == proposal:
                    logger.info(
                        "EP epoch %d: members %s, %d expert copies (%s)",
                        won.epoch,
                        list(won.members),
                        len(won.transfers),
                        won.reason,
                    )
                return won
            time.sleep(0.005)

    def _install(self, view: View, connect_timeout_s: float | None = None) -> None:
        cfg = self.config
        idx = view.members.index(self.seat)
        self.view = view
        self.group = open_group(
            self.membership.store,
            f"{cfg.prefix}/pg/{view.epoch}/",
            idx,
            len(view.members),
            backend=cfg.backend,
            timeout_s=cfg.timeout_s,
            connect_timeout_s=connect_timeout_s or cfg.timeout_s + cfg.stale_s,
            host=cfg.host,
        )
        self._xchg = 0
        self._shm_on = self._probe_shm(self.group)
        self._mailbox = self._shm_on and MAILBOX_OK
        if self._shm_on and self._shm is not None:  # the collective round's host: this engine
            self._plane = ShmRound(self._collective.ep, self._shm)
        else:
            self._plane = self._collective
        ctx = FetchContext(self.seat, view.members, self.bank, self.group)
        got = self.live_source.fetch(view.transfers, ctx)
        if self.store_source is not None and any(t.src_seat == STORE for t in view.transfers):
            got.update(self.store_source.fetch(view.transfers, ctx))
        for e, flat in got.items():
            self.bank.put(e, flat)
        self.bank.retain([e for e in view.placement.seat_experts(self.seat) if e >= 0])
        self._seat_to_member.fill_(-1)
        for i, seat in enumerate(view.members):
            self._seat_to_member[seat] = i
        self._replica_table = view.placement.replica_table()
        self._table = None
        self.round = view.resume_round

    def _probe_shm(self, group: Group) -> bool:
        """Collective: does this epoch move rows over the shared-memory plane?"""
        cfg = self.config
        if cfg.transport == "collective" or group.device.type != "cpu":
            if cfg.transport == "shm":
                raise EPError("EP transport 'shm' needs CPU tensors (backend 'gloo')")
            return False
        if self._shm is None:
            try:
                self._shm = ShmPlane(
                    max_members=cfg.num_seats, row_width=DISPATCH_ROW + cfg.slots_per_rank
                )
            except (OSError, MooncakeError) as exc:
                logger.warning("EP seat %d: no shared memory (%s)", self.seat, exc)
        row = self._shm.probe_row() if self._shm is not None else ShmPlane.no_probe_row()
        rows = group.all_gather(row)
        ok = self._shm is not None and self._shm.probe(rows)
        votes = group.all_reduce(torch.tensor([int(ok)], dtype=torch.int64))
        agreed = int(votes.item()) == group.size
        if not agreed and cfg.transport == "shm":
            raise EPError(
                "EP transport 'shm' was required but some member cannot map the others' shared "
                "memory (different hosts or no permission); use transport 'auto'"
            )
        logger.debug("EP seat %d: epoch data plane %s", self.seat, "shm" if agreed else "group")
        return agreed

    def _require_view(self) -> View:
        if self.view is None:
            raise EPError(f"seat {self.seat} is not serving; call start() or join()")
        return self.view
