"""Types and constants of ``mooncake.structured_object_store`` (the published 0.3.13 names).

The dataclasses carry the published field names, order and defaults; the handle functions
(:func:`export_dataproto_ref`, :func:`import_dataproto_ref`) write and read the same
JSON-safe dict. :mod:`mooncake_core.compat.structured_object_store` re-exports everything.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

__all__ = [
    "AUTO_PARALLEL_MIN_BYTES",
    "AUTO_PARALLEL_MIN_CHUNKS",
    "DATAPROTO_REF_HANDLE_TYPE",
    "DATAPROTO_REF_HANDLE_VERSION",
    "DEFAULT_BUNDLE_CHUNK_BYTES",
    "MISSING",
    "MISSING_OBJECT_ERROR",
    "STORAGE_GROUP_ID",
    "STRUCTURED_FIELD_SPECS_KEY",
    "BundleStore",
    "BundleTransferPolicy",
    "FieldSchema",
    "MooncakeDataProtoRef",
    "RemoteBundleRef",
    "StructuredFieldLocation",
    "StructuredMemberSlice",
    "StructuredObjectPayload",
    "StructuredObjectReadSpec",
    "StructuredObjectResult",
    "export_dataproto_ref",
    "import_dataproto_ref",
    "is_dataproto_ref_handle",
    "raw_destination",
    "tensor_object_buffer",
]

DEFAULT_BUNDLE_CHUNK_BYTES = 64 * 1024**2
AUTO_PARALLEL_MIN_BYTES = DEFAULT_BUNDLE_CHUNK_BYTES
AUTO_PARALLEL_MIN_CHUNKS = 8
#: what ``remove`` returns for a key that is already gone (not an error when cleaning up)
MISSING_OBJECT_ERROR = -704
STRUCTURED_FIELD_SPECS_KEY = "__mooncake_structured_fields__"
DATAPROTO_REF_HANDLE_TYPE = "mooncake_dataproto_ref"
DATAPROTO_REF_HANDLE_VERSION = 1
STORAGE_GROUP_ID = "storage_group_id"


class _Missing:
    """Marks an absent dict key (distinct from a ``None`` value)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<MISSING>"


MISSING = _Missing()


class BundleStore(Protocol):
    """What a bundle needs of a store: the four calls of ``MooncakeDistributedStore``."""

    def put(self, key: str, value: Any, config: Any = None) -> int: ...

    def get(self, key: str) -> bytes: ...

    def remove(self, key: str, force: bool = False) -> int: ...

    def is_exist(self, key: str) -> int: ...


@dataclass(frozen=True)
class BundleTransferPolicy:
    """How payload chunks are written (kept for the published API; chunks are put in order)."""

    max_inflight_put: int = 1
    put_mode: Literal["auto", "batch", "parallel"] = "auto"
    copy_mode: Literal["auto", "zero_copy", "copy"] = "auto"


@dataclass(frozen=True)
class FieldSchema:
    """A codec hint for one DataProto field; ``metadata["section"]`` pins its section."""

    codec: str
    nullable: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class RemoteBundleRef:
    """Where a bundle's manifest lives, and the manifest when known."""

    manifest_key: str
    manifest: dict[str, Any]


@dataclass(frozen=True, init=False)
class StructuredObjectPayload:
    """JSON metadata plus named members (bytes, ndarrays, tensors)."""

    metadata: Mapping[str, Any]
    buffers: Mapping[str, Any]

    def __init__(
        self,
        metadata: Mapping[str, Any] | None = None,
        buffers: Mapping[str, Any] | None = None,
    ) -> None:
        if buffers is None:
            raise TypeError("StructuredObjectPayload requires buffers")
        object.__setattr__(self, "metadata", {} if metadata is None else metadata)
        object.__setattr__(self, "buffers", buffers)


@dataclass
class StructuredObjectResult:
    """A materialized structured object: its metadata and the members read."""

    metadata: dict[str, Any]
    objects: dict[str, Any]


@dataclass(frozen=True)
class StructuredFieldLocation:
    """The stage and member that hold one DataProto field."""

    stage: str
    member: str
    section: Literal["batch", "non_tensor_batch"]


