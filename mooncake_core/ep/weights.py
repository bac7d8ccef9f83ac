"""Where a seat gets the weights of experts it must host but does not hold.

Contract:

- A re-plan yields a list of :class:`Transfer` (expert, source seat or ``STORE``,
  destination seat), identical on every member of the new epoch.
- :class:`ExpertWeightSource` answers ``fetch(transfers, ctx)`` with the flat weights of
  every transfer whose destination is this seat.

  * :class:`LiveReplicaSource` copies from a live replica: it is *collective*, every member
    of the epoch calls it with the same transfers (senders send, receivers receive, one
    uneven all-to-all on the epoch's group, bounded by the group timeout).
  * :class:`StoreWeightSource` reads experts saved as objects in the Mooncake store
    through any client with ``put(key, bytes)`` / ``get(key) -> bytes`` (``get`` raises
    :class:`~mooncake_core.errors.ObjectNotFound` when absent). It is not collective.

Nothing here reads weights from disk.
"""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from mooncake_core.ep.comm import Group
from mooncake_core.ep.experts import ExpertBank
from mooncake_core.errors import EPError, ObjectNotFound

__all__ = [
    "STORE",
    "ExpertWeightSource",
    "FetchContext",
    "LiveReplicaSource",
    "StoreClientProtocol",
    "StoreWeightSource",
    "Transfer",
]

STORE = -1
"""``Transfer.src_seat`` value meaning "read it from the weight store"."""


@dataclass(frozen=True)
class Transfer:
    """Move one expert's weights to ``dst_seat`` from ``src_seat`` (or :data:`STORE`)."""

    expert: int
    src_seat: int
    dst_seat: int


@dataclass(frozen=True)
class FetchContext:
    """What a source may use: this seat, the epoch's members (sorted seats), its group."""

    seat: int
    members: tuple[int, ...]
    bank: ExpertBank
    group: Group | None


class ExpertWeightSource(ABC):
    """Provider of expert weights for a re-plan.

    *Called by* the EP engine while installing a new epoch, after the group is formed.
    *Blocking*: yes, bounded by the group timeout (live) or the store client's own timeout.
    *Thread-safety*: one call at a time.
    """

    collective: ClassVar[bool]
    """True if every member must call :meth:`fetch` with the same transfers."""

    @abstractmethod
    def fetch(self, transfers: Sequence[Transfer], ctx: FetchContext) -> dict[int, torch.Tensor]:
        """Return ``{expert: flat weights}`` for every transfer with ``dst_seat == ctx.seat``.

        Raises:
            EPError: a weight could not be obtained (the message names the expert).
        """


class LiveReplicaSource(ExpertWeightSource):
    """Copy experts from the seats that hold them over the epoch's group (collective)."""

    collective = True

    def fetch(self, transfers: Sequence[Transfer], ctx: FetchContext) -> dict[int, torch.Tensor]:
        if ctx.group is None:
            raise EPError("live-replica fetch needs the epoch's group")
        live = [t for t in transfers if t.src_seat != STORE]
        for t in live:
            if t.src_seat not in ctx.members or t.dst_seat not in ctx.members:
                raise EPError(f"transfer of expert {t.expert} names a seat outside the epoch: {t}")
        numel = ctx.bank.numel
        index = {seat: i for i, seat in enumerate(ctx.members)}
        outgoing = sorted(
            (t for t in live if t.src_seat == ctx.seat), key=lambda t: (index[t.dst_seat], t.expert)
        )
        incoming = sorted(
            (t for t in live if t.dst_seat == ctx.seat), key=lambda t: (index[t.src_seat], t.expert)
        )
        if not live:
            return {}
        send_splits = [0] * len(ctx.members)
        for t in outgoing:
            send_splits[index[t.dst_seat]] += 1
        recv_splits = [0] * len(ctx.members)
        for t in incoming:
            recv_splits[index[t.src_seat]] += 1
        device = ctx.group.device
        if outgoing:
            send = torch.stack([ctx.bank.get(t.expert) for t in outgoing]).to(device)
        else:
            send = torch.empty((0, numel), dtype=torch.float32, device=device)
        recv = ctx.group.all_to_all(send, send_splits, recv_splits)
        return {t.expert: recv[i].cpu() for i, t in enumerate(incoming)}


class StoreClientProtocol(Protocol):
    """The part of the Mooncake store client this module needs."""

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes:
        """Return the object; raise :class:`ObjectNotFound` when absent."""
        ...


class StoreWeightSource(ExpertWeightSource):
    """Experts saved as store objects under ``{key_prefix}/{expert}``.

    Args:
        client: a store client (``mooncake_core.store`` ``StoreClient`` or compatible).
        key_prefix: object key prefix, e.g. ``"model-x/layer3/experts"``.
    """

    collective = False

    def __init__(self, client: StoreClientProtocol, key_prefix: str = "mooncake/ep/experts"):
        self.client = client
        self.key_prefix = key_prefix.rstrip("/")
        self.loads = 0
        """Experts read from the store so far."""

    def key(self, expert: int) -> str:
        return f"{self.key_prefix}/{expert}"

    def publish(self, expert: int, flat: torch.Tensor) -> None:
        """Save one expert's flat weights (call once per expert, e.g. at model load)."""
        buf = io.BytesIO()
        torch.save(flat.detach().reshape(-1).to(torch.float32).cpu().clone(), buf)
        self.client.put(self.key(expert), buf.getvalue())

    def load(self, expert: int) -> torch.Tensor:
        """Read one expert; raises :class:`EPError` naming the key if it is absent."""
        key = self.key(expert)
        try:
            data = self.client.get(key)
        except ObjectNotFound as exc:
            raise EPError(
                f"expert {expert} is not in the store under {key!r}; publish it with "
                "StoreWeightSource.publish() when the model is loaded"
            ) from exc
        tensor = torch.load(io.BytesIO(data), weights_only=True)
        if not isinstance(tensor, torch.Tensor):
            raise EPError(f"store object {key!r} is not a tensor")
        self.loads += 1
        return tensor

    def fetch(self, transfers: Sequence[Transfer], ctx: FetchContext) -> dict[int, torch.Tensor]:
        return {
            t.expert: self.load(t.expert)
            for t in transfers
            if t.dst_seat == ctx.seat and t.src_seat == STORE
        }
