"""The codecs of object-dtype DataProto columns (published 0.3.13 wire format).

Every codec turns a column (one value per row) into named payload buffers, each stored as
one member ``non_tensor_batch.<field>.<payload>`` of the stage's structured object, plus
JSON metadata kept in the DataProto ref (``encoded_non_tensor``):

- ``typed_ragged`` / ``ragged_tensor``: ``data`` (all rows' elements, one dtype),
  ``offsets`` (int64, rows + 1), ``shapes`` (int64, rows x max ndim), ``ndims`` (int16),
  ``nulls`` (bool);
- ``ndarray``: ``data`` (one element per row), ``nulls``;
- ``bytes_ragged`` / ``media_bytes`` / ``utf8_ragged`` / ``json_ragged`` /
  ``msgpack_ragged``: ``data`` (the rows' bytes back to back), ``offsets``, ``nulls``;
- ``media_list_ragged``: ``data``, ``row_offsets``, ``byte_offsets``, ``nulls``;
- ``ragged_tensor_dict``: ``null_mask`` and ``<key>.<ragged_tensor payload>`` per key;
- ``structured_recursive``: per node ``node.<i>.missing`` / ``.row_mask`` / ``.lengths``
  and per leaf ``leaf.<i>.<payload>`` plus ``leaf.<i>.missing``.

Payloads here are numpy arrays (stored with the ``ndarray`` encoding) or ``bytes``
(``bytes`` encoding): the same stored bytes as the published module's multi-buffer and
direct-copy payloads, which it also stores as one contiguous run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from mooncake_core.compat.structured_infer import (
    CodecDecision,
    is_pil_image,
    loaded_torch,
    torch_module,
)
from mooncake_core.compat.structured_types import FieldSchema

__all__ = ["Encoded", "decode_leaf", "encode_leaf", "encode_leaf_schema"]

TYPED_RAGGED_DEFAULT_DTYPE = "int64"
RAGGED_TENSOR_DEFAULT_DTYPE = "torch.float32"
FALLBACK_ERRORS = (TypeError, ValueError, OverflowError, RuntimeError, RecursionError)
_RAGGED_PAYLOAD_NAMES = frozenset({"data", "offsets", "shapes", "ndims", "nulls"})
Payload = dict[str, Any]
Meta = dict[str, Any]


@dataclass
class Encoded:
    """One encoded column: its codec, row count, payload buffers and metadata."""

    codec: str
    rows: int
    payload: Payload
    metadata: Meta


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


# ---------------------------------------------------------------- typed ragged
def _contiguous(value: Any, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    if isinstance(value, np.ndarray) and value.dtype == dtype and value.flags.c_contiguous:
        return value
    return np.ascontiguousarray(np.asarray(value, dtype=dtype))


def _flat_data(arrays: list[np.ndarray[Any, Any]], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    if not arrays:
        return np.empty(0, dtype=dtype)
    flat: np.ndarray[Any, Any] = np.concatenate([a.reshape(-1) for a in arrays])
    return flat.astype(dtype, copy=False)


def _ragged_meta(dtype: np.dtype[Any], max_ndim: int, row_format: str, rows: Any) -> Meta:
    return {
        "dtype": str(dtype),
        "max_ndim": int(max_ndim),
        "shape_policy": "ragged",
        "row_format": row_format,
        "ndarray_rows": rows,
    }


def _regular_ndarray_rows(values: list[Any], dtype: np.dtype[Any]) -> tuple[Payload, Meta] | None:
    """Rows that are ndarrays of one dtype and one shape (contiguous)."""
    if len(values) < 2:
        return None
    first = values[0]
    for v in values:
        if (
            not isinstance(v, np.ndarray)
            or v.dtype != dtype
            or not v.flags.c_contiguous
            or v.shape != first.shape
        ):
            return None
    rows, width = len(values), int(first.size)
    ndim = int(first.ndim)
    if ndim == 0:
        shapes = np.zeros((rows, 1), dtype=np.int64)
        ndims = np.zeros(rows, dtype=np.int16)
    else:
        shapes = np.empty((rows, ndim), dtype=np.int64)
        shapes[:] = first.shape
        ndims = np.full(rows, ndim, dtype=np.int16)
    payload = {
        "data": _flat_data(values, dtype),
        "offsets": np.arange(rows + 1, dtype=np.int64) * width,
        "shapes": shapes,
        "ndims": ndims,
        "nulls": np.zeros(rows, dtype=np.bool_),
    }
    meta = _ragged_meta(dtype, ndim, "ndarray", None)
    meta["physical_layout"] = "contiguous_flat"
    return payload, meta


def _ndarray_rows(values: list[Any], dtype: np.dtype[Any]) -> tuple[Payload, Meta] | None:
    """Rows that are all ndarrays (or None): one flat buffer, shapes kept per row."""
    regular = _regular_ndarray_rows(values, dtype)
    if regular is not None:
        return regular
    rows = len(values)
    if rows == 0 or not all(v is None or isinstance(v, np.ndarray) for v in values):
        return None
    nulls = np.asarray([v is None for v in values], dtype=np.bool_)
    arrays = [_contiguous(v, dtype) for v in values if v is not None]
    lengths = np.zeros(rows, dtype=np.int64)
    lengths[~nulls] = [a.size for a in arrays]
    scalars = [a.ndim == 0 for a in arrays]
    tails = {(a.ndim, a.shape[1:]) for a in arrays if a.ndim > 0}
    same_tail = not (any(scalars) and not all(scalars)) and len(tails) <= 1
    tail: tuple[int, ...] | None = next(iter(tails))[1] if tails else None
    if same_tail and tail is not None and any(d == 0 for d in tail):
        same_tail = False
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if not arrays or all(scalars):
        max_ndim = 0
    elif same_tail:
        max_ndim = int(next(iter(tails))[0] or 1)
    else:
        max_ndim = max(a.ndim for a in arrays)
    ndims = np.zeros(rows, dtype=np.int16)
    if max_ndim == 0:
        shapes = np.zeros((rows, 1), dtype=np.int64)
    elif same_tail and tail is not None:
        shapes = np.zeros((rows, max_ndim), dtype=np.int64)
        tail_elems = int(np.prod(tail, dtype=np.int64)) if tail else 1
        shapes[:, 0] = lengths // tail_elems
        if max_ndim > 1:
            shapes[:, 1:] = tail
        ndims[~nulls] = max_ndim
    else:
        shapes = np.zeros((rows, max(max_ndim, 1)), dtype=np.int64)
        for row, a in zip(np.flatnonzero(~nulls), arrays, strict=True):
            ndims[row] = a.ndim
            if a.ndim > 0:
                shapes[row, : a.ndim] = a.shape
    payload = {
        "data": _flat_data(arrays, dtype),
        "offsets": offsets,
        "shapes": shapes,
        "ndims": ndims,
        "nulls": nulls,
    }
    meta = _ragged_meta(dtype, max_ndim, "ndarray", None)
    meta["physical_layout"] = "contiguous_flat"
    return payload, meta


def encode_typed_ragged(values: list[Any], dtype_hint: Any = None) -> tuple[Payload, Meta]:
    if dtype_hint is None:
        sources = [np.asarray(v) for v in values if v is not None]
        dtype = np.result_type(*sources) if sources else np.dtype(TYPED_RAGGED_DEFAULT_DTYPE)
    else:
        dtype = np.dtype(dtype_hint)
    if dtype.hasobject:
        raise ValueError("typed_ragged codec requires non-object dtype")
    fast = _ndarray_rows(values, dtype)
    if fast is not None:
        return fast
    arrays = [np.asarray([], dtype=dtype) if v is None else _contiguous(v, dtype) for v in values]
    max_ndim = max((a.ndim for a in arrays), default=0)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.size for a in arrays], dtype=np.int64)
    shapes = np.zeros((len(arrays), max(max_ndim, 1)), dtype=np.int64)
    for row, a in enumerate(arrays):
        if a.ndim > 0:
            shapes[row, : a.ndim] = a.shape
    is_array = [v is not None and isinstance(v, np.ndarray) for v in values]
    if all(v is None or a for v, a in zip(values, is_array, strict=True)):
        row_format = "ndarray"
    elif any(is_array):
        row_format = "mixed"
    else:
        row_format = "list"
    payload = {
        "data": _flat_data(arrays, dtype),
        "offsets": offsets,
        "shapes": shapes,
        "ndims": np.asarray([a.ndim for a in arrays], dtype=np.int16),
        "nulls": np.asarray([v is None for v in values], dtype=np.bool_),
    }
    return payload, _ragged_meta(
        dtype, max_ndim, row_format, is_array if row_format == "mixed" else None
    )


def _uniform_width(offsets: Any, rows: int) -> int | None:
    if rows <= 0 or int(offsets[0]) != 0:
        return None
    total = int(offsets[-1])
    if total < 0 or total % rows != 0:
        return None
    width = total // rows
    return width if bool(np.all(offsets[1:] - offsets[:-1] == width)) else None


def _fast_ndarray_rows(data: Any, p: Payload, rows: int, meta: Mapping[str, Any]) -> Any:
    """The published fast path for ``contiguous_flat`` ndarray rows (views into data)."""
    offsets, shapes, ndims, nulls = p["offsets"], p["shapes"], p["ndims"], p["nulls"]
    max_ndim = int(meta.get("max_ndim", 0))
    if max_ndim == 1:
        width = None if bool(nulls.any()) else _uniform_width(offsets, rows)
        if width is not None:
            return list(data.reshape((rows, width)))
        return [
            None if bool(nulls[r]) else data[int(offsets[r]) : int(offsets[r + 1])]
            for r in range(rows)
        ]
    if max_ndim <= 1 or rows == 0:
        return None
    present = np.flatnonzero(~nulls)
    if present.size == 0:
        return [None] * rows
    tail = tuple(int(v) for v in shapes[int(present[0]), 1:max_ndim])
    if any(d == 0 for d in tail):
        return None
    for r in present:
        if int(ndims[r]) != max_ndim or tuple(int(v) for v in shapes[r, 1:max_ndim]) != tail:
            return None
    tail_elems = int(np.prod(tail, dtype=np.int64)) if tail else 1
    if tail_elems <= 0 or int(offsets[-1]) % tail_elems != 0:
        return None
    flat = data.reshape((-1, *tail))
    first = offsets // tail_elems
    if not bool(nulls.any()):
        width = _uniform_width(first, rows)
        if width is not None:
            return list(flat.reshape((rows, width, *tail)))
    return [
        None if bool(nulls[r]) else flat[int(first[r]) : int(first[r + 1])] for r in range(rows)
    ]


def decode_typed_ragged(p: Payload, rows: int, meta: Mapping[str, Any] | None) -> list[Any]:
    meta = meta or {}
    dtype = np.dtype(meta.get("dtype", TYPED_RAGGED_DEFAULT_DTYPE))
    raw = p["data"]
    torch = loaded_torch()
    if torch is not None and isinstance(raw, torch.Tensor):
        data = raw.numpy()
    elif isinstance(raw, (bytes, bytearray, memoryview)):
        data = np.frombuffer(raw, dtype=dtype)
    elif isinstance(raw, np.ndarray):
        data = raw if raw.dtype == dtype else np.frombuffer(raw, dtype=dtype)
    else:
        data = np.asarray(raw, dtype=dtype)
    row_format = meta.get("row_format")
    if row_format == "ndarray" and meta.get("physical_layout") == "contiguous_flat":
        fast = _fast_ndarray_rows(data, p, rows, meta)
        if fast is not None:
            return list(fast)
    offsets, shapes, ndims, nulls = p["offsets"], p["shapes"], p["ndims"], p["nulls"]
    marks = meta.get("ndarray_rows") or []
    out: list[Any] = []
    for r in range(rows):
        if bool(nulls[r]):
            out.append(None)
            continue
        shape = tuple(int(v) for v in shapes[r, : int(ndims[r])].tolist())
        array = data[int(offsets[r]) : int(offsets[r + 1])].reshape(shape)
        keep = row_format == "ndarray" or (row_format == "mixed" and bool(marks[r]))
        out.append(array if keep else array.tolist())
    return out


# ---------------------------------------------------------------- tensors
def _parse_torch_dtype(name: str) -> Any:
    torch = torch_module()
    dtype = None if torch is None else getattr(torch, name.removeprefix("torch."), None)
    if torch is None or not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype: {name}")
    return dtype


def _numpy_of_torch(name: str) -> np.dtype[Any]:
    torch = torch_module()
    dtype = _parse_torch_dtype(name)
    if dtype == torch.bfloat16:
        raise ValueError("torch.bfloat16 has no value-preserving numpy dtype")
    out: np.dtype[Any] = np.dtype(torch.empty(0, dtype=dtype).numpy().dtype)
    return out


def encode_ragged_tensor(values: list[Any]) -> tuple[Payload, Meta]:
    torch = torch_module()
    if torch is None:
        raise RuntimeError("torch is required to encode ragged tensor fields")
    dtype = None
    converted: list[Any] = []
    for v in values:
        if v is None:
            converted.append(None)
            continue
        if isinstance(v, np.ndarray):
            if v.dtype == object:
                raise ValueError("ragged tensor codec requires numeric ndarray values")
            tensor = torch.as_tensor(v if v.flags.writeable else v.copy())
        else:
            tensor = v.detach()
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            raise ValueError("ragged tensor codec does not support torch.bfloat16")
        dtype = tensor.dtype if dtype is None else dtype
        if tensor.dtype != dtype:
            raise ValueError(f"mixed tensor dtype: {dtype} vs {tensor.dtype}")
        converted.append(tensor.numpy())
    name = str(dtype) if dtype is not None else RAGGED_TENSOR_DEFAULT_DTYPE
    payload, meta = encode_typed_ragged(converted, _numpy_of_torch(name))
    meta["dtype"] = name
    return payload, meta


def decode_ragged_tensor(p: Payload, rows: int, meta: Mapping[str, Any] | None) -> list[Any]:
    torch = torch_module()
    if torch is None:
        raise RuntimeError("torch is required to decode ragged tensor fields")
    name = (meta or {}).get("dtype", RAGGED_TENSOR_DEFAULT_DTYPE)
    patched = dict(meta or {})
    patched["dtype"] = str(_numpy_of_torch(name))
    dtype = _parse_torch_dtype(name)
    return [
        None
        if v is None
        else torch.from_numpy(v).to(dtype)
        if isinstance(v, np.ndarray)
        else torch.as_tensor(v, dtype=dtype)
        for v in decode_typed_ragged(p, rows, patched)
    ]


def _dict_keys(keys: Any) -> list[str]:
    out: list[str] = []
    for key in keys.keys() if isinstance(keys, Mapping) else keys:
        if not isinstance(key, str):
            raise TypeError("ragged_tensor_dict keys must be strings")
        if not key:
            raise ValueError("ragged_tensor_dict keys must not be empty")
        if any(sep in key for sep in (".", "/", "\\")):
            raise ValueError("ragged_tensor_dict keys must not contain '.', '/', or '\\'")
        if key in out:
            raise ValueError(f"ragged_tensor_dict keys contain duplicate key {key!r}")
        out.append(key)
    return out


def encode_ragged_tensor_dict(values: list[Any], schema: FieldSchema) -> Encoded:
    """Rows of ``{key: tensor}`` (or None): one ``ragged_tensor`` payload per key."""
    declared = schema.metadata.get("keys")
    keys = None if declared is None else _dict_keys(declared)
    seen: set[str] = set()
    for row, item in enumerate(values):
        if item is None:
            continue
        if not isinstance(item, Mapping):
            raise TypeError(
                "ragged_tensor_dict rows must be mappings or None; "
                f"row {row} is {type(item).__name__}"
            )
        nones = sorted(k for k, v in item.items() if v is None)
        if nones:
            raise TypeError(
                "ragged_tensor_dict rows cannot contain explicit None tensor values; "
                f"row {row} has explicit None for {nones}"
            )
        row_keys = _dict_keys(item.keys())
        if keys is None:
            seen.update(row_keys)
            continue
        extra = sorted(set(row_keys) - set(keys))
        if extra:
            raise ValueError(
                "ragged_tensor_dict rows contain keys not declared in FieldSchema"
                f" metadata['keys']; row {row} has keys not declared: {extra}"
            )
    if keys is None:
        keys = _dict_keys(sorted(seen))
    if keys and torch_module() is None:
        raise RuntimeError("torch is required to encode ragged_tensor_dict fields")
    payload: Payload = {"null_mask": np.asarray([v is None for v in values], dtype=np.bool_)}
    codecs: dict[str, Any] = {}
    for key in keys:
        try:
            sub, sub_meta = encode_ragged_tensor(
                [None if v is None else v.get(key) for v in values]
            )
        except FALLBACK_ERRORS as exc:
            raise ValueError(f"failed to encode ragged_tensor_dict key {key!r}") from exc
        payload.update({f"{key}.{n}": a for n, a in sub.items()})
        codecs[key] = sub_meta
    return Encoded("ragged_tensor_dict", len(values), payload, {"keys": keys, "key_codecs": codecs})


def decode_ragged_tensor_dict(p: Payload, rows: int, meta: Mapping[str, Any]) -> list[Any]:
    mask = p["null_mask"]
    if isinstance(mask, (bytes, bytearray)):
        mask = np.frombuffer(mask, dtype=np.bool_)
    keys = meta.get("keys", [])
    columns = {}
    for key in keys:
        sub = {n[len(key) + 1 :]: a for n, a in p.items() if n.startswith(f"{key}.")}
        missing = sorted(_RAGGED_PAYLOAD_NAMES - set(sub))
        if missing:
            raise ValueError(
                f"ragged_tensor_dict payload for key {key!r} is missing payloads: {missing}"
            )
        columns[key] = decode_ragged_tensor(sub, rows, meta.get("key_codecs", {}).get(key))
    return [
        None if bool(mask[r]) else {k: columns[k][r] for k in keys if columns[k][r] is not None}
        for r in range(rows)
    ]


# ---------------------------------------------------------------- scalars and bytes
def encode_numeric(values: list[Any], dtype_name: str) -> tuple[Payload, Meta]:
    dtype = np.dtype(dtype_name)
    fill = False if dtype == np.dtype(np.bool_) else 0
    data = np.asarray([fill if v is None else v for v in values], dtype=dtype)
    nulls = np.asarray([v is None for v in values], dtype=np.bool_)
    return {"data": data, "nulls": nulls}, {"dtype": str(data.dtype), "shape": list(data.shape)}


def decode_numeric(p: Payload) -> list[Any]:
    data, nulls = p["data"], p["nulls"]
    if not bool(nulls.any()):
        return list(data.tolist())
    values = data.astype(object)
    values[nulls] = None
    return list(values.tolist())


def _media(value: Any) -> tuple[bytes, str | None, dict[str, Any]]:
    if value is None:
        return b"", None, {"kind": "null"}
    if is_pil_image(value):
        image = value.convert(value.mode) if getattr(value, "readonly", False) else value
        info = {
            "kind": "pil_raw",
            "mode": image.mode,
            "size": list(image.size),
            "format": getattr(value, "format", None),
        }
        return image.tobytes(), "image/raw", info
    return bytes(value), None, {"kind": "bytes"}


def _from_media(data: memoryview, encoding: Mapping[str, Any] | None) -> Any:
    if not encoding or encoding.get("kind") != "pil_raw":
        return bytes(data)
    try:
        from PIL import Image
    except ImportError:
        return bytes(data)
    mode = encoding["mode"]
    image = Image.frombuffer(mode, tuple(encoding["size"]), bytes(data), "raw", mode, 0, 1)
    image.format = encoding.get("format")
    return image


def encode_bytes(values: list[Any]) -> tuple[Payload, Meta]:
    parts = [_media(v) for v in values]
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(d) for d, _, _ in parts], dtype=np.int64)
    meta: Meta = {}
    if any(e.get("kind") == "pil_raw" for _, _, e in parts):
        meta["media_encodings"] = [e for _, _, e in parts]
    types = sorted({t for _, t, _ in parts if t})
    if types:
        meta["media_types"] = types
        meta["encode_source"] = "raw_pixels_from_object"
    payload = {
        "data": b"".join(d for d, _, _ in parts),
        "offsets": offsets,
        "nulls": np.asarray([v is None for v in values], dtype=np.bool_),
    }
    return payload, meta


def decode_bytes(p: Payload, rows: int, meta: Mapping[str, Any] | None = None) -> list[Any]:
    data, offsets, nulls = memoryview(p["data"]), p["offsets"], p["nulls"]
    encodings = (meta or {}).get("media_encodings", [])
    return [
        None
        if bool(nulls[r])
        else _from_media(
            data[int(offsets[r]) : int(offsets[r + 1])],
            encodings[r] if r < len(encodings) else None,
        )
        for r in range(rows)
    ]


def encode_media_list(values: list[Any]) -> tuple[Payload, Meta]:
    row_offsets, byte_offsets, parts, types, encodings = [0], [0], [], [], []
    for value in values:
        items = [] if value is None else list(value)
        for item in items:
            data, media_type, encoding = _media(item)
            parts.append(data)
            types.append(media_type)
            encodings.append(encoding)
            byte_offsets.append(byte_offsets[-1] + len(data))
        row_offsets.append(row_offsets[-1] + len(items))
    meta: Meta = {"encode_source": "raw_pixels_from_object", "media_encodings": encodings}
    if any(types):
        meta["media_types"] = sorted({t for t in types if t})
    payload = {
        "data": b"".join(parts),
        "row_offsets": np.asarray(row_offsets, dtype=np.int64),
        "byte_offsets": np.asarray(byte_offsets, dtype=np.int64),
        "nulls": np.asarray([v is None for v in values], dtype=np.bool_),
    }
    return payload, meta


def decode_media_list(p: Payload, rows: int, meta: Mapping[str, Any] | None) -> list[Any]:
    data, rows_at, bytes_at = memoryview(p["data"]), p["row_offsets"], p["byte_offsets"]
    encodings = (meta or {}).get("media_encodings", [])
    out: list[Any] = []
    for r in range(rows):
        if bool(p["nulls"][r]):
            out.append(None)
            continue
        items = range(int(rows_at[r]), int(rows_at[r + 1]))
        out.append(
            [
                _from_media(
                    data[int(bytes_at[i]) : int(bytes_at[i + 1])],
                    encodings[i] if i < len(encodings) else None,
                )
                for i in items
            ]
        )
    return out


def encode_msgpack(path: str, values: list[Any]) -> tuple[Payload, Meta]:
    packer = msgpack.Packer(use_bin_type=True, strict_types=True)
    parts: list[bytes] = []
    try:
        for v in values:
            parts.append(b"" if v is None else packer.pack(v))
    except TypeError as exc:
        raise ValueError(
            f"unsupported structured non-tensor field {path}: msgpack codec cannot encode value"
        ) from exc
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(b) for b in parts], dtype=np.int64)
    nulls = np.asarray([v is None for v in values], dtype=np.bool_)
    return {"data": b"".join(parts), "offsets": offsets, "nulls": nulls}, {}


def decode_msgpack(p: Payload, rows: int) -> list[Any]:
    offsets, nulls = p["offsets"], p["nulls"]
    if len(offsets) != rows + 1:
        raise ValueError(f"msgpack_ragged offsets length {len(offsets)} does not match rows {rows}")
    if len(nulls) != rows:
        raise ValueError(f"msgpack_ragged nulls length {len(nulls)} does not match rows {rows}")
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(bytes(p["data"]))
    if rows == 0 or not bool(nulls.any()):
        values = list(unpacker)
        if len(values) != rows:
            raise ValueError(f"msgpack_ragged decoded {len(values)} rows, expected {rows}")
        return values
    present = iter(unpacker)
    return [None if bool(n) else next(present) for n in nulls]


# ---------------------------------------------------------------- leaves and schemas
def encode_leaf(values: list[Any], decision: CodecDecision) -> Encoded:
    """Inference path: encode one leaf column with the codec ``decision`` chose."""
    if not decision.accepted:
        raise ValueError(f"unsupported structured non-tensor field: {decision.reason}")
    codec = decision.codec
    if codec == "ragged_tensor":
        payload, meta = encode_ragged_tensor(values)
    elif codec == "typed_ragged":
        payload, meta = encode_typed_ragged(values)
    elif codec == "media_list_ragged":
        payload, meta = encode_media_list(values)
    elif codec == "ndarray":
        payload, meta = encode_numeric(values, decision.metadata["dtype"])
    elif codec in ("bytes_ragged", "media_bytes"):
        payload, meta = encode_bytes(values)
    elif codec == "utf8_ragged":
        payload, meta = encode_bytes([None if v is None else v.encode("utf-8") for v in values])
    elif codec == "msgpack_ragged":
        pack = msgpack.packb
        payload, meta = encode_bytes(
            [None if v is None else pack(v, use_bin_type=True, strict_types=True) for v in values]
        )
    elif codec == "json_ragged":
        payload, meta = encode_bytes([None if v is None else _json_bytes(v) for v in values])
    else:
        raise ValueError(f"unsupported structured non-tensor codec: {codec}")
    meta.update(
        {
            "schema_source": "inferred_from_runtime_values",
            "decision_reason": decision.reason,
            "normalized_type": decision.normalized_type,
            **decision.metadata,
        }
    )
    return Encoded(codec, len(values), payload, meta)


def _schema_dtype(schema: FieldSchema) -> np.dtype[Any] | None:
    name = schema.metadata.get("dtype")
    if name is None:
        return None
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid FieldSchema metadata['dtype']: {name!r}") from exc
    if dtype.kind not in "biufc":
        raise ValueError(f"FieldSchema metadata['dtype'] must be numeric or bool, got {dtype}")
    out: np.dtype[Any] = dtype
    return out


def encode_leaf_schema(path: str, values: list[Any], schema: FieldSchema) -> Encoded | None:
    """Encode a column with the codec a ``FieldSchema`` names (no inference); None for
    ``auto`` and for ``ndarray`` without a dtype (the caller falls back to inference)."""
    codec = schema.codec
    if codec == "auto":
        return None
    if codec == "ragged_tensor_dict":
        return encode_ragged_tensor_dict(values, schema)
    if codec == "ragged_tensor":
        payload, meta = encode_ragged_tensor(values)
    elif codec == "typed_ragged":
        payload, meta = encode_typed_ragged(values, _schema_dtype(schema))
    elif codec == "ndarray":
        dtype = _schema_dtype(schema)
        if dtype is None:
            return None
        payload, meta = encode_numeric(values, str(dtype))
    elif codec in ("bytes_ragged", "media_bytes"):
        payload, meta = encode_bytes(values)
    elif codec == "media_list_ragged":
        payload, meta = encode_media_list(values)
    elif codec == "utf8_ragged":
        payload, meta = encode_bytes([None if v is None else v.encode("utf-8") for v in values])
    elif codec == "msgpack_ragged":
        payload, meta = encode_msgpack(path, values)
    elif codec == "json_ragged":
        payload, meta = encode_bytes([None if v is None else _json_bytes(v) for v in values])
    else:
        raise ValueError(f"unsupported schema codec: {codec!r}")
    return Encoded(codec, len(values), payload, meta)


def decode_leaf(codec: str, p: Payload, rows: int, meta: Mapping[str, Any] | None) -> list[Any]:
    """The rows of one leaf column (any codec but the two composite ones)."""
    if codec == "ragged_tensor":
        return decode_ragged_tensor(p, rows, meta)
    if codec == "typed_ragged":
        return decode_typed_ragged(p, rows, meta)
    if codec == "media_list_ragged":
        return decode_media_list(p, rows, meta)
    if codec == "ndarray":
        return decode_numeric(p)
    if codec == "media_bytes":
        return decode_bytes(p, rows, meta)
    if codec == "bytes_ragged":
        return decode_bytes(p, rows)
    if codec == "utf8_ragged":
        return [None if v is None else v.decode("utf-8") for v in decode_bytes(p, rows)]
    if codec == "msgpack_ragged":
        return decode_msgpack(p, rows)
    if codec == "json_ragged":
        return [None if v is None else json.loads(v) for v in decode_bytes(p, rows)]
    raise ValueError(f"unknown structured non-tensor codec: {codec}")
