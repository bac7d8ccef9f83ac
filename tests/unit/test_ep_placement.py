"""Placement: EPLB-style replicas, balance, fault-aware repair that moves only what must move."""

from __future__ import annotations

import pytest

from mooncake_core.ep import Placement, balanced_placement, repair_placement, seat_imbalance
from mooncake_core.ep.membership import AliveInfo, View, plan_view
from mooncake_core.errors import InvalidRouting


def _zipf(n: int, alpha: float = 1.2) -> list[float]:
    return [1000.0 / (i + 1) ** alpha for i in range(n)]


def test_balanced_placement_replicates_hot_experts_and_balances() -> None:
    load = _zipf(32)
    naive = Placement(32, 4, 10, tuple([e for e in range(32)] + [-1] * 8))
    p = balanced_placement(load, range(4), 4, 10)
    assert all(len(p.replicas(e)) >= 1 for e in range(32))
    assert len(p.replicas(0)) > len(p.replicas(31))
    before = seat_imbalance(load, naive, range(4))
    after = seat_imbalance(load, p, range(4))
    assert before >= 2.0 and after <= 1.15, (before, after)


def test_repair_moves_only_lost_experts() -> None:
    p = balanced_placement([1.0] * 32, range(4), 4, 16)  # every expert twice
    live = [0, 1, 3]
    new = repair_placement(p, live, [1.0] * 32)
    assert new.seat_experts(2) == (-1,) * 16
    assert new.moved_slots(p, live) == 0  # redundancy covers seat 2: nothing moves
    assert all(new.replicas(e, live) for e in range(32))


def test_repair_without_spare_slots_takes_redundant_replicas() -> None:
    load = _zipf(32)
    p = balanced_placement(load, range(4), 4, 12)  # 48 slots; 36 survive for 32 experts
    lost_only = {e for e in p.seat_experts(1)} - {e for s in (0, 2, 3) for e in p.seat_experts(s)}
    new = repair_placement(p, [0, 2, 3], load)
    assert all(new.replicas(e, [0, 2, 3]) for e in range(32))
    assert new.moved_slots(p, [0, 2, 3]) == len(lost_only)


def test_repair_with_too_few_slots_leaves_coldest_unplaced_and_fills_joiners() -> None:
    p = balanced_placement([1.0] * 32, range(4), 4, 8)  # no redundancy
    new = repair_placement(p, [0, 2, 3], [1.0] * 32)
    assert sum(1 for e in range(32) if not new.replicas(e)) == 8
    back = repair_placement(new, [0, 1, 2, 3], [1.0] * 32)
    assert all(back.replicas(e) for e in range(32))
    assert back.moved_slots(new, [0, 2, 3]) == 0  # survivors keep theirs; the joiner fills up


def test_plan_view_copies_from_live_holders_only() -> None:
    p = balanced_placement([1.0] * 32, range(4), 4, 8)
    old = View(0, (0, 1, 2, 3), p)
    posted = {
        s: AliveInfo(5, 5, tuple(e for e in p.seat_experts(s)), (1.0,) * 32) for s in (0, 1, 3)
    }
    v = plan_view(old, posted, {})
    assert v.members == (0, 1, 3) and v.transfers == () and v.resume_round == 5
    rejoin = plan_view(v, {s: posted[s] for s in (0, 1, 3)}, {2: "n"}, reason="join")
    assert rejoin.members == (0, 1, 2, 3) and rejoin.joined == ((2, "n"),)
    assert rejoin.transfers and all(
        t.dst_seat == 2 and t.src_seat in (0, 1, 3) for t in rejoin.transfers
    )
    assert View.from_json(rejoin.to_json()) == rejoin


def test_plan_view_with_nobody_alive_is_an_error() -> None:
    p = balanced_placement([1.0] * 8, range(2), 2, 4)
    with pytest.raises(Exception, match="no member of epoch 0 is alive"):
        plan_view(View(0, (0, 1), p), {}, {})


def test_bad_placement_is_rejected() -> None:
    with pytest.raises(InvalidRouting, match="expected num_seats"):
        Placement(4, 2, 2, (0, 1, 2))
    with pytest.raises(InvalidRouting, match="holds an expert twice"):
        Placement(4, 2, 2, (0, 0, 1, 2))


def test_rebalance_hands_bins_to_seats_that_already_hold_them() -> None:
    live = [0, 1, 2]
    before = balanced_placement([1.0] * 32, range(4), 4, 16)
    held = {s: [e for e in before.seat_experts(s) if e >= 0] for s in live}
    load = _zipf(32)
    plain = balanced_placement(load, live, 4, 16)
    sticky = balanced_placement(load, live, 4, 16, held=held)
    assert seat_imbalance(load, sticky, live) == pytest.approx(seat_imbalance(load, plain, live))

    def copies(p: Placement) -> int:
        return sum(1 for s in live for e in p.seat_experts(s) if e >= 0 and e not in held[s])

    assert copies(sticky) <= copies(plain)
