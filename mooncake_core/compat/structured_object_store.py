"""``mooncake.structured_object_store``: named buffers and structured objects over a store.

:class:`MooncakeBundleTransfer` stores a bundle (raw metadata bytes plus named buffers,
each cut into chunks) or a structured object (JSON metadata plus members: bytes, numpy
arrays, torch tensors, jagged nested tensors) in any :class:`BundleStore` (an object with
``put`` / ``get`` / ``remove`` / ``is_exist``, such as
:class:`mooncake_core.compat.store.MooncakeDistributedStore` or a dict wrapper), with the
manifest layout of the published 0.3.13 module (:mod:`.structured_bundle`), so bundles
written by either side read back on the other. Reads can select members, slice rows
(axis 0), and land in caller memory (:meth:`MooncakeBundleTransfer.materialize_into`).
The DataProto methods live in :mod:`.structured_dataproto`. What of the published module
is left out, and why: :data:`mooncake_core.compat.inventory.NOT_PROVIDED`.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from mooncake_core.compat import structured_bundle as _sb
from mooncake_core.compat import structured_dataproto as _dp
from mooncake_core.compat import tensor_format
from mooncake_core.compat.structured_infer import infer_structure
from mooncake_core.compat.structured_types import (
    AUTO_PARALLEL_MIN_BYTES,
    AUTO_PARALLEL_MIN_CHUNKS,
    DATAPROTO_REF_HANDLE_TYPE,
    DATAPROTO_REF_HANDLE_VERSION,
    DEFAULT_BUNDLE_CHUNK_BYTES,
    MISSING,
    MISSING_OBJECT_ERROR,
    STORAGE_GROUP_ID,
    STRUCTURED_FIELD_SPECS_KEY,
    BundleStore,
    BundleTransferPolicy,
    DataProtoRefLike,
    FieldSchema,
    MooncakeDataProtoRef,
    RawDestination,
    RemoteBundleRef,
    StructuredFieldLocation,
    StructuredMemberSlice,
    StructuredObjectPayload,
    StructuredObjectReadSpec,
    StructuredObjectResult,
    TensorObjectBuffer,
    export_dataproto_ref,
    export_ref,
    import_dataproto_ref,
    import_ref,
    is_dataproto_ref_handle,
    raw_destination,
    tensor_object_buffer,
)

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
    "MooncakeBundleTransfer",
    "MooncakeDataProtoRef",
    "RemoteBundleRef",
    "StructuredFieldLocation",
    "StructuredMemberSlice",
    "StructuredObjectPayload",
    "StructuredObjectReadSpec",
    "StructuredObjectResult",
    "export_dataproto_ref",
    "export_ref",
    "import_dataproto_ref",
    "import_ref",
    "infer_structure",
    "is_dataproto_ref_handle",
    "raw_destination",
    "tensor_object_buffer",
]

_WRAPPED = "__mooncake_wrapped_object__"


# ---------------------------------------------------------------- encoding members
def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _encode_tensor(value: Any) -> tuple[dict[str, Any], Any]:
    if value.is_nested:
        torch = _torch()
        if value.layout != torch.jagged:
            raise ValueError("structured nested tensor fields require torch.jagged layout")
        lengths = value.lengths()
        parts = [value.values(), value.offsets(), *([] if lengths is None else [lengths])]
        blobs = [tensor_format.pack(p) for p in parts]
        spec = {
            "encoding": "torch_tensor",
            "dtype": str(value.dtype),
            "nested": True,
            "format": "tensor_parts",
            "part_bytes": [len(b) for b in blobs],
            "has_lengths": lengths is not None,
            "ragged_idx": int(getattr(value, "_ragged_idx", 1)),
        }
        return spec, b"".join(blobs)
    spec = {
        "encoding": "torch_tensor",
        "dtype": str(value.dtype),
        "shape": list(value.shape),
        "element_size": int(value.element_size()),
    }
    return spec, _sb.TensorPayload(value)


def _encode_member(value: Any) -> tuple[dict[str, Any], Any]:
    if isinstance(value, TensorObjectBuffer):
        return {"encoding": "torch_tensor"}, value
    if isinstance(value, _sb.TensorPayload):
        return _encode_tensor(value.tensor)
    torch = sys.modules.get("torch")  # a tensor means torch is imported: no import here
    if torch is not None and isinstance(value, torch.Tensor):
        return _encode_tensor(value)
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        spec = {"encoding": "ndarray", "dtype": array.dtype.str, "shape": list(array.shape)}
        return spec, array.view(np.uint8).reshape(-1)
    return {"encoding": "bytes"}, value


def encode_structured(
    metadata: Mapping[str, Any], fields: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata with the member specs under :data:`STRUCTURED_FIELD_SPECS_KEY`, members
    ready for a bundle)."""
    if not isinstance(metadata, Mapping):
        raise TypeError("structured metadata must be a mapping")
    out = dict(metadata)
    if STRUCTURED_FIELD_SPECS_KEY in out:
        raise ValueError(f"structured metadata key {STRUCTURED_FIELD_SPECS_KEY!r} is reserved")
    if not isinstance(out.get("layout", "structured"), str):
        raise ValueError("structured metadata layout must be a string")
    out.setdefault("layout", "structured")
    specs: dict[str, Any] = {}
    members: dict[str, Any] = {}
    for name, value in fields.items():
        _sb.key_segment_ok(name, "buffer name")
        specs[name], members[name] = _encode_member(value)
    if specs:
        out[STRUCTURED_FIELD_SPECS_KEY] = specs
    return out, members