@dataclass
class MooncakeDataProtoRef:
    """A DataProto stored as per-stage structured objects (nothing is read until asked)."""

    batch_size: int
    stage_refs: dict[str, RemoteBundleRef]
    field_index: dict[str, StructuredFieldLocation]
    meta_info: dict[str, Any]
    namespace: str = "default"
    partition: str = "default"
    global_indexes: list[int] | None = None
    encoded_non_tensor: dict[str, Any] = field(default_factory=dict)
    _storage_group_id: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class StructuredMemberSlice:
    """Rows ``start:end:step`` of one member along ``axis`` (only axis 0 is read)."""

    axis: int
    start: int
    end: int
    step: int = 1


@dataclass(frozen=True)
class StructuredObjectReadSpec:
    """What to read of a structured object: which members, and slices of them."""

    ref: RemoteBundleRef | Mapping[str, Any]
    member_names: tuple[str, ...] | None = None
    member_slices: tuple[tuple[str, StructuredMemberSlice], ...] = ()

    def select_members(self, names: Sequence[str] | None) -> StructuredObjectReadSpec:
        """A copy that reads only ``names`` (None: every member)."""
        chosen = None if names is None else tuple(names)
        return StructuredObjectReadSpec(self.ref, chosen, self.member_slices)

    def slice_member(
        self, name: str, axis: int, start: int, end: int, step: int = 1
    ) -> StructuredObjectReadSpec:
        """A copy that reads rows ``start:end:step`` of member ``name``."""
        slices = dict(self.member_slices)
        slices[name] = StructuredMemberSlice(axis=axis, start=start, end=end, step=step)
        return StructuredObjectReadSpec(self.ref, self.member_names, tuple(slices.items()))

    def member_slice(self, name: str) -> StructuredMemberSlice | None:
        """The slice set for ``name``, or None."""
        return dict(self.member_slices).get(name)


@dataclass(frozen=True)
class TensorObjectBuffer:
    """Caller memory holding a tensor object (header and data), put with ``put_from``."""

    ptr: int
    size: int
    owner: Any
    batch_size: int | None = None

    def __len__(self) -> int:
        if self.batch_size is None:
            raise TypeError("tensor object buffer requires batch_size for DataProto use")
        return self.batch_size


@dataclass(frozen=True)
class RawDestination:
    """Caller memory a member is read into (``materialize_into``)."""

    ptr: int
    size: int
    owner: Any
    pre_registered: bool = False


def tensor_object_buffer(
    ptr: int, size: int, owner: Any = None, batch_size: int | None = None
) -> TensorObjectBuffer:
    """A tensor member whose object bytes already sit at ``ptr`` (``size`` bytes)."""
    return TensorObjectBuffer(ptr=int(ptr), size=int(size), owner=owner, batch_size=batch_size)


def raw_destination(
    ptr: int, size: int, owner: Any = None, *, pre_registered: bool = False
) -> RawDestination:
    """A destination of ``size`` bytes at ``ptr`` for :meth:`materialize_into`."""
    return RawDestination(ptr=int(ptr), size=int(size), owner=owner, pre_registered=pre_registered)


# ---------------------------------------------------------------- DataProto handles
DataProtoRefLike = MooncakeDataProtoRef | Mapping[str, Any]


def is_dataproto_ref_handle(value: Any) -> bool:
    """True for a dict made by :func:`export_dataproto_ref`."""
    return isinstance(value, Mapping) and value.get("type") == DATAPROTO_REF_HANDLE_TYPE


