"""The tensor family of ``mooncake.store``'s ``MooncakeDistributedStore``, as a mixin.

Torch tensors are stored as typed values (:mod:`mooncake_core.store.values`: a small header
with dtype and shape, then the bytes): readable by these methods, not by the published
store, and the other way round. CPU tensors only (CUDA ones are moved). The methods rely on
the store's own helpers (``_run``, ``_put``, ``_upsert``, ``_host`` and the byte calls);
:class:`~mooncake_core.compat.store.MooncakeDistributedStore` mixes them in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from mooncake_core.compat.store_types import INVALID_PARAMS, _code
from mooncake_core.errors import MooncakeError, ObjectExists
from mooncake_core.store import values as _values

if TYPE_CHECKING:
    from mooncake_core.store import StoreClient

__all__ = ["TensorMethods"]

logger = logging.getLogger("mooncake_core.compat.store")

T = TypeVar("T")


class TensorMethods:
    """``put_tensor`` / ``get_tensor`` and the rest of the published tensor family."""

    if TYPE_CHECKING:  # provided by MooncakeDistributedStore

        def _run(self, what: str, fn: Callable[[StoreClient], T]) -> T | int: ...
        def _put(self, what: str, fn: Callable[[StoreClient], None]) -> int: ...
        def _upsert(self, key: str, put: Callable[[], int]) -> int: ...
        def _host(self, addr: int, n: int) -> memoryview: ...
        def put_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int: ...
        def get_into(self, key: str, buffer_ptr: int, size: int) -> int: ...
        def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int: ...
        def batch_put_from(
            self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any = None
        ) -> list[int]: ...
        def batch_upsert_from(
            self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any = None
        ) -> list[int]: ...
        def batch_get_into(
            self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
        ) -> list[int]: ...

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a torch tensor; 0 or a negative code."""
        return self._put(f"put_tensor {key!r}", lambda c: c.put_tensor(key, tensor))

    def get_tensor(self, key: str) -> Any:
        """The tensor stored with :meth:`put_tensor`, or None."""
        res = self._run(f"get_tensor {key!r}", lambda c: c.get_tensor(key))
        return None if isinstance(res, int) else res

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """Insert or replace a tensor (remove, then put: not atomic)."""
        return self._upsert(key, lambda: self.put_tensor(key, tensor))

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        """Per key: 0 (stored, or already there) or a negative code."""
        if len(keys) != len(tensors_list):
            logger.error("batch_put_tensor: %d keys but %d tensors", len(keys), len(tensors_list))
            return [INVALID_PARAMS] * len(keys)
        try:
            packed = [_values.pack_tensor(t) for t in tensors_list]
        except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
            logger.error("batch_put_tensor: not a tensor: %s", exc)
            return [INVALID_PARAMS] * len(keys)
        res = self._run("batch_put_tensor", lambda c: c.put_batch(keys, packed))
        if isinstance(res, int):
            return [res] * len(keys)
        return [0 if e is None or isinstance(e, ObjectExists) else _code(e) for e in res]

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        """Per key: 0 or a negative code (remove, then put: not atomic)."""
        if len(keys) != len(tensors_list):
            logger.error(
                "batch_upsert_tensor: %d keys but %d tensors", len(keys), len(tensors_list)
            )
            return [INVALID_PARAMS] * len(keys)
        return [self.upsert_tensor(k, t) for k, t in zip(keys, tensors_list, strict=True)]

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        """Per key: the tensor, or None (missing, or not stored as a tensor)."""
        res = self._run("batch_get_tensor", lambda c: c.get_batch(keys))
        if isinstance(res, int):
            return [None] * len(keys)
        return [self._tensor_or_none(k, raw) for k, raw in zip(keys, res, strict=True)]

    @staticmethod
    def _tensor_or_none(key: str, raw: bytes | None) -> Any:
        if raw is None:
            return None
        try:
            return _values.unpack_tensor(key, raw)
        except (MooncakeError, ValueError, TypeError, AttributeError) as exc:
            logger.error("get tensor %r: %s", key, exc)
            return None

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store ``size`` bytes of registered memory that hold a tensor as
        :meth:`get_tensor_into` left it (header, then data)."""
        return self.put_from(key, buffer_ptr, size)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """:meth:`put_tensor_from`, replacing an existing object."""
        return self.upsert_from(key, buffer_ptr, size)

    def batch_put_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """:meth:`put_tensor_from` for many keys."""
        return self.batch_put_from(keys, buffer_ptrs, sizes)

    def batch_upsert_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """:meth:`upsert_tensor_from` for many keys."""
        return self.batch_upsert_from(keys, buffer_ptrs, sizes)

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read a tensor object into registered memory; returns a tensor that shares that
        memory (after the header), or None."""
        n = self.get_into(key, buffer_ptr, size)
        return None if n < 0 else self._tensor_at(key, int(buffer_ptr), n)

    def batch_get_tensor_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[Any]:
        """:meth:`get_tensor_into` for many keys: per key a tensor or None."""
        res = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [
            None if n < 0 else self._tensor_at(k, int(p), n)
            for k, p, n in zip(keys, buffer_ptrs, res, strict=False)
        ]

    def _tensor_at(self, key: str, addr: int, n: int) -> Any:
        try:
            view = self._host(addr, n)
            meta, _ = _values.unpack(key, bytes(view[: min(n, 4096)]))
            import torch

            head = _values.HEADER.size + _values.HEADER.unpack_from(view)[1]
            dtype = getattr(torch, str(meta["dtype"]))
            if head == n:
                return torch.empty(meta["shape"], dtype=dtype)
            return torch.frombuffer(view[head:], dtype=dtype).reshape(meta["shape"])
        except (MooncakeError, ValueError, TypeError, AttributeError, RuntimeError) as exc:
            logger.error("get_tensor_into %r: %s", key, exc)
            return None

    # Tensor parallelism: put_tensor_with_tp splits along split_dim into tp_size shards
    # stored as "<key>_tp_<rank>"; with tp_size <= 1 the whole tensor is stored under key.
    @staticmethod
    def _tp_key(key: str, tp_rank: int, tp_size: int) -> str:
        return key if tp_size <= 1 else f"{key}_tp_{tp_rank}"

    def put_tensor_with_tp(
        self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        """Store the ``tp_size`` shards of ``tensor`` (split along ``split_dim``)."""
        return self.batch_put_tensor_with_tp([key], [tensor], tp_rank, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[Any],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """:meth:`put_tensor_with_tp` for many tensors; per key 0 or the first failure."""
        if len(base_keys) != len(tensors_list) or tp_size < 1:
            logger.error("batch_put_tensor_with_tp: bad arguments (tp_size %d)", tp_size)
            return [INVALID_PARAMS] * len(base_keys)
        keys: list[str] = []
        shards: list[Any] = []
        for key, tensor in zip(base_keys, tensors_list, strict=True):
            try:
                parts = [tensor] if tp_size == 1 else list(tensor.chunk(tp_size, split_dim))
            except (AttributeError, IndexError, RuntimeError, TypeError) as exc:
                logger.error("put_tensor_with_tp %r: %s", key, exc)
                parts = []
            if len(parts) != tp_size:
                return [INVALID_PARAMS] * len(base_keys)
            keys += [self._tp_key(key, r, tp_size) for r in range(tp_size)]
            shards += parts
        res = self.batch_put_tensor(keys, shards)
        return [
            next((rc for rc in res[i * tp_size : (i + 1) * tp_size] if rc), 0)
            for i in range(len(base_keys))
        ]

    def get_tensor_with_tp(
        self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> Any:
        """This rank's shard (or the whole tensor when ``tp_size`` <= 1), or None."""
        return self.get_tensor(self._tp_key(key, tp_rank, tp_size))

    def batch_get_tensor_with_tp(
        self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1
    ) -> list[Any]:
        """:meth:`get_tensor_with_tp` for many keys."""
        return self.batch_get_tensor([self._tp_key(k, tp_rank, tp_size) for k in base_keys])
