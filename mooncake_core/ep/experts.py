"""A tiny MoE expert (gated-free MLP) and the weights a seat holds.

Contract:

- An expert is ``y = silu(x @ w1) @ w2`` with ``w1: [hidden, ffn]``, ``w2: [ffn, hidden]``;
  its weights travel as one flat float tensor of :func:`expert_numel` elements, which is what
  :mod:`mooncake_core.ep.weights` moves between seats or to the store.
- :class:`ExpertBank` holds the flat weights of the experts on this seat (by logical id)
  and runs them over a ``recv_x`` packed by local slot, as returned by ``dispatch``.
- :func:`reference_moe` is the single-process result the EP layer must reproduce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mooncake_core.errors import EPError

__all__ = ["ExpertBank", "expert_numel", "make_expert_weights", "reference_moe", "run_expert"]


def expert_numel(hidden: int, ffn: int) -> int:
    """Elements of one expert's flat weights."""
    return 2 * hidden * ffn


def make_expert_weights(num_experts: int, hidden: int, ffn: int, seed: int = 0) -> torch.Tensor:
    """Deterministic ``[E, expert_numel]`` float32 weights (for tests, benchmarks, examples)."""
    gen = torch.Generator().manual_seed(seed)
    w: torch.Tensor = torch.randn(num_experts, expert_numel(hidden, ffn), generator=gen)
    return w.div(hidden**0.5)


def run_expert(flat: torch.Tensor, x: torch.Tensor, hidden: int, ffn: int) -> torch.Tensor:
    """Apply one expert given its flat weights."""
    w1 = flat[: hidden * ffn].view(hidden, ffn).to(x.dtype)
    w2 = flat[hidden * ffn :].view(ffn, hidden).to(x.dtype)
    out: torch.Tensor = torch.nn.functional.silu(x @ w1) @ w2
    return out


def reference_moe(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: torch.Tensor,
    hidden: int,
    ffn: int,
) -> torch.Tensor:
    """Single-process MoE: ``y_t = sum_k w_tk * expert_{idx_tk}(x_t)`` (``-1`` skipped)."""
    y = torch.zeros_like(x)
    flat_idx = topk_idx.reshape(-1)
    tok = torch.arange(x.shape[0]).repeat_interleave(topk_idx.shape[1])
    w = topk_weights.reshape(-1).to(x.dtype)
    for e in torch.unique(flat_idx[flat_idx >= 0]).tolist():  # loop over experts, not tokens
        sel = flat_idx == e
        out = run_expert(weights[e], x[tok[sel]], hidden, ffn)
        y.index_add_(0, tok[sel], out * w[sel, None])
    return y


class ExpertBank:
    """The experts one seat holds, by logical id.

    Thread-safety: not thread-safe; owned by the rank's EP engine.
    """

    def __init__(self, hidden: int, ffn: int, held: Mapping[int, torch.Tensor] | None = None):
        self.hidden = hidden
        self.ffn = ffn
        self.numel = expert_numel(hidden, ffn)
        self._held: dict[int, torch.Tensor] = {}
        for e, flat in (held or {}).items():
            self.put(e, flat)

    def put(self, expert: int, flat: torch.Tensor) -> None:
        if flat.numel() != self.numel:
            raise EPError(
                f"expert {expert} weights have {flat.numel()} elements; expected {self.numel}"
            )
        self._held[expert] = flat.detach().reshape(-1).to(torch.float32).clone()

    def get(self, expert: int) -> torch.Tensor:
        try:
            return self._held[expert]
        except KeyError:
            raise EPError(f"this seat does not hold expert {expert}") from None

    def held(self) -> list[int]:
        return sorted(self._held)

    def retain(self, experts: Sequence[int]) -> None:
        """Drop every expert not in ``experts`` (after a re-plan moved it away)."""
        keep = set(experts)
        for e in [e for e in self._held if e not in keep]:
            del self._held[e]

    def forward(
        self, recv_x: torch.Tensor, recv_counts: torch.Tensor, local_experts: Sequence[int]
    ) -> torch.Tensor:
        """Run each local slot's expert on its contiguous block of ``recv_x``.

        Args:
            recv_x: ``[N, H]`` rows grouped by local slot (as ``dispatch`` returns them).
            recv_counts: ``[S]`` rows per local slot.
            local_experts: logical expert of each local slot (``-1`` = empty).
        """
        out = torch.empty_like(recv_x)
        start = 0
        for slot, n in enumerate(recv_counts.tolist()):
            if n:
                e = local_experts[slot]
                out[start : start + n] = run_expert(
                    self.get(e), recv_x[start : start + n], self.hidden, self.ffn
                )
            start += n
        return out
