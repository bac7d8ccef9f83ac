"""Checks of the reshard planner: which fragments own a tensor (ownership axes), which
source DP replicas are complete, whether targets are covered, and whether a finished
plan agrees with its source and target placements. Published messages throughout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mooncake_core.compat.reshard.contracts import ParticipantId, TensorId
from mooncake_core.compat.reshard.geometry import boxes_exactly_cover, regions_exactly_cover
from mooncake_core.compat.reshard.weight.types import (
    OwnershipAxis,
    PlacementFragment,
    TensorDescriptor,
)

__all__ = [
    "complete_dp_owned_source_owners",
    "complete_parallel_source_replicas",
    "has_dp_ownership",
    "parallel_tensor_owner",
]

Owner = tuple[tuple[str, int], ...]


def parallel_tensor_owner(tensor: TensorDescriptor, fragment: PlacementFragment) -> Owner:
    """The fragment's coordinates on the tensor's ownership axes."""
    return tuple(
        (a.kind, getattr(fragment.rank, a.kind))
        for a in tensor.parallel_axes
        if isinstance(a, OwnershipAxis)
    )


def has_dp_ownership(tensor: TensorDescriptor) -> bool:
    """True when DP ranks own the tensor (rather than each holding a replica)."""
    return any(isinstance(a, OwnershipAxis) and a.kind == "dp" for a in tensor.parallel_axes)


def _covers(tensor: TensorDescriptor, frags: Sequence[Any]) -> bool:
    boxes = {(f.global_offset, f.local_shape): f for f in frags if f.tensor_id == tensor.tensor_id}
    return boxes_exactly_cover((0,) * len(tensor.global_shape), tensor.global_shape, tuple(boxes))


def _by_owner(tensor: TensorDescriptor, frags: Sequence[Any]) -> dict[Owner, list[Any]]:
    out: dict[Owner, list[Any]] = {}
    for frag in frags:
        out.setdefault(parallel_tensor_owner(tensor, frag), []).append(frag)
    return out


def _by_dp_tensor(frags: Sequence[Any]) -> dict[int, dict[TensorId, list[Any]]]:
    out: dict[int, dict[TensorId, list[Any]]] = {}
    for frag in frags:
        out.setdefault(frag.rank.dp, {}).setdefault(frag.tensor_id, []).append(frag)
    return out


def complete_dp_owned_source_owners(
    source_tensors: dict[TensorId, TensorDescriptor],
    source_fragments: Sequence[PlacementFragment],
) -> dict[TensorId, Owner]:
    """For each DP-owned tensor, its one owner whose fragments cover it completely."""
    owned = [t for t in source_tensors.values() if has_dp_ownership(t)]
    if not owned:
        return {}
    per_tensor: dict[TensorId, list[PlacementFragment]] = {}
    for frag in source_fragments:
        per_tensor.setdefault(frag.tensor_id, []).append(frag)
    out: dict[TensorId, Owner] = {}
    for tensor in owned:
        groups = _by_owner(tensor, per_tensor.get(tensor.tensor_id, []))
        complete = sorted(o for o, fs in groups.items() if _covers(tensor, fs))
        if not complete:
            raise ValueError(
                f"DP-owned source tensor has no complete declared owner: {tensor.tensor_id}"
            )
        if len(complete) != 1 or len(groups) != 1:
            raise ValueError(
                f"DP-owned source tensor has ambiguous declared owners: {tensor.tensor_id}"
            )
        out[tensor.tensor_id] = complete[0]
    return out


def complete_parallel_source_replicas(
    source_tensors: dict[TensorId, TensorDescriptor],
    source_fragments: Sequence[PlacementFragment],
) -> dict[int, dict[TensorId, Owner]]:
    """The source DP ranks holding a complete replica of every replicated tensor, with
    the owner chosen per tensor."""
    per_dp = _by_dp_tensor(source_fragments)
    replicated = [t for t in source_tensors.values() if not has_dp_ownership(t)]
    if not replicated:
        return {}
    out: dict[int, dict[TensorId, Owner]] = {}
    for dp in sorted(per_dp):
        owners: dict[TensorId, Owner] | None = {}
        for tensor in replicated:
            groups = _by_owner(tensor, per_dp[dp].get(tensor.tensor_id, []))
            complete = [o for o, fs in groups.items() if _covers(tensor, fs)]
            if not groups or len(complete) != len(groups):
                owners = None
                break
            assert owners is not None
            owners[tensor.tensor_id] = min(complete)
        if owners is not None:
            out[dp] = owners
    if not out:
        raise ValueError(
            "source manifests have no complete DP replica; tensors are not fully covered"
        )
    return out


def check_target_inventory(
    target_tensors: dict[TensorId, TensorDescriptor], target_fragments: Sequence[Any]
) -> None:
    """Every target tensor is covered: by its DP owner, or within each target DP rank by
    each ownership group."""
    if not target_fragments:
        raise ValueError("target manifests have no fragments")
    per_dp = _by_dp_tensor(target_fragments)
    for tensor in target_tensors.values():
        if has_dp_ownership(tensor):
            everywhere = [f for dp in per_dp.values() for f in dp.get(tensor.tensor_id, [])]
            groups = _by_owner(tensor, everywhere)
            if not groups or not all(_covers(tensor, fs) for fs in groups.values()):
                raise ValueError(
                    f"target tensor is not fully covered by its DP owner: {tensor.tensor_id}"
                )
            continue
        for dp in sorted(per_dp):
            groups = _by_owner(tensor, per_dp[dp].get(tensor.tensor_id, []))
            if not groups or not all(_covers(tensor, fs) for fs in groups.values()):
                raise ValueError(f"target tensor is not fully covered: {tensor.tensor_id}: dp={dp}")


def check_local_target_inventory(
    target_tensors: dict[TensorId, TensorDescriptor], target_fragments: Sequence[Any]
) -> None:
    if not target_fragments:
        raise ValueError("local target manifest has no fragments")
    if len({f.rank for f in target_fragments}) != 1:
        raise ValueError("local target manifest must describe exactly one executor")
    missing = sorted(set(target_tensors) - {f.tensor_id for f in target_fragments})
    if missing:
        raise ValueError(f"local target manifest is missing fragments: {', '.join(missing)}")


def check_tensor_pair(source: TensorDescriptor, target: TensorDescriptor) -> None:
    if source.layout_fingerprint != target.layout_fingerprint:
        raise ValueError(f"layout mismatch for tensor {source.tensor_id}")
    fields = ("global_shape", "dtype", "itemsize", "layer_id", "expert_id")
    if any(getattr(source, f) != getattr(target, f) for f in fields):
        raise ValueError(f"tensor descriptor mismatch: {source.tensor_id}")


def check_tensor_sets(
    source: dict[TensorId, TensorDescriptor],
    target: dict[TensorId, TensorDescriptor],
    *,
    subset: bool = False,
) -> None:
    missing = [] if subset else sorted(set(source) - set(target))
    if missing:
        raise ValueError(f"target manifests are missing tensors: {', '.join(missing)}")
    unknown = sorted(set(target) - set(source))
    if unknown:
        raise ValueError(f"target manifests contain unknown tensors: {', '.join(unknown)}")


def _check_side(plan: Any, side: str) -> set[ParticipantId]:
    """Each operation's fragment on ``side`` is a fragment of that side's placement;
    returns the participants the operations touch."""
    placement = plan.target_placement if side == "target" else plan.source_placement
    parts = {p.participant_id: p for p in placement.parts}
    owner_of = {
        f.placement_fragment_id: p.participant_id for p in placement.parts for f in p.fragments
    }
    touched: set[ParticipantId] = set()
    for op in plan.operations:
        frag = op.target if side == "target" else op.source
        if not isinstance(frag, PlacementFragment):
            raise ValueError(f"logical transfer operation {side} must be a placement")
        who = owner_of.get(frag.placement_fragment_id)
        if who is None or frag not in parts[who].fragments:
            raise ValueError(f"logical plan and {side} placement fragment snapshots differ")
        touched.add(who)
    return touched


def _check_executor(plan: Any, executor: Any, side: str, seen: set[ParticipantId]) -> Any:
    placement = plan.target_placement if side == "target" else plan.source_placement
    word = "target" if side == "target" else "source"
    if executor.placement_id != placement.placement_id:
        raise ValueError(f"logical {word} executor placement differs from {word}")
    if executor.participant_id in seen:
        raise ValueError(f"logical plan has duplicate {word} executor participant")
    seen.add(executor.participant_id)
    part = next((p for p in placement.parts if p.participant_id == executor.participant_id), None)
    if part is None or executor.rank != part.rank:
        raise ValueError(f"logical {word} executor differs from {word} placement")
    if executor.placement_fragment_ids != tuple(
        sorted(f.placement_fragment_id for f in part.fragments)
    ):
        raise ValueError(f"logical {word} executor fragments differ from {word} placement")
    if not plan.operation_indices_for_executor(executor, side):
        raise ValueError(f"logical {word} executor operations differ from {word} placement")
    return part


def check_target_coverage(plan: Any) -> None:
    """Target operations and executors agree with the target placement, and every
    selected target fragment is written exactly once."""
    touched = _check_side(plan, "target")
    if not plan.target_executors:
        raise ValueError("logical plan has no target executor metadata")
    seen: set[ParticipantId] = set()
    fragments: dict[str, PlacementFragment] = {}
    tensors: dict[TensorId, TensorDescriptor] = {}
    for executor in plan.target_executors:
        part = _check_executor(plan, executor, "target", seen)
        fragments.update({f.placement_fragment_id: f for f in part.fragments})
        for tensor in part.tensors:
            if tensors.setdefault(tensor.tensor_id, tensor) != tensor:
                raise ValueError("logical target tensor catalog differs from placement")
    if seen != touched:
        raise ValueError("logical target executors differ from planned operations")
    if plan.target_tensors != tuple(sorted(tensors.values(), key=lambda t: t.tensor_id)):
        raise ValueError("logical target tensor catalog differs from placement")
    per_fragment: dict[str, list[Any]] = {}
    for op in plan.operations:
        per_fragment.setdefault(op.target.placement_fragment_id, []).append(op)
    for fid, target in fragments.items():
        if not regions_exactly_cover(target, per_fragment.get(fid, ())):
            raise ValueError(f"logical target fragment is not fully covered: {fid}")


def check_source_placement(plan: Any) -> None:
    """Source operations and executors agree with the source placement."""
    source = plan.source_placement
    if source is None:
        return
    if plan.source_tensors != source.tensors:
        raise ValueError("logical plan source tensor catalog differs from placement")
    if not plan.source_executors:
        raise ValueError("logical plan has no source executor metadata")
    touched = _check_side(plan, "source")
    seen: set[ParticipantId] = set()
    for executor in plan.source_executors:
        _check_executor(plan, executor, "source", seen)
    if seen != touched:
        raise ValueError("logical source executors differ from planned operations")
