"""Model-weight tensors, parallel axes, ranks and address-free placement fragments.

Every value validates itself on construction (``ValueError`` with the published
message) and normalises what has one canonical form: axes sorted dp, pp, ep, tp;
aliases sorted; a fragment without an id gets ``sha256:`` of its canonical JSON.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from math import prod
from typing import Literal, TypeVar, cast

from mooncake_core.compat.reshard.contracts import (
    PlacementFragmentId,
    RuntimeBindingFragment,
    TensorId,
)

__all__ = [
    "OwnershipAxis",
    "ParallelAxis",
    "ParallelAxisKind",
    "ParallelRank",
    "PlacementFragment",
    "ReplicatedAxis",
    "RuntimeBindingFragment",
    "SplitAxis",
    "SplitAxisKind",
    "TensorDescriptor",
    "canonical_strides_bytes",
    "require_manifest_items",
    "require_sha256_digest",
    "validate_fragment_geometry",
]

ParallelAxisKind = Literal["dp", "pp", "ep", "tp"]
SplitAxisKind = Literal["ep", "tp"]
#: the canonical order of the parallel axes
AXIS_ORDER: dict[str, int] = {"dp": 0, "pp": 1, "ep": 2, "tp": 3}
U64_MAX = (1 << 64) - 1
_T = TypeVar("_T")


# -- checks shared by the weight modules (private to this package) -------------------


def check_text(value: object, name: str) -> str:
    if type(value) is not str or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def check_int(value: object, name: str, *, minimum: int | None = None) -> int:
    if type(value) is not int:
        raise ValueError(f"{name} must be an integer")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}")
    return value


def check_u64(value: object, name: str, *, minimum: int = 0) -> int:
    number = check_int(value, name, minimum=minimum)
    if number > U64_MAX:
        raise ValueError(f"{name} must fit in an unsigned 64-bit integer")
    return number


def check_seq(value: object, name: str) -> Sequence[object]:
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a sequence")
    return value


def check_ints(value: object, name: str, *, minimum: int) -> tuple[int, ...]:
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must contain integers")
    return tuple(check_int(v, name, minimum=minimum) for v in value)


def canonical_json_sha(content: object) -> str:
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# -- public helpers ---------------------------------------------------------------


def require_sha256_digest(value: object, name: str) -> None:
    """Raise unless ``value`` is 64 lowercase hex digits."""
    digest = check_text(value, name)
    if len(digest) != 64 or not set(digest) <= set("0123456789abcdef"):
        raise ValueError(f"{name} must be a lowercase SHA-256 digest")


def require_manifest_items(value: object, name: str, item_type: type[_T]) -> tuple[_T, ...]:
    """``value`` as a tuple, each item an ``item_type`` (else ``ValueError``)."""
    items = tuple(check_seq(value, name))
    if any(not isinstance(item, item_type) for item in items):
        raise ValueError(f"{name} must contain {item_type.__name__}")
    return cast(tuple[_T, ...], items)


def canonical_strides_bytes(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Row-major byte strides of a dense array of ``shape``."""
    strides = []
    step = itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def _axis_kind(kind: object) -> None:
    check_text(kind, "parallel axis kind")
    if kind not in AXIS_ORDER:
        raise ValueError(f"unsupported parallel axis kind: {kind}")


@dataclass(frozen=True)
class ParallelRank:
    """A participant's coordinates on the data, tensor, pipeline and expert axes."""

    dp: int = 0
    tp: int = 0
    pp: int = 0
    ep: int = 0

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp", "ep"):
            check_int(getattr(self, axis), f"parallel rank {axis}", minimum=0)


@dataclass(frozen=True)
class SplitAxis:
    """Ranks of this axis (tp or ep) each hold a slice of dimension ``dim``."""

    kind: SplitAxisKind
    dim: int

    def __post_init__(self) -> None:
        _axis_kind(self.kind)
        if self.kind not in ("ep", "tp"):
            raise ValueError(f"{self.kind} cannot use split semantics")
        check_int(self.dim, "split axis dim", minimum=0)
        if self.kind == "ep" and self.dim != 0:
            raise ValueError("EP must split the leading logical expert dimension")


@dataclass(frozen=True)
class ReplicatedAxis:
    """Ranks of this axis each hold a whole copy."""

    kind: ParallelAxisKind

    def __post_init__(self) -> None:
        _axis_kind(self.kind)


@dataclass(frozen=True)
class OwnershipAxis:
    """Only the ranks of this axis that declare the tensor hold it."""

    kind: ParallelAxisKind

    def __post_init__(self) -> None:
        _axis_kind(self.kind)


ParallelAxis = SplitAxis | ReplicatedAxis | OwnershipAxis


