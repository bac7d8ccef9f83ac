"""Expert placement: logical experts -> physical slots on EP ranks (seats).

Contract:

- :class:`Placement` is an immutable table ``slot -> logical expert`` (``-1`` = empty) for
  ``num_seats * slots_per_rank`` slots, seat-major: slot ``s`` lives on seat
  ``s // slots_per_rank``. A seat never holds the same expert twice.
- :func:`balanced_placement` is EPLB-style: it decides how many replicas each expert gets
  from its observed load (hot experts get redundant replicas) and packs replicas onto the
  live seats so per-seat load is balanced (longest-processing-time greedy).
- :func:`repair_placement` is fault-aware re-planning: given the previous placement and a
  new set of live seats, it keeps every replica that still sits on a live seat and moves
  only what must move (experts that lost their last replica, then free slots of joining
  seats), so that every logical expert keeps at least one live replica whenever there are
  enough live slots.
- :func:`seat_imbalance` reports max/mean load per seat for a load vector and a placement,
  assuming tokens are spread evenly across the replicas of an expert (what routing does).

All functions are pure and deterministic: every rank computes the same answer from the
same inputs.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mooncake_core.errors import InvalidRouting

__all__ = [
    "Placement",
    "balanced_placement",
    "repair_placement",
    "seat_imbalance",
]


@dataclass(frozen=True)
class Placement:
    """Which logical expert every physical slot holds.

    Attributes:
        num_experts: logical experts ``E``.
        num_seats: EP seats ``R`` (fixed capacity; a seat may be dead).
        slots_per_rank: physical expert slots per seat ``S``.
        slot_expert: ``R*S`` entries, logical expert id or ``-1`` for an empty slot.
    """

    num_experts: int
    num_seats: int
    slots_per_rank: int
    slot_expert: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.slot_expert) != self.num_seats * self.slots_per_rank:
            raise InvalidRouting(
                f"placement has {len(self.slot_expert)} slots; expected "
                f"num_seats*slots_per_rank = {self.num_seats * self.slots_per_rank}"
            )
        for seat in range(self.num_seats):
            held = [e for e in self.seat_experts(seat) if e >= 0]
            if len(set(held)) != len(held):
                raise InvalidRouting(f"seat {seat} holds an expert twice: {held}")
            if any(e >= self.num_experts for e in held):
                raise InvalidRouting(f"seat {seat} holds an expert id >= {self.num_experts}")

    def seat_experts(self, seat: int) -> tuple[int, ...]:
        """Experts (``-1`` for empty) in the slots of ``seat``, in slot order."""
        s = self.slots_per_rank
        return self.slot_expert[seat * s : (seat + 1) * s]

    def replicas(self, expert: int, live: Iterable[int] | None = None) -> list[int]:
        """Global slot ids holding ``expert``, optionally only on seats in ``live``."""
        keep = None if live is None else set(live)
        return [
            slot
            for slot, e in enumerate(self.slot_expert)
            if e == expert and (keep is None or slot // self.slots_per_rank in keep)
        ]

    def replica_table(self) -> torch.Tensor:
        """``[E, max_replicas]`` int64 of global slot ids, padded with ``-1``."""
        per: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, e in enumerate(self.slot_expert):
            if e >= 0:
                per[e].append(slot)
        width = max(1, max(len(p) for p in per))
        table = torch.full((self.num_experts, width), -1, dtype=torch.int64)
        for e, slots in enumerate(per):
            if slots:
                table[e, : len(slots)] = torch.tensor(slots, dtype=torch.int64)
        return table

    def moved_slots(self, other: Placement, live: Iterable[int]) -> int:
        """Slots on ``live`` seats whose expert differs between ``self`` and ``other``."""
        live_set = set(live)
        return sum(
            1
            for slot, (a, b) in enumerate(zip(self.slot_expert, other.slot_expert, strict=True))
            if slot // self.slots_per_rank in live_set and a != b and b >= 0
        )

    def describe(self) -> str:
        """One line per seat, for logs and examples."""
        return "\n".join(
            f"seat {seat}: {list(self.seat_experts(seat))}" for seat in range(self.num_seats)
        )

    def to_list(self) -> list[int]:
        return list(self.slot_expert)


def _check_load(load: Sequence[float], num_experts: int) -> list[float]:
    if len(load) != num_experts:
        raise InvalidRouting(
            f"load has {len(load)} entries; expected one per expert ({num_experts})"
        )
    # A small floor keeps never-seen experts placeable and ties deterministic.
    return [max(float(x), 0.0) + 1e-6 for x in load]


def _replica_counts(load: list[float], budget: int, cap: int) -> list[int]:
    """Replicas per expert: one each (hottest first if short), extra to the hottest per replica."""
    num_experts = len(load)
    counts = [0] * num_experts
    order = sorted(range(num_experts), key=lambda e: (-load[e], e))
    for e in order[: min(budget, num_experts)]:
        counts[e] = 1
    extra = budget - sum(counts)
    heap = [(-load[e] / counts[e], e) for e in range(num_experts) if counts[e] and counts[e] < cap]
    heapq.heapify(heap)
    while extra > 0 and heap:
        _, e = heapq.heappop(heap)
        counts[e] += 1
        extra -= 1
        if counts[e] < cap:
            heapq.heappush(heap, (-load[e] / counts[e], e))
    return counts


def balanced_placement(
    load: Sequence[float],
    live_seats: Iterable[int],
    num_seats: int,
    slots_per_rank: int,
    held: Mapping[int, Iterable[int]] | None = None,
) -> Placement:
    """EPLB-style placement from per-expert load over the live seats.

    Args:
        load: observed tokens (or any non-negative load) per logical expert.
        live_seats: seats that get slots; the others stay empty.
        num_seats: total seat capacity ``R``.
        slots_per_rank: slots per seat ``S``.
        held: experts each seat holds now; the balanced bins are handed to the seats that
            already hold most of their experts, so fewer weights move (balance unchanged).

    Returns:
        A placement where hot experts have redundant replicas and per-seat load (load of an
        expert split evenly over its replicas) is balanced greedily.
    """
    num_experts = len(load)
    weights = _check_load(load, num_experts)
    seats = sorted(set(live_seats))
    if not seats:
        raise InvalidRouting("no live seat to place experts on")
    counts = _replica_counts(weights, len(seats) * slots_per_rank, len(seats))
    replicas = sorted(
        ((weights[e] / counts[e], e) for e in range(num_experts) for _ in range(counts[e])),
        key=lambda t: (-t[0], t[1]),
    )
    seat_load = {s: 0.0 for s in seats}
    seat_items: dict[int, list[int]] = {s: [] for s in seats}
    for share, e in replicas:
        options = [
            s for s in seats if len(seat_items[s]) < slots_per_rank and e not in seat_items[s]
        ]
        if not options:  # only happens when an expert has more replicas than seats
            continue
        best = min(options, key=lambda s: (seat_load[s], s))
        seat_items[best].append(e)
        seat_load[best] += share
    bins = [seat_items[s] for s in seats]
    owner = dict(zip(range(len(bins)), seats, strict=True))
    if held is not None:
        have = {s: set(held.get(s, ())) for s in seats}
        pairs = sorted(
            ((len(have[s] & set(b)), i, s) for i, b in enumerate(bins) for s in seats),
            key=lambda t: (-t[0], t[1], t[2]),
        )
        owner, taken = {}, set()
        for _, i, s in pairs:
            if i not in owner and s not in taken:
                owner[i] = s
                taken.add(s)
    slot_expert = [-1] * (num_seats * slots_per_rank)
    for i, b in enumerate(bins):
        for j, e in enumerate(sorted(b)):
            slot_expert[owner[i] * slots_per_rank + j] = e
    return Placement(num_experts, num_seats, slots_per_rank, tuple(slot_expert))


def repair_placement(
    old: Placement,
    live_seats: Iterable[int],
    load: Sequence[float],
    available: Iterable[int] | None = None,
) -> Placement:
    """Fault-aware re-plan that moves only what must move.

    Replicas on seats that stay live keep their slot. Slots of seats that left are cleared.
    Every expert that has no live replica any more gets one slot: a free slot if there is
    one (joining seats bring free slots), else the slot of a redundant replica of the expert
    with the lowest load per replica. Remaining free slots (e.g. of a joining seat) get
    extra replicas of the hottest experts per replica.

    Args:
        old: the placement of the previous epoch.
        live_seats: seats of the new epoch.
        load: per-expert load used to choose which replicas to add or give up.
        available: experts whose weights can be obtained at all (a live holder or a weight
            store); others are not placed. Default: every expert.

    Returns:
        The new placement. ``moved_slots(old -> new)`` equals the number of slots that had
        to change.
    """
    weights = _check_load(load, old.num_experts)
    seats = sorted(set(live_seats))
    if not seats:
        raise InvalidRouting("no live seat to place experts on")
    s_per = old.slots_per_rank
    avail = set(range(old.num_experts)) if available is None else set(available)
    slot_expert = [-1] * len(old.slot_expert)
    for seat in seats:
        for slot in range(seat * s_per, (seat + 1) * s_per):
            slot_expert[slot] = old.slot_expert[slot]
    counts = [0] * old.num_experts
    for e in slot_expert:
        if e >= 0:
            counts[e] += 1

    def seat_of_free(expert: int) -> int | None:
        free = [
            slot
            for slot, e in enumerate(slot_expert)
            if e < 0
            and slot // s_per in seats
            and expert not in slot_expert[(slot // s_per) * s_per : (slot // s_per + 1) * s_per]
        ]
        if not free:
            return None
        loads = {
            slot: _seat_load(slot_expert, slot // s_per, s_per, weights, counts) for slot in free
        }
        return min(free, key=lambda slot: (loads[slot], slot))

    lost = sorted((e for e in avail if counts[e] == 0), key=lambda e: (-weights[e], e))
    for e in lost:
        free_slot = seat_of_free(e)
        if free_slot is not None:
            slot = free_slot
        else:
            donors = [
                s
                for s, d in enumerate(slot_expert)
                if d >= 0
                and counts[d] >= 2
                and e not in slot_expert[(s // s_per) * s_per : (s // s_per + 1) * s_per]
            ]
            if not donors:
                continue  # not enough live slots: this expert stays unplaced
            slot = min(
                donors,
                key=lambda s: (
                    weights[slot_expert[s]] / (counts[slot_expert[s]] - 1),
                    -_seat_load(slot_expert, s // s_per, s_per, weights, counts),
                    s,
                ),
            )
            counts[slot_expert[slot]] -= 1
        slot_expert[slot] = e
        counts[e] += 1
    # Fill any remaining free slots (joiners) with replicas of the hottest experts.
    while True:
        candidates = sorted(
            (e for e in avail if counts[e] > 0), key=lambda e: (-weights[e] / counts[e], e)
        )
        placed = False
        for e in candidates:
            free_slot = seat_of_free(e)
            if free_slot is not None:
                slot_expert[free_slot] = e
                counts[e] += 1
                placed = True
                break
        if not placed:
            break
    return Placement(old.num_experts, old.num_seats, s_per, tuple(slot_expert))


def _seat_load(
    slot_expert: Sequence[int],
    seat: int,
    s_per: int,
    weights: Sequence[float],
    counts: Sequence[int],
) -> float:
    return sum(
        weights[e] / max(counts[e], 1)
        for e in slot_expert[seat * s_per : (seat + 1) * s_per]
        if e >= 0
    )


def seat_imbalance(load: Sequence[float], placement: Placement, live_seats: Iterable[int]) -> float:
    """max/mean per-seat load when each expert's load is split evenly over its live replicas."""
    seats = sorted(set(live_seats))
    per_seat = {s: 0.0 for s in seats}
    for e, x in enumerate(load):
        reps = placement.replicas(e, seats)
        for slot in reps:
            per_seat[slot // placement.slots_per_rank] += float(x) / len(reps)
    mean = sum(per_seat.values()) / max(len(per_seat), 1)
    return max(per_seat.values()) / mean if mean > 0 else 1.0
