"""Tensor messages: ``put_tensor_async(tensor, peer, key)`` on one engine,
``get_tensor(key)`` on the other.

The wire form is a JSON header (key, kind, dtype, shape) followed by the raw bytes; the
receiver's listener ``recv_into`` s the bytes straight into a freshly allocated array.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np

from mooncake_core.errors import InvalidRequest, TransferTimeout

__all__ = ["TensorInbox", "encode_tensor", "MAX_TENSOR_BYTES"]

MAX_TENSOR_BYTES = 16 << 30


def encode_tensor(tensor: Any, key: str) -> tuple[bytes, memoryview]:
    """Header bytes and a zero-copy view of the tensor's data."""
    kind = "numpy"
    if type(tensor).__module__.startswith("torch"):
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise InvalidRequest(f"cannot send {type(tensor).__name__} as a tensor")
        kind = "torch"
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = list(tensor.shape)
        t = tensor.detach().contiguous().cpu()
        arr = t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
        data = arr.data.cast("B") if arr.size else memoryview(b"")
    elif isinstance(tensor, np.ndarray):
        arr = np.ascontiguousarray(tensor)
        dtype = arr.dtype.str
        shape = list(arr.shape)
        data = arr.reshape(-1).view(np.uint8).data if arr.size else memoryview(b"")
    else:
        raise InvalidRequest(
            f"cannot send {type(tensor).__name__} as a tensor (torch.Tensor or numpy.ndarray)"
        )
    head = json.dumps({"key": key, "kind": kind, "dtype": dtype, "shape": shape}).encode()
    return head, data


class _Buf:
    def __init__(self, n: int) -> None:
        self.array = np.empty(n, dtype=np.uint8)
        self.view = self.array.data


class TensorInbox:
    """Tensors received from peers, by key; ``take`` waits for one to arrive."""

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}
        self._cond = threading.Condition()

    def alloc(self, n: int) -> _Buf:
        if n < 0 or n > MAX_TENSOR_BYTES:
            raise ValueError(f"tensor of {n} bytes refused (limit {MAX_TENSOR_BYTES})")
        return _Buf(n)

    def deliver(self, meta: dict[str, Any], buf: _Buf) -> None:
        key = str(meta["key"])
        shape = [int(x) for x in meta["shape"]]
        if meta["kind"] == "torch":
            import torch

            dtype = getattr(torch, str(meta["dtype"]))
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown torch dtype {meta['dtype']!r}")
            t = (
                torch.from_numpy(buf.array).view(dtype)
                if buf.array.size
                else torch.empty(0, dtype=dtype)
            )
            value: Any = t.reshape(shape)
        else:
            value = buf.array.view(np.dtype(str(meta["dtype"]))).reshape(shape)
        with self._cond:
            self._items[key] = value
            self._cond.notify_all()

    def take(self, key: str, timeout: float) -> Any:
        end = time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                left = end - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(
                        f"no tensor with key {key!r} arrived within {timeout:.1f}s"
                    )
                self._cond.wait(left)
            return self._items.pop(key)