@dataclass(frozen=True)
class TensorDescriptor:
    """A logical weight tensor: id, global shape, dtype, how the parallel axes cut it."""

    tensor_id: TensorId
    global_shape: tuple[int, ...]
    dtype: str
    itemsize: int
    shard_dims: tuple[int, ...]
    layout_fingerprint: str
    parallel_axes: tuple[ParallelAxis, ...]
    layer_id: int | None = None
    expert_id: int | None = None

    def __post_init__(self) -> None:
        shape = check_ints(self.global_shape, "global_shape", minimum=1)
        if not shape:
            raise ValueError("global_shape must not be empty")
        object.__setattr__(self, "global_shape", shape)
        check_text(self.tensor_id, "tensor_id")
        check_text(self.dtype, "dtype")
        check_int(self.itemsize, "itemsize", minimum=1)
        dims = check_ints(self.shard_dims, "shard_dims", minimum=0)
        if len(set(dims)) != len(dims):
            raise ValueError("shard_dims must not contain duplicates")
        if list(dims) != sorted(dims):
            raise ValueError("shard_dims must be sorted")
        if any(d >= len(shape) for d in dims):
            raise ValueError("shard_dims contains an out-of-range dimension")
        object.__setattr__(self, "shard_dims", dims)
        raw = check_seq(self.parallel_axes, "TensorDescriptor parallel_axes")
        if any(not isinstance(a, (SplitAxis, ReplicatedAxis, OwnershipAxis)) for a in raw):
            raise ValueError("TensorDescriptor parallel_axes must contain explicit axis values")
        axes = sorted(cast(Sequence[ParallelAxis], raw), key=lambda a: AXIS_ORDER[a.kind])
        if len({a.kind for a in axes}) != len(axes):
            raise ValueError("parallel_axes must not contain duplicate kinds")
        split = [a.dim for a in axes if isinstance(a, SplitAxis)]
        if len(set(split)) != len(split):
            raise ValueError("split axes must not share a dimension")
        if any(d >= len(shape) for d in split):
            raise ValueError("split axis dimension is out of range")
        if tuple(sorted(split)) != dims:
            raise ValueError("parallel axis split dimensions conflict with shard_dims")
        object.__setattr__(self, "parallel_axes", tuple(axes))
        for name in ("layer_id", "expert_id"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name, minimum=0)
        if self.expert_id is not None and any(
            isinstance(a, SplitAxis) and a.kind == "ep" for a in axes
        ):
            raise ValueError("an individually allocated expert requires explicit EP ownership")
        check_text(self.layout_fingerprint, "layout_fingerprint")


def validate_fragment_geometry(
    tensor: TensorDescriptor,
    *,
    fragment_id: str,
    global_offset: tuple[int, ...],
    local_shape: tuple[int, ...],
    nbytes: int,
) -> None:
    """Raise unless the box lies inside ``tensor`` and ``nbytes`` is its dense size."""
    rank = len(tensor.global_shape)
    if len(global_offset) != rank or len(local_shape) != rank:
        raise ValueError(f"fragment rank mismatch: {fragment_id}")
    for start, extent, total in zip(global_offset, local_shape, tensor.global_shape, strict=False):
        if start + extent > total:
            raise ValueError(f"fragment is out of bounds: {fragment_id}")
    want = prod(local_shape) * tensor.itemsize
    if nbytes != want:
        raise ValueError(
            f"fragment byte size mismatch: {fragment_id}: expected {want}, got {nbytes}"
        )


def _aliases(value: object) -> tuple[TensorId, ...]:
    names = tuple(check_seq(value, "aliases"))
    if any(type(n) is not str or not n for n in names):
        raise ValueError("aliases must contain non-empty strings")
    if len(set(names)) != len(names):
        raise ValueError("aliases must not contain duplicates")
    return tuple(TensorId(n) for n in sorted(cast(tuple[str, ...], names)))


@dataclass(frozen=True, init=False)
class PlacementFragment:
    """A box of one tensor held by one parallel rank (no address). Without an explicit
    ``placement_fragment_id`` its id is the sha256 of its canonical JSON."""

    tensor_id: TensorId
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    nbytes: int
    rank: ParallelRank
    pipeline_stage_id: int | None
    aliases: tuple[TensorId, ...]
    placement_fragment_id: PlacementFragmentId

    def __init__(
        self,
        tensor_id: TensorId,
        global_offset: tuple[int, ...],
        local_shape: tuple[int, ...],
        nbytes: int,
        rank: ParallelRank,
        pipeline_stage_id: int | None = None,
        aliases: tuple[TensorId, ...] = (),
        placement_fragment_id: PlacementFragmentId | None = None,
    ) -> None:
        offset = check_ints(global_offset, "global_offset", minimum=0)
        shape = check_ints(local_shape, "local_shape", minimum=1)
        check_text(tensor_id, "tensor_id")
        check_u64(nbytes, "nbytes", minimum=1)
        if not isinstance(rank, ParallelRank):
            raise ValueError("rank must be a ParallelRank")
        if pipeline_stage_id is not None:
            check_int(pipeline_stage_id, "pipeline_stage_id", minimum=0)
        group = _aliases(aliases)
        if group and len(group) < 2:
            raise ValueError("alias group must contain at least two tensor IDs")
        if group and tensor_id not in group:
            raise ValueError("alias group must contain the fragment tensor_id")
        if placement_fragment_id is None:
            content: dict[str, object] = {
                "schema": "weight-placement-fragment",
                "tensor_id": tensor_id,
                "global_offset": offset,
                "local_shape": shape,
                "nbytes": nbytes,
                "rank": asdict(rank),
                "aliases": group,
            }
            if pipeline_stage_id is not None:
                content["pipeline_stage_id"] = pipeline_stage_id
            placement_fragment_id = PlacementFragmentId(f"sha256:{canonical_json_sha(content)}")
        else:
            check_text(placement_fragment_id, "placement_fragment_id")
        for name, value in (
            ("tensor_id", tensor_id),
            ("global_offset", offset),
            ("local_shape", shape),
            ("nbytes", nbytes),
            ("rank", rank),
            ("pipeline_stage_id", pipeline_stage_id),
            ("aliases", group),
            ("placement_fragment_id", placement_fragment_id),
        ):
            object.__setattr__(self, name, value)

    @property
    def fragment_id(self) -> PlacementFragmentId:
        """The fragment's id (its ``placement_fragment_id``)."""
        return self.placement_fragment_id