# ---------------------------------------------------------------- reading members
def _rows(member_slice: StructuredMemberSlice, total: int) -> tuple[int, int, int]:
    if member_slice.step <= 0:
        raise ValueError("structured ndarray slicing step must be positive")
    return slice(member_slice.start, member_slice.end, member_slice.step).indices(total)


def _nested_from_parts(values: Any, offsets: Any, lengths: Any, ragged_idx: int) -> Any:
    torch = _torch()
    seq = lengths if lengths is not None else offsets.diff()
    lo, hi = (int(seq.min().item()), int(seq.max().item())) if seq.numel() else (0, 0)
    return torch.nested.nested_tensor_from_jagged(
        values,
        offsets=offsets,
        lengths=lengths,
        jagged_dim=ragged_idx,
        min_seqlen=lo,
        max_seqlen=hi,
    )


def _nested_from_payload(payload: bytes, spec: Mapping[str, Any]) -> Any:
    fmt = spec.get("format", "torch_save")
    if fmt == "torch_save":
        v = _sb.torch_load_bytes(payload)
        return _nested_from_parts(
            v.values(), v.offsets(), v.lengths(), int(getattr(v, "_ragged_idx", 1))
        )
    if fmt != "tensor_parts":
        raise ValueError(f"unsupported nested tensor payload format: {fmt}")
    sizes = spec.get("part_bytes")
    want = 3 if spec.get("has_lengths") else 2
    if not isinstance(sizes, list) or len(sizes) != want:
        raise ValueError("nested tensor payload has invalid part metadata")
    parts, at = [], 0
    for size in sizes:
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError("nested tensor payload has invalid part size")
        if at + size > len(payload):
            raise ValueError("nested tensor payload is truncated")
        parts.append(tensor_format.unpack(payload[at : at + size]))
        at += size
    if at != len(payload):
        raise ValueError("nested tensor payload has trailing bytes")
    lengths = parts[2] if want == 3 else None
    return _nested_from_parts(parts[0], parts[1], lengths, int(spec.get("ragged_idx", 1)))


