"""Rows of an encoded object column, read by index: only those rows' bytes move.

An object-dtype ``non_tensor_batch`` column is stored as payload members (offsets, data,
shapes, nulls, ...; :mod:`structured_codecs`, :mod:`structured_recursive`). Reading rows
``[r0, r1, ...]`` of it, as the published 0.3.13 module does:

- per-row members (``nulls``, ``shapes``, ``ndims``, ``ndarray`` data, the recursive
  ``missing`` / row-mask / length members) are read row by row;
- of an ``offsets`` member only the boundaries ``r`` and ``r + 1`` of each row are read,
  and the rows' spans of the ``data`` member are then gathered (``media_list_ragged``: the
  items' spans, through ``row_offsets`` then ``byte_offsets``), with offsets rebuilt from 0;
- ``ragged_tensor_dict`` reads each key like a ``ragged_tensor`` column, and
  ``structured_recursive`` each node and leaf, the same way.

Every read is a list of byte ranges of a member's payload
(:func:`structured_ranges.read_ranges_into`): over our store or the published one only
those ranges move (``get_into_ranges``), consecutive rows making one range. The payloads
are then decoded by the same :func:`structured_recursive.decode_column` as a whole read,
with the per-row metadata (``media_encodings``, and the ``ndarray_rows`` marks of a
``mixed`` typed column, which the published module leaves unselected) cut to the rows, so
the values equal the whole column's rows.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mooncake_core.compat.structured_bundle import decode_json, field_specs
from mooncake_core.compat.structured_recursive import decode_column
from mooncake_core.compat.structured_types import RemoteBundleRef

__all__ = ["read_encoded_rows"]

_BYTES_CODECS = ("media_bytes", "bytes_ragged", "utf8_ragged", "msgpack_ragged", "json_ragged")
Payload = dict[str, Any]


class _Stage:
    """The members of one stage bundle, read by rows."""

    def __init__(self, transfer: Any, stage_ref: RemoteBundleRef) -> None:
        self.bundles = transfer._bundles
        self.manifest = self.bundles.resolve(stage_ref)
        meta = decode_json(self.bundles.read_payload(self.manifest["meta"]), "structured metadata")
        self.specs = field_specs(meta)

    def _ndarray_spec(self, member: str) -> tuple[np.dtype[Any], list[int]]:
        spec = self.specs.get(member, {"encoding": "bytes"})
        dtype, shape = spec.get("dtype"), spec.get("shape")
        if spec.get("encoding") != "ndarray" or not isinstance(dtype, str):
            raise ValueError(f"structured non-tensor payload {member} is missing dtype")
        if not isinstance(shape, list) or not shape:
            raise ValueError(f"structured ndarray field {member} is missing dtype or shape")
        return np.dtype(dtype), [int(d) for d in shape]

    def rows(self, member: str, rows: Sequence[int]) -> np.ndarray[Any, Any]:
        """Rows ``rows`` (axis 0) of an ndarray member."""
        dtype, shape = self._ndarray_spec(member)
        out = np.empty((len(rows), *shape[1:]), dtype=dtype)
        width = out.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        if width and len(rows):
            self.bundles.read_ranges_into(
                self.manifest["buffers"][member],
                out.view(np.uint8).reshape(-1),
                [(int(r) * width, i * width, width) for i, r in enumerate(rows)],
            )
        return out

    def spans(
        self, member: str, rows: Sequence[int]
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """``(begins, ends)`` of each row of an offsets member: its boundaries ``r`` and
        ``r + 1``, each read once."""
        at = np.asarray(rows, dtype=np.int64)
        if at.size == 0:
            empty = self.rows(member, [])
            return empty, empty
        bounds = np.unique(np.concatenate([at, at + 1]))
        values = self.rows(member, bounds.tolist())
        pos = np.searchsorted(bounds, at)
        return values[pos], values[pos + 1]

    def gather(
        self, member: str, begins: Any, ends: Any, unit: int
    ) -> tuple[Any, np.ndarray[Any, Any]]:
        """The spans ``[begin, end)`` (in units of ``unit`` bytes) of a member, one after
        the other, and their offsets from 0 (in units)."""
        counts = np.asarray(ends, dtype=np.int64) - np.asarray(begins, dtype=np.int64)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        spec = self.specs.get(member, {"encoding": "bytes"})
        total = int(offsets[-1]) * unit
        if spec.get("encoding") == "ndarray":
            data: Any = np.empty(int(offsets[-1]), dtype=np.dtype(spec["dtype"]))
            dest = data.view(np.uint8).reshape(-1)
        else:
            data = dest = bytearray(total)
        ranges = [
            (int(b) * unit, int(o) * unit, int(n) * unit)
            for b, o, n in zip(begins, offsets[:-1], counts, strict=True)
            if n
        ]
        if ranges:
            self.bundles.read_ranges_into(self.manifest["buffers"][member], dest, ranges)
        return (bytes(data) if isinstance(data, bytearray) else data), offsets


def _unit(st: _Stage, member: str) -> int:
    spec = st.specs.get(member, {})
    if spec.get("encoding") != "ndarray" or not isinstance(spec.get("dtype"), str):
        raise ValueError(f"structured non-tensor payload {member} is missing dtype")
    return int(np.dtype(spec["dtype"]).itemsize)


def _cut(meta: dict[str, Any], name: str, index: Sequence[int]) -> None:
    values = meta.get(name)
    if isinstance(values, list):
        meta[name] = [values[int(i)] for i in index]


def _payload_rows(
    st: _Stage, codec: str, meta: dict[str, Any], members: Mapping[str, str], rows: Sequence[int]
) -> tuple[Payload, dict[str, Any]]:
    """The payloads (by payload name) of rows ``rows`` of a column, and its metadata cut to
    them; ``members`` maps payload names to stored member names."""
    if codec == "structured_recursive":
        meta = copy.deepcopy(meta)
        out: Payload = {}
        for node in meta.get("nodes", []):
            for k in ("missing_payload", "row_mask_payload", "lengths_payload"):
                if node.get(k) is not None:
                    out[node[k]] = st.rows(members[node[k]], rows)
        for leaf in meta.get("leaves", []):
            local = leaf["payload_members"]
            sub, leaf["metadata"] = _payload_rows(
                st,
                leaf["codec"],
                dict(leaf.get("metadata") or {}),
                {n: members[g] for n, g in local.items() if n != "missing"},
                rows,
            )
            out.update({local[n]: v for n, v in sub.items()})
            out[local["missing"]] = st.rows(members[local["missing"]], rows)
        return out, meta
    if codec == "ragged_tensor_dict":
        out = {"null_mask": st.rows(members["null_mask"], rows)}
        key_codecs = dict(meta.get("key_codecs") or {})
        for key in meta.get("keys", []):
            sub, key_codecs[key] = _payload_rows(
                st,
                "ragged_tensor",
                dict(key_codecs.get(key) or {}),
                {n[len(key) + 1 :]: m for n, m in members.items() if n.startswith(f"{key}.")},
                rows,
            )
            out.update({f"{key}.{n}": v for n, v in sub.items()})
        return out, dict(meta, key_codecs=key_codecs)
    if codec == "ndarray":
        return {
            "data": st.rows(members["data"], rows),
            "nulls": st.rows(members["nulls"], rows),
        }, meta
    if codec in ("ragged_tensor", "typed_ragged"):
        begins, ends = st.spans(members["offsets"], rows)
        data, offsets = st.gather(members["data"], begins, ends, _unit(st, members["data"]))
        _cut(meta, "ndarray_rows", rows)
        return {
            "data": data,
            "offsets": offsets,
            "shapes": st.rows(members["shapes"], rows),
            "ndims": st.rows(members["ndims"], rows),
            "nulls": st.rows(members["nulls"], rows),
        }, meta
    if codec in _BYTES_CODECS:
        begins, ends = st.spans(members["offsets"], rows)
        data, offsets = st.gather(members["data"], begins, ends, 1)
        _cut(meta, "media_encodings", rows)
        return {"data": data, "offsets": offsets, "nulls": st.rows(members["nulls"], rows)}, meta
    if codec == "media_list_ragged":
        first, last = st.spans(members["row_offsets"], rows)
        items = [i for b, e in zip(first, last, strict=True) for i in range(int(b), int(e))]
        begins, ends = st.spans(members["byte_offsets"], items)
        data, byte_offsets = st.gather(members["data"], begins, ends, 1)
        row_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(np.asarray(last, dtype=np.int64) - first, out=row_offsets[1:])
        _cut(meta, "media_encodings", items)
        return {
            "data": data,
            "row_offsets": row_offsets,
            "byte_offsets": byte_offsets,
            "nulls": st.rows(members["nulls"], rows),
        }, meta
    raise ValueError(f"unknown structured non-tensor codec: {codec}")


def read_encoded_rows(
    transfer: Any,
    stage_ref: RemoteBundleRef,
    encoded: Mapping[str, Any],
    rows: Sequence[int],
    stages: dict[str, Any] | None = None,
) -> list[Any]:
    """Rows ``rows`` (non-negative, any order, repeats allowed) of the encoded column
    ``encoded`` (its ``encoded_non_tensor`` entry) stored in the stage ``stage_ref``.
    ``stages`` (a dict the caller keeps for one read) holds each stage's manifest and
    metadata once read, so the columns of one stage read them once."""
    cache = {} if stages is None else stages
    stage = cache.get(stage_ref.manifest_key)
    if stage is None:
        stage = cache[stage_ref.manifest_key] = _Stage(transfer, stage_ref)
    codec = str(encoded["codec"])
    payload, meta = _payload_rows(
        stage,
        codec,
        dict(encoded.get("metadata") or {}),
        encoded["payload_members"],
        list(rows),
    )
    return decode_column({"codec": codec, "metadata": meta}, payload, len(rows))
