"""Elastic expert parallelism: DeepEP-shaped dispatch/combine that survives dead ranks.

Contract (one :class:`ElasticEP` per rank; all ranks call the same methods in the same order):

- ``start()`` forms epoch 0 with every seat. ``join()`` is for a restarted or new rank: it
  asks to join, is admitted by the next transition, receives its experts (from live replicas,
  or from the weight store if one is configured) and then follows the others.
- ``dispatch(x, topk_idx, topk_weights, active_ranks, num_experts, timeout)`` routes pairs to
  live replicas (policy for experts without one) and returns ``(recv_x, recv_counts,
  handle)``: ``recv_x`` is ``[N, H]`` grouped by local slot (a buffer reused by the next
  dispatch), ``recv_counts[s]`` rows for slot ``s``. ``combine(expert_out, handle)`` applies
  the gate weights at the expert side, sends the rows back and sums them: ``y``.
- ``forward(...)`` = dispatch + local experts + combine, retried across membership changes;
  this is what a MoE layer calls.
- Two transports, chosen per epoch (``EPConfig.transport``; every member uses the same):

  * *collective*: every round is three all-to-alls on the epoch's group (header, payload,
    combine); a payload row is one token per destination rank with its local slots and
    gate weights, and the expert side sums its pairs per token before sending back;
  * *shm* (same host, :mod:`mooncake_core.ep.shm`): one row per (token, destination slot)
    written straight into the sender's shared buffer; receivers concatenate their chunks
    out of the senders' buffers, and combine sums the weighted rows out of the experts'
    buffers. Headers go through shared-memory mailboxes (x86-64), else the group.

- Every round starts with a header exchange carrying the round number, a hash of
  ``active_ranks`` (ranks passing different masks all get :class:`InvalidRouting`), an
  error flag (a rank whose input is invalid still takes part, so the others get a clear
  error instead of a timeout) and the leader's "a join is pending" flag.
- An exchange that fails (peer reset, peer process gone, peer left the epoch) or exceeds its
  timeout starts a transition (see :mod:`mooncake_core.ep.membership`): the group is
  dropped and the mailbox marked, survivors agree on the next epoch, form a fresh group,
  copy the weights the re-plan moved, and the call raises :class:`RankFailure` (``forward``
  retries transparently). Survivors that had already finished the failed round replay it
  with zero tokens so every member is at the same round.

Where things live: this module is the front (lifecycle, the layer, validation and routing of
a round, header checks); :mod:`~mooncake_core.ep.rounds` moves a round's rows (the collective
and the shared-memory strategy), :mod:`~mooncake_core.ep.epochs` handles epoch changes.

Recovery bound: a crashed rank (sockets reset, process gone) is noticed at once; a hung one after
``timeout_s``. The agreement then waits until the dead rank's heartbeat is ``stale_s`` old
(counted from its death, so it overlaps detection) and forms the new group. Hence
``recover <= max(timeout_s, stale_s) + T_rebuild`` where ``T_rebuild`` (group rendezvous +
weight copy) is tens of milliseconds on loopback for the test sizes.
"""

from __future__ import annotations

import logging
import time
import uuid
import zlib

import torch

from mooncake_core.ep.comm import Group, GroupFailure
from mooncake_core.ep.config import EPConfig
from mooncake_core.ep.epochs import EpochChanges, abort_word
from mooncake_core.ep.experts import ExpertBank
from mooncake_core.ep.membership import Membership, MembershipStoreLost, View
from mooncake_core.ep.placement import Placement, balanced_placement
from mooncake_core.ep.rounds import (
    CTRL,
    ERR,
    JOIN,
    MASK,
    ROUND,
    WILDCARD,
    CollectiveRound,
    DispatchHandle,
    Head,
    Pairs,
    Round,
)
from mooncake_core.ep.routing import ReplicaTable, route, validate_routing
from mooncake_core.ep.shm import MailboxFailure, ShmPlane
from mooncake_core.ep.weights import ExpertWeightSource, LiveReplicaSource
from mooncake_core.errors import EPError, InvalidRouting, RankFailure

__all__ = ["DispatchHandle", "ElasticEP"]