def json_safe(value: Any) -> Any:
    """``value`` with numpy scalars and arrays as Python values; TypeError for the rest."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    raise TypeError(
        f"DataProto ref handles support only JSON-safe values, got {type(value).__name__}"
    )


def export_dataproto_ref(ref: MooncakeDataProtoRef) -> dict[str, Any]:
    """``ref`` as a JSON-safe dict another process can :func:`import_dataproto_ref`."""
    if not isinstance(ref, MooncakeDataProtoRef):
        raise TypeError(f"expected MooncakeDataProtoRef, got {type(ref).__name__}")
    handle: dict[str, Any] = {
        "type": DATAPROTO_REF_HANDLE_TYPE,
        "version": DATAPROTO_REF_HANDLE_VERSION,
        "kind": "bundle_stages",
        "batch_size": int(ref.batch_size),
        "namespace": ref.namespace,
        "partition": ref.partition,
        "global_indexes": json_safe(ref.global_indexes),
        "stage_refs": {s: {"manifest_key": r.manifest_key} for s, r in ref.stage_refs.items()},
        "field_index": {
            name: {"stage": loc.stage, "member": loc.member, "section": loc.section}
            for name, loc in ref.field_index.items()
        },
        "meta_info": json_safe(ref.meta_info),
        "encoded_non_tensor": json_safe(ref.encoded_non_tensor),
    }
    if ref._storage_group_id is not None:
        handle[STORAGE_GROUP_ID] = ref._storage_group_id
    json.dumps(handle, ensure_ascii=False)  # proves it serializes
    return handle


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"DataProto ref handle {what} must be a mapping")
    return value


def _nonempty_str(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _global_indexes(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError("DataProto ref handle global_indexes must be a list or null")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in value):
        raise ValueError("DataProto ref handle global_indexes must contain integers")
    return list(value)


def import_dataproto_ref(handle: Mapping[str, Any]) -> MooncakeDataProtoRef:
    """The :class:`MooncakeDataProtoRef` a handle describes; ValueError for a bad handle."""
    if not is_dataproto_ref_handle(handle):
        raise ValueError("not a Mooncake DataProto ref handle")
    version = int(handle.get("version", -1))
    if version not in (DATAPROTO_REF_HANDLE_VERSION, 2):
        raise ValueError(f"unsupported DataProto ref handle version: {handle.get('version')!r}")
    if handle.get("kind") != "bundle_stages":
        raise ValueError(f"unsupported DataProto ref handle kind: {handle.get('kind')!r}")
    stage_refs: dict[str, RemoteBundleRef] = {}
    for stage, raw in _mapping(handle.get("stage_refs"), "stage_refs").items():
        key = _mapping(raw, f"stage_refs[{stage!r}]").get("manifest_key")
        if not (_nonempty_str(stage) and _nonempty_str(key)):
            raise ValueError(
                "DataProto ref handle stage refs must contain non-empty string names and"
                " manifest_key values"
            )
        stage_refs[stage] = RemoteBundleRef(manifest_key=str(key), manifest={})
    field_index: dict[str, StructuredFieldLocation] = {}
    for name, raw in _mapping(handle.get("field_index"), "field_index").items():
        loc = _mapping(raw, f"field_index[{name!r}]")
        section = loc.get("section")
        if section not in {"batch", "non_tensor_batch"}:
            raise ValueError(f"invalid DataProto field section: {section!r}")
        where, member = loc.get("stage"), loc.get("member")
        if not (_nonempty_str(name) and _nonempty_str(where) and _nonempty_str(member)):
            raise ValueError("DataProto ref handle field locations must be non-empty strings")
        if where not in stage_refs:
            raise ValueError(
                f"DataProto ref handle field {name!r} references unknown stage {where!r}"
            )
        field_index[name] = StructuredFieldLocation(
            stage=str(where), member=str(member), section=section
        )
    group = handle.get(STORAGE_GROUP_ID)
    if (version == 2 and group is None) or (group is not None and not _nonempty_str(group)):
        raise ValueError("DataProto ref handle has invalid storage_group_id")
    return MooncakeDataProtoRef(
        batch_size=int(handle["batch_size"]),
        stage_refs=stage_refs,
        field_index=field_index,
        meta_info=dict(_mapping(handle.get("meta_info", {}), "meta_info")),
        namespace=str(handle.get("namespace", "default")),
        partition=str(handle.get("partition", "default")),
        global_indexes=_global_indexes(handle.get("global_indexes")),
        encoded_non_tensor=dict(
            _mapping(handle.get("encoded_non_tensor", {}), "encoded_non_tensor")
        ),
        _storage_group_id=group,
    )


def resolve_dataproto_ref(ref: DataProtoRefLike) -> MooncakeDataProtoRef:
    """``ref`` itself, or the ref a handle describes."""
    if isinstance(ref, MooncakeDataProtoRef):
        return ref
    if is_dataproto_ref_handle(ref):
        return import_dataproto_ref(ref)
    raise TypeError(f"expected MooncakeDataProtoRef or DataProto handle, got {type(ref).__name__}")


export_ref = export_dataproto_ref
import_ref = import_dataproto_ref
