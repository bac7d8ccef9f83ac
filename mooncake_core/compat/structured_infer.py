"""Codec inference for object-dtype DataProto columns (``infer_structure``).

The published 0.3.13 ``mooncake.structured_object_store`` stores an object-dtype
``non_tensor_batch`` column (strings, bytes, lists, dicts, per-row arrays or tensors) as
typed buffers chosen per *leaf*: dict rows are expanded key by key, short lists of
containers index by index, down to leaf columns, and each leaf gets one codec:

========================  ==============================================================
``ragged_tensor``         torch tensors of one dtype (per-row shapes kept)
``media_list_ragged``     lists of bytes-like items (or PIL images)
``typed_ragged``          numeric ndarrays, or numeric lists / tuples (one common dtype)
``ndarray``               numeric / bool Python or numpy scalars
``bytes_ragged``          bytes-like values
``media_bytes``           PIL images
``utf8_ragged``           str
``msgpack_ragged``        dicts, lists, tuples (msgpack, ``strict_types``)
========================  ==============================================================

``infer_structure`` and the decision order follow the published module (same limits:
64 dict keys, lists up to 8 items, 32 levels). Absent dict keys are :data:`MISSING`,
distinct from ``None``. Written from the published module's behaviour; the codecs
themselves are in :mod:`mooncake_core.compat.structured_codecs`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mooncake_core.compat.structured_types import MISSING, _Missing

__all__ = [
    "MISSING",
    "CodecDecision",
    "InferredLeaf",
    "InferredNode",
    "choose_leaf_codec",
    "escape_key",
    "infer_structure",
    "is_bytes_like",
    "is_media_list",
    "is_pil_image",
    "non_null",
]

INFER_MAX_STRUCT_KEYS = 64
INFER_MAX_LIST_LEN = 8
INFER_MAX_DEPTH = 32


def torch_module() -> Any:
    """torch when installed, else None (the core does not require it)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def loaded_torch() -> Any:
    """torch if some code imported it already, else None: a value can only be a tensor
    then, so type checks need not pay torch's import (seconds)."""
    return sys.modules.get("torch")


@dataclass
class CodecDecision:
    """The codec chosen for one leaf column, or why none was (``accepted=False``)."""

    accepted: bool
    codec: str
    reason: str
    normalized_type: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferredLeaf:
    """One leaf column: its path (``root.key[0]``), row values, and codec decision."""

    path: str
    values: list[Any]
    decision: CodecDecision


@dataclass
class InferredNode:
    """An interior dict or list node of the expanded structure."""

    path: str
    node_type: str
    children: list[Any]
    lengths: list[int] | None = None
    row_mask: list[bool] | None = None


def non_null(values: list[Any]) -> list[Any]:
    """The values that are neither ``None`` nor :data:`MISSING`."""
    return [v for v in values if v is not None and not isinstance(v, _Missing)]


def is_pil_image(value: Any) -> bool:
    module = getattr(value.__class__, "__module__", None) or ""
    return module.startswith("PIL.") and hasattr(value, "save")


def is_bytes_like(value: Any) -> bool:
    return isinstance(value, (bytes, bytearray, memoryview))


def is_media_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        is_pil_image(item) or is_bytes_like(item) for item in value
    )


def _numeric_sequence_dtype(values: list[Any]) -> Any:
    try:
        return np.result_type(*[np.asarray(v).dtype for v in values])
    except (TypeError, ValueError, OverflowError):
        return None


