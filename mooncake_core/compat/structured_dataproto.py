"""The DataProto paths of ``mooncake.structured_object_store`` (published 0.3.13 layout).

A DataProto-like object (``batch``, ``non_tensor_batch``, ``meta_info``: attributes or an
envelope dict; verl's ``DataProto`` itself is not needed) is stored per *stage* as one
structured object whose members are ``batch.<field>`` and ``non_tensor_batch.<field>``,
with ``{"layout": "dataproto_stage", "dataproto": {...}}`` metadata; every key of one
DataProto shares a storage group id (``structured-<hex>``) in the write config. A
:class:`MooncakeDataProtoRef` maps fields to stages; appending fields to a stage writes a
merged manifest over the old and new members.

Dense fields (torch tensors, numeric numpy arrays) are members as they are. An
object-dtype ``non_tensor_batch`` column (strings, bytes, lists, dicts, per-row arrays or
tensors), or one whose ``FieldSchema`` names a codec, is encoded into typed payload members
``non_tensor_batch.<field>.<payload>`` (:mod:`structured_recursive`,
:mod:`structured_codecs`) and described in the ref's ``encoded_non_tensor``; reading it
decodes whole columns, or reads only the selected rows' bytes (:mod:`structured_partial`).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mooncake_core.compat.structured_bundle import (
    BundleManifests,
    cleanup_keys,
    config_with_group,
    decode_json,
    encode_json,
    field_specs,
    ndarray_target,
    patched_header,
    select_nested_rows,
)
from mooncake_core.compat.structured_codecs import Encoded
from mooncake_core.compat.structured_flat import (
    batch_size,
    check_schema_sections,
    envelope_to_flat_dict,
    flat_dict_to_envelope,
    is_sequence,
    schema_section,
    split_sections,
)
from mooncake_core.compat.structured_partial import read_encoded_rows
from mooncake_core.compat.structured_recursive import (
    decode_column,
    encode_inferred,
    encode_with_schema,
)
from mooncake_core.compat.structured_types import (
    STRUCTURED_FIELD_SPECS_KEY,
    DataProtoRefLike,
    FieldSchema,
    MooncakeDataProtoRef,
    RawDestination,
    RemoteBundleRef,
    StructuredFieldLocation,
    StructuredMemberSlice,
    StructuredObjectPayload,
    TensorObjectBuffer,
    resolve_dataproto_ref,
)

__all__ = [
    "cleanup_append",
    "envelope_to_flat_dict",
    "flat_dict_to_envelope",
    "get_stage_fields",
    "manifest_view",
    "put_stage",
    "resolve_dataproto_ref",
]


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _config_type() -> Any:
    try:
        from mooncake_core.compat.store import ReplicateConfig
    except ImportError:
        return None
    return ReplicateConfig


# ---------------------------------------------------------------- writing a stage
def new_group_id(config: Any) -> str | None:
    """The storage group of a new DataProto: the config's one group id, a fresh
    ``structured-<hex>`` when it has none, None for ``""``."""
    raw = getattr(config, "group_ids", None)
    if raw is None:
        group = None
    elif isinstance(raw, str):
        group = raw
    else:
        try:
            ids = list(raw)
        except TypeError as error:
            raise ValueError(
                "structured object store config.group_ids must contain strings"
            ) from error
        if len(ids) > 1:
            raise ValueError(
                "structured object store config.group_ids must contain exactly one logical"
                " group id; it is expanded across internal Mooncake keys"
            )
        group = ids[0] if ids else None
    if group is None:
        return f"structured-{uuid.uuid4().hex}"
    if not isinstance(group, str):
        raise ValueError("structured object store config.group_ids must contain strings")
    return group or None


def _merge_metadata(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    if old.get("dataproto") != new.get("dataproto"):
        raise ValueError("DataProto stage metadata mismatch during manifest merge")
    out = dict(old)
    specs = dict(old.get(STRUCTURED_FIELD_SPECS_KEY, {}))
    added = dict(new.get(STRUCTURED_FIELD_SPECS_KEY, {}))
    clash = sorted(set(specs) & set(added))
    if clash:
        raise ValueError(f"structured members already exist: {clash}")
    specs.update(added)
    if specs:
        out[STRUCTURED_FIELD_SPECS_KEY] = specs
    return out


def _stage_meta(transfer: Any, manifest: Mapping[str, Any]) -> dict[str, Any]:
    return decode_json(transfer._bundles.read_payload(manifest["meta"]), "structured metadata")


def _append_to_stage(
    transfer: Any,
    old_ref: RemoteBundleRef,
    payload: StructuredObjectPayload,
    partition: str,
    chunk_bytes: int | None,
    policy: Any,
    config: Any,
) -> RemoteBundleRef:
    bundles: BundleManifests = transfer._bundles
    new_ref = transfer.put_structured_object(
        payload, partition=partition, chunk_bytes=chunk_bytes, policy=policy, config=config
    )
    try:
        old_m, new_m = bundles.resolve(old_ref), bundles.resolve(new_ref)
        merged_meta = _merge_metadata(_stage_meta(transfer, old_m), _stage_meta(transfer, new_m))
        buffers = dict(old_m["buffers"])
        clash = sorted(set(buffers) & set(new_m["buffers"]))
        if clash:
            raise ValueError(f"structured members already exist: {clash}")
        buffers.update(new_m["buffers"])
        cleanup = [
            *old_m.get("cleanup_keys", []),
            bundles.manifest_key(old_ref),
            *bundles.payload_keys(old_m["meta"]),
            bundles.manifest_key(new_ref),
            *bundles.payload_keys(new_m["meta"]),
        ]
        merged = bundles.put_merged_manifest(
            encode_json(merged_meta, "structured metadata"),
            buffers,
            partition=partition,
            chunk_bytes=chunk_bytes,
            policy=policy,
            cleanup=cleanup,
            config=config,
        )
    except Exception:
        transfer.remove_bundle(new_ref)
        raise
    obsolete = [bundles.manifest_key(new_ref), *bundles.payload_keys(new_m["meta"])]
    cleanup_keys(bundles.store, obsolete, strict=False)
    return merged


def _schema_column(name: str, value: Any) -> np.ndarray[Any, Any]:
    if isinstance(value, np.ndarray):
        return value
    if is_sequence(value):
        column = np.empty(len(value), dtype=object)
        column[:] = list(value)
        return column
    raise TypeError(
        f"non_tensor_batch field {name!r} with FieldSchema must be an ndarray or"
        " non-string sequence"
    )


def _encode_column(name: str, value: Any, schema: FieldSchema | None) -> Encoded | None:
    """The encoded column for ``value`` (None: stored as a plain member)."""
    path = f"non_tensor_batch.{name}"
    encoded = None
    if schema is not None:
        try:
            column = _schema_column(name, value)
            if schema.codec != "auto":
                encoded = encode_with_schema(path, column, schema)
            elif not schema.nullable and any(v is None for v in column):
                raise ValueError(f"FieldSchema for {path!r} is not nullable")
        except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise type(exc)(
                f"failed to encode non_tensor_batch field {name!r} with FieldSchema codec"
                f" {schema.codec!r}: {exc}"
            ) from exc
    if encoded is None and isinstance(value, np.ndarray) and value.dtype == object:
        encoded = encode_inferred(path, value)
    return encoded


def put_stage(
    transfer: Any,
    ref: MooncakeDataProtoRef | None,
    data: Any,
    namespace: str,
    partition: str,
    stage: str,
    chunk_bytes: int | None,
    policy: Any,
    overwrite: bool,
    schemas: Mapping[str, FieldSchema] | None,
    config: Any,
) -> MooncakeDataProtoRef:
    """Store ``data``'s fields as stage ``stage`` (new, appended to, or overwritten)."""
    batch, non_tensor, meta_info = split_sections(data)
    check_schema_sections(
        {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": meta_info}, schemas
    )
    size = batch_size(batch, non_tensor)
    if ref is not None and size != ref.batch_size:
        raise ValueError(
            f"DataProto append batch size {size} does not match ref batch size {ref.batch_size}"
        )
    both = sorted(set(batch) & set(non_tensor))
    if both:
        raise ValueError(f"DataProto batch and non_tensor_batch fields overlap: {both}")
    buffers: dict[str, Any] = {}
    updates: dict[str, StructuredFieldLocation] = {}
    for name, value in batch.items():
        buffers[f"batch.{name}"] = value
        updates[name] = StructuredFieldLocation(stage, f"batch.{name}", "batch")
    encoded_updates: dict[str, Any] = {}
    for name, value in non_tensor.items():
        schema = (schemas or {}).get(name)
        declared = None if schema is None else schema_section(name, schema)
        column = _encode_column(
            name, value, schema if declared in (None, "non_tensor_batch") else None
        )
        updates[name] = StructuredFieldLocation(
            stage, f"non_tensor_batch.{name}", "non_tensor_batch"
        )
        if column is None:
            buffers[f"non_tensor_batch.{name}"] = value
            continue
        members = {p: f"non_tensor_batch.{name}.{p}" for p in column.payload}
        buffers.update({members[p]: v for p, v in column.payload.items()})
        encoded_updates[name] = {
            "codec": column.codec,
            "rows": column.rows,
            "metadata": column.metadata,
            "payload_members": members,
        }
    if not buffers:
        if ref is not None:
            merged = dict(ref.meta_info)
            merged.update(meta_info)
            return MooncakeDataProtoRef(
                ref.batch_size,
                dict(ref.stage_refs),
                dict(ref.field_index),
                merged,
                ref.namespace,
                ref.partition,
                ref.global_indexes,
                dict(ref.encoded_non_tensor),
                ref._storage_group_id,
            )
        return MooncakeDataProtoRef(
            size,
            {},
            {},
            dict(meta_info),
            namespace,
            partition,
            encoded_non_tensor={},
            _storage_group_id=new_group_id(config),
        )
    duplicates = sorted(set(ref.field_index) & set(updates)) if ref is not None else []
    if duplicates and not overwrite:
        raise ValueError(f"DataProto fields already exist: {duplicates}")
    if ref is not None and overwrite:
        dangling = [
            n for n, loc in ref.field_index.items() if loc.stage == stage and n not in updates
        ]
        if dangling:
            raise ValueError(
                f"DataProto overwrite for stage {stage!r} must include existing fields:"
                f" {sorted(dangling)}"
            )
    group = new_group_id(config) if ref is None else ref._storage_group_id
    cfg = config if group is None else config_with_group(config, group, _config_type())
    payload = StructuredObjectPayload(
        metadata={
            "layout": "dataproto_stage",
            "dataproto": {
                "version": 1,
                "namespace": namespace,
                "partition": partition,
                "stage": stage,
                "batch_size": size,
            },
        },
        buffers=buffers,
    )
    existing = ref.stage_refs.get(stage) if ref is not None else None
    if existing is not None and not overwrite:
        stage_ref = _append_to_stage(
            transfer, existing, payload, partition, chunk_bytes, policy, cfg
        )
    else:
        stage_ref = transfer.put_structured_object(
            payload, partition=partition, chunk_bytes=chunk_bytes, policy=policy, config=cfg
        )
        if existing is not None and existing.manifest_key != stage_ref.manifest_key:
            transfer.remove_bundle(existing)
    if ref is None:
        stage_refs, index, meta = {stage: stage_ref}, dict(updates), dict(meta_info)
        encoded: dict[str, Any] = dict(encoded_updates)
    else:
        stage_refs = dict(ref.stage_refs)
        stage_refs[stage] = stage_ref
        index = dict(ref.field_index)
        index.update(updates)
        meta = dict(ref.meta_info)
        meta.update(meta_info)
        encoded = {k: v for k, v in ref.encoded_non_tensor.items() if k not in updates}
        encoded.update(encoded_updates)
    return MooncakeDataProtoRef(
        size,
        stage_refs,
        index,
        meta,
        namespace,
        partition,
        None if ref is None else ref.global_indexes,
        encoded,
        group,
    )


# ---------------------------------------------------------------- reading fields
@dataclass(frozen=True)
class _Rows:
    count: int
    member_slice: StructuredMemberSlice | None = None
    indices: tuple[int, ...] | None = None


def _slice_count(s: StructuredMemberSlice, total: int) -> int:
    if s.step <= 0:
        raise ValueError("structured ndarray slicing step must be positive")
    start, end, step = slice(s.start, s.end, s.step).indices(total)
    return 0 if start >= end else 1 + (end - 1 - start) // step


def _row_selection(rows: Any, total: int) -> _Rows | None:
    if rows is None:
        return None
    if isinstance(rows, StructuredMemberSlice):
        if rows.axis != 0:
            raise ValueError("DataProto row slicing currently supports axis=0 only")
        return _Rows(_slice_count(rows, total), member_slice=rows)
    if isinstance(rows, slice):
        start, end, step = rows.indices(total)
        if step <= 0:
            raise ValueError("DataProto row slicing step must be positive")
        s = StructuredMemberSlice(axis=0, start=start, end=end, step=step)
        return _Rows(_slice_count(s, total), member_slice=s)
    if is_sequence(rows):
        out = []
        for i in rows:
            if not isinstance(i, (int, np.integer)):
                raise TypeError("DataProto row indices must be integers")
            j = int(i) + (total if int(i) < 0 else 0)
            if not 0 <= j < total:
                raise IndexError(f"DataProto row index {i} out of range for {total} rows")
            out.append(j)
        return _Rows(len(out), indices=tuple(out))
    raise TypeError("DataProto rows must be a slice, StructuredMemberSlice, or row index sequence")


def _field_selection(
    ref: MooncakeDataProtoRef, fields: Any, batch_fields: Any, non_tensor_fields: Any
) -> tuple[list[str], list[str]]:
    if fields is not None and (batch_fields is not None or non_tensor_fields is not None):
        raise ValueError("fields cannot be combined with batch_fields or non_tensor_fields")
    if fields is not None:
        names = list(fields)
        _known(ref, names)
        return (
            [n for n in names if ref.field_index[n].section == "batch"],
            [n for n in names if ref.field_index[n].section == "non_tensor_batch"],
        )
    if batch_fields is None and non_tensor_fields is None:
        b = [n for n, loc in ref.field_index.items() if loc.section == "batch"]
        nt = [n for n, loc in ref.field_index.items() if loc.section == "non_tensor_batch"]
    else:
        b, nt = list(batch_fields or []), list(non_tensor_fields or [])
    _known(ref, [*b, *nt])
    return b, nt


def _known(ref: MooncakeDataProtoRef, names: Sequence[str]) -> None:
    missing = [n for n in names if n not in ref.field_index]
    if missing:
        raise KeyError(f"unknown DataProto fields: {missing}")


def _read_indices(
    transfer: Any, stage_ref: RemoteBundleRef, member: str, idx: Sequence[int], dest: Any
) -> Any:
    from mooncake_core.compat import tensor_format

    bundles: BundleManifests = transfer._bundles
    manifest = bundles.resolve(stage_ref)
    spec = field_specs(_stage_meta(transfer, manifest)).get(member, {"encoding": "bytes"})
    payload = manifest["buffers"][member]
    encoding = spec.get("encoding", "bytes")
    shape = spec.get("shape")
    if encoding == "torch_tensor" and spec.get("nested"):
        got = transfer.materialize_into(
            transfer.read_spec(stage_ref).select_members([member]),
            None if dest is None else {member: dest},
        )
        return select_nested_rows(got.objects[member], idx)
    if encoding == "torch_tensor" and payload.get("format") == "torch_save":
        if dest is not None:
            raise ValueError(
                f"structured torch_save tensor member {member} does not support destinations"
            )
        from mooncake_core.compat.structured_bundle import torch_load_bytes

        return torch_load_bytes(bundles.read_payload(payload))[list(idx)]
    if encoding == "ndarray":
        if not isinstance(spec.get("dtype"), str) or not isinstance(shape, list):
            raise ValueError(f"structured ndarray field {member} is missing dtype or shape")
        if not shape:
            raise ValueError("structured ndarray indexed read requires at least one dimension")
        dtype = np.dtype(spec["dtype"])
        row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        target = ndarray_target(member, dest, dtype, (len(idx), *map(int, shape[1:])))
        flat = target.view(np.uint8).reshape(-1)
        bundles.read_ranges_into(
            payload, flat, [(r * row, o * row, row) for o, r in enumerate(idx)]
        )
        return target
    if encoding != "torch_tensor":
        raise ValueError(f"structured member {member} does not support indexed rows")
    head_bytes = int(payload.get("metadata_bytes", -1))
    size = int(spec.get("element_size", 0))
    if head_bytes < 0 or not isinstance(shape, list) or size <= 0:
        raise ValueError(f"structured tensor field {member} is missing slice metadata")
    if not shape:
        raise ValueError("structured tensor indexed read requires at least one dimension")
    row = size * int(np.prod(shape[1:], dtype=np.int64))
    data = bytearray(len(idx) * row)
    bundles.read_ranges_into(
        payload, data, [(head_bytes + r * row, o * row, row) for o, r in enumerate(idx)]
    )
    head = patched_header(
        bundles.read_range(payload, 0, head_bytes), (len(idx), *shape[1:]), len(data)
    )
    if dest is not None:
        import ctypes

        if not isinstance(dest, (TensorObjectBuffer, RawDestination)):
            raise ValueError(
                f"structured tensor member {member} only supports tensor_object_buffer or"
                " raw_destination destinations"
            )
        if dest.size < head_bytes + len(data):
            raise ValueError(
                f"tensor destination has {dest.size} bytes, expected at least"
                f" {head_bytes + len(data)}"
            )
        ctypes.memmove(dest.ptr, head + bytes(data), head_bytes + len(data))
        return dest
    return tensor_format.unpack(head + bytes(data))


def _read_encoded(
    transfer: Any,
    ref: MooncakeDataProtoRef,
    name: str,
    selection: _Rows | None,
    stages: dict[str, Any],
) -> list[Any]:
    """An encoded column: its payload members read whole and decoded, or, for selected
    rows, only those rows' bytes (:mod:`structured_partial`)."""
    rows: range | tuple[int, ...] | None = None
    if selection is not None and selection.indices is not None:
        rows = selection.indices
    elif selection is not None and selection.member_slice is not None:
        s = selection.member_slice
        rows = range(*slice(s.start, s.end, s.step).indices(ref.batch_size))
        if rows.step != 1:
            raise ValueError("DataProto structured non-tensor slicing currently requires step=1")
    enc = ref.encoded_non_tensor[name]
    members = enc["payload_members"]
    stage_ref = ref.stage_refs[ref.field_index[name].stage]
    if rows is not None:
        return read_encoded_rows(transfer, stage_ref, enc, rows, stages)
    spec = transfer.read_spec(stage_ref).select_members(list(members.values()))
    got = transfer.materialize(spec).objects
    return decode_column(enc, {p: got[m] for p, m in members.items()}, ref.batch_size)


def _object_column(values: list[Any]) -> np.ndarray[Any, Any]:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def _build(
    batch: dict[str, Any], non_tensor: dict[str, Any], meta: dict[str, Any], cls: Any
) -> Any:
    if cls is None or cls is dict:
        return {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": meta}
    from_dict = getattr(cls, "from_dict", None)
    try:
        if callable(from_dict):
            return from_dict(batch, non_tensor, meta_info=meta)
        return cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)
    except TypeError as error:
        raise TypeError(
            f"{getattr(cls, '__name__', cls)!r} cannot be constructed from "
            "batch, non_tensor_batch, and meta_info"
        ) from error


def get_stage_fields(
    transfer: Any,
    ref_like: DataProtoRefLike,
    fields: Any,
    batch_fields: Any,
    non_tensor_fields: Any,
    meta_info_keys: Sequence[str] | None,
    data_cls: Any,
    destinations: Mapping[str, Any] | None,
    rows: Any,
    flat: bool,
) -> Any:
    """Read the selected fields (and rows) of a DataProto ref."""
    ref = resolve_dataproto_ref(ref_like)
    selection = _row_selection(rows, ref.batch_size)
    row_slice = None if selection is None else selection.member_slice
    indices = None if selection is None else selection.indices
    b_names, nt_names = _field_selection(ref, fields, batch_fields, non_tensor_fields)
    out: dict[str, dict[str, Any]] = {"batch": {}, "non_tensor_batch": {}}
    dests = destinations or {}
    by_stage: dict[str, list[tuple[str, StructuredFieldLocation]]] = {}
    encoded: list[str] = []
    for name in [*b_names, *nt_names]:
        loc = ref.field_index[name]
        if loc.section == "non_tensor_batch" and name in ref.encoded_non_tensor:
            encoded.append(name)
            continue
        by_stage.setdefault(loc.stage, []).append((name, loc))
    for stage, entries in by_stage.items():
        stage_ref = ref.stage_refs[stage]
        if indices is not None:
            for name, loc in entries:
                out[loc.section][name] = _read_indices(
                    transfer, stage_ref, loc.member, indices, dests.get(name)
                )
            continue
        members = [loc.member for _, loc in entries]
        spec = transfer.read_spec(stage_ref).select_members(members)
        if row_slice is not None:
            for m in members:
                spec = spec.slice_member(
                    m, row_slice.axis, row_slice.start, row_slice.end, row_slice.step
                )
        stage_dests = {loc.member: dests[n] for n, loc in entries if n in dests}
        result = transfer.materialize_into(spec, stage_dests)
        for name, loc in entries:
            out[loc.section][name] = result.objects[loc.member]
    stages: dict[str, Any] = {}
    for name in encoded:
        values = _read_encoded(transfer, ref, name, selection, stages)
        out["non_tensor_batch"][name] = values if flat else _object_column(values)
    keys = meta_info_keys
    meta = (
        dict(ref.meta_info)
        if keys is None
        else {k: ref.meta_info[k] for k in keys if k in ref.meta_info}
    )
    return _build(out["batch"], out["non_tensor_batch"], meta, data_cls)


# ---------------------------------------------------------------- views and cleanup
def manifest_view(transfer: Any, ref: MooncakeDataProtoRef) -> dict[str, Any]:
    """The fields of a DataProto ref with their member specs, from the stage manifests."""
    bundles: BundleManifests = transfer._bundles
    metas = {s: _stage_meta(transfer, bundles.resolve(r)) for s, r in ref.stage_refs.items()}
    fields: dict[str, dict[str, Any]] = {}
    for name, loc in ref.field_index.items():
        specs = field_specs(metas[loc.stage])
        spec = dict(specs.get(loc.member, {"encoding": "bytes"}))
        enc = ref.encoded_non_tensor.get(name)
        if enc is not None:
            spec = {
                "encoding": "structured_non_tensor",
                "codec": enc["codec"],
                "metadata": enc.get("metadata"),
                "payload_members": dict(enc["payload_members"]),
                "payload_specs": {
                    p: dict(specs.get(m, {"encoding": "bytes"}))
                    for p, m in enc["payload_members"].items()
                },
            }
        fields[name] = {
            "section": loc.section,
            "stage": loc.stage,
            "member": loc.member,
            "spec": spec,
        }
    return {
        "namespace": ref.namespace,
        "partition": ref.partition,
        "batch_size": ref.batch_size,
        "batch_fields": {n: f for n, f in fields.items() if f["section"] == "batch"},
        "non_tensor_fields": {
            n: f for n, f in fields.items() if f["section"] == "non_tensor_batch"
        },
        "meta_info_keys": list(ref.meta_info),
        "stages": {
            s: {"manifest_key": r.manifest_key, "dataproto": metas[s].get("dataproto", {})}
            for s, r in ref.stage_refs.items()
        },
    }


def cleanup_append(
    transfer: Any, previous: MooncakeDataProtoRef, appended: MooncakeDataProtoRef
) -> None:
    """Remove the keys an append wrote that ``previous`` does not use."""
    bundles: BundleManifests = transfer._bundles
    for stage, stage_ref in appended.stage_refs.items():
        old = previous.stage_refs.get(stage)
        if old is None:
            transfer.remove_bundle(stage_ref)
            continue
        if stage_ref.manifest_key == old.manifest_key:
            continue
        is_exist = getattr(bundles.store, "is_exist", None)
        if callable(is_exist) and is_exist(stage_ref.manifest_key) == 0:
            continue
        manifest = bundles.resolve(stage_ref)
        old_names = {loc.member for loc in previous.field_index.values() if loc.stage == stage}
        for name, enc in previous.encoded_non_tensor.items():
            if previous.field_index[name].stage == stage:
                old_names.update(enc["payload_members"].values())
        fresh = [p for n, p in manifest["buffers"].items() if n not in old_names]
        fresh_ids = {bundles.object_id_of(p["key"]) for p in fresh}
        keys = [
            *bundles.payload_keys(manifest["meta"]),
            *[c["key"] for p in fresh for c in p["chunks"]],
        ]
        keys += [
            k for k in manifest.get("cleanup_keys", []) if bundles.object_id_of(k) in fresh_ids
        ]
        cleanup_keys(bundles.store, keys, strict=True)
        cleanup_keys(bundles.store, [stage_ref.manifest_key], strict=True)
