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
from dataclasses import dataclass
from typing import NoReturn

import torch

from mooncake_core.ep.comm import Group, GroupFailure, open_group
from mooncake_core.ep.config import EPConfig
from mooncake_core.ep.experts import ExpertBank
from mooncake_core.ep.membership import (
    AliveInfo,
    Membership,
    MembershipStoreLost,
    View,
    plan_view,
)
from mooncake_core.ep.placement import Placement, balanced_placement
from mooncake_core.ep.routing import ReplicaTable, route, validate_routing
from mooncake_core.ep.shm import COMBINE, DISPATCH, MAILBOX_OK, MailboxFailure, ShmPlane
from mooncake_core.ep.weights import (
    STORE,
    ExpertWeightSource,
    FetchContext,
    LiveReplicaSource,
)
from mooncake_core.errors import EPError, Evicted, InvalidRouting, MooncakeError, RankFailure

__all__ = ["DispatchHandle", "ElasticEP"]

logger = logging.getLogger(__name__)

_ERR = 1
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_JOIN = 2
_WILDCARD = -1
_DISPATCH_ROW = 9  # fixed values of a shared-memory dispatch header row (then one per slot)


def _abort_word(epoch: int) -> int:
    """Mailbox sequence word meaning "this member left epoch ``epoch``"."""
    return -(epoch + 1)


@dataclass(frozen=True)
class DispatchHandle:
    """What ``combine`` needs from ``dispatch`` (opaque to callers)."""

    epoch: int
    round: int
    num_tokens: int
    send_token: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    pair_row: torch.Tensor
    pair_weight: torch.Tensor
    num_recv_rows: int
    dtype: torch.dtype
    num_pairs: int = 0
    shm_send_counts: list[list[int]] | None = None
    shm_chunk_at: list[list[int]] | None = None


@dataclass(frozen=True)
class _Head:
    """What a dispatch carries from validation to its header exchange."""

    mask_hash: int
    ctrl: int
    error: InvalidRouting | None
    view: View
    timeout: float | None
    dtype: torch.dtype
    num_tokens: int