class _Reader:
    """Reads the members of structured objects out of a bundle store."""

    def __init__(self, bundles: _sb.BundleManifests) -> None:
        self.bundles = bundles

    def materialize_into(
        self, spec: StructuredObjectReadSpec, destinations: Mapping[str, Any] | None
    ) -> StructuredObjectResult:
        if spec.member_names is not None and not spec.member_names:
            raise ValueError("structured read spec selected no members")
        manifest = self.bundles.resolve(spec.ref)
        metadata = _sb.decode_json(
            self.bundles.read_payload(manifest["meta"]), "structured metadata"
        )
        buffers = manifest["buffers"]
        selected = list(buffers) if spec.member_names is None else list(spec.member_names)
        missing = [n for n in selected if n not in buffers]
        if missing:
            raise KeyError(f"unknown bundle buffers: {missing}")
        specs = _sb.field_specs(metadata)
        dests = destinations or {}
        slices = dict(spec.member_slices)
        objects = {
            name: self.member(
                name,
                buffers[name],
                specs.get(name, {"encoding": "bytes"}),
                slices.get(name),
                dests.get(name),
            )
            for name in selected
        }
        return StructuredObjectResult(metadata=dict(metadata), objects=objects)

    def member(
        self,
        name: str,
        payload: Mapping[str, Any],
        spec: Mapping[str, Any],
        member_slice: StructuredMemberSlice | None,
        dest: Any,
    ) -> Any:
        encoding = spec.get("encoding", "bytes")
        if encoding == "bytes":
            if member_slice is not None:
                raise ValueError(f"structured bytes member {name} does not support slicing")
            if dest is not None:
                raise ValueError(
                    f"structured bytes member {name} does not support materialize_into"
                )
            return self.bundles.read_payload(payload)
        if encoding == "torch_tensor":
            return self._tensor(name, payload, spec, member_slice, dest)
        if encoding != "ndarray":
            raise ValueError(f"unsupported structured field encoding: {encoding}")
        return self._ndarray(name, payload, spec, member_slice, dest)

    def _ndarray(
        self,
        name: str,
        payload: Mapping[str, Any],
        spec: Mapping[str, Any],
        member_slice: StructuredMemberSlice | None,
        dest: Any,
    ) -> np.ndarray:
        dtype_s, shape_l = spec.get("dtype"), spec.get("shape")
        if not isinstance(dtype_s, str) or not isinstance(shape_l, list):
            raise ValueError(f"structured ndarray field {name} is missing dtype or shape")
        dtype, shape = np.dtype(dtype_s), tuple(int(d) for d in shape_l)
        offset, step, cover = 0, 1, shape[0] if shape else 1
        out_shape = shape
        length = _sb.nbytes_of(shape, dtype)
        if member_slice is not None:
            if member_slice.axis != 0:
                raise ValueError("structured ndarray slicing currently supports axis=0 only")
            if not shape:
                raise ValueError("structured ndarray slicing requires at least one dimension")
            start, end, step = _rows(member_slice, shape[0])
            row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
            offset = start * row
            if start >= end:
                out_shape, length, cover = (0, *shape[1:]), 0, 0
            else:
                count = 1 + (end - 1 - start) // step
                cover = (count - 1) * step + 1
                out_shape, length = (count, *shape[1:]), cover * row
        target = _sb.ndarray_target(name, dest, dtype, out_shape)
        if length == 0:
            return target
        if step == 1:
            self.bundles.read_range_into(payload, target.view(np.uint8).reshape(-1), offset, length)
            return target
        temp = np.empty((cover, *shape[1:]), dtype=dtype)
        self.bundles.read_range_into(payload, temp.view(np.uint8).reshape(-1), offset, length)
        target[...] = temp[::step]
        return target

    def _tensor(
        self,
        name: str,
        payload: Mapping[str, Any],
        spec: Mapping[str, Any],
        member_slice: StructuredMemberSlice | None,
        dest: Any,
    ) -> Any:
        store = self.bundles.store
        if spec.get("nested"):
            if dest is not None:
                raise ValueError(
                    f"structured nested tensor member {name} does not support destinations"
                )
            value = _nested_from_payload(self.bundles.read_payload(payload), spec)
            if member_slice is None:
                return value
            if member_slice.axis != 0:
                raise ValueError("structured nested tensor slicing currently supports axis=0 only")
            return _sb.select_nested_rows(value, range(*_rows(member_slice, len(value))))
        if member_slice is not None:
            return self._tensor_rows(name, payload, spec, member_slice, dest)
        if dest is not None:
            if not isinstance(dest, (TensorObjectBuffer, RawDestination)):
                raise ValueError(
                    f"structured tensor member {name} only supports tensor_object_buffer or"
                    " raw_destination destinations"
                )
            if payload.get("kind") == "tensor":
                get_into = getattr(store, "get_tensor_into", None)
                if not callable(get_into):
                    raise RuntimeError("structured tensor payload does not support get_tensor_into")
                result = get_into(payload["key"], dest.ptr, dest.size)
                return dest if result is None else result
            total = int(payload["bytes"])
            if dest.size < total:
                raise ValueError(
                    f"tensor destination has {dest.size} bytes, expected at least {total}"
                )
            self.bundles.read_range_to_address(payload, dest.ptr, 0, total)
            return dest
        if payload.get("kind") == "tensor":
            get_tensor = getattr(store, "get_tensor", None)
            if not callable(get_tensor):
                raise RuntimeError("structured tensor payload does not support get_tensor")
            return get_tensor(payload["key"])
        data = self.bundles.read_payload(payload)
        if payload.get("format") == "torch_save":
            return _sb.torch_load_bytes(data)
        return tensor_format.unpack(data)

    def _tensor_rows(
        self,
        name: str,
        payload: Mapping[str, Any],
        spec: Mapping[str, Any],
        member_slice: StructuredMemberSlice,
        dest: Any,
    ) -> Any:
        if payload.get("format") == "torch_save":
            if dest is not None:
                raise ValueError(
                    f"structured torch_save tensor member {name} does not support destinations"
                )
            if member_slice.axis != 0:
                raise ValueError("structured tensor slicing currently supports axis=0 only")
            value = _sb.torch_load_bytes(self.bundles.read_payload(payload))
            start, end, step = _rows(member_slice, len(value))
            return value[start:end:step]
        head_bytes = int(payload.get("metadata_bytes", -1))
        shape, size = spec.get("shape"), int(spec.get("element_size", 0))
        if head_bytes < 0 or not isinstance(shape, list) or size <= 0:
            raise ValueError(f"structured tensor field {name} is missing slice metadata")
        if member_slice.axis != 0:
            raise ValueError("structured tensor slicing currently supports axis=0 only")
        if not shape:
            raise ValueError("structured tensor slicing requires at least one dimension")
        start, end, step = _rows(member_slice, int(shape[0]))
        if step != 1:
            raise ValueError("structured tensor slicing currently requires step=1")
        row = size * int(np.prod(shape[1:], dtype=np.int64))
        at, length = head_bytes + start * row, (end - start) * row
        head = self.bundles.read_range(payload, 0, head_bytes)
        head = _sb.patched_header(head, (end - start, *shape[1:]), length)
        if dest is not None:
            if not isinstance(dest, (TensorObjectBuffer, RawDestination)):
                raise ValueError(
                    f"structured tensor member {name} only supports tensor_object_buffer or"
                    " raw_destination destinations"
                )
            if dest.size < head_bytes + length:
                raise ValueError(
                    f"tensor destination has {dest.size} bytes, expected at least"
                    f" {head_bytes + length}"
                )
            ctypes.memmove(dest.ptr, head, head_bytes)
            self.bundles.read_range_to_address(payload, dest.ptr + head_bytes, at, length)
            return dest
        return tensor_format.unpack(head + self.bundles.read_range(payload, at, length))