logger = logging.getLogger(__name__)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ElasticEP(EpochChanges):
    """One rank of an elastic EP layer.

    Args:
        config: sizes, policy and timeouts (identical on every rank).
        seat: this rank's seat ``0..num_seats-1``.
        bank: expert weights; for ``start()`` it must hold (at least) this seat's experts
            of the initial placement; for ``join()`` it may be empty.
        store_host, store_port: the shared TCPStore (hosted by the launcher).
        placement: initial placement (default: balanced for uniform load).
        store_source: optional weight store used when no live replica has an expert.

    Thread-safety: not thread-safe; one call at a time, from the rank's main thread.
    """

    def __init__(
        self,
        config: EPConfig,
        seat: int,
        bank: ExpertBank,
        store_host: str,
        store_port: int,
        placement: Placement | None = None,
        store_source: ExpertWeightSource | None = None,
    ):
        if not 0 <= seat < config.num_seats:
            raise EPError(f"seat {seat} outside 0..{config.num_seats - 1}")
        if bank.hidden != config.hidden:
            raise EPError(f"expert bank hidden {bank.hidden} != config hidden {config.hidden}")
        self.config = config
        self.seat = seat
        self.bank = bank
        self.store_source = store_source
        self.live_source = LiveReplicaSource()
        self.membership = Membership(
            store_host,
            store_port,
            seat,
            prefix=config.prefix,
            heartbeat_s=config.heartbeat_s,
            stale_s=config.stale_s,
            store_timeout_s=config.connect_timeout_s,
        )
        self._initial = placement or balanced_placement(
            [1.0] * config.num_experts,
            range(config.num_seats),
            config.num_seats,
            config.slots_per_rank,
        )
        self.view: View | None = None
        self.served_view: View | None = None
        """The view whose epoch served the last completed round (``view`` may already be
        newer: a join transition runs right after the round that announced it)."""
        self.group: Group | None = None
        self.round = 0
        self.step = 0
        self.load = torch.zeros(config.num_experts, dtype=torch.float64)
        self.stats: dict[str, float] = {
            "dropped": 0,
            "substituted": 0,
            "transitions": 0,
            "last_recover_s": 0.0,
        }
        self._table: ReplicaTable | None = None
        self._table_mask: torch.Tensor | None = None
        self._table_mask_src: torch.Tensor | None = None
        self._view_mask: tuple[View, torch.Tensor, int] | None = None
        self._seat_to_member = torch.full((config.num_seats,), -1, dtype=torch.int64)
        self._replica_table = self._initial.replica_table()
        self._transition_pending = False
        self._last_join_poll = 0.0
        self._store_lost = False
        self._bufs: dict[str, torch.Tensor] = {}
        self._shm: ShmPlane | None = None
        self._shm_on = False
        self._mailbox = False
        self._xchg = 0  # header exchanges completed in this epoch
        self._collective = CollectiveRound(self)
        self._plane: Round = self._collective

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Form epoch 0 with every seat (blocks until all seats connect or connect timeout)."""
        self.membership.start_heartbeat()
        view = View(0, tuple(range(self.config.num_seats)), self._initial)
        for e in view.placement.seat_experts(self.seat):
            if e >= 0 and e not in self.bank.held():
                if self.store_source is None:
                    raise EPError(
                        f"seat {self.seat} must hold expert {e} to start; "
                        "load it or pass store_source"
                    )
                self.bank.put(e, self._store_load(e))
        won = self.membership.offer_view(view)
        self._install(won, connect_timeout_s=self.config.connect_timeout_s)
        logger.info("EP seat %d started epoch 0 with %d seats", self.seat, self.config.num_seats)

    def join(self, timeout_s: float = 60.0) -> None:
        """Rejoin (or join) the running EP group; returns once this seat serves again."""
        self.membership.start_heartbeat()
        nonce = uuid.uuid4().hex
        self.membership.request_join(nonce)
        deadline = time.monotonic() + timeout_s
        while True:
            view = self.membership.current_view()
            if view is not None and (self.seat, nonce) in view.joined:
                break
            if time.monotonic() > deadline:
                raise EPError(
                    f"seat {self.seat} was not admitted within {timeout_s:.0f}s; "
                    "are the other ranks still calling forward()/dispatch()?"
                )
            time.sleep(0.01)
        self.round = view.resume_round
        self.step = view.max_step
        try:
            self._install(view)
        except GroupFailure as exc:
            self._transition("failure", cause=exc)
        logger.info("EP seat %d joined at epoch %d", self.seat, self.epoch)

    def close(self) -> None:
        """Stop heartbeats and drop the group (other ranks will see this seat as dead)."""
        if self.view is not None:
            self._leave_mailboxes(self.view.epoch)
        if self.group is not None:
            self.group.close()
            self.group = None
        self.membership.close()
        if self._shm is not None:
            self._shm.close()
            self._shm = None
            self._shm_on = self._mailbox = False
            self._plane = self._collective

    # ------------------------------------------------------------------ properties
    @property
    def placement(self) -> Placement:
        return self._require_view().placement

    @property
    def members(self) -> tuple[int, ...]:
        return self._require_view().members

    def active_ranks(self) -> torch.Tensor:
        """``[num_seats]`` int32 mask of the current epoch."""
        return self._require_view().active_mask()

    def local_experts(self) -> tuple[int, ...]:
        return self.placement.seat_experts(self.seat)

    # ------------------------------------------------------------------ the layer
    def forward(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        active_ranks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """MoE output ``y [T, H]`` for this rank's tokens; survives membership changes."""
        for _ in range(self.config.num_seats + 3):
            try:
                recv_x, counts, handle = self.dispatch(
                    x, topk_idx, topk_weights, active_ranks, router_logits=router_logits
                )
                out = self.bank.forward(recv_x, counts, self.local_experts())
                return self.combine(out, handle)
            except RankFailure as exc:
                logger.info(
                    "EP seat %d retrying step %d at epoch %d: %s",
                    self.seat,
                    self.step,
                    self.epoch,
                    exc,
                )
        raise EPError(f"seat {self.seat}: membership kept changing; gave up step {self.step}")

    def rebalance(self) -> None:
        """Collective: re-place experts from the load seen so far (EPLB); next epoch."""
        self._require_view()
        self._transition("rebalance", rebalance=True)

    def reset_load(self) -> None:
        self.load.zero_()

    # ------------------------------------------------------------------ dispatch / combine
    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        active_ranks: torch.Tensor | None = None,
        num_experts: int | None = None,
        timeout: float | None = None,
        router_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Send each token to the ranks of its experts' live replicas.

        Args:
            x: ``[T, H]`` tokens of this rank.
            topk_idx: ``[T, K]`` logical experts (``-1`` = masked).
            topk_weights: ``[T, K]`` gate weights.
            active_ranks: optional ``[num_seats]`` int mask, identical on every rank; ANDed
                with the epoch's members and updated in place (DeepEP style).
            num_experts: checked against the config when given.
            timeout: seconds for each collective (default ``config.timeout_s``).
            router_logits: ``[T, E]``, needed by the ``substitute`` policy.

        Returns:
            ``(recv_x [N, H] grouped by local slot, recv_counts [S], handle)``.

        Raises:
            InvalidRouting: bad input here or on another rank (no communication hangs).
            RankFailure: membership changed; the new epoch is installed; call again.
            Evicted: the survivors left this seat out; call ``join()``.
        """
        self._catch_up()
        return self._dispatch(
            x, topk_idx, topk_weights, active_ranks, num_experts, timeout, router_logits
        )

    def combine(
        self, expert_out: torch.Tensor, handle: DispatchHandle, timeout: float | None = None
    ) -> torch.Tensor:
        """Weighted sum of the expert outputs back at the tokens' rank: ``y [T, H]``."""
        view = self._require_view()
        if handle.epoch != view.epoch or handle.round != self.round:
            raise EPError(
                f"stale dispatch handle (epoch {handle.epoch}, round {handle.round}); current is "
                f"epoch {view.epoch}, round {self.round}: dispatch again"
            )
        if expert_out.shape != (handle.num_pairs, self.config.hidden):
            raise InvalidRouting(
                f"expert_out must be [{handle.num_pairs}, {self.config.hidden}] like recv_x; "
                f"got {tuple(expert_out.shape)}"
            )
        group = self._require_group()
        plane = (
            self._plane
            if handle.shm_send_counts is not None and self._shm is not None
            else self._collective
        )
        y = plane.combine(group, expert_out, handle, timeout)
        if self.round == self.step:
            self.step += 1
        self.round += 1
        self.served_view = view
        if self._transition_pending:
            self._transition("join")
        return y

    # ------------------------------------------------------------------ internals: rounds
    def _catch_up(self) -> None:
        while self.round < self.step:
            h = self.config.hidden
            k = self.config.top_k
            recv_x, counts, handle = self._dispatch(
                torch.empty((0, h)),
                torch.empty((0, k), dtype=torch.int64),
                torch.empty((0, k)),
                None,
                None,
                None,
                None,
                wildcard=True,
            )
            self.combine(self.bank.forward(recv_x, counts, self.local_experts()), handle)

    def _routing_table(self, mask: torch.Tensor) -> ReplicaTable:
        if self._table is not None and mask is self._table_mask_src:
            return self._table
        self._table_mask_src = mask
        if (
            self._table is None
            or self._table_mask is None
            or not torch.equal(mask, self._table_mask)
        ):
            slot_live = mask.to(torch.bool).repeat_interleave(self.config.slots_per_rank)
            self._table = ReplicaTable.build(self._replica_table, slot_live)
            self._table_mask = mask.clone()
        return self._table

    def _dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        active_ranks: torch.Tensor | None,
        num_experts: int | None,
        timeout: float | None,
        router_logits: torch.Tensor | None,
        wildcard: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        cfg = self.config
        view = self._require_view()
        group = self._require_group()
        if self._view_mask is None or self._view_mask[0] is not view:
            m0 = view.active_mask()
            self._view_mask = (view, m0, zlib.crc32(bytes(m0.tolist())))
        mask, mask_crc = self._view_mask[1], self._view_mask[2]
        error: InvalidRouting | None = None
        try:
            if num_experts is not None and num_experts != cfg.num_experts:
                raise InvalidRouting(
                    f"num_experts {num_experts} != {cfg.num_experts} of this EP layer"
                )
            validate_routing(x, topk_idx, topk_weights, cfg.num_experts, cfg.hidden, router_logits)
            if active_ranks is not None:
                if tuple(active_ranks.shape) != (cfg.num_seats,):
                    raise InvalidRouting(
                        f"active_ranks must be [{cfg.num_seats}]; got {tuple(active_ranks.shape)}"
                    )
                if int((active_ranks != 0).sum()) == 0:
                    raise InvalidRouting(
                        "active_ranks marks every rank inactive; nothing can serve tokens"
                    )
                mask = mask * (active_ranks.cpu() != 0).to(torch.int32)
                active_ranks.copy_(mask.to(active_ranks.dtype))
                mask_crc = zlib.crc32(bytes(mask.tolist()))
            if int(mask.sum()) == 0:
                raise InvalidRouting("no rank of active_ranks is alive in this epoch")
        except InvalidRouting as exc:
            error = exc
        ctrl = ERR if error is not None else 0
        if (
            view.members[0] == self.seat
            and time.monotonic() - self._last_join_poll > cfg.join_poll_s
        ):
            self._last_join_poll = time.monotonic()
            outside = [s for s in range(cfg.num_seats) if s not in view.members]
            try:
                if self.membership.any_join_pending(outside):
                    ctrl |= JOIN
            except MembershipStoreLost as exc:  # steps go on; joins wait for the store
                if not self._store_lost:
                    logger.warning("EP seat %d: %s", self.seat, exc)
                self._store_lost = True
        mask_hash = WILDCARD if wildcard else mask_crc
        dev = group.device
        k = cfg.top_k if error is not None else topk_idx.shape[1]
        pairs: Pairs | None = None
        if error is None:
            # Routing tables live on the CPU (they are tiny); on CUDA this costs a copy of
            # topk_idx/topk_weights per step (the NCCL path is untested here).
            r = route(
                topk_idx.cpu(),
                topk_weights.cpu(),
                self._routing_table(mask),
                cfg.policy,
                None if router_logits is None else router_logits.cpu(),
                offset=self.seat,
            )
            self.stats["dropped"] += r.dropped
            self.stats["substituted"] += r.substituted
            valid = r.experts >= 0
            self.load += torch.bincount(r.experts[valid], minlength=cfg.num_experts).to(
                torch.float64
            )
            slots = r.slots
            dest = torch.where(
                slots >= 0, self._seat_to_member[(slots // cfg.slots_per_rank).clamp(min=0)], -1
            )
            pairs = Pairs(slots, r.weights, dest)
            dtype = x.dtype
            xi = x.to(dev).contiguous().view(_INT_OF_SIZE[x.element_size()])
        else:
            dtype = x.dtype if x.is_floating_point() else torch.float32
            xi = torch.empty((0, cfg.hidden), dtype=dtype, device=dev).view(
                _INT_OF_SIZE[dtype.itemsize]
            )
        head = Head(
            mask_hash, ctrl, error, view, timeout, dtype, x.shape[0] if error is None else 0, k
        )
        return self._plane.dispatch(group, head, xi, pairs)

    def _exchange(
        self, group: Group, rows: list[list[int]], timeout: float | None
    ) -> list[list[int]]:
        """One header exchange of this epoch: ``rows[j]`` goes to member ``j``; returns the
        row every member sent us. Over the mailboxes on the shared-memory plane, else an
        all-to-all on the group. Raises :class:`GroupFailure`."""
        shm = self._shm
        if self._mailbox and shm is not None:
            epoch = self.epoch
            seq = (epoch << 32) | (self._xchg + 1)
            shm.post(seq, rows)
            t = self.config.timeout_s if timeout is None else timeout
            try:
                got = shm.collect(seq, group.rank, len(rows[0]), t, abort_word(epoch))
            except MailboxFailure as exc:
                raise GroupFailure(f"header exchange failed: {exc}") from exc
            self._xchg += 1
            return got
        m = group.size
        header = torch.tensor(rows, dtype=torch.int64, device=group.device)
        out: list[list[int]] = group.all_to_all(header, [1] * m, [1] * m, timeout).cpu().tolist()
        self._xchg += 1
        return out

    def _check_header(self, hdr: list[list[int]], error: InvalidRouting | None, view: View) -> None:
        bad = [view.members[i] for i, row in enumerate(hdr) if row[CTRL] & ERR]
        if error is not None:
            raise error
        if bad:
            raise InvalidRouting(
                f"seat(s) {bad} rejected their input in round {self.round}; "
                "the round was aborted on every rank (see the error on those ranks)"
            )
        rounds = [row[ROUND] for row in hdr]
        if any(r != self.round for r in rounds):
            raise EPError(
                f"round mismatch in epoch {view.epoch}: members at rounds {rounds}, "
                f"this seat at {self.round}"
            )
        hashes = {view.members[i]: row[MASK] for i, row in enumerate(hdr) if row[MASK] != WILDCARD}
        if len(set(hashes.values())) > 1:
            raise InvalidRouting(
                f"active_ranks differs across ranks in round {self.round} "
                f"(mask hash per seat: {hashes}); pass the same mask on every rank"
            )

    # ------------------------------------------------------------------ internals: epochs
    @property
    def transport(self) -> str:
        """Where this epoch's rows travel: ``"shm"`` or ``"collective"``."""
        return "shm" if self._shm_on else "collective"

    def _buffer(
        self, name: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A reused scratch tensor (large fresh allocations cost page faults every step)."""
        numel = shape[0] * shape[1]
        buf = self._bufs.get(name)
        if (
            buf is None
            or buf.numel() * buf.element_size() < numel * dtype.itemsize
            or buf.device != device
        ):
            buf = torch.empty(max(numel * dtype.itemsize, 1), dtype=torch.uint8, device=device)
            self._bufs[name] = buf
        return buf[: numel * dtype.itemsize].view(dtype).view(shape)

    def _store_load(self, expert: int) -> torch.Tensor:
        from mooncake_core.ep.weights import StoreWeightSource

        if not isinstance(self.store_source, StoreWeightSource):
            raise EPError(f"expert {expert} missing and no store source configured")
        return self.store_source.load(expert)

    def _require_group(self) -> Group:
        if self.group is None:
            raise EPError(f"seat {self.seat} has no EP group; call start() or join()")
        return self.group
