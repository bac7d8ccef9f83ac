"""One EP round (dispatch + combine) over either data plane: two strategies, one interface.

An :class:`~mooncake_core.ep.engine.ElasticEP` validates and routes a round itself, then hands
it to the :class:`Round` of its epoch (chosen when the epoch is installed, see
:mod:`mooncake_core.ep.epochs`):

- :class:`CollectiveRound`: three all-to-alls on the epoch's group (header, payload, combine);
  a payload row is one token per destination member with its local slots and gate weights,
  and the expert side sums its pairs per token before sending back.
- :class:`ShmRound` (same host, :mod:`mooncake_core.ep.shm`): one row per (token,
  destination slot) written straight into the sender's shared buffer; receivers concatenate
  their chunks out of the senders' buffers, and combine sums the weighted rows out of the
  experts' buffers.

Header rows are lists of ints (exchanged as one tensor or through the shared-memory
mailboxes); the constants below name their fields. A round reaches back into the engine only
through :class:`RoundHost`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple, NoReturn, Protocol

import torch

from mooncake_core.ep.comm import Group, GroupFailure
from mooncake_core.ep.config import EPConfig
from mooncake_core.ep.membership import View
from mooncake_core.ep.shm import COMBINE, DISPATCH, ShmPlane
from mooncake_core.errors import EPError, InvalidRouting

__all__ = ["CollectiveRound", "DispatchHandle", "Head", "Pairs", "Round", "RoundHost", "ShmRound"]

# control bits of a header row's CTRL field
ERR = 1  # this member's input was invalid: the round is aborted everywhere
JOIN = 2  # (leader's row) a join is pending: transition after this round
WILDCARD = -1  # MASK field of a catch-up round: matches any mask

# fields of a dispatch header row (both planes)
COUNT = 0  # rows this member sends to the receiver
MASK = 1  # hash of active_ranks
CTRL = 2  # ERR | JOIN
ROUND = 3  # the sender's round number
# then, on the shared-memory plane: where the sender's rows are
SHM_OFFSET = 4  # first row for this receiver in the sender's buffer
SHM_PID, SHM_FD, SHM_GEN = 5, 6, 7  # the sender's buffer (ShmPlane.descriptor)
SHM_WEIGHTS_AT = 8  # byte offset of the gate weights in that buffer
DISPATCH_ROW = 9  # fixed fields of a shared-memory dispatch row (then one count per slot)

# fields of a shared-memory combine header row
COMBINE_ROUND = 0
COMBINE_PID, COMBINE_FD, COMBINE_GEN = 1, 2, 3
COMBINE_ROW = 4  # fixed fields (then, per slot, where its chunk starts in the sender's buffer)


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
class Head:
    """What a dispatch carries from validation to its header exchange."""

    mask_hash: int
    ctrl: int
    error: InvalidRouting | None
    view: View
    timeout: float | None
    dtype: torch.dtype
    num_tokens: int
    top_k: int  # pairs per token in the payload rows (the config's top_k after an error)


class Pairs(NamedTuple):
    """A round's routed (token, expert) pairs, each ``[T, K]``."""

    slots: torch.Tensor  # global slot of each pair (-1: dropped)
    weights: torch.Tensor  # gate weight of each pair
    dest: torch.Tensor  # member index holding the slot (-1: dropped)


