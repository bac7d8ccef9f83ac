"""Fault-aware routing of (token, logical expert) pairs to live physical replicas.

Contract:

- :func:`validate_routing` checks shapes, dtypes and expert ids and raises
  :class:`~mooncake_core.errors.InvalidRouting` with a message naming the bad argument.
- :func:`route` maps every valid pair of ``topk_idx`` (``-1`` = masked by the router) to a
  global slot on a live seat. Tokens of one expert are spread round-robin over its live
  replicas (starting at an offset per source rank, so ranks do not pile onto the first
  replica). When an expert has no live replica, the policy decides:

  * ``"renormalize"``: the pair is dropped and the token's remaining gate weights are
    scaled so that they sum to the token's original gate mass
    (``w'_k = w_k * sum_j w_j / sum_{j live} w_j``);
  * ``"substitute"``: the pair is replaced by the next-best *available* expert from the
    router logits that the token has not selected yet; the substitute keeps the gate weight
    of the expert it replaces. If no expert is left, the pair falls back to renormalize.

Everything is vectorized torch; there is no Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mooncake_core.errors import InvalidRouting

__all__ = ["Policy", "Route", "ReplicaTable", "route", "validate_routing"]

Policy = Literal["renormalize", "substitute"]
POLICIES: tuple[str, ...] = ("renormalize", "substitute")


@dataclass(frozen=True)
class ReplicaTable:
    """Per-expert live replicas, live ones first.

    Attributes:
        slots: ``[E, W]`` int64 global slot ids; entries past ``num_live[e]`` are unusable.
        num_live: ``[E]`` int64 live replicas per expert.
    """

    slots: torch.Tensor
    num_live: torch.Tensor

    @staticmethod
    def build(replica_table: torch.Tensor, slot_live: torch.Tensor) -> ReplicaTable:
        """From ``Placement.replica_table()`` and a ``[num_slots]`` bool liveness mask."""
        valid = replica_table >= 0
        live = valid & slot_live[replica_table.clamp(min=0)]
        order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)
        return ReplicaTable(replica_table.gather(1, order), live.sum(dim=1))


@dataclass(frozen=True)
class Route:
    """Where each (token, k) pair goes.

    Attributes:
        experts: ``[T, K]`` logical expert per pair after the policy (``-1`` = none).
        slots: ``[T, K]`` global physical slot per pair (``-1`` = none).
        weights: ``[T, K]`` float32 gate weights after the policy (0 where no slot).
        dropped: pairs the policy dropped (no live replica, nothing to substitute).
        substituted: pairs the policy replaced with another expert.
    """

    experts: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor
    dropped: int
    substituted: int


def validate_routing(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    hidden: int | None = None,
    router_logits: torch.Tensor | None = None,
) -> None:
    """Raise :class:`InvalidRouting` naming the first malformed argument."""
    if x.dim() != 2:
        raise InvalidRouting(f"x must be [tokens, hidden]; got shape {tuple(x.shape)}")
    if hidden is not None and x.shape[1] != hidden:
        raise InvalidRouting(
            f"x has hidden size {x.shape[1]}; this EP layer was built for {hidden}"
        )
    if not x.is_floating_point():
        raise InvalidRouting(f"x must be floating point; got {x.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise InvalidRouting(
            f"topk_idx must be [tokens={x.shape[0]}, k]; got shape {tuple(topk_idx.shape)}"
        )
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise InvalidRouting(f"topk_idx must be int64 or int32; got {topk_idx.dtype}")
    if topk_weights.shape != topk_idx.shape:
        raise InvalidRouting(
            f"topk_weights shape {tuple(topk_weights.shape)} "
            f"!= topk_idx shape {tuple(topk_idx.shape)}"
        )
    if not topk_weights.is_floating_point():
        raise InvalidRouting(f"topk_weights must be floating point; got {topk_weights.dtype}")
    if topk_idx.numel():
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            bad = lo if lo < -1 else hi
            raise InvalidRouting(
                f"topk_idx contains expert id {bad}; "
                f"valid ids are 0..{num_experts - 1} (-1 = masked)"
            )
    if router_logits is not None and tuple(router_logits.shape) != (x.shape[0], num_experts):
        raise InvalidRouting(
            f"router_logits must be [tokens={x.shape[0]}, experts={num_experts}]; "
            f"got {tuple(router_logits.shape)}"
        )


def route(
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    table: ReplicaTable,
    policy: Policy = "renormalize",
    router_logits: torch.Tensor | None = None,
    offset: int = 0,
) -> Route:
    """Map pairs to live replicas and apply ``policy`` to experts without one.

    Args:
        topk_idx: ``[T, K]`` logical experts (``-1`` = masked), already validated.
        topk_weights: ``[T, K]`` gate weights.
        table: live replicas per expert.
        policy: ``"renormalize"`` or ``"substitute"``.
        router_logits: ``[T, E]``; required for ``"substitute"``.
        offset: replica round-robin start (the source rank).

    Returns:
        The :class:`Route`.
    """
    if policy not in POLICIES:
        raise InvalidRouting(f"unknown policy {policy!r}; choose one of {POLICIES}")
    idx = topk_idx.to(torch.int64)
    w = topk_weights.to(torch.float32)
    num_experts = table.slots.shape[0]
    available = table.num_live > 0
    valid = idx >= 0
    missing = valid & ~available[idx.clamp(min=0)]
    substituted = 0
    if policy == "substitute" and bool(missing.any()):
        if router_logits is None:
            raise InvalidRouting("policy 'substitute' needs router_logits [tokens, experts]")
        masked = router_logits.to(torch.float32).clone()
        masked[:, ~available] = float("-inf")
        masked.scatter_(1, idx.clamp(min=0), float("-inf"))
        k = min(idx.shape[1], num_experts)
        cand_val, cand_idx = torch.topk(masked, k, dim=1)
        nth = (torch.cumsum(missing.to(torch.int64), dim=1) - 1).clamp(min=0, max=k - 1)
        sub_ok = missing & torch.isfinite(cand_val.gather(1, nth))
        idx = torch.where(sub_ok, cand_idx.gather(1, nth), idx)
        missing = missing & ~sub_ok
        substituted = int(sub_ok.sum())
    dropped = int(missing.sum())
    if dropped:
        total = (w * valid).sum(dim=1, keepdim=True)
        w = torch.where(missing, torch.zeros_like(w), w)
        kept = (w * valid).sum(dim=1, keepdim=True)
        scale = torch.where(kept != 0, total / torch.where(kept != 0, kept, 1.0), 0.0)
        w = w * scale
        idx = torch.where(missing, torch.full_like(idx, -1), idx)
    valid = idx >= 0
    w = torch.where(valid, w, torch.zeros_like(w))
    # Round-robin over live replicas: the n-th pair (in token order) of expert e goes to
    # replica (n + offset) % num_live[e].
    flat = torch.where(valid, idx, torch.full_like(idx, num_experts)).reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    pos_sorted = torch.arange(flat.numel(), dtype=torch.int64) - starts[flat[order]]
    pos = torch.empty_like(pos_sorted)
    pos[order] = pos_sorted
    e = flat.clamp(max=num_experts - 1)
    n_live = table.num_live[e].clamp(min=1)
    choice = (pos + offset) % n_live
    slots = table.slots[e, choice]
    slots = torch.where(flat < num_experts, slots, torch.full_like(slots, -1)).reshape(idx.shape)
    return Route(idx, slots, w, dropped, substituted)
