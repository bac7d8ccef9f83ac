"""DataProto sections and flat dicts for ``mooncake.structured_object_store``.

Splits a DataProto-like object into ``batch`` / ``non_tensor_batch`` / ``meta_info``, and a
flat dict into those sections by row count (as the published 0.3.13 module does), and joins
them back. Used by :mod:`mooncake_core.compat.structured_dataproto`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mooncake_core.compat.structured_types import FieldSchema

__all__ = [
    "as_dict",
    "batch_size",
    "check_schema_sections",
    "envelope_to_flat_dict",
    "flat_dict_to_envelope",
    "is_sequence",
    "schema_section",
    "split_sections",
]

_SECTIONS = frozenset({"batch", "non_tensor_batch", "meta_info"})


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


# ---------------------------------------------------------------- sections and schemas
def as_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    items = getattr(value, "items", None)
    if callable(items):
        return dict(items())
    raise TypeError(f"expected mapping-like value, got {type(value).__name__}")


def _is_envelope(data: Mapping[str, Any]) -> bool:
    if not data or not set(data) <= _SECTIONS:
        return False
    return all(
        v is None or isinstance(v, Mapping) or callable(getattr(v, "items", None))
        for v in data.values()
    )


def split_sections(data: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(batch, non_tensor_batch, meta_info) of a DataProto-like object or envelope dict; a
    plain mapping is all batch."""
    if isinstance(data, Mapping):
        if _is_envelope(data):
            return (
                as_dict(data.get("batch")),
                as_dict(data.get("non_tensor_batch")),
                as_dict(data.get("meta_info")),
            )
        return dict(data), {}, {}
    return (
        as_dict(getattr(data, "batch", None)),
        as_dict(getattr(data, "non_tensor_batch", None)),
        as_dict(getattr(data, "meta_info", None)),
    )


def schema_section(name: str, schema: FieldSchema) -> str | None:
    """The section a schema pins its field to, or None."""
    section = schema.metadata.get("section")
    if section is None:
        return None
    if section not in _SECTIONS:
        raise ValueError(
            f"FieldSchema for {name!r} metadata['section'] must be one of {sorted(_SECTIONS)}"
        )
    return str(section)


def _schema_dtype(schema: FieldSchema) -> np.dtype[Any] | None:
    name = schema.metadata.get("dtype")
    if name is None:
        return None
    try:
        dtype: np.dtype[Any] = np.dtype(name)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid FieldSchema metadata['dtype']: {name!r}") from exc
    if dtype.kind not in "biufc":
        raise ValueError(f"FieldSchema metadata['dtype'] must be numeric or bool, got {dtype}")
    return dtype


def check_schema_sections(
    sections: Mapping[str, Mapping[str, Any]], schemas: Mapping[str, FieldSchema] | None
) -> None:
    if not schemas:
        return
    where: dict[str, set[str]] = {}
    for section, fields in sections.items():
        for name in fields:
            where.setdefault(name, set()).add(section)
    for name, schema in schemas.items():
        declared = schema_section(name, schema)
        actual = where.get(name)
        if declared is None or not actual or declared in actual:
            continue
        text = ", ".join(repr(s) for s in sorted(actual))
        raise ValueError(
            f"FieldSchema for {name!r} declares section {declared!r}, but data contains it in"
            f" {text}"
        )


def batch_size(batch: Mapping[str, Any], non_tensor: Mapping[str, Any]) -> int:
    sizes = {len(v) for section in (batch, non_tensor) for v in section.values()}
    if not sizes:
        return 0
    if len(sizes) != 1:
        raise ValueError(f"DataProto fields have inconsistent batch sizes: {sorted(sizes)}")
    return sizes.pop()


