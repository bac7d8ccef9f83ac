"""The values a reshard transfer plan is made of: :class:`TransferRegion` (one box copied
from a source fragment to a target fragment, lowered to ``inner_bytes`` runs on an
outer loop of byte strides), :class:`PlacementExecutorPlan`, :class:`PipelineRouteGroup`,
:class:`PlanningLimits` and :class:`LogicalTransferPlan`. Every one checks itself on
construction with the published messages."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar

from mooncake_core.compat.reshard.contracts import (
    ParticipantId,
    PlacementFragmentId,
    PlacementId,
    ResourceId,
    RevisionId,
    TensorId,
)
from mooncake_core.compat.reshard.geometry import box_contains
from mooncake_core.compat.reshard.weight.placement import WeightPlacementManifest
from mooncake_core.compat.reshard.weight.storage_manifest import (
    StoredFragment,
    StoredManifestIdentity,
    WeightManifest,
    validate_weight_manifest_snapshot,
)
from mooncake_core.compat.reshard.weight.types import (
    ParallelRank,
    PlacementFragment,
    TensorDescriptor,
    canonical_strides_bytes,
)

__all__ = [
    "LogicalTransferOperation",
    "LogicalTransferPlan",
    "PipelineRouteGroup",
    "PlacementExecutorPlan",
    "PlanningLimits",
    "RuntimeTensorOwner",
    "TransferRegion",
]

RuntimeTensorOwner = tuple[tuple[str, int], ...]
Fragment = PlacementFragment | StoredFragment
_S = TypeVar("_S", bound=Fragment)
_T = TypeVar("_T", bound=Fragment)


# -- region geometry ------------------------------------------------------------------


def fragment_itemsize(frag: Any) -> int:
    """Bytes per element of a dense fragment."""
    count = prod(frag.local_shape)
    if count <= 0 or frag.nbytes % count != 0:
        raise ValueError("transfer region fragment byte size is invalid")
    if frag.nbytes // count <= 0:
        raise ValueError("transfer region fragment itemsize is invalid")
    return int(frag.nbytes // count)


def _zip(*seqs: Sequence[int]) -> Iterator[tuple[int, ...]]:
    if len({len(s) for s in seqs}) > 1:
        raise ValueError("zip() arguments have different lengths")
    return zip(*seqs, strict=True)


def region_geometry(
    source: Any, target: Any, offset: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(source base, target base, inner bytes, outer counts, source strides, target
    strides): the innermost dimensions that are contiguous on both sides merge into
    one run; the rest become the outer loop."""
    size = fragment_itemsize(source)
    if size != fragment_itemsize(target):
        raise ValueError("transfer region source and target itemsize differ")
    s_strides = canonical_strides_bytes(source.local_shape, size)
    t_strides = canonical_strides_bytes(target.local_shape, size)
    s_base = sum((o - b) * st for o, b, st in _zip(offset, source.global_offset, s_strides))
    t_base = sum((o - b) * st for o, b, st in _zip(offset, target.global_offset, t_strides))
    keep = len(shape) - 1
    inner = shape[-1] * size
    for dim in range(len(shape) - 2, -1, -1):
        if s_strides[dim] != inner or t_strides[dim] != inner:
            break
        inner *= shape[dim]
        keep = dim
    return s_base, t_base, inner, shape[:keep], s_strides[:keep], t_strides[:keep]


def check_outer_strides(
    counts: tuple[int, ...], strides: tuple[int, ...], inner: int, side: str
) -> None:
    span = inner
    for count, stride in _zip(tuple(reversed(counts)), tuple(reversed(strides))):
        if count > 1 and stride < span:
            raise ValueError(f"transfer region {side} strides overlap")
        span += (count - 1) * stride


_INT_TUPLES = ("overlap_offset", "overlap_shape", "outer_loop_counts", "source_strides")