def choose_leaf_codec(values: list[Any]) -> CodecDecision:
    """The published decision order for one leaf column."""
    nn = non_null(values)
    if not nn:
        return CodecDecision(False, "msgpack_ragged", "all rows are null", "msgpack")
    torch = loaded_torch()
    if torch is not None and all(isinstance(v, torch.Tensor) for v in nn):
        dtypes = {v.dtype for v in nn}
        if len(dtypes) != 1:
            return CodecDecision(
                False,
                "ragged_tensor",
                f"mixed tensor dtype: {sorted(str(d) for d in dtypes)}",
                "torch.Tensor",
            )
        return CodecDecision(
            True,
            "ragged_tensor",
            "all non-null rows are Tensor",
            "torch.Tensor",
            {"dtype": str(nn[0].dtype)},
        )
    if all(is_media_list(v) for v in nn):
        return CodecDecision(True, "media_list_ragged", "all rows are media lists", "media list")
    if all(isinstance(v, np.ndarray) for v in nn):
        if all(np.issubdtype(v.dtype, np.number) for v in nn):
            return CodecDecision(
                True,
                "typed_ragged",
                "all rows are numeric ndarray",
                "numeric sequence",
                {"recursive_source": "ndarray"},
            )
        return CodecDecision(False, "msgpack_ragged", "object ndarray rows", "python object")
    if all(isinstance(v, (list, tuple)) for v in nn):
        dtype = _numeric_sequence_dtype(nn)
        if dtype is not None and np.issubdtype(dtype, np.number):
            return CodecDecision(
                True,
                "typed_ragged",
                "all rows are numeric sequences",
                "numeric sequence",
                {"dtype": str(dtype)},
            )
    if all(isinstance(v, (bool, int, float, np.number)) for v in nn):
        return CodecDecision(
            True,
            "ndarray",
            "all rows are numeric scalar",
            "numeric scalar",
            {"dtype": str(np.result_type(*nn))},
        )
    if all(is_bytes_like(v) for v in nn):
        return CodecDecision(True, "bytes_ragged", "all rows are bytes-like", "bytes-like")
    if all(is_pil_image(v) for v in nn):
        return CodecDecision(True, "media_bytes", "all rows are media", "media")
    if all(isinstance(v, str) for v in nn):
        return CodecDecision(True, "utf8_ragged", "all rows are str", "str")
    if all(isinstance(v, (dict, list, tuple)) for v in nn):
        return CodecDecision(True, "msgpack_ragged", "all rows are msgpack-like", "msgpack")
    return CodecDecision(False, "msgpack_ragged", "no codec matched", "python object")


def _dict_keys(values: list[Any]) -> list[str] | None:
    nn = non_null(values)
    if not nn or not all(isinstance(v, dict) for v in nn):
        return None
    keys = {k for v in nn for k in v}
    if not all(isinstance(k, str) for k in keys) or len(keys) > INFER_MAX_STRUCT_KEYS:
        return None
    return sorted(keys)


def _list_shape(values: list[Any]) -> tuple[int, list[int]] | None:
    nn = non_null(values)
    if not nn or not all(isinstance(v, (list, tuple)) for v in nn):
        return None
    longest = max(len(v) for v in nn)
    if longest > INFER_MAX_LIST_LEN:
        return None
    if not all(item is None or isinstance(item, (dict, list, tuple)) for v in nn for item in v):
        return None
    return longest, [len(v) if isinstance(v, (list, tuple)) else 0 for v in values]


def escape_key(key: str) -> str:
    """A dict key as one path segment (``\\``, ``.`` and ``[`` escaped)."""
    return key.replace("\\", "\\\\").replace(".", "\\.").replace("[", "\\[")


def infer_structure(
    path: str,
    values: list[Any],
    leaves: list[InferredLeaf],
    nodes: list[InferredNode],
    *,
    _depth: int = 0,
) -> None:
    """Expand ``values`` (one row each) into leaf columns and interior nodes.

    ``leaves`` and ``nodes`` are filled in place. Dict rows expand per key (a key absent
    from a row is :data:`MISSING` there), lists of containers (at most 8 items) per index;
    every node records which rows had a real container (``row_mask``). Raises
    ``ValueError`` past 32 levels.
    """
    if _depth > INFER_MAX_DEPTH:
        raise ValueError(f"infer_structure exceeded max depth {INFER_MAX_DEPTH} at {path!r}")
    keys = _dict_keys(values)
    if keys is not None:
        nodes.append(
            InferredNode(path, "dict", list(keys), row_mask=[isinstance(v, dict) for v in values])
        )
        for key in keys:
            column = [v.get(key, MISSING) if isinstance(v, dict) else None for v in values]
            infer_structure(f"{path}.{escape_key(key)}", column, leaves, nodes, _depth=_depth + 1)
        return
    shape = _list_shape(values)
    if shape is not None:
        longest, lengths = shape
        is_list = [isinstance(v, (list, tuple)) for v in values]
        nodes.append(InferredNode(path, "list", list(range(longest)), lengths, row_mask=is_list))
        for index in range(longest):
            column = [
                (v[index] if index < len(v) else MISSING) if ok else None
                for v, ok in zip(values, is_list, strict=True)
            ]
            infer_structure(f"{path}[{index}]", column, leaves, nodes, _depth=_depth + 1)
        return
    leaves.append(InferredLeaf(path, values, choose_leaf_codec(values)))