# ---------------------------------------------------------------- the public class
class MooncakeBundleTransfer:
    """Bundles, structured objects and DataProtos over a :class:`BundleStore`."""

    def __init__(
        self,
        store: BundleStore,
        key_prefix: str = "bundle",
        default_chunk_bytes: int = DEFAULT_BUNDLE_CHUNK_BYTES,
        buffer_pool: Any = None,
    ) -> None:
        """``buffer_pool`` is accepted for the published signature; payloads travel through
        the store's ``put`` / ``get`` (the stored bytes are the same)."""
        self.store = store
        self.key_prefix = _sb.key_prefix_ok(key_prefix)
        self.default_chunk_bytes = _sb.chunk_bytes_ok(default_chunk_bytes)
        self.buffer_pool = buffer_pool
        self._bundles = _sb.BundleManifests(store, self.key_prefix, self.default_chunk_bytes)
        self._reader = _Reader(self._bundles)

    # -- bundles and structured objects
    def put_bundle(
        self,
        meta: bytes | bytearray | memoryview,
        buffers: Mapping[str, Any],
        partition: str = "default",
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        max_inflight_put: int | None = None,
        config: Any = None,
    ) -> RemoteBundleRef:
        """Store raw ``meta`` bytes and named bytes-like ``buffers`` as one bundle."""
        return self._bundles.put_bundle(
            meta, buffers, partition, chunk_bytes, policy, max_inflight_put, config
        )

    def remove_bundle(self, ref: _sb.BundleRefLike) -> None:
        """Remove every key of a bundle (nothing to do when it is already gone)."""
        self._bundles.remove_bundle(ref)

    def put_structured_object(
        self,
        payload: StructuredObjectPayload,
        partition: str = "default",
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        max_inflight_put: int | None = None,
        config: Any = None,
    ) -> RemoteBundleRef:
        """Store JSON metadata plus members (bytes, ndarrays, tensors) as a bundle."""
        metadata, members = encode_structured(payload.metadata, payload.buffers)
        pol = _sb.policy_ok(policy, max_inflight_put)
        meta = _sb.encode_json(metadata, "structured metadata")
        return self._bundles.put_bundle(meta, members, partition, chunk_bytes, pol, None, config)

    def put_object(
        self,
        obj: Any,
        partition: str = "default",
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        max_inflight_put: int | None = None,
        config: Any = None,
    ) -> RemoteBundleRef:
        """Store a mapping of members, or one tensor / array / bytes value."""
        if isinstance(obj, Mapping):
            payload = StructuredObjectPayload(metadata={}, buffers=obj)
        else:
            payload = StructuredObjectPayload(metadata={_WRAPPED: True}, buffers={"value": obj})
        return self.put_structured_object(
            payload, partition, chunk_bytes, policy, max_inflight_put, config
        )

    def get_object(self, ref: _sb.BundleRefLike) -> Any:
        """What :meth:`put_object` stored: the value, or the dict of members."""
        result = self.materialize(self.read_spec(ref))
        if result.metadata.get(_WRAPPED):
            return result.objects["value"]
        return result.objects

    def read_spec(self, ref: _sb.BundleRefLike) -> StructuredObjectReadSpec:
        """A read plan for the whole object (narrow it with ``select_members`` /
        ``slice_member``)."""
        return StructuredObjectReadSpec(ref=ref)

    def materialize(self, spec: StructuredObjectReadSpec) -> StructuredObjectResult:
        """Read what ``spec`` selects."""
        return self._reader.materialize_into(spec, None)

    def materialize_into(
        self, spec: StructuredObjectReadSpec, destinations: Mapping[str, Any] | None
    ) -> StructuredObjectResult:
        """Read what ``spec`` selects, into ``destinations[name]`` where given (an ndarray
        of the member's dtype and shape, a :func:`raw_destination`, or for tensors a
        :func:`tensor_object_buffer`)."""
        return self._reader.materialize_into(spec, destinations)

    @staticmethod
    def release_result(result: Any) -> None:
        """Release buffer-pool leases held by arrays in ``result`` (ours hold none: our
        reads land in ordinary memory; objects that carry a lease are released)."""
        seen_owners: set[int] = set()
        seen: set[int] = set()

        def visit(value: Any) -> None:
            owner = getattr(value, "_mooncake_pool_owner", None)
            if owner is not None:
                if id(owner) not in seen_owners:
                    seen_owners.add(id(owner))
                    owner.release()
                return
            items: Any = None
            if isinstance(value, Mapping):
                items = value.values()
            elif hasattr(value, "batch") and hasattr(value, "non_tensor_batch"):
                items = (value.batch, value.non_tensor_batch, getattr(value, "meta_info", None))
            elif isinstance(value, (list, tuple)):
                items = value
            elif isinstance(value, np.ndarray) and value.dtype == object:
                items = value.flat
            if items is not None and id(value) not in seen:
                seen.add(id(value))
                for item in items:
                    visit(item)

        visit(result)

    # -- DataProto and flat dicts (structured_dataproto)
    def put(
        self,
        data: Any,
        *,
        type: Literal["dataproto", "dict"] = "dataproto",  # noqa: A002 - published name
        namespace: str = "default",
        partition: str = "default",
        stage: str = "default",
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        config: Any = None,
        field_schemas: Mapping[str, FieldSchema] | None = None,
    ) -> MooncakeDataProtoRef:
        """Store a DataProto-like object (``batch`` / ``non_tensor_batch`` / ``meta_info``)
        or, with ``type="dict"``, a flat dict split into those sections by row count."""
        if type == "dataproto":
            stage_data = data
        elif type == "dict":
            stage_data = _dp.flat_dict_to_envelope(data, field_schemas)
        else:
            raise ValueError(f"unsupported Mooncake payload type: {type!r}")
        return _dp.put_stage(
            self,
            None,
            stage_data,
            namespace,
            partition,
            stage,
            chunk_bytes,
            policy,
            False,
            field_schemas,
            config,
        )

    def get(
        self,
        ref: DataProtoRefLike,
        *,
        type: Literal["dataproto", "dict"] = "dataproto",  # noqa: A002 - published name
        fields: Sequence[str] | None = None,
        batch_fields: Sequence[str] | None = None,
        non_tensor_fields: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        data_cls: Any | None = None,
        destinations: Mapping[str, Any] | None = None,
        rows: slice | StructuredMemberSlice | Sequence[int] | None = None,
    ) -> Any:
        """Read back what :meth:`put` stored (selected fields, rows, meta_info keys)."""
        if type not in {"dataproto", "dict"}:
            raise ValueError(f"unsupported Mooncake payload type: {type!r}")
        flat = type == "dict"
        result = _dp.get_stage_fields(
            self,
            ref,
            fields,
            batch_fields,
            non_tensor_fields,
            meta_info_keys,
            dict if flat else data_cls,
            destinations,
            rows,
            flat,
        )
        return _dp.envelope_to_flat_dict(result) if flat else result

    def put_dataproto(
        self,
        data: Any,
        *,
        namespace: str = "default",
        partition: str = "default",
        stage: str = "default",
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        field_schemas: Mapping[str, FieldSchema] | None = None,
        config: Any = None,
    ) -> MooncakeDataProtoRef:
        """:meth:`put` with ``type="dataproto"``."""
        return self.put(
            data,
            type="dataproto",
            namespace=namespace,
            partition=partition,
            stage=stage,
            chunk_bytes=chunk_bytes,
            policy=policy,
            field_schemas=field_schemas,
            config=config,
        )

    def append_dataproto_fields(
        self,
        ref: DataProtoRefLike,
        data: Any,
        *,
        stage: str,
        overwrite: bool = False,
        chunk_bytes: int | None = None,
        policy: BundleTransferPolicy | None = None,
        field_schemas: Mapping[str, FieldSchema] | None = None,
        config: Any = None,
    ) -> MooncakeDataProtoRef:
        """A new ref with ``data``'s fields added in ``stage`` (the old ref stays valid
        unless ``overwrite`` replaces that stage)."""
        base = _dp.resolve_dataproto_ref(ref)
        return _dp.put_stage(
            self,
            base,
            data,
            base.namespace,
            base.partition,
            stage,
            chunk_bytes,
            policy,
            overwrite,
            field_schemas,
            config,
        )

    def dataproto_manifest_view(self, ref: DataProtoRefLike) -> dict[str, Any]:
        """Per field: section, stage, member and member spec, read from the manifests."""
        return _dp.manifest_view(self, _dp.resolve_dataproto_ref(ref))

    def get_dataproto(
        self,
        ref: DataProtoRefLike,
        *,
        fields: Sequence[str] | None = None,
        batch_fields: Sequence[str] | None = None,
        non_tensor_fields: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        data_cls: Any | None = None,
        destinations: Mapping[str, Any] | None = None,
        rows: slice | StructuredMemberSlice | Sequence[int] | None = None,
    ) -> Any:
        """:meth:`get` with ``type="dataproto"``."""
        return _dp.get_stage_fields(
            self,
            ref,
            fields,
            batch_fields,
            non_tensor_fields,
            meta_info_keys,
            data_cls,
            destinations,
            rows,
            False,
        )

    def cleanup_dataproto(self, ref: DataProtoRefLike) -> None:
        """Remove every stage bundle of a DataProto ref."""
        seen: set[str] = set()
        for stage_ref in _dp.resolve_dataproto_ref(ref).stage_refs.values():
            if stage_ref.manifest_key not in seen:
                seen.add(stage_ref.manifest_key)
                self.remove_bundle(stage_ref)

    def cleanup_dataproto_append(
        self, previous: DataProtoRefLike, appended: DataProtoRefLike
    ) -> None:
        """Remove what an append added (a ref never published) and leave ``previous``
        intact."""
        _dp.cleanup_append(
            self, _dp.resolve_dataproto_ref(previous), _dp.resolve_dataproto_ref(appended)
        )