@dataclass(frozen=True)
class TransferRegion(Generic[_S, _T]):
    """Copy box ``overlap_offset`` / ``overlap_shape`` of ``tensor_id`` from ``source``
    to ``target``: ``prod(outer_loop_counts)`` runs of ``inner_bytes``, run ``i`` at
    ``base + sum(index_d * stride_d)`` on each side."""

    tensor_id: TensorId
    source: _S
    target: _T
    overlap_offset: tuple[int, ...]
    overlap_shape: tuple[int, ...]
    source_base_offset: int
    target_base_offset: int
    inner_bytes: int
    outer_loop_counts: tuple[int, ...]
    source_strides: tuple[int, ...]
    target_strides: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in (*_INT_TUPLES, "target_strides"):
            value = getattr(self, name)
            bad = ValueError(f"transfer region {name} must contain integers")
            if isinstance(value, (str, bytes, bytearray)):
                raise bad
            try:
                items = tuple(value)
            except TypeError as exc:
                raise bad from exc
            if any(type(v) is not int for v in items):
                raise bad
            object.__setattr__(self, name, items)
        src: Fragment = self.source
        dst: Fragment = self.target
        if not self.tensor_id:
            raise ValueError("transfer region tensor_id must not be empty")
        if src.tensor_id != self.tensor_id or dst.tensor_id != self.tensor_id:
            raise ValueError("transfer region tensor mismatch")
        rank = len(self.overlap_offset)
        ranks = (len(self.overlap_shape), len(src.global_offset), len(dst.global_offset))
        if rank == 0 or any(r != rank for r in ranks):
            raise ValueError("transfer region logical rank mismatch")
        if min(self.overlap_offset) < 0 or min(self.overlap_shape) <= 0:
            raise ValueError("transfer region logical box is invalid")
        box = (self.overlap_offset, self.overlap_shape)
        if not box_contains(src.global_offset, src.local_shape, *box):
            raise ValueError("transfer region exceeds source logical fragment")
        if not box_contains(dst.global_offset, dst.local_shape, *box):
            raise ValueError("transfer region exceeds target logical fragment")
        for name in ("source_base_offset", "target_base_offset", "inner_bytes"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"transfer region {name} must be an integer")
        if self.source_base_offset < 0 or self.target_base_offset < 0:
            raise ValueError("transfer region base offsets must be non-negative")
        if self.inner_bytes <= 0:
            raise ValueError("transfer region inner_bytes must be positive")
        counts = self.outer_loop_counts
        if not len(counts) == len(self.source_strides) == len(self.target_strides):
            raise ValueError("transfer region outer loop rank mismatch")
        if any(c <= 0 for c in counts):
            raise ValueError("transfer region outer loop counts must be positive")
        if any(s < 0 for s in (*self.source_strides, *self.target_strides)):
            raise ValueError("transfer region strides must be non-negative")
        size = fragment_itemsize(src)
        if size != fragment_itemsize(dst):
            raise ValueError("transfer region source and target itemsize differ")
        want = region_geometry(src, dst, self.overlap_offset, self.overlap_shape)
        if self.total_bytes != prod(self.overlap_shape) * size:
            raise ValueError("transfer region loop geometry does not match overlap")
        if self.source_base_offset != want[0]:
            raise ValueError("transfer region source base offset is inconsistent")
        if self.target_base_offset != want[1]:
            raise ValueError("transfer region target base offset is inconsistent")
        have = (self.inner_bytes, counts, self.source_strides, self.target_strides)
        if have != want[2:]:
            raise ValueError("transfer region loop geometry is not canonical")
        check_outer_strides(counts, self.source_strides, self.inner_bytes, "source")
        check_outer_strides(counts, self.target_strides, self.inner_bytes, "target")
        self.validate_bounds()

    @property
    def segment_count(self) -> int:
        return prod(self.outer_loop_counts)

    @property
    def total_bytes(self) -> int:
        return self.inner_bytes * self.segment_count

    @property
    def source_offset(self) -> int:
        return self.source_base_offset

    @property
    def target_offset(self) -> int:
        return self.target_base_offset

    @property
    def nbytes(self) -> int:
        return self.inner_bytes

    @property
    def repeat(self) -> int:
        return self.segment_count

    @property
    def source_stride(self) -> int:
        return self._one_stride(self.source_strides, "source")

    @property
    def target_stride(self) -> int:
        return self._one_stride(self.target_strides, "target")

    @staticmethod
    def _one_stride(strides: tuple[int, ...], side: str) -> int:
        if len(strides) > 1:
            raise ValueError(f"N-D transfer region has multiple {side} strides")
        return strides[0] if strides else 0

    def validate_bounds(self) -> None:
        """Raise if the last run ends past either fragment."""
        for side, base, strides, frag in (
            ("source", self.source_base_offset, self.source_strides, self.source),
            ("target", self.target_base_offset, self.target_strides, self.target),
        ):
            reach = sum((c - 1) * s for c, s in _zip(self.outer_loop_counts, strides))
            if base + reach + self.inner_bytes > frag.nbytes:
                raise ValueError(f"transfer region exceeds {side} fragment")

    def iter_segments(self, *, max_segments: int) -> Iterable[tuple[int, int, int]]:
        """``(source offset, target offset, nbytes)`` for each run, in row-major order
        of the outer loop (refused when there are more than ``max_segments``)."""
        if type(max_segments) is not int or max_segments <= 0:
            raise ValueError("max_segments must be a positive integer")
        if self.segment_count > max_segments:
            raise ValueError(
                f"transfer region exceeds max_segments: {self.segment_count} > {max_segments}"
            )
        counts = self.outer_loop_counts
        index = [0] * len(counts)
        while True:
            yield (
                self.source_base_offset + sum(i * s for i, s in _zip(index, self.source_strides)),
                self.target_base_offset + sum(i * s for i, s in _zip(index, self.target_strides)),
                self.inner_bytes,
            )
            for dim in reversed(range(len(counts))):
                index[dim] += 1
                if index[dim] < counts[dim]:
                    break
                index[dim] = 0
            else:
                return


