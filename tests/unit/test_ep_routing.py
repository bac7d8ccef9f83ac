"""Routing: live replicas only, spreading, renormalize / substitute against loop references."""

from __future__ import annotations

import pytest
import torch

from mooncake_core.ep import Placement, ReplicaTable, balanced_placement, route, validate_routing
from mooncake_core.errors import InvalidRouting


def _table(p: Placement, live_seats: list[int]) -> ReplicaTable:
    mask = torch.zeros(p.num_seats, dtype=torch.bool)
    mask[live_seats] = True
    return ReplicaTable.build(p.replica_table(), mask.repeat_interleave(p.slots_per_rank))


def _inputs(
    t: int = 64, e: int = 32, k: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(t, e, generator=gen)
    vals, idx = torch.topk(logits, k, dim=1)
    return idx, torch.softmax(vals, dim=1), logits


def test_routes_only_to_live_replicas_and_spreads_load() -> None:
    p = balanced_placement([1.0] * 32, range(4), 4, 16)
    idx, w, _ = _inputs(400)
    r = route(idx, w, _table(p, [0, 1, 3]))
    seats = r.slots // 16
    assert bool((seats != 2).all()) and r.dropped == 0
    assert torch.equal(r.experts, idx) and torch.allclose(r.weights, w)
    for e in range(32):  # both live replicas of each expert get a share
        used = set(r.slots[idx == e].tolist())
        assert used <= set(p.replicas(e, [0, 1, 3]))
    r_all = route(idx, w, _table(p, [0, 1, 2, 3]))
    counts = torch.bincount(r_all.slots.reshape(-1), minlength=64).float()
    assert counts.max() / counts[counts > 0].mean() < 2.0


def test_renormalize_matches_loop_reference() -> None:
    p = balanced_placement([1.0] * 32, range(4), 4, 8)
    idx, w, _ = _inputs()
    r = route(idx, w, _table(p, [0, 2, 3]), "renormalize")
    dead = set(p.seat_experts(1))
    for t in range(idx.shape[0]):
        keep = [k for k in range(4) if int(idx[t, k]) not in dead]
        scale = float(w[t].sum()) / sum(float(w[t, k]) for k in keep) if keep else 0.0
        for k in range(4):
            if k in keep:
                assert int(r.experts[t, k]) == int(idx[t, k])
                assert float(r.weights[t, k]) == pytest.approx(float(w[t, k]) * scale, rel=1e-6)
            else:
                assert (
                    int(r.experts[t, k]) == -1
                    and int(r.slots[t, k]) == -1
                    and float(r.weights[t, k]) == 0.0
                )
    assert r.dropped == sum(int(e) in dead for e in idx.reshape(-1))


def test_substitute_matches_loop_reference() -> None:
    p = balanced_placement([1.0] * 32, range(4), 4, 8)
    idx, w, logits = _inputs()
    r = route(idx, w, _table(p, [0, 2, 3]), "substitute", logits)
    dead = set(p.seat_experts(1))
    for t in range(idx.shape[0]):
        chosen = idx[t].tolist()
        order = torch.argsort(logits[t], descending=True).tolist()
        for k, e in enumerate(chosen):
            if e in dead:
                chosen[k] = next(c for c in order if c not in dead and c not in chosen)
        assert r.experts[t].tolist() == chosen
        assert torch.allclose(r.weights[t], w[t])
    assert r.dropped == 0 and r.substituted == sum(int(e) in dead for e in idx.reshape(-1))


def test_substitute_needs_logits() -> None:
    p = balanced_placement([1.0] * 32, range(4), 4, 8)
    idx, w, _ = _inputs()
    with pytest.raises(InvalidRouting, match="needs router_logits"):
        route(idx, w, _table(p, [0, 2, 3]), "substitute")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda x, i, w: (x, i.masked_fill(i == i[0, 0], 40), w), "expert id 40"),
        (lambda x, i, w: (x, i.masked_fill(i == i[0, 0], -3), w), "expert id -3"),
        (lambda x, i, w: (x[:-1], i, w), "topk_idx must be"),
        (lambda x, i, w: (x, i, w[:, :2]), "topk_weights shape"),
        (lambda x, i, w: (x[:, :5], i, w), "hidden size 5"),
        (lambda x, i, w: (x, i.float(), w), "int64 or int32"),
    ],
)
def test_validation_names_the_problem(mutate, match) -> None:  # type: ignore[no-untyped-def]
    idx, w, _ = _inputs()
    x = torch.randn(idx.shape[0], 8)
    x, idx, w = mutate(x, idx, w)
    with pytest.raises(InvalidRouting, match=match):
        validate_routing(x, idx, w, 32, hidden=8)