# ---------------------------------------------------------------- flat dicts
def is_sequence(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _dense(value: Any) -> bool:
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return bool(value.ndim > 0)
    return isinstance(value, np.ndarray) and value.dtype != object and value.ndim > 0


def _row_aligned_dense(value: Any, rows: int) -> bool:
    if rows == 0:
        return False
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return bool(value.shape[:1] == (rows,))
    return isinstance(value, np.ndarray) and value.dtype != object and value.shape[:1] == (rows,)


def _auto_rows(data: Mapping[str, Any], exclude: set[str]) -> int:
    dense = {len(v) for k, v in data.items() if k not in exclude and _dense(v)}
    if len(dense) > 1:
        raise ValueError(f"flat dict dense fields have ambiguous batch sizes: {sorted(dense)}")
    if dense:
        return dense.pop()
    sizes = {
        len(v)
        for k, v in data.items()
        if k not in exclude and ((isinstance(v, np.ndarray) and v.ndim > 0) or is_sequence(v))
    }
    if not sizes:
        return 0
    if len(sizes) != 1:
        raise ValueError(
            f"flat dict fields have ambiguous batch sizes: {sorted(sizes)}; "
            "pass FieldSchema metadata['section'] for list-valued metadata fields"
        )
    return sizes.pop()


def _flat_non_tensor(name: str, value: Any, rows: int, schema: FieldSchema | None) -> Any:
    if isinstance(value, np.ndarray):
        if len(value) != rows:
            raise ValueError(
                f"flat dict non_tensor_batch field {name!r} has batch size {len(value)},"
                f" expected {rows}"
            )
        dtype = _schema_dtype(schema) if schema is not None else None
        if (
            schema is not None
            and schema.codec == "ndarray"
            and dtype is not None
            and (value.dtype != object or all(v is not None for v in value))
        ):
            return np.asarray(value, dtype=dtype)
        return value
    if is_sequence(value):
        if len(value) != rows:
            raise ValueError(
                f"flat dict non_tensor_batch field {name!r} has batch size {len(value)},"
                f" expected {rows}"
            )
        out = np.empty(rows, dtype=object)
        out[:] = list(value)
        return out
    raise TypeError(
        f"flat dict non_tensor_batch field {name!r} must be an ndarray or non-string sequence"
    )


def flat_dict_to_envelope(
    data: Mapping[str, Any], schemas: Mapping[str, FieldSchema] | None = None
) -> dict[str, Any]:
    """Split a flat dict: row-aligned dense values are batch, row-aligned sequences are
    non_tensor_batch, the rest is meta_info (a schema's ``section`` overrides)."""
    if not isinstance(data, Mapping):
        raise TypeError("flat dict payload must be a mapping")
    schemas = schemas or {}
    sizes = set()
    for name, schema in schemas.items():
        if name in data and schema_section(name, schema) in {"batch", "non_tensor_batch"}:
            try:
                sizes.add(len(data[name]))
            except TypeError as error:
                raise ValueError(f"flat dict row-aligned field {name!r} must be sized") from error
    if len(sizes) > 1:
        raise ValueError(f"flat dict fields have inconsistent batch sizes: {sorted(sizes)}")
    schema_rows = sizes.pop() if sizes else 0
    rows = schema_rows
    if rows == 0:
        meta = {n for n, s in schemas.items() if n in data and schema_section(n, s) == "meta_info"}
        rows = _auto_rows(data, meta)
    batch: dict[str, Any] = {}
    non_tensor: dict[str, Any] = {}
    meta_info: dict[str, Any] = {}
    for key, value in data.items():
        hint = schemas.get(key)
        section = None if hint is None else schema_section(key, hint)
        if section is None:
            if _row_aligned_dense(value, rows):
                batch[key] = value
            elif schema_rows == 0 and is_sequence(value) and len(value) == rows:
                non_tensor[key] = _flat_non_tensor(key, value, rows, hint)
            else:
                meta_info[key] = value
        elif section == "batch":
            batch[key] = value
        elif section == "non_tensor_batch":
            non_tensor[key] = _flat_non_tensor(key, value, rows, hint)
        else:
            meta_info[key] = value
    return {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": meta_info}


def envelope_to_flat_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    """One dict of meta_info, batch and non_tensor_batch (object arrays as lists)."""
    meta, batch = as_dict(data.get("meta_info")), as_dict(data.get("batch"))
    non_tensor = as_dict(data.get("non_tensor_batch"))
    overlap = (
        (set(meta) & set(batch)) | (set(meta) & set(non_tensor)) | (set(batch) & set(non_tensor))
    )
    if overlap:
        raise ValueError(f"Duplicate keys found across DataProto sections: {sorted(overlap)}")
    out = dict(meta)
    out.update(batch)
    for name, value in non_tensor.items():
        obj = isinstance(value, np.ndarray) and value.dtype == object
        out[name] = value.tolist() if obj else value
    return out