LogicalTransferOperation = TransferRegion[Fragment, PlacementFragment]
LogicalTransferRegion = LogicalTransferOperation


@dataclass(frozen=True)
class PipelineRouteGroup:
    """The operations that go from one source pipeline stage to one target stage."""

    source_pp: int | None
    source_pipeline_stage_id: int | None
    target_pp: int
    target_pipeline_stage_id: int | None
    operation_indices: tuple[int, ...]

    def __post_init__(self) -> None:
        indices = tuple(self.operation_indices)
        object.__setattr__(self, "operation_indices", indices)
        if self.source_pp is not None and (type(self.source_pp) is not int or self.source_pp < 0):
            raise ValueError("pipeline route source_pp must be non-negative")
        if type(self.target_pp) is not int or self.target_pp < 0:
            raise ValueError("pipeline route target_pp must be non-negative")
        for name in ("source_pipeline_stage_id", "target_pipeline_stage_id"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"pipeline route {name} must be non-negative")
        if any(type(i) is not int or i < 0 for i in indices):
            raise ValueError("pipeline route indices must be non-negative integers")
        if len(set(indices)) != len(indices):
            raise ValueError("pipeline route has duplicate operation indices")


@dataclass(frozen=True)
class PlanningLimits:
    """Upper bounds on a plan's size; planning past one fails."""

    max_transfer_regions: int = 1_000_000
    max_segments_per_region: int = 1_000_000
    max_total_lowered_segments: int = 10_000_000

    def __post_init__(self) -> None:
        for name in (
            "max_transfer_regions",
            "max_segments_per_region",
            "max_total_lowered_segments",
        ):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"planning limit {name} must be a positive integer")


@dataclass(frozen=True)
class PlacementExecutorPlan:
    """One participant that reads (source) or writes (target) in the plan."""

    placement_id: PlacementId
    participant_id: ParticipantId
    rank: ParallelRank
    placement_fragment_ids: tuple[PlacementFragmentId, ...]

    def __post_init__(self) -> None:
        ids = tuple(self.placement_fragment_ids)
        object.__setattr__(self, "placement_fragment_ids", ids)
        if not self.placement_id or not self.participant_id or not ids:
            raise ValueError("placement executor identifiers must not be empty")
        if len(set(ids)) != len(ids):
            raise ValueError("placement executor has duplicate fragment IDs")


_ExecKey = tuple[PlacementId, ParticipantId, ParallelRank, tuple[PlacementFragmentId, ...]]


def _exec_key(executor: PlacementExecutorPlan) -> _ExecKey:
    return (
        executor.placement_id,
        executor.participant_id,
        executor.rank,
        executor.placement_fragment_ids,
    )


@dataclass(frozen=True)
class _OperationViews:
    source_indices: Mapping[_ExecKey, tuple[int, ...]]
    target_indices: Mapping[_ExecKey, tuple[int, ...]]
    pipeline_routes: tuple[PipelineRouteGroup, ...]

    def operation_indices_for(self, executor: PlacementExecutorPlan, side: str) -> tuple[int, ...]:
        if side not in ("source", "target"):
            raise ValueError(f"invalid executor side: {side}")
        table = self.source_indices if side == "source" else self.target_indices
        return table.get(_exec_key(executor), ())


