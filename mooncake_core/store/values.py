"""Typed values: numpy arrays and torch tensors stored with their dtype and shape.

A typed value is one store object: an 8-byte header (magic ``MCT1``, JSON length), the JSON
``{"kind", "dtype", "shape"}``, then the raw bytes. :class:`~mooncake_core.store.client.StoreClient`
uses these functions for ``put_array``/``get_array`` and ``put_tensor``/``get_tensor``;
numpy and torch are imported only when such a value is built or read.
"""

from __future__ import annotations

import json
import struct
from typing import Any

from mooncake_core.store.buffers import as_view, nbytes
from mooncake_core.store.protocol import InvalidArgument

__all__ = ["pack_array", "unpack_array", "pack_tensor", "unpack_tensor", "pack", "unpack"]

MAGIC = b"MCT1"
HEADER = struct.Struct("<4sI")


def pack(meta: dict[str, Any], data: Any) -> bytearray:
    """The object bytes of ``data`` (any buffer) under the header describing it."""
    head = json.dumps(meta).encode()
    hdr = HEADER.pack(MAGIC, len(head)) + head
    n = len(as_view(data, False)[0]) if nbytes(data) else 0
    buf = bytearray(len(hdr) + n)
    buf[: len(hdr)] = hdr
    if n:
        buf[len(hdr) :] = as_view(data, False)[0]
    return buf


def unpack(key: str, raw: bytes) -> tuple[dict[str, Any], bytearray]:
    """The header's metadata and the raw bytes of the object stored under ``key``."""
    data = bytearray(raw)
    if len(data) < HEADER.size or data[:4] != MAGIC:
        raise InvalidArgument(f"{key!r} was not stored with put_array/put_tensor")
    _, n = HEADER.unpack_from(data)
    meta = json.loads(bytes(data[HEADER.size : HEADER.size + n]))
    return meta, data[HEADER.size + n :]


def pack_array(arr: Any) -> bytearray:
    """A numpy array (made contiguous) as a typed value."""
    import numpy as np

    a = np.ascontiguousarray(arr)
    return pack({"kind": "numpy", "dtype": a.dtype.str, "shape": list(a.shape)}, a)


def unpack_array(key: str, raw: bytes) -> Any:
    """The numpy array a typed value holds (a view of a fresh copy of ``raw``)."""
    import numpy as np

    meta, data = unpack(key, raw)
    return np.frombuffer(data, dtype=np.dtype(meta["dtype"])).reshape(meta["shape"])


def pack_tensor(tensor: Any) -> bytearray:
    """A torch tensor (moved to the CPU if needed) as a typed value."""
    t = tensor.detach().contiguous().cpu()
    meta = {"kind": "torch", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    return pack(meta, t)


def unpack_tensor(key: str, raw: bytes) -> Any:
    """The torch tensor a typed value holds."""
    import torch

    meta, data = unpack(key, raw)
    dtype = getattr(torch, str(meta["dtype"]))
    if not data:
        return torch.empty(meta["shape"], dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(meta["shape"])