class RoundHost(Protocol):
    """What a round needs from its engine (``ElasticEP``)."""

    config: EPConfig
    round: int
    _transition_pending: bool

    def _exchange(
        self, group: Group, rows: list[list[int]], timeout: float | None
    ) -> list[list[int]]: ...

    def _check_header(
        self, hdr: list[list[int]], error: InvalidRouting | None, view: View
    ) -> None: ...

    def _fail(self, exc: GroupFailure) -> NoReturn: ...

    def _buffer(
        self, name: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


class Round(ABC):
    """How one round's rows travel in an epoch (see module doc)."""

    name: str

    def __init__(self, ep: RoundHost) -> None:
        self.ep = ep

    @abstractmethod
    def dispatch(
        self, group: Group, head: Head, xi: torch.Tensor, pairs: Pairs | None
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Exchange headers and rows; ``(recv_x, recv_counts, handle)`` like ``ElasticEP.dispatch``.

        ``xi``: the tokens bit-cast to an integer type; ``pairs``: where they go (None when
        this member's input was invalid: it sends nothing).
        """

    @abstractmethod
    def combine(
        self, group: Group, expert_out: torch.Tensor, handle: DispatchHandle, timeout: float | None
    ) -> torch.Tensor:
        """The gate-weighted sum of the expert outputs at the tokens' member: ``y [T, H]``."""


class CollectiveRound(Round):
    """Rows through all-to-alls on the epoch's group (see module doc)."""

    name = "collective"

    def dispatch(
        self, group: Group, head: Head, xi: torch.Tensor, pairs: Pairs | None
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Header, then payload all-to-all: one row per (token, destination member) carrying
        the token, its K local slots and K gate weights."""
        ep, cfg = self.ep, self.ep.config
        m, k, dev = group.size, head.top_k, group.device
        if pairs is not None:
            slots, weights, dest = pairs
            has = (dest.unsqueeze(-1) == torch.arange(m)).any(dim=1)  # [T, M]
            member_token = has.t().nonzero()
            send_member, send_token = member_token[:, 0], member_token[:, 1]
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
            hdr = ep._exchange(
                group, [[n, head.mask_hash, head.ctrl, ep.round] for n in send_splits], head.timeout
            )
        except GroupFailure as exc:
            ep._fail(exc)
        ep._check_header(hdr, head.error, head.view)
        if hdr[0][CTRL] & JOIN:  # row 0 is the leader's header
            ep._transition_pending = True
        recv_splits = [r[COUNT] for r in hdr]
        # One row per (token, destination): the token's hidden state, then K local slots and
        # K gate weights, all bit-cast to an integer type of the element size of x.
        itype = xi.dtype
        hw = xi.shape[1]
        meta = torch.cat([local_slot, w.view(torch.int32)], dim=1).to(dev).view(itype)
        n_send = send_token.numel()
        width = hw + meta.shape[1]
        payload = ep._buffer("payload", (n_send, width), itype, dev)
        torch.index_select(xi, 0, send_token.to(dev), out=payload[:, :hw])
        payload[:, hw:].copy_(meta)
        recv_buf = ep._buffer("recv", (int(sum(recv_splits)), width), itype, dev)
        try:  # as bytes: gloo has no all-to-all for every dtype (int16, bf16)
            group.all_to_all(
                payload.view(torch.uint8),
                send_splits,
                recv_splits,
                head.timeout,
                out=recv_buf.view(torch.uint8),
            )
        except GroupFailure as exc:
            ep._fail(exc)
        recv = recv_buf
        rmeta = recv[:, hw:].contiguous().view(torch.int32)
        ls = rmeta[:, :k]
        rw = rmeta[:, k:].contiguous().view(torch.float32)
        pr = (ls >= 0).nonzero()
        row, kk = pr[:, 0], pr[:, 1]
        pslot = ls[row, kk].to(torch.int64)
        order = torch.argsort(pslot, stable=True)
        row_o = row[order].to(dev)
        rows = ep._buffer("recv_x", (row_o.numel(), hw), itype, dev)
        torch.index_select(recv[:, :hw], 0, row_o, out=rows)
        recv_x = rows.view(head.dtype)  # grouped by local slot; valid until the next dispatch
        recv_counts = torch.bincount(pslot[order], minlength=cfg.slots_per_rank)
        handle = DispatchHandle(
            epoch=head.view.epoch,
            round=ep.round,
            num_tokens=head.num_tokens,
            send_token=send_token.to(dev),
            send_splits=send_splits,
            recv_splits=recv_splits,
            pair_row=row_o,
            pair_weight=rw[row, kk][order].to(dev),
            num_recv_rows=int(recv.shape[0]),
            dtype=head.dtype,
            num_pairs=int(row_o.numel()),
        )
        return recv_x, recv_counts, handle

    def combine(
        self, group: Group, expert_out: torch.Tensor, handle: DispatchHandle, timeout: float | None
    ) -> torch.Tensor:
        """Gate-weight and sum the pairs per token at the expert side, all-to-all them back,
        and add them up per token."""
        ep = self.ep
        dev, h = group.device, ep.config.hidden
        weighted = ep._buffer("weighted", (handle.num_pairs, h), handle.dtype, dev)
        torch.mul(
            expert_out.to(handle.dtype),
            handle.pair_weight[:, None].to(handle.dtype),
            out=weighted,
        )
        partial = ep._buffer("partial", (handle.num_recv_rows, h), handle.dtype, dev)
        partial.zero_().index_add_(0, handle.pair_row, weighted)
        back_buf = ep._buffer("back", (int(sum(handle.send_splits)), h), handle.dtype, dev)
        try:
            group.all_to_all(
                partial.view(torch.uint8),
                handle.recv_splits,
                handle.send_splits,
                timeout,
                out=back_buf.view(torch.uint8),
            )
        except GroupFailure as exc:
            ep._fail(exc)
        y = torch.zeros((handle.num_tokens, h), dtype=handle.dtype, device=dev)
        y.index_add_(0, handle.send_token, back_buf)
        return y


class ShmRound(Round):
    """Rows through the members' shared-memory buffers (see module doc)."""

    name = "shm"

    def __init__(self, ep: RoundHost, shm: ShmPlane) -> None:
        super().__init__(ep)
        self.shm = shm

    def dispatch(
        self, group: Group, head: Head, xi: torch.Tensor, pairs: Pairs | None
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Dispatch over the shared-memory plane.

        One row per (token, destination slot) pair, sorted by (member, local slot), so a
        receiver's ``recv_x`` is one concatenation of (slot, source) chunks read straight out
        of the sources' buffers, and combine needs no reduction on the expert side. Each
        source's buffer holds its rows, then (8-byte aligned) their float32 gate weights.
        """
        ep, cfg, shm = self.ep, self.ep.config, self.shm
        m, s_per = group.size, cfg.slots_per_rank
        itype, hw = xi.dtype, xi.shape[1]
        row_bytes = hw * itype.itemsize
        if pairs is not None:
            slots, weights, dest = pairs
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
                # fields: see SHM_* above
                [n, head.mask_hash, head.ctrl, ep.round, offset, pid, fd, gen, w_at, *c]
            )
            offset += n
        try:
            peers = ep._exchange(group, rows_hdr, head.timeout)
        except GroupFailure as exc:
            ep._fail(exc)
        ep._check_header(peers, head.error, head.view)
        if peers[0][CTRL] & JOIN:  # row 0 is the leader's header
            ep._transition_pending = True
        per_slot = [sum(p[DISPATCH_ROW + s] for p in peers) for s in range(s_per)]
        recv_counts = torch.tensor(per_slot, dtype=torch.int64)
        n_recv = sum(per_slot)
        recv_x = ep._buffer("recv_x", (n_recv, hw), itype, xi.device)
        recv_w = ep._buffer("recv_w", (1, n_recv), torch.float32, xi.device)[0]
        xs: list[torch.Tensor] = []
        ws: list[torch.Tensor] = []
        chunk_at = [[0] * s_per for _ in range(m)]  # where chunk (source i, slot s) lands
        try:
            src_x, src_w, cursor = [], [], []
            for p in peers:
                buf = shm.peer(DISPATCH, p[SHM_PID], p[SHM_FD], p[SHM_GEN]) if p[COUNT] else out
                src_x.append(buf[: buf.numel() // row_bytes * row_bytes].view(itype).view(-1, hw))
                src_w.append(buf[p[SHM_WEIGHTS_AT] :].view(torch.float32))
                cursor.append(p[SHM_OFFSET])
            at = 0
            for s in range(s_per):
                for i, p in enumerate(peers):
                    cnt = p[DISPATCH_ROW + s]
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
            ep._fail(GroupFailure(f"shared-memory read of round {ep.round} failed: {exc}"))
        handle = DispatchHandle(
            epoch=head.view.epoch,
            round=ep.round,
            num_tokens=head.num_tokens,
            send_token=send_token,
            send_splits=[sum(c) for c in send_counts],
            recv_splits=[int(p[COUNT]) for p in peers],
            pair_row=torch.empty(0, dtype=torch.int64),
            pair_weight=recv_w,
            num_recv_rows=n_recv,
            dtype=head.dtype,
            num_pairs=n_recv,
            shm_send_counts=send_counts,
            shm_chunk_at=chunk_at,
        )
        return recv_x.view(head.dtype), recv_counts, handle

    def combine(
        self,
        group: Group,
        expert_out: torch.Tensor,
        handle: DispatchHandle,
        timeout: float | None,
    ) -> torch.Tensor:
        """Combine over the shared-memory plane: the gate-weighted expert outputs go straight
        into this rank's combine buffer (in ``recv_x`` order), a header exchange tells every
        source where its chunks are, and each rank sums its pairs' rows out of the members'
        buffers into ``y``."""
        ep, shm = self.ep, self.shm
        h, dt = ep.config.hidden, handle.dtype
        send_counts, chunk_at = handle.shm_send_counts, handle.shm_chunk_at
        assert send_counts is not None and chunk_at is not None
        n = handle.num_pairs
        out = shm.send(COMBINE, n * h * dt.itemsize).view(dt).view(n, h)
        torch.mul(expert_out.to(dt), handle.pair_weight[:, None].to(dt), out=out)
        pid, fd, gen = shm.descriptor(COMBINE)
        rows_hdr = [[ep.round, pid, fd, gen, *at] for at in chunk_at]  # see COMBINE_* above
        try:
            hdr = ep._exchange(group, rows_hdr, timeout)
        except GroupFailure as exc:
            ep._fail(exc)
        if any(r[COMBINE_ROUND] != ep.round for r in hdr):
            raise EPError(
                "round mismatch in combine: members at rounds "
                f"{[r[COMBINE_ROUND] for r in hdr]}, this seat "
                f"at {ep.round}"
            )
        y = torch.zeros((handle.num_tokens, h), dtype=dt)
        tokens = handle.send_token
        a = 0
        try:
            for counts, r in zip(send_counts, hdr, strict=True):
                if not any(counts):
                    continue
                buf = shm.peer(COMBINE, r[COMBINE_PID], r[COMBINE_FD], r[COMBINE_GEN])
                src = buf[: buf.numel() // (h * dt.itemsize) * h * dt.itemsize].view(dt).view(-1, h)
                for c, at in zip(counts, r[COMBINE_ROW:], strict=True):
                    if c:
                        y.index_add_(0, tokens[a : a + c], src[at : at + c])
                        a += c
        except OSError as exc:
            ep._fail(GroupFailure(f"shared-memory read of round {ep.round} failed: {exc}"))
        return y