def _indices_by_executor(
    operations: Sequence[Any], executors: Sequence[PlacementExecutorPlan], side: str
) -> Mapping[_ExecKey, tuple[int, ...]]:
    out: dict[_ExecKey, list[int]] = {}
    by_fragment: dict[PlacementFragmentId, list[_ExecKey]] = {}
    for executor in executors:
        key = _exec_key(executor)
        if key in out:
            raise ValueError("transfer plan has duplicate executor projection key")
        out[key] = []
        for fid in executor.placement_fragment_ids:
            by_fragment.setdefault(fid, []).append(key)
    for index, op in enumerate(operations):
        frag = op.source if side == "source" else op.target
        if isinstance(frag, PlacementFragment):
            for key in by_fragment.get(frag.placement_fragment_id, ()):
                out[key].append(index)
    return MappingProxyType({k: tuple(v) for k, v in out.items()})


def _pipeline_routes(operations: Sequence[Any]) -> tuple[PipelineRouteGroup, ...]:
    routes: dict[tuple[int | None, int | None, int, int | None], list[int]] = {}
    for index, op in enumerate(operations):
        placed = isinstance(op.source, PlacementFragment)
        key = (
            op.source.rank.pp if placed else None,
            op.source.pipeline_stage_id if placed else None,
            op.target.rank.pp,
            op.target.pipeline_stage_id,
        )
        routes.setdefault(key, []).append(index)

    def order(key: tuple[int | None, int | None, int, int | None]) -> tuple[int, ...]:
        return tuple(-1 if v is None else v for v in key)

    return tuple(
        PipelineRouteGroup(*key, operation_indices=tuple(routes[key]))
        for key in sorted(routes, key=order)
    )


def _check_operation(op: object, from_placement: bool) -> None:
    if not isinstance(op, TransferRegion):
        raise ValueError("logical transfer plan requires a canonical transfer operation")
    if not isinstance(op.target, PlacementFragment):
        raise ValueError("logical transfer plan target must be a placement")
    if from_placement and not isinstance(op.source, PlacementFragment):
        raise ValueError("logical transfer plan source must be a placement")
    if not from_placement and not isinstance(op.source, StoredFragment):
        raise ValueError("logical transfer plan source has no placement")
    op.validate_bounds()


def _sorted_catalog(tensors: Sequence[TensorDescriptor]) -> tuple[TensorDescriptor, ...]:
    return tuple(sorted(tensors, key=lambda t: t.tensor_id))


