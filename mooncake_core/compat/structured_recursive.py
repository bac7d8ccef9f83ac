"""Encoding a whole object-dtype DataProto column (published 0.3.13 layout).

:func:`encode_inferred` (no schema) and :func:`encode_with_schema` choose between one
codec for the whole column (:mod:`structured_codecs`) and the ``structured_recursive``
layout: when :func:`~mooncake_core.compat.structured_infer.infer_structure` expands the
rows into dict / list nodes and some leaf holds arrays, tensors or bytes, every leaf is
stored with its own codec plus a ``missing`` mask, and every node with its ``missing``,
``row_mask`` and (lists) ``lengths`` buffers, so that the rows rebuild exactly (absent
keys stay absent, ``None`` stays ``None``). :func:`decode_column` reads any of them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mooncake_core.compat.structured_codecs import (
    FALLBACK_ERRORS,
    Encoded,
    Payload,
    decode_leaf,
    decode_ragged_tensor_dict,
    encode_leaf,
    encode_leaf_schema,
)
from mooncake_core.compat.structured_infer import (
    CodecDecision,
    InferredLeaf,
    InferredNode,
    choose_leaf_codec,
    escape_key,
    infer_structure,
    non_null,
)
from mooncake_core.compat.structured_types import MISSING, FieldSchema, _Missing

__all__ = ["decode_column", "encode_inferred", "encode_with_schema"]

_RECURSIVE_LEAF_CODECS = {"ragged_tensor", "bytes_ragged", "media_bytes", "media_list_ragged"}
_PLAIN_CODECS = {"msgpack_ragged", "json_ragged"}


def _path_tokens(path: str) -> list[str | int]:
    tokens: list[str | int] = []
    current: list[str] = []
    i = 0
    while i < len(path):
        char = path[i]
        if char == "\\" and i + 1 < len(path):
            current.append(path[i + 1])
            i += 2
            continue
        if char in ".[":
            if current:
                tokens.append("".join(current))
                current = []
            if char == "[":
                end = path.index("]", i)
                tokens.append(int(path[i + 1 : end]))
                i = end + 1
                continue
            i += 1
            continue
        current.append(char)
        i += 1
    if current:
        tokens.append("".join(current))
    return tokens


def _lookup(value: Any, root: str, target: str) -> Any:
    suffix = target[len(root) :].removeprefix(".")
    if not suffix:
        return value
    current = value
    for token in _path_tokens(suffix):
        if isinstance(current, _Missing):
            return MISSING
        if isinstance(token, str):
            if not isinstance(current, dict) or token not in current:
                return MISSING
        elif not isinstance(current, (list, tuple)) or token >= len(current):
            return MISSING
        current = current[token]
    return current


def _plain(value: Any) -> Any:
    """numpy values as Python ones, for the msgpack / JSON codecs."""
    if isinstance(value, np.ndarray):
        return _plain(value.tolist()) if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _wants_recursive(leaf: InferredLeaf, schema_leaves: bool) -> bool:
    decision = leaf.decision
    if decision.codec in _RECURSIVE_LEAF_CODECS:
        return True
    if decision.codec != "typed_ragged":
        return False
    if schema_leaves:
        return decision.metadata.get("recursive_source") == "ndarray"
    return any(isinstance(v, np.ndarray) for v in non_null(leaf.values))


def _encode_recursive(path: str, values: list[Any], schema_leaves: bool) -> Encoded | None:
    """The ``structured_recursive`` layout, or None when the column does not need it.

    ``schema_leaves``: the leaves go through the schema encoder with the inferred codec
    (the ``auto``-schema path) rather than the inference encoder (no schema); the two
    record different leaf metadata, as published."""
    leaves: list[InferredLeaf] = []
    nodes: list[InferredNode] = []
    infer_structure(path, values, leaves, nodes)
    if not nodes or not any(_wants_recursive(leaf, schema_leaves) for leaf in leaves):
        return None
    payload: Payload = {}
    node_specs: list[dict[str, Any]] = []
    for i, node in enumerate(nodes):
        spec: dict[str, Any] = {
            "id": i,
            "path": node.path,
            "node_type": node.node_type,
            "children": list(node.children),
        }
        payload[f"node.{i}.missing"] = np.asarray(
            [_lookup(v, path, node.path) is MISSING for v in values], dtype=np.bool_
        )
        spec["missing_payload"] = f"node.{i}.missing"
        if node.row_mask is not None:
            payload[f"node.{i}.row_mask"] = np.asarray(node.row_mask, dtype=np.bool_)
            spec["row_mask_payload"] = f"node.{i}.row_mask"
        if node.lengths is not None:
            payload[f"node.{i}.lengths"] = np.asarray(node.lengths, dtype=np.int64)
            spec["lengths_payload"] = f"node.{i}.lengths"
        node_specs.append(spec)
    leaf_specs: list[dict[str, Any]] = []
    for i, leaf in enumerate(leaves):
        missing = np.asarray([isinstance(v, _Missing) for v in leaf.values], dtype=np.bool_)
        column = [None if m else v for m, v in zip(missing, leaf.values, strict=True)]
        decision = leaf.decision
        if not decision.accepted and all(v is None or isinstance(v, _Missing) for v in leaf.values):
            decision = CodecDecision(True, "json_ragged", "all rows are null or missing", "json")
        if schema_leaves:
            if decision.codec in _PLAIN_CODECS:
                column = [_plain(v) for v in column]
            schema = FieldSchema(codec=decision.codec, metadata=decision.metadata)
            encoded = encode_with_schema(leaf.path, np.asarray(column, dtype=object), schema)
        else:
            encoded = encode_leaf(column, decision)
        members = {}
        for name, value in encoded.payload.items():
            payload[f"leaf.{i}.{name}"] = value
            members[name] = f"leaf.{i}.{name}"
        payload[f"leaf.{i}.missing"] = missing
        members["missing"] = f"leaf.{i}.missing"
        leaf_specs.append(
            {
                "id": i,
                "path": leaf.path,
                "codec": encoded.codec,
                "rows": encoded.rows,
                "metadata": encoded.metadata,
                "payload_members": members,
            }
        )
    metadata = {
        "schema_source": "inferred_from_runtime_values",
        "structure_version": 1,
        "root_path": path,
        "nodes": node_specs,
        "leaves": leaf_specs,
    }
    return Encoded("structured_recursive", len(values), payload, metadata)


def _encode_fallback(path: str, values: list[Any]) -> Encoded:
    """A schema of ``auto`` (or ``ndarray`` without a dtype): the recursive layout when it
    applies, else the inferred codec, then msgpack, then JSON; ValueError naming what
    failed when none fits."""
    errors: list[str] = []
    try:
        recursive = _encode_recursive(path, values, schema_leaves=True)
        if recursive is not None:
            return recursive
    except FALLBACK_ERRORS as error:
        errors.append(f"structured_recursive: {error}")
    decision = choose_leaf_codec(values)
    codecs = [
        decision.codec,
        *(c for c in ("msgpack_ragged", "json_ragged") if c != decision.codec),
    ]
    for codec in codecs:
        meta = dict(decision.metadata or {}) if codec == decision.codec else {}
        column = [_plain(v) for v in values] if codec in _PLAIN_CODECS else values
        array = np.asarray(column, dtype=object)
        try:
            return encode_with_schema(path, array, FieldSchema(codec=codec, metadata=meta))
        except FALLBACK_ERRORS as error:
            errors.append(f"{codec}: {error}")
    raise ValueError(
        f"unable to infer a safe codec for structured non-tensor field {path!r}; tried {errors}"
    )


def encode_with_schema(path: str, column: np.ndarray[Any, Any], schema: FieldSchema) -> Encoded:
    """Encode ``column`` with the codec its ``FieldSchema`` names."""
    values = list(column)
    if not schema.nullable and any(v is None for v in values):
        raise ValueError(f"FieldSchema for {path!r} is not nullable")
    encoded = encode_leaf_schema(path, values, schema)
    return encoded if encoded is not None else _encode_fallback(path, values)


def encode_inferred(path: str, column: np.ndarray[Any, Any]) -> Encoded:
    """An object-dtype column without a schema: the recursive layout when its structure
    holds arrays, tensors or bytes, else one inferred codec for the whole column
    (ValueError when none fits, e.g. every row None)."""
    values = list(column)
    recursive = _encode_recursive(path, values, schema_leaves=False)
    if recursive is not None:
        return recursive
    return encode_leaf(values, choose_leaf_codec(values))


# ---------------------------------------------------------------- decoding
def _child_path(node: Mapping[str, Any], child: Any) -> str:
    if node["node_type"] == "dict":
        return f"{node['path']}.{escape_key(str(child))}"
    return f"{node['path']}[{int(child)}]"


def _depth(path: str) -> int:
    return path.count(".") + path.count("[")


def _rebuild(
    meta: Mapping[str, Any], payload: Payload, columns: dict[str, list[Any]], rows: int
) -> list[Any]:
    nodes = sorted(meta.get("nodes", []), key=lambda n: _depth(n["path"]), reverse=True)
    for node in nodes:
        missing, mask, lengths = (
            None if node.get(k) is None else payload[node[k]]
            for k in ("missing_payload", "row_mask_payload", "lengths_payload")
        )
        out: list[Any] = []
        for r in range(rows):
            if missing is not None and bool(missing[r]):
                out.append(MISSING)
            elif mask is not None and not bool(mask[r]):
                out.append(None)
            elif node["node_type"] == "dict":
                item = {}
                for child in node["children"]:
                    value = columns[_child_path(node, child)][r]
                    if not isinstance(value, _Missing):
                        item[child] = value
                out.append(item)
            else:
                length = int(lengths[r]) if lengths is not None else len(node["children"])
                seq: list[Any] = [None] * length
                for child in node["children"]:
                    if int(child) < length:
                        value = columns[_child_path(node, child)][r]
                        if not isinstance(value, _Missing):
                            seq[int(child)] = value
                out.append(seq)
        columns[node["path"]] = out
    return columns[meta["root_path"]]


def decode_column(encoded: Mapping[str, Any], payload: Payload, rows: int) -> list[Any]:
    """The rows of an encoded column (``encoded``: its ``encoded_non_tensor`` entry;
    ``payload``: its payload buffers by payload name)."""
    codec = encoded.get("codec")
    meta = encoded.get("metadata") or {}
    if codec == "ragged_tensor_dict":
        return decode_ragged_tensor_dict(payload, rows, meta)
    if codec != "structured_recursive":
        return decode_leaf(str(codec), payload, rows, encoded.get("metadata"))
    columns: dict[str, list[Any]] = {}
    for leaf in meta.get("leaves", []):
        members = leaf["payload_members"]
        sub = {n: payload[m] for n, m in members.items() if n != "missing"}
        values = decode_leaf(leaf["codec"], sub, rows, leaf.get("metadata"))
        missing = payload[members["missing"]]
        columns[leaf["path"]] = [MISSING if bool(missing[r]) else values[r] for r in range(rows)]
    return _rebuild(meta, payload, columns, rows)
