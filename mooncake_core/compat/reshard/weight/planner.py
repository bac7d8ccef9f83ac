"""``mooncake.reshard.weight.planner``: plan the copies that turn one weight placement
(or a stored weight manifest) into another.

For each target fragment (in fragment-id order) the planner finds the source fragments
whose boxes overlap it, picks one source per geometry (a complete DP replica chosen
round-robin by target DP rank, the declared owner for DP-owned tensors, the first
stored copy), requires the overlaps to cover the target exactly, and lowers each
overlap to a :class:`TransferRegion`. The result, a :class:`LogicalTransferPlan`, is
the published 0.3.13 one: the same regions in the same order, the same executors and
pipeline routes, the same errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mooncake_core.compat.reshard.contracts import ParticipantId, TensorId
from mooncake_core.compat.reshard.geometry import boxes_exactly_cover
from mooncake_core.compat.reshard.weight._plan_checks import (
    check_local_target_inventory,
    check_target_inventory,
    check_tensor_pair,
    check_tensor_sets,
    complete_dp_owned_source_owners,
    complete_parallel_source_replicas,
    has_dp_ownership,
    parallel_tensor_owner,
)
from mooncake_core.compat.reshard.weight._plan_types import (
    LogicalTransferOperation,
    LogicalTransferPlan,
    PipelineRouteGroup,
    PlacementExecutorPlan,
    PlanningLimits,
    TransferRegion,
    fragment_itemsize,
    region_geometry,
)
from mooncake_core.compat.reshard.weight.placement import WeightPlacementManifest
from mooncake_core.compat.reshard.weight.storage_manifest import StoredFragment, WeightManifest
from mooncake_core.compat.reshard.weight.types import (
    ParallelRank,
    PlacementFragment,
    TensorDescriptor,
)

__all__ = [
    "LogicalTransferOperation",
    "LogicalTransferPlan",
    "PipelineRouteGroup",
    "PlacementExecutorPlan",
    "PlanningLimits",
    "TransferRegion",
    "plan_placement_transfer",
    "plan_placement_transfer_to_local_target",
    "plan_stored_transfer_to_target_placement",
]

Tensors = dict[TensorId, TensorDescriptor]


def _collect(placement: Any, label: str) -> tuple[Tensors, list[PlacementFragment]]:
    if not isinstance(placement, WeightPlacementManifest):
        raise ValueError(f"{label} placement manifests must be WeightPlacementManifest")
    seen: set[str] = set()
    for frag in placement.fragments:
        if frag.placement_fragment_id in seen:
            raise ValueError(f"duplicate {label} placement fragment: {frag.placement_fragment_id}")
        seen.add(frag.placement_fragment_id)
    return {t.tensor_id: t for t in placement.tensors}, list(placement.fragments)


def _same_generation(source: Any, target: WeightPlacementManifest) -> None:
    if source.resource_id != target.resource_id:
        raise ValueError("source and target resource_id differ")
    if source.revision != target.revision:
        raise ValueError("source and target revision differ")
    if source.weight_generation != target.weight_generation:
        raise ValueError("source and target weight_generation differ")


def _source_order(frag: Any) -> tuple[Any, ...]:
    if isinstance(frag, StoredFragment):
        return (0, 0, 0, 0, frag.object_key, frag.fragment_id)
    r = frag.rank
    return (r.dp, r.pp, r.ep, r.tp, frag.fragment_id)


def _overlap(a: Any, b: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    if len({len(a.global_offset), len(b.global_offset), len(a.local_shape)}) > 1:
        raise ValueError("zip() arguments have different lengths")
    start = tuple(max(x, y) for x, y in zip(a.global_offset, b.global_offset, strict=True))
    end = tuple(
        min(x + n, y + m)
        for x, n, y, m in zip(
            a.global_offset, a.local_shape, b.global_offset, b.local_shape, strict=False
        )
    )
    shape = tuple(e - s for s, e in zip(start, end, strict=True))
    return None if any(n <= 0 for n in shape) else (start, shape)


class _Candidates:
    """The groups of source fragments (one group per distinct box) of one tensor,
    searchable by the dimension along which their boxes differ most."""

    def __init__(self, groups: list[list[Any]]) -> None:
        rank = len(groups[0][0].global_offset)

        def spread(d: int) -> tuple[int, int]:
            boxes = {
                (g[0].global_offset[d], g[0].global_offset[d] + g[0].local_shape[d]) for g in groups
            }
            return (len(boxes), -d)

        self.dim = max(range(rank), key=spread)
        self.groups = [
            (
                g[0].global_offset[self.dim],
                g[0].global_offset[self.dim] + g[0].local_shape[self.dim],
                g,
            )
            for g in groups
        ]

    def overlapping(self, target: PlacementFragment) -> list[list[Any]]:
        lo = target.global_offset[self.dim]
        hi = lo + target.local_shape[self.dim]
        return [g for start, end, g in self.groups if start < hi and end > lo]


def _region(
    tensor: TensorDescriptor,
    source: Any,
    target: PlacementFragment,
    offset: tuple[int, ...],
    shape: tuple[int, ...],
) -> TransferRegion[Any, PlacementFragment]:
    if fragment_itemsize(source) != tensor.itemsize or fragment_itemsize(target) != tensor.itemsize:
        raise ValueError("transfer region fragment itemsize differs from descriptor")
    s_base, t_base, inner, counts, s_strides, t_strides = region_geometry(
        source, target, offset, shape
    )
    return TransferRegion(
        tensor_id=tensor.tensor_id,
        source=source,
        target=target,
        overlap_offset=offset,
        overlap_shape=shape,
        source_base_offset=s_base,
        target_base_offset=t_base,
        inner_bytes=inner,
        outer_loop_counts=counts,
        source_strides=s_strides,
        target_strides=t_strides,
    )


def _plan(
    source_tensors: Tensors,
    source_fragments: Sequence[Any],
    target_tensors: Tensors,
    target_fragments: Sequence[PlacementFragment],
    limits: PlanningLimits | None,
    *,
    local_target: bool = False,
) -> tuple[list[TransferRegion[Any, PlacementFragment]], PlanningLimits]:
    limits = limits or PlanningLimits()
    if local_target:
        check_tensor_sets(source_tensors, target_tensors, subset=True)
        check_local_target_inventory(target_tensors, target_fragments)
    else:
        check_tensor_sets(source_tensors, target_tensors)
        check_target_inventory(target_tensors, target_fragments)
    placed = [f for f in source_fragments if isinstance(f, PlacementFragment)]
    stored = [f for f in source_fragments if isinstance(f, StoredFragment)]
    if len(placed) + len(stored) != len(source_fragments) or not source_fragments:
        raise ValueError("source fragments mix placement and stored locations")
    if placed and stored:
        raise ValueError("source fragments mix placement and stored locations")
    replicas = complete_parallel_source_replicas(source_tensors, placed) if placed else {}
    dp_owners = complete_dp_owned_source_owners(source_tensors, placed) if placed else {}
    replica_dps = sorted(replicas)
    dp_for_target = (
        {dp: replica_dps[dp % len(replica_dps)] for dp in {f.rank.dp for f in target_fragments}}
        if placed and replica_dps
        else {}
    )
    boxes: dict[TensorId, dict[tuple[Any, ...], list[Any]]] = {}
    for frag in source_fragments:
        key = (frag.tensor_id, frag.global_offset, frag.local_shape)
        boxes.setdefault(frag.tensor_id, {}).setdefault(key, []).append(frag)
    index = {
        tid: _Candidates([sorted(g, key=_source_order) for g in per_box.values()])
        for tid, per_box in boxes.items()
    }
    ops: list[TransferRegion[Any, PlacementFragment]] = []
    lowered = 0
    for target in sorted(target_fragments, key=lambda f: f.fragment_id):
        tensor = target_tensors[target.tensor_id]
        source_tensor = source_tensors.get(target.tensor_id)
        if source_tensor is None:
            raise ValueError(f"missing source tensor: {target.tensor_id}")
        check_tensor_pair(source_tensor, tensor)
        found: list[tuple[tuple[int, ...], tuple[int, ...], Any]] = []
        candidates = index.get(target.tensor_id)
        for group in candidates.overlapping(target) if candidates is not None else ():
            if placed:
                if has_dp_ownership(source_tensor):
                    owner, dp = dp_owners[target.tensor_id], None
                else:
                    dp = dp_for_target[target.rank.dp]
                    owner = replicas[dp][target.tensor_id]
                eligible = [
                    f
                    for f in group
                    if isinstance(f, PlacementFragment)
                    and (dp is None or f.rank.dp == dp)
                    and parallel_tensor_owner(source_tensor, f) == owner
                ]
                if not eligible:
                    continue
                chosen = eligible[0]
            else:
                chosen = group[0]
            box = _overlap(chosen, target)
            if box is None:
                continue
            if len(ops) + len(found) + 1 > limits.max_transfer_regions:
                raise ValueError(
                    "logical transfer plan exceeds max_transfer_regions: "
                    f"{limits.max_transfer_regions}"
                )
            found.append((*box, chosen))
        found.sort(key=lambda item: (item[0], item[1], item[2].fragment_id))
        if not boxes_exactly_cover(
            target.global_offset, target.local_shape, tuple((o, s) for o, s, _ in found)
        ):
            raise ValueError(f"target fragment is not fully covered: {target.fragment_id}")
        for offset, shape, source in found:
            region = _region(tensor, source, target, offset, shape)
            if region.segment_count > limits.max_segments_per_region:
                raise ValueError(
                    "logical transfer region exceeds max_segments_per_region: "
                    f"{region.segment_count} > {limits.max_segments_per_region}"
                )
            if lowered + region.segment_count > limits.max_total_lowered_segments:
                raise ValueError(
                    "logical transfer plan exceeds max_total_lowered_segments: "
                    f"{lowered + region.segment_count} > {limits.max_total_lowered_segments}"
                )
            ops.append(region)
            lowered += region.segment_count
    ops.sort(
        key=lambda r: (
            r.target.fragment_id,
            r.target_base_offset,
            r.source.fragment_id,
            r.source_base_offset,
        )
    )
    return ops, limits


def _executors(
    placement: WeightPlacementManifest,
    ops: Sequence[TransferRegion[Any, PlacementFragment]],
    side: str,
    participants: frozenset[ParticipantId] | None = None,
) -> tuple[PlacementExecutorPlan, ...]:
    used: set[str] = set()
    for op in ops:
        frag = op.source if side == "source" else op.target
        if not isinstance(frag, PlacementFragment):
            raise ValueError(f"placement executor operation {side} is not a placement")
        used.add(frag.placement_fragment_id)
    out = []
    ranks: set[ParallelRank] = set()
    for part in placement.parts:
        if participants is not None and part.participant_id not in participants:
            continue
        if not part.fragments:
            continue
        if part.rank in ranks:
            raise ValueError(f"duplicate {side} placement executor rank: {part.rank}")
        ranks.add(part.rank)
        ids = tuple(sorted(f.placement_fragment_id for f in part.fragments))
        if any(i in used for i in ids):
            out.append(
                PlacementExecutorPlan(placement.placement_id, part.participant_id, part.rank, ids)
            )
    out.sort(key=lambda e: (e.rank.dp, e.rank.pp, e.rank.ep, e.rank.tp))
    return tuple(out)


def _make_plan(
    ops: list[TransferRegion[Any, PlacementFragment]],
    limits: PlanningLimits,
    source_tensors: Tensors,
    target_tensors: Tensors,
    source: WeightPlacementManifest | None,
    manifest: WeightManifest | None,
    target: WeightPlacementManifest,
    target_participants: frozenset[ParticipantId] | None = None,
) -> LogicalTransferPlan:
    ident = source if source is not None else manifest
    assert ident is not None
    return LogicalTransferPlan(
        resource_id=ident.resource_id,
        revision=ident.revision,
        source_placement=source,
        target_placement=target,
        source_tensors=tuple(sorted(source_tensors.values(), key=lambda t: t.tensor_id)),
        target_tensors=tuple(sorted(target_tensors.values(), key=lambda t: t.tensor_id)),
        operations=tuple(ops),
        source_manifest=manifest,
        planning_limits=limits,
        source_executors=_executors(source, ops, "source") if source is not None else (),
        target_executors=_executors(target, ops, "target", target_participants),
    )


def plan_placement_transfer(
    source_placement: WeightPlacementManifest,
    target_placement: WeightPlacementManifest,
    *,
    planning_limits: PlanningLimits | None = None,
) -> LogicalTransferPlan:
    """Plan a reshard between two complete placements of the same weights."""
    source_tensors, source_fragments = _collect(source_placement, "source")
    target_tensors, target_fragments = _collect(target_placement, "target")
    _same_generation(source_placement, target_placement)
    ops, limits = _plan(
        source_tensors, source_fragments, target_tensors, target_fragments, planning_limits
    )
    return _make_plan(
        ops, limits, source_tensors, target_tensors, source_placement, None, target_placement
    )


def plan_placement_transfer_to_local_target(
    source_placement: WeightPlacementManifest,
    target_placement: WeightPlacementManifest,
    target_participant_id: ParticipantId | None = None,
    *,
    planning_limits: PlanningLimits | None = None,
) -> LogicalTransferPlan:
    """Plan only what one target participant (the only one, by default) receives."""
    source_tensors, source_fragments = _collect(source_placement, "source")
    if target_participant_id is None:
        if target_placement.topology.world_size != 1:
            raise ValueError("target_participant_id is required for a multi-participant target")
        target_participant_id = target_placement.parts[0].participant_id
    part = next(
        (p for p in target_placement.parts if p.participant_id == target_participant_id), None
    )
    if part is None:
        raise ValueError(f"unknown target participant: {target_participant_id}")
    target_tensors = {t.tensor_id: t for t in part.tensors}
    _same_generation(source_placement, target_placement)
    ops, limits = _plan(
        source_tensors,
        source_fragments,
        target_tensors,
        list(part.fragments),
        planning_limits,
        local_target=True,
    )
    plan = _make_plan(
        ops,
        limits,
        source_tensors,
        target_tensors,
        source_placement,
        None,
        target_placement,
        frozenset({target_participant_id}),
    )
    if len(plan.target_executors) != 1:
        raise ValueError("local target placement must describe exactly one executor")
    return plan


def plan_stored_transfer_to_target_placement(
    source_manifest: WeightManifest,
    target_placement: WeightPlacementManifest,
    *,
    planning_limits: PlanningLimits | None = None,
) -> LogicalTransferPlan:
    """Plan loading a stored weight group into a target placement."""
    target_tensors, target_fragments = _collect(target_placement, "target")
    _same_generation(source_manifest, target_placement)
    source_tensors = {t.tensor_id: t for t in source_manifest.tensors}
    ops, limits = _plan(
        source_tensors, source_manifest.fragments, target_tensors, target_fragments, planning_limits
    )
    return _make_plan(
        ops, limits, source_tensors, target_tensors, None, source_manifest, target_placement
    )