@dataclass(frozen=True)
class LogicalTransferPlan:
    """Every region to copy to fill a target placement, from a source placement or a
    stored weight manifest (exactly one), with the executors on each side. Checked on
    construction (and again when unpickled) against both sides' snapshots."""

    _operation_views: ClassVar[_OperationViews]

    resource_id: ResourceId
    revision: RevisionId
    source_placement: WeightPlacementManifest | None
    target_placement: WeightPlacementManifest
    source_tensors: tuple[TensorDescriptor, ...]
    target_tensors: tuple[TensorDescriptor, ...]
    operations: tuple[LogicalTransferOperation, ...]
    source_manifest: WeightManifest | None = None
    planning_limits: PlanningLimits = field(default_factory=PlanningLimits)
    source_executors: tuple[PlacementExecutorPlan, ...] = ()
    target_executors: tuple[PlacementExecutorPlan, ...] = ()
    source_manifest_identity: StoredManifestIdentity | None = field(init=False)

    def __post_init__(self) -> None:
        for name in (
            "source_tensors",
            "target_tensors",
            "operations",
            "source_executors",
            "target_executors",
        ):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.resource_id or not self.revision:
            raise ValueError("logical transfer plan identifiers must not be empty")
        if not isinstance(self.target_placement, WeightPlacementManifest):
            raise ValueError("logical transfer plan target placement is invalid")
        limits = self.planning_limits
        if not isinstance(limits, PlanningLimits):
            raise ValueError("logical transfer plan planning_limits is invalid")
        if len(self.operations) > limits.max_transfer_regions:
            raise ValueError("logical transfer plan exceeds max_transfer_regions")
        src, manifest, dst = self.source_placement, self.source_manifest, self.target_placement
        if src is not None and not isinstance(src, WeightPlacementManifest):
            raise ValueError("logical transfer plan source placement is invalid")
        if manifest is not None and not isinstance(manifest, WeightManifest):
            raise ValueError("logical transfer plan source manifest is invalid")
        if (src is None) == (manifest is None):
            raise ValueError("logical transfer plan requires exactly one source provenance")
        identity = None
        if manifest is not None:
            manifest = validate_weight_manifest_snapshot(manifest)
            object.__setattr__(self, "source_manifest", manifest)
            identity = manifest.manifest_identity
        object.__setattr__(self, "source_manifest_identity", identity)
        for side, placement in (("source", src), ("target", dst)):
            if placement is not None and (
                placement.resource_id != self.resource_id or placement.revision != self.revision
            ):
                raise ValueError(f"logical transfer plan {side} placement identity differs")
        if src is not None and src.weight_generation != dst.weight_generation:
            raise ValueError("logical transfer plan source and target weight_generation differs")
        if manifest is not None and (
            manifest.resource_id != self.resource_id
            or manifest.revision != self.revision
            or manifest.weight_generation != dst.weight_generation
        ):
            raise ValueError("logical transfer plan source manifest identity differs")
        lowered = 0
        for op in self.operations:
            _check_operation(op, src is not None)
            if op.segment_count > limits.max_segments_per_region:
                raise ValueError("logical transfer plan exceeds max_segments_per_region")
            lowered += op.segment_count
            if lowered > limits.max_total_lowered_segments:
                raise ValueError("logical transfer plan exceeds max_total_lowered_segments")
        executors = (*self.source_executors, *self.target_executors)
        if any(not isinstance(e, PlacementExecutorPlan) for e in executors):
            raise ValueError("logical transfer plan has invalid canonical executor metadata")
        self.validate_source_manifest_snapshot()
        views = _OperationViews(
            source_indices=_indices_by_executor(self.operations, self.source_executors, "source"),
            target_indices=_indices_by_executor(self.operations, self.target_executors, "target"),
            pipeline_routes=_pipeline_routes(self.operations),
        )
        object.__setattr__(self, "_operation_views", views)
        from mooncake_core.compat.reshard.weight._plan_checks import check_target_coverage

        check_target_coverage(self)
        self.validate_source_placement_snapshot()

    @property
    def total_bytes(self) -> int:
        return sum(op.total_bytes for op in self.operations)

    @property
    def source_placement_id(self) -> PlacementId | None:
        return None if self.source_placement is None else self.source_placement.placement_id

    @property
    def target_placement_id(self) -> PlacementId:
        return self.target_placement.placement_id

    def validate_source_manifest_snapshot(self) -> None:
        """Raise if a stored source no longer matches what the plan was made from."""
        if self.source_manifest is None:
            if self.source_manifest_identity is not None:
                raise ValueError("logical plan has unexpected source manifest identity")
            return
        manifest = validate_weight_manifest_snapshot(self.source_manifest)
        if self.source_manifest_identity != manifest.manifest_identity:
            raise ValueError("logical plan source manifest identity differs")
        if self.source_tensors != _sorted_catalog(manifest.tensors):
            raise ValueError("logical plan source tensor catalog differs")
        stored = {f.fragment_id: f for f in manifest.fragments}
        for op in self.operations:
            source = op.source
            if not isinstance(source, StoredFragment) or stored.get(source.fragment_id) != source:
                raise ValueError("logical plan and source manifest fragment snapshots differ")

    def validate_source_placement_snapshot(self) -> None:
        """Raise if a placement source contradicts the plan's operations or executors."""
        if self.source_placement is None:
            return
        from mooncake_core.compat.reshard.weight._plan_checks import check_source_placement

        check_source_placement(self)

    @property
    def pipeline_routes(self) -> tuple[PipelineRouteGroup, ...]:
        return self._operation_views.pipeline_routes

    def operation_indices_for_executor(
        self, executor: PlacementExecutorPlan, side: str
    ) -> tuple[int, ...]:
        """Indices into ``operations`` that ``executor`` takes part in on ``side``."""
        executors = self.source_executors if side == "source" else self.target_executors
        if side not in ("source", "target"):
            raise ValueError(f"invalid executor side: {side}")
        if executor not in executors:
            raise ValueError(f"{side} executor is not part of this logical plan")
        return self._operation_views.operation_indices_for(executor, side)

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "_operation_views"}

    def __setstate__(self, state: dict[str, object]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.__post_init__()
