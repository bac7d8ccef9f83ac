"""Checks across fragments: unique ids, boxes in bounds and disjoint per rank, alias
groups, complete coverage of every tensor along its split / replicated / ownership
axes, and disjoint runtime address ranges. Each failure is the published
``ValueError`` message."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import product

from mooncake_core.compat.reshard.contracts import (
    RuntimeBindingFragment,
    RuntimeInstanceId,
    TensorId,
)
from mooncake_core.compat.reshard.geometry import boxes_exactly_cover, boxes_overlap
from mooncake_core.compat.reshard.weight.topology import ParallelTopology
from mooncake_core.compat.reshard.weight.types import (
    OwnershipAxis,
    ParallelRank,
    PlacementFragment,
    ReplicatedAxis,
    SplitAxis,
    TensorDescriptor,
    validate_fragment_geometry,
)

__all__ = [
    "OwnershipAxis",
    "ParallelRank",
    "ParallelTopology",
    "PlacementFragment",
    "ReplicatedAxis",
    "RuntimeBindingFragment",
    "SplitAxis",
    "TensorDescriptor",
    "boxes_exactly_cover",
    "boxes_overlap",
    "validate_fragment_geometry",
]

Coords = tuple[tuple[str, int], ...]


def _coords(rank: ParallelRank, kinds: Sequence[str]) -> Coords:
    return tuple((kind, getattr(rank, kind)) for kind in kinds)


def _at(rank: ParallelRank, coords: Coords) -> bool:
    return all(getattr(rank, kind) == value for kind, value in coords)


def _kinds(tensor: TensorDescriptor, semantics: type) -> tuple[str, ...]:
    return tuple(a.kind for a in tensor.parallel_axes if isinstance(a, semantics))


def _validate_fragments(
    tensors: Sequence[TensorDescriptor],
    fragments: Sequence[PlacementFragment],
    *,
    require_complete_alias_groups: bool = False,
) -> None:
    by_id: dict[TensorId, TensorDescriptor] = {}
    for tensor in tensors:
        if tensor.tensor_id in by_id:
            raise ValueError(f"duplicate tensor_id: {tensor.tensor_id}")
        by_id[tensor.tensor_id] = tensor
    ids: set[str] = set()
    boxes: set[tuple[object, ...]] = set()
    for frag in fragments:
        if frag.fragment_id in ids:
            raise ValueError(f"duplicate fragment_id: {frag.fragment_id}")
        ids.add(frag.fragment_id)
        box = (frag.tensor_id, frag.rank, frag.global_offset, frag.local_shape)
        if box in boxes:
            raise ValueError(
                f"duplicate logical fragment for tensor and parallel rank: {frag.fragment_id}"
            )
        boxes.add(box)
        owner = by_id.get(frag.tensor_id)
        if owner is None:
            raise ValueError(f"unknown tensor_id: {frag.tensor_id}")
        validate_fragment_geometry(
            owner,
            fragment_id=frag.fragment_id,
            global_offset=frag.global_offset,
            local_shape=frag.local_shape,
            nbytes=frag.nbytes,
        )
    if require_complete_alias_groups:
        _check_alias_groups(by_id, fragments)
    per_owner: dict[tuple[str, ParallelRank], list[PlacementFragment]] = {}
    for frag in fragments:
        per_owner.setdefault((frag.tensor_id, frag.rank), []).append(frag)
    for group in per_owner.values():
        if len(group) > 1 and boxes_overlap([(f.global_offset, f.local_shape) for f in group]):
            raise ValueError("logical fragment boxes overlap for tensor and parallel rank")


def _check_alias_groups(
    tensors: Mapping[TensorId, TensorDescriptor], fragments: Sequence[PlacementFragment]
) -> None:
    """Every alias group names known tensors, each of which declares that same group
    (only a complete placement can tell)."""
    per_tensor: dict[TensorId, list[PlacementFragment]] = {}
    groups: set[tuple[TensorId, ...]] = set()
    for frag in fragments:
        per_tensor.setdefault(frag.tensor_id, []).append(frag)
        if frag.aliases:
            groups.add(frag.aliases)
    for group in groups:
        unknown = sorted(set(group) - set(tensors))
        if unknown:
            raise ValueError(f"alias group references unknown tensor: {unknown[0]}")
        for member in group:
            if {f.aliases for f in per_tensor[member]} != {group}:
                raise ValueError(f"alias group is not declared consistently for tensor: {member}")


def _validate_complete_weight_placement(
    tensors: Sequence[TensorDescriptor],
    fragments: Sequence[PlacementFragment],
    *,
    topology: ParallelTopology,
) -> None:
    if not tensors:
        raise ValueError("global weight placement must contain tensors")
    if not fragments:
        raise ValueError("global weight placement must contain fragments")
    per_tensor: dict[TensorId, list[PlacementFragment]] = {}
    for frag in fragments:
        per_tensor.setdefault(frag.tensor_id, []).append(frag)
    for tensor in tensors:
        held = per_tensor.get(tensor.tensor_id, [])
        if not held:
            raise ValueError(f"global placement tensor is not fully covered: {tensor.tensor_id}")
        _check_axes(tensor, held, topology)


def _check_axes(
    tensor: TensorDescriptor, frags: Sequence[PlacementFragment], topology: ParallelTopology
) -> None:
    _check_undeclared_axes(tensor, frags, topology)
    owning = _kinds(tensor, OwnershipAxis)
    replicated = _kinds(tensor, ReplicatedAxis)
    for owner in sorted({_coords(f.rank, owning) for f in frags}):
        mine = [f for f in frags if _coords(f.rank, owning) == owner]
        want = {_coords(p.rank, replicated) for p in topology.participants if _at(p.rank, owner)}
        if {_coords(f.rank, replicated) for f in mine} != want:
            raise ValueError(
                "global placement tensor is not fully covered: missing or unexpected "
                f"replicated-axis participant for {tensor.tensor_id}"
            )
        for replica in sorted(want):
            cover = [f for f in mine if _coords(f.rank, replicated) == replica]
            whole = ((0,) * len(tensor.global_shape), tensor.global_shape)
            if not boxes_exactly_cover(*whole, [(f.global_offset, f.local_shape) for f in cover]):
                raise ValueError(
                    f"global placement tensor is not fully covered: {tensor.tensor_id}"
                )
            _check_split_participants(tensor, cover, topology, owner + replica)
            _check_split_geometry(tensor, cover)


def _check_undeclared_axes(
    tensor: TensorDescriptor, frags: Sequence[PlacementFragment], topology: ParallelTopology
) -> None:
    """An active axis the tensor does not declare may only vary together with a
    declared one (TP and EP on the same workers); dp and pp never."""
    declared = tuple(a.kind for a in tensor.parallel_axes)
    varying = tuple(k for k in declared if len({getattr(f.rank, k) for f in frags}) > 1)
    for kind in ("dp", "pp", "ep", "tp"):
        if kind in declared or getattr(topology, f"{kind}_size") == 1:
            continue
        values = {getattr(f.rank, kind) for f in frags}
        if kind in ("dp", "pp") or len(values) <= 1:
            raise ValueError(
                "global placement tensor requires explicit parallel semantics "
                f"for active undeclared {kind} axis: {tensor.tensor_id}"
            )
        if not varying:
            raise ValueError(
                f"global placement tensor varies across undeclared {kind} axis: {tensor.tensor_id}"
            )
        seen: dict[Coords, int] = {}
        for frag in frags:
            if seen.setdefault(_coords(frag.rank, varying), getattr(frag.rank, kind)) != getattr(
                frag.rank, kind
            ):
                raise ValueError(
                    "global placement tensor varies independently across undeclared "
                    f"{kind} axis: {tensor.tensor_id}"
                )


def _merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, end in sorted(set(spans)):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _check_split_geometry(tensor: TensorDescriptor, frags: Sequence[PlacementFragment]) -> None:
    """The split ranks form a full grid, and along each split axis the ranks own
    consecutive, gap-free slices of its dimension."""
    axes = [a for a in tensor.parallel_axes if isinstance(a, SplitAxis)]
    if not axes:
        return
    values = [sorted({getattr(f.rank, a.kind) for f in frags}) for a in axes]
    seen = {tuple(getattr(f.rank, a.kind) for a in axes) for f in frags}
    if seen != set(product(*values)):
        raise ValueError(
            "non-Cartesian split-axis participant mapping cannot prove "
            f"rank-to-dimension ownership: {tensor.tensor_id}"
        )
    for axis in axes:
        spans: dict[int, list[tuple[int, int]]] = {}
        for frag in frags:
            start = frag.global_offset[axis.dim]
            spans.setdefault(getattr(frag.rank, axis.kind), []).append(
                (start, start + frag.local_shape[axis.dim])
            )
        owned = sorted((a, b, r) for r, s in spans.items() for a, b in _merged(s))
        cursor = 0
        for start, end, _ in owned:
            if start != cursor:
                break
            cursor = end
        else:
            if cursor == tensor.global_shape[axis.dim]:
                continue
        raise ValueError(
            "split-axis rank geometry conflicts with declared dimension: "
            f"{tensor.tensor_id}: {axis.kind} -> dim {axis.dim}"
        )


def _check_split_participants(
    tensor: TensorDescriptor,
    frags: Sequence[PlacementFragment],
    topology: ParallelTopology,
    fixed: Coords,
) -> None:
    kinds = _kinds(tensor, SplitAxis)
    if not kinds:
        return
    want = {_coords(p.rank, kinds) for p in topology.participants if _at(p.rank, fixed)}
    have = {_coords(f.rank, kinds) for f in frags}
    full = all(
        {dict(c)[k] for c in want} == set(range(getattr(topology, f"{k}_size"))) for k in kinds
    )
    if not full or have != want:
        raise ValueError(
            "global placement tensor is not fully covered: missing or unexpected "
            f"split-axis participant for {tensor.tensor_id}"
        )


def _alias_key(tensor: TensorDescriptor) -> tuple[object, ...]:
    return (
        tensor.global_shape,
        tensor.dtype,
        tensor.itemsize,
        tensor.shard_dims,
        tensor.parallel_axes,
        tensor.layer_id,
        tensor.expert_id,
        tensor.layout_fingerprint,
    )


def _declared_alias(
    a: tuple[PlacementFragment, RuntimeBindingFragment],
    b: tuple[PlacementFragment, RuntimeBindingFragment],
    tensors: Mapping[TensorId, TensorDescriptor],
) -> bool:
    """Two bindings at one address are fine when they are the same box of tensors that
    declare each other as aliases and describe the same data."""
    (pa, ba), (pb, bb) = a, b
    return (
        ba.address == bb.address
        and ba.nbytes == bb.nbytes
        and len(pa.aliases) >= 2
        and pa.aliases == pb.aliases
        and pa.tensor_id in pa.aliases
        and pb.tensor_id in pa.aliases
        and pa.global_offset == pb.global_offset
        and pa.local_shape == pb.local_shape
        and _alias_key(tensors[pa.tensor_id]) == _alias_key(tensors[pb.tensor_id])
    )


def _validate_runtime_binding_address_ranges(
    *,
    instance_id: RuntimeInstanceId,
    tensors: Sequence[TensorDescriptor],
    placements: Sequence[PlacementFragment],
    bindings: Sequence[RuntimeBindingFragment],
) -> None:
    """Within one address space (instance, worker, device) views may not overlap
    (except declared aliases), and allocations overlap only when identical."""
    by_tensor = {t.tensor_id: t for t in tensors}
    by_fragment = {p.placement_fragment_id: p for p in placements}
    spaces: dict[tuple[str, str, str], list[tuple[PlacementFragment, RuntimeBindingFragment]]]
    spaces = {}
    for view in bindings:
        key = (instance_id, view.worker_id, view.device)
        spaces.setdefault(key, []).append((by_fragment[view.placement_fragment_id], view))
    for space, pairs in spaces.items():
        open_views: list[tuple[PlacementFragment, RuntimeBindingFragment]] = []
        for pair in sorted(pairs, key=lambda item: item[1].address):
            start = pair[1].address
            open_views = [o for o in open_views if o[1].address + o[1].nbytes > start]
            for other in open_views:
                if not _declared_alias(other, pair, by_tensor):
                    raise ValueError(
                        "runtime binding address ranges overlap: "
                        f"{other[1].fragment_id} and {pair[1].fragment_id} in {space}"
                    )
            open_views.append(pair)
        open_allocs: list[RuntimeBindingFragment] = []
        for binding in sorted((b for _, b in pairs), key=lambda b: b.storage_address):
            start = binding.storage_address
            open_allocs = [o for o in open_allocs if o.storage_address + o.storage_nbytes > start]
            for alloc in open_allocs:
                same = (alloc.storage_address, alloc.storage_nbytes) == (
                    binding.storage_address,
                    binding.storage_nbytes,
                )
                if not same:
                    raise ValueError(
                        "runtime binding storage allocation ranges overlap: "
                        f"{alloc.fragment_id} and {binding.fragment_id} in {space}"
                    )
            open_allocs.append(binding)