class ElasticEP:
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

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Form epoch 0 with every seat (blocks until all seats connect or connect timeout)."""
        self.membership.start_heartbeat()
        view = View(0, tuple(range(self.config.num_seats)), self._initial)
        for e in view.placement.seat_experts(self.seat):
            if e >= 0 and e not in self.bank.held():
                if self.store_source is None:
                    raise EPError(
                        f"seat {self.seat} must hold expert {e} to start; load it or pass store_source"
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
                    f"seat {self.seat} was not admitted within {timeout_s:.0f}s; are the other ranks "
                    "still calling forward()/dispatch()?"
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

    # ------------------------------------------------------------------ properties
    @property
    def epoch(self) -> int:
        return -1 if self.view is None else self.view.epoch

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
        dev, h = group.device, self.config.hidden
        if handle.shm_send_counts is not None and self._shm is not None:
            y = self._combine_shm(self._shm, group, expert_out, handle, timeout)
        else:
            weighted = self._buffer("weighted", (handle.num_pairs, h), handle.dtype, dev)
            torch.mul(
                expert_out.to(handle.dtype),
                handle.pair_weight[:, None].to(handle.dtype),
                out=weighted,
            )
            partial = self._buffer("partial", (handle.num_recv_rows, h), handle.dtype, dev)
            partial.zero_().index_add_(0, handle.pair_row, weighted)
            back_buf = self._buffer("back", (int(sum(handle.send_splits)), h), handle.dtype, dev)
            try:
                group.all_to_all(
                    partial.view(torch.uint8),
                    handle.recv_splits,
                    handle.send_splits,
                    timeout,
                    out=back_buf.view(torch.uint8),
                )
            except GroupFailure as exc:
                self._fail(exc)
            y = torch.zeros((handle.num_tokens, h), dtype=handle.dtype, device=dev)
            y.index_add_(0, handle.send_token, back_buf)
        if self.round == self.step:
            self.step += 1
        self.round += 1
        self.served_view = view
        if self._transition_pending:
            self._transition("join")
        return y

    def _combine_shm(
        self,
        shm: ShmPlane,
        group: Group,
        expert_out: torch.Tensor,
        handle: DispatchHandle,
        timeout: float | None,
    ) -> torch.Tensor:
        """Combine over the shared-memory plane: the gate-weighted expert outputs go straight
        into this rank's combine buffer (in ``recv_x`` order), a header exchange tells every
        source where its chunks are, and each rank sums its pairs' rows out of the members'
        buffers into ``y``."""
        h, dt = self.config.hidden, handle.dtype
        send_counts, chunk_at = handle.shm_send_counts, handle.shm_chunk_at
        assert send_counts is not None and chunk_at is not None
        n = handle.num_pairs
        out = shm.send(COMBINE, n * h * dt.itemsize).view(dt).view(n, h)
        torch.mul(expert_out.to(dt), handle.pair_weight[:, None].to(dt), out=out)
        pid, fd, gen = shm.descriptor(COMBINE)
        rows_hdr = [[self.round, pid, fd, gen, *at] for at in chunk_at]
        try:
            hdr = self._exchange(group, rows_hdr, timeout)
        except GroupFailure as exc:
            self._fail(exc)
        if any(r[0] != self.round for r in hdr):
            raise EPError(
                f"round mismatch in combine: members at rounds {[r[0] for r in hdr]}, this seat "
                f"at {self.round}"
            )
        y = torch.zeros((handle.num_tokens, h), dtype=dt)
        tokens = handle.send_token
        a = 0
        try:
            for counts, r in zip(send_counts, hdr, strict=True):
                if not any(counts):
                    continue
                buf = shm.peer(COMBINE, r[1], r[2], r[3])
                src = buf[: buf.numel() // (h * dt.itemsize) * h * dt.itemsize].view(dt).view(-1, h)
                for c, at in zip(counts, r[4:], strict=True):
                    if c:
                        y.index_add_(0, tokens[a : a + c], src[at : at + c])
                        a += c
        except OSError as exc:
            self._fail(GroupFailure(f"shared-memory read of round {self.round} failed: {exc}"))
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
        m = len(view.members)
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
        ctrl = _ERR if error is not None else 0
        if (
            view.members[0] == self.seat
            and time.monotonic() - self._last_join_poll > cfg.join_poll_s
        ):
            self._last_join_poll = time.monotonic()
            outside = [s for s in range(cfg.num_seats) if s not in view.members]
            try:
                if self.membership.any_join_pending(outside):
                    ctrl |= _JOIN
            except MembershipStoreLost as exc:  # steps go on; joins wait for the store
                if not self._store_lost:
                    logger.warning("EP seat %d: %s", self.seat, exc)
                self._store_lost = True
        mask_hash = _WILDCARD if wildcard else mask_crc
        dev = group.device
        k = cfg.top_k if error is not None else topk_idx.shape[1]
        slots: torch.Tensor | None = None
        weights: torch.Tensor | None = None
        dest: torch.Tensor | None = None
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
            slots, weights = r.slots, r.weights
            dest = torch.where(
                slots >= 0, self._seat_to_member[(slots // cfg.slots_per_rank).clamp(min=0)], -1
            )
            dtype = x.dtype
            xi = x.to(dev).contiguous().view(_INT_OF_SIZE[x.element_size()])
        else:
            dtype = x.dtype if x.is_floating_point() else torch.float32
            xi = torch.empty((0, cfg.hidden), dtype=dtype, device=dev).view(
                _INT_OF_SIZE[dtype.itemsize]
            )
        head = _Head(
            mask_hash, ctrl, error, view, timeout, dtype, x.shape[0] if error is None else 0
        )
        if self._shm_on and self._shm is not None:
            return self._dispatch_shm(self._shm, group, head, xi, slots, weights, dest)
        if slots is not None and weights is not None and dest is not None:
            has = (dest.unsqueeze(-1) == torch.arange(m)).any(dim=1)  # [T, M]
            pairs = has.t().nonzero()
            send_member, send_token = pairs[:, 0], pairs[:, 1]
            send_splits = torch.bincount(send_member, minlength=m).tolist()
            same = dest[send_token] == send_member[:, None]
            local_slot = torch.where(same, slots[send_token] % cfg.slots_per_rank, -1).to(
                torch.int32
            )
            w = torch.where(same, weights[send_token], 0.0).to(torch.float32)
        else:
            send_token = torch.empty(0, dtype=torch.int64)
            send_splits = [0] * m
            local_slot = torch.empty((0, k), dtype=torch.int32)
            w = torch.empty((0, k), dtype=torch.float32)
        try:
            hdr = self._exchange(
                group, [[n, mask_hash, ctrl, self.round] for n in send_splits], timeout
            )
        except GroupFailure as exc:
            self._fail(exc)
        self._check_header(hdr, error, view)
        if hdr[0][2] & _JOIN:  # row 0 is the leader's header
            self._transition_pending = True
        recv_splits = [r[0] for r in hdr]
        # One row per (token, destination): the token's hidden state, then K local slots and
        # K gate weights, all bit-cast to an integer type of the element size of x.
        itype = xi.dtype
        hw = xi.shape[1]
        meta = torch.cat([local_slot, w.view(torch.int32)], dim=1).to(dev).view(itype)
        n_send = send_token.numel()
        width = hw + meta.shape[1]
        payload = self._buffer("payload", (n_send, width), itype, dev)
        torch.index_select(xi, 0, send_token.to(dev), out=payload[:, :hw])
        payload[:, hw:].copy_(meta)
        recv_buf = self._buffer("recv", (int(sum(recv_splits)), width), itype, dev)
        try:  # as bytes: gloo has no all-to-all for every dtype (int16, bf16)
            group.all_to_all(
                payload.view(torch.uint8),
                send_splits,
                recv_splits,
                timeout,
                out=recv_buf.view(torch.uint8),
            )
        except GroupFailure as exc:
            self._fail(exc)
        recv = recv_buf
        rmeta = recv[:, hw:].contiguous().view(torch.int32)
        ls = rmeta[:, :k]
        rw = rmeta[:, k:].contiguous().view(torch.float32)
        pr = (ls >= 0).nonzero()
        row, kk = pr[:, 0], pr[:, 1]
        pslot = ls[row, kk].to(torch.int64)
        order = torch.argsort(pslot, stable=True)
        row_o = row[order].to(dev)
        rows = self._buffer("recv_x", (row_o.numel(), hw), itype, dev)
        torch.index_select(recv[:, :hw], 0, row_o, out=rows)
        recv_x = rows.view(dtype)  # grouped by local slot; valid until the next dispatch
        recv_counts = torch.bincount(pslot[order], minlength=cfg.slots_per_rank)
        handle = DispatchHandle(
            epoch=view.epoch,
            round=self.round,
            num_tokens=head.num_tokens,
            send_token=send_token.to(dev),
            send_splits=send_splits,
            recv_splits=recv_splits,
            pair_row=row_o,
            pair_weight=rw[row, kk][order].to(dev),
            num_recv_rows=int(recv.shape[0]),
            dtype=dtype,
            num_pairs=int(row_o.numel()),
        )
        return recv_x, recv_counts, handle

    def _dispatch_shm(
        self,
        shm: ShmPlane,
        group: Group,
        head: _Head,
        xi: torch.Tensor,
        slots: torch.Tensor | None,
        weights: torch.Tensor | None,
        dest: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Dispatch over the shared-memory plane.

        One row per (token, destination slot) pair, sorted by (member, local slot), so a
        receiver's ``recv_x`` is one concatenation of (slot, source) chunks read straight out
        of the sources' buffers, and combine needs no reduction on the expert side. Each
        source's buffer holds its rows, then (8-byte aligned) their float32 gate weights.
        """
        cfg = self.config
        m, s_per = group.size, cfg.slots_per_rank
        itype, hw = xi.dtype, xi.shape[1]
        row_bytes = hw * itype.itemsize
        if slots is not None and weights is not None and dest is not None:
            key = torch.where(slots >= 0, dest * s_per + slots % s_per, m * s_per).reshape(-1)
            order = torch.argsort(key, stable=True)
            counts = torch.bincount(key, minlength=m * s_per + 1)[: m * s_per]
            n_pairs = int(order.numel() - (key == m * s_per).sum())
            order = order[:n_pairs]
            send_token = order // slots.shape[1]
            pair_w = weights.reshape(-1)[order]
        else:
            counts = torch.zeros(m * s_per, dtype=torch.int64)
            n_pairs = 0
            send_token = torch.empty(0, dtype=torch.int64)
            pair_w = torch.empty(0, dtype=torch.float32)
        w_at = -(-n_pairs * row_bytes // 8) * 8
        out = shm.send(DISPATCH, w_at + 4 * n_pairs)
        torch.index_select(
            xi, 0, send_token, out=out[: n_pairs * row_bytes].view(itype).view(n_pairs, hw)
        )
        out[w_at : w_at + 4 * n_pairs].view(torch.float32).copy_(pair_w)
        send_counts: list[list[int]] = counts.view(m, s_per).tolist()
        pid, fd, gen = shm.descriptor(DISPATCH)
        rows_hdr = []
        offset = 0
        for c in send_counts:
            n = sum(c)
            rows_hdr.append(
                [n, head.mask_hash, head.ctrl, self.round, offset, pid, fd, gen, w_at, *c]
            )
            offset += n
        try:
            peers = self._exchange(group, rows_hdr, head.timeout)
        except GroupFailure as exc:
            self._fail(exc)
        self._check_header(peers, head.error, head.view)
        if peers[0][2] & _JOIN:  # row 0 is the leader's header
            self._transition_pending = True
        per_slot = [sum(p[_DISPATCH_ROW + s] for p in peers) for s in range(s_per)]
        recv_counts = torch.tensor(per_slot, dtype=torch.int64)
        n_recv = sum(per_slot)
        recv_x = self._buffer("recv_x", (n_recv, hw), itype, xi.device)
        recv_w = self._buffer("recv_w", (1, n_recv), torch.float32, xi.device)[0]
        xs: list[torch.Tensor] = []
        ws: list[torch.Tensor] = []
        chunk_at = [[0] * s_per for _ in range(m)]  # where chunk (source i, slot s) lands
        try:
            src_x, src_w, cursor = [], [], []
            for p in peers:
                buf = shm.peer(DISPATCH, p[5], p[6], p[7]) if p[0] else out
                src_x.append(buf[: buf.numel() // row_bytes * row_bytes].view(itype).view(-1, hw))
                src_w.append(buf[p[8] :].view(torch.float32))
                cursor.append(p[4])
            at = 0
            for s in range(s_per):
                for i, p in enumerate(peers):
                    cnt = p[_DISPATCH_ROW + s]
                    if cnt:
                        a = cursor[i]
                        xs.append(src_x[i][a : a + cnt])
                        ws.append(src_w[i][a : a + cnt])
                        cursor[i] = a + cnt
                        chunk_at[i][s] = at
                        at += cnt
            if xs:
                torch.cat(xs, out=recv_x)
                torch.cat(ws, out=recv_w)
        except OSError as exc:  # a source's buffer vanished between its header and our read
            self._fail(GroupFailure(f"shared-memory read of round {self.round} failed: {exc}"))
        handle = DispatchHandle(
            epoch=head.view.epoch,
            round=self.round,
            num_tokens=head.num_tokens,
            send_token=send_token,
            send_splits=[sum(c) for c in send_counts],
            recv_splits=[int(p[0]) for p in peers],
            pair_row=torch.empty(0, dtype=torch.int64),
            pair_weight=recv_w,
            num_recv_rows=n_recv,
            dtype=head.dtype,
            num_pairs=n_recv,
            shm_send_counts=send_counts,
            shm_chunk_at=chunk_at,
        )
        return recv_x.view(head.dtype), recv_counts, handle

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
                got = shm.collect(seq, group.rank, len(rows[0]), t, _abort_word(epoch))
            except MailboxFailure as exc:
                raise GroupFailure(f"header exchange failed: {exc}") from exc
            self._xchg += 1
            return got
        m = group.size
        header = torch.tensor(rows, dtype=torch.int64, device=group.device)
        out: list[list[int]] = group.all_to_all(header, [1] * m, [1] * m, timeout).cpu().tolist()
        self._xchg += 1
        return out

    def _leave_mailboxes(self, epoch: int) -> None:
        """Members waiting on our mailbox for the exchange in progress fail at once (the
        shared-memory counterpart of closing the group)."""
        if self._mailbox and self._shm is not None:
            self._shm.abort_slot(self._xchg + 1, _abort_word(epoch))

    def _check_header(self, hdr: list[list[int]], error: InvalidRouting | None, view: View) -> None:
        bad = [view.members[i] for i, row in enumerate(hdr) if row[2] & _ERR]
        if error is not None:
            raise error
        if bad:
            raise InvalidRouting(
                f"seat(s) {bad} rejected their input in round {self.round}; the round was aborted on "
                "every rank (see the error on those ranks)"
            )
        rounds = [row[3] for row in hdr]
        if any(r != self.round for r in rounds):
            raise EPError(
                f"round mismatch in epoch {view.epoch}: members at rounds {rounds}, this seat at {self.round}"
            )
        hashes = {view.members[i]: row[1] for i, row in enumerate(hdr) if row[1] != _WILDCARD}
        if len(set(hashes.values())) > 1:
            raise InvalidRouting(
                f"active_ranks differs across ranks in round {self.round} (mask hash per seat: {hashes}); "
                "pass the same mask on every rank"
            )

    # ------------------------------------------------------------------ internals: epochs
    def _fail(self, exc: GroupFailure) -> NoReturn:
        self._transition("failure", cause=exc)
        raise RankFailure(
            f"seat {self.seat}: membership changed during round {self.round}; now epoch {self.epoch} "
            f"with seats {list(self.members)}; redo the step"
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
                    f"seat {self.seat} was left out of epoch {view.epoch} (members {list(view.members)}); "
                    "call join() to come back"
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
                    max_members=cfg.num_seats, row_width=_DISPATCH_ROW + cfg.slots_per_rank
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

    def _require_view(self) -> View:
        if self.view is None:
            raise EPError(f"seat {self.seat} is not serving; call start() or join()")
        return self.view

    def _require_group(self) -> Group:
        if self.group is None:
            raise EPError(f"seat {self.seat} has no EP group; call start() or join()")
        return self.group
