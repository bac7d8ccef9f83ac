"""The tensor family of ``mooncake.store``'s ``MooncakeDistributedStore``, as a mixin.

Tensors are stored in the published store's own object format
(:mod:`mooncake_core.compat.tensor_format`: a 304-byte header, then the bytes), so an object's
bytes are the same whichever store wrote them: ``get()`` of a tensor, a buffer filled by
``get_tensor_into`` and the input of ``put_tensor_from`` mean the same on both. The reading
methods also accept tensors written by our own :meth:`StoreClient.put_tensor`
(:mod:`mooncake_core.store.values`). CPU tensors only (others are copied to the CPU). The
methods rely on the store's own helpers (``_run``, ``_put``, ``_upsert``, ``_host`` and the
byte calls); :class:`~mooncake_core.compat.store.MooncakeDistributedStore` mixes them in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from mooncake_core.compat import tensor_format as _fmt
from mooncake_core.compat.store_types import INVALID_PARAMS, _code
from mooncake_core.errors import MooncakeError, ObjectExists
from mooncake_core.store import values as _values

if TYPE_CHECKING:
    from mooncake_core.store import StoreClient

__all__ = ["TensorMethods"]

logger = logging.getLogger("mooncake_core.compat.store")

T = TypeVar("T")
_BAD_TENSOR = (
    _fmt.TensorFormatError,
    AttributeError,
    IndexError,
    TypeError,
    ValueError,
    RuntimeError,
)


class TensorMethods:
    """``put_tensor`` / ``get_tensor`` and the rest of the published tensor family."""

    if TYPE_CHECKING:  # provided by MooncakeDistributedStore

        def _run(self, what: str, fn: Callable[[StoreClient], T]) -> T | int: ...
        def _put(self, what: str, fn: Callable[[StoreClient], None]) -> int: ...
        def _upsert(self, key: str, put: Callable[[], int]) -> int: ...
        def _kw(self, config: Any) -> dict[str, Any]: ...
        def _refused(self, what: str, config: Any, staged: bool) -> bool: ...
        def _host(self, addr: int, n: int) -> memoryview: ...
        def put_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int: ...
        def get_into(self, key: str, buffer_ptr: int, size: int) -> int: ...
        def upsert_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int: ...
        def get_size(self, key: str) -> int: ...
        def batch_put_from(
            self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: Any = None
        ) -> list[int]: ...
        def batch_get_into(
            self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
        ) -> list[int]: ...

    # ------------------------------------------------------------------ whole tensors
    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a torch tensor; 0 or a negative code (-600: not a tensor, or a dtype the
        published format has no code for)."""
        return self.batch_put_tensor([key], [tensor])[0]

    def get_tensor(self, key: str) -> Any:
        """The tensor stored under ``key``, or None (missing, or not a tensor object)."""
        res = self._run(f"get_tensor {key!r}", lambda c: c.get(key))
        return self._tensor_or_none(key, res) if isinstance(res, bytes) else None

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """Insert or replace a tensor (remove, then put: not atomic)."""
        return self._upsert_tensor(key, tensor, None)

    def _upsert_tensor(self, key: str, tensor: Any, config: Any) -> int:
        if self._refused(f"upsert tensor {key!r}", config, staged=False):
            return INVALID_PARAMS
        try:
            packed = _fmt.pack(tensor)
        except _BAD_TENSOR as exc:
            logger.error("upsert tensor %r: %s", key, exc)
            return INVALID_PARAMS
        return self._upsert(key, lambda: self._put_packed([key], [packed], config)[0])

    # ------------------------------------------------------------------ with a ReplicateConfig
    # The published pub_* methods are the tensor puts that take a ReplicateConfig: the same
    # object bytes (checked against the wheel), placed as the config says.
    def pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """:meth:`put_tensor` with a ``ReplicateConfig``."""
        return self._put_tensors(f"pub_tensor {key!r}", [key], [tensor], config)[0]

    def upsert_pub_tensor(self, key: str, tensor: Any, config: Any = None) -> int:
        """:meth:`upsert_tensor` with a ``ReplicateConfig``."""
        return self._upsert_tensor(key, tensor, config)

    def batch_pub_tensor(
        self, keys: list[str], tensors_list: list[Any], config: Any = None
    ) -> list[int]:
        """:meth:`batch_put_tensor` with a ``ReplicateConfig``."""
        return self._put_tensors("batch_pub_tensor", keys, tensors_list, config)

    def batch_upsert_pub_tensor(
        self, keys: list[str], tensors_list: list[Any], config: Any = None
    ) -> list[int]:
        """:meth:`batch_upsert_tensor` with a ``ReplicateConfig``."""
        if len(keys) != len(tensors_list):
            logger.error("batch_upsert_pub_tensor: %d keys but %d tensors", len(keys),
                         len(tensors_list))  # fmt: skip
            return [INVALID_PARAMS] * len(keys)
        return [self._upsert_tensor(k, t, config) for k, t in zip(keys, tensors_list, strict=True)]

    def pub_tensor_with_tp(
        self,
        key: str,
        tensor: Any,
        config: Any = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        """:meth:`put_tensor_with_tp` with a ``ReplicateConfig``."""
        return self._put_tp([key], [tensor], tp_size, split_dim, config)[0]

    def batch_pub_tensor_with_tp(
        self,
        base_keys: list[str],
        tensors_list: list[Any],
        config: Any = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """:meth:`batch_put_tensor_with_tp` with a ``ReplicateConfig``."""
        return self._put_tp(base_keys, tensors_list, tp_size, split_dim, config)

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        """Per key: 0 (stored, or already there) or a negative code."""
        return self._put_tensors("batch_put_tensor", keys, tensors_list, None)

    def _put_tensors(
        self, what: str, keys: list[str], tensors_list: list[Any], config: Any
    ) -> list[int]:
        if self._refused(what, config, staged=False):
            return [INVALID_PARAMS] * len(keys)
        if len(keys) != len(tensors_list):
            logger.error("batch_put_tensor: %d keys but %d tensors", len(keys), len(tensors_list))
            return [INVALID_PARAMS] * len(keys)
        out = [INVALID_PARAMS] * len(keys)
        todo: list[int] = []
        packed: list[bytes] = []
        for i, (key, tensor) in enumerate(zip(keys, tensors_list, strict=True)):
            try:
                packed.append(_fmt.pack(tensor))
            except _BAD_TENSOR as exc:
                logger.error("put tensor %r: %s", key, exc)
                continue
            todo.append(i)
        done = self._put_packed([keys[i] for i in todo], packed, config)
        for i, rc in zip(todo, done, strict=True):
            out[i] = rc
        return out

    def _put_packed(self, keys: list[str], packed: list[bytes], config: Any = None) -> list[int]:
        if not keys:
            return []
        kw = self._kw(config)
        res = self._run("put tensor", lambda c: c.put_batch(keys, packed, **kw))
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
        if not keys:
            return []
        res = self._run("batch_get_tensor", lambda c: c.get_batch(keys))
        if isinstance(res, int):
            return [None] * len(keys)
        return [self._tensor_or_none(k, raw) for k, raw in zip(keys, res, strict=True)]

    @staticmethod
    def _tensor_or_none(key: str, raw: bytes | None) -> Any:
        if raw is None:
            return None
        try:
            if _fmt.is_tensor_object(raw):
                return _fmt.unpack(raw)
            return _values.unpack_tensor(key, raw)  # written by StoreClient.put_tensor
        except (MooncakeError, *_BAD_TENSOR) as exc:
            logger.error("get tensor %r: %s", key, exc)
            return None

    # ------------------------------------------------------------------ registered memory
    def _check_tensor_buffer(self, what: str, buffer_ptr: int, size: int) -> bool:
        """True when ``[buffer_ptr, +size)`` holds a whole tensor object (header and data)."""
        try:
            view = self._host(int(buffer_ptr), int(size))
            head = _fmt.unpack_header(view)
        except (MooncakeError, *_BAD_TENSOR) as exc:
            logger.error("%s: %s", what, exc)
            return False
        if _fmt.HEADER_SIZE + head.data_bytes > int(size):
            logger.error("%s: the buffer holds less than the tensor its header describes", what)
            return False
        return True

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store ``size`` bytes of registered memory that hold a tensor object (header, then
        data, as :meth:`get_tensor_into` leaves it); -600 if they do not."""
        if not self._check_tensor_buffer(f"put_tensor_from {key!r}", buffer_ptr, size):
            return INVALID_PARAMS
        return self.put_from(key, buffer_ptr, size)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """:meth:`put_tensor_from`, replacing an existing object."""
        if not self._check_tensor_buffer(f"upsert_tensor_from {key!r}", buffer_ptr, size):
            return INVALID_PARAMS
        return self.upsert_from(key, buffer_ptr, size)

    def batch_put_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """:meth:`put_tensor_from` for many keys."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            logger.error("batch_put_tensor_from: keys, buffer_ptrs and sizes differ in length")
            return [INVALID_PARAMS] * len(keys)
        # as published: one buffer without a whole tensor object refuses the whole batch
        for k, p, n in zip(keys, buffer_ptrs, sizes, strict=True):
            if not self._check_tensor_buffer(f"batch_put_tensor_from {k!r}", p, n):
                return [INVALID_PARAMS] * len(keys)
        return self.batch_put_from(keys, buffer_ptrs, sizes)

    def batch_upsert_tensor_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]:
        """:meth:`upsert_tensor_from` for many keys."""
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            logger.error("batch_upsert_tensor_from: keys, buffer_ptrs and sizes differ in length")
            return [INVALID_PARAMS] * len(keys)
        return [
            self.upsert_tensor_from(k, p, n)
            for k, p, n in zip(keys, buffer_ptrs, sizes, strict=True)
        ]

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read a tensor object into registered memory; returns a tensor that shares that
        memory (after the 304-byte header), or None."""
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
            return _fmt.unpack(self._host(addr, n), copy=False)
        except (MooncakeError, *_BAD_TENSOR) as exc:
            logger.error("get_tensor_into %r: %s", key, exc)
            return None

    # ------------------------------------------------------------------ tensor parallelism
    # put_tensor_with_tp splits along split_dim into tp_size equal shards stored as
    # "<key>_tp_<rank>" (each header records rank, size, split_dim and the whole shape);
    # with tp_size <= 1 the whole tensor is stored under key, as the published store does.
    @staticmethod
    def _tp_key(key: str, tp_rank: int, tp_size: int) -> str:
        return key if tp_size <= 1 else f"{key}_tp_{tp_rank}"

    @staticmethod
    def _shards(tensor: Any, tp_size: int, split_dim: int) -> list[bytes]:
        """The packed shards; :class:`TensorFormatError` if ``tensor`` does not split evenly."""
        if tp_size <= 1:
            return [_fmt.pack(tensor)]
        shape = tuple(int(d) for d in tensor.shape)
        if not 0 <= split_dim < len(shape):
            raise _fmt.TensorFormatError(f"split_dim {split_dim} of a {len(shape)}-d tensor")
        if shape[split_dim] < tp_size or shape[split_dim] % tp_size:
            raise _fmt.TensorFormatError(
                f"dimension {split_dim} ({shape[split_dim]}) does not split into {tp_size} shards"
            )
        parts = tensor.split(shape[split_dim] // tp_size, split_dim)
        return [
            _fmt.pack(part, _fmt.Shard(rank, tp_size, split_dim, shape))
            for rank, part in enumerate(parts)
        ]

    def put_tensor_with_tp(
        self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        """Store the ``tp_size`` shards of ``tensor`` (split evenly along ``split_dim``)."""
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
        return self._put_tp(base_keys, tensors_list, tp_size, split_dim, None)

    def _put_tp(
        self, base_keys: list[str], tensors_list: list[Any], tp_size: int, split_dim: int,
        config: Any,
    ) -> list[int]:  # fmt: skip
        if self._refused("put tensor shards", config, staged=False):
            return [INVALID_PARAMS] * len(base_keys)
        if len(base_keys) != len(tensors_list):
            logger.error("batch_put_tensor_with_tp: %d keys but %d tensors", len(base_keys),
                         len(tensors_list))  # fmt: skip
            return [INVALID_PARAMS] * len(base_keys)
        out = [0] * len(base_keys)
        keys: list[str] = []
        packed: list[bytes] = []
        owner: list[int] = []
        for i, (key, tensor) in enumerate(zip(base_keys, tensors_list, strict=True)):
            try:
                shards = self._shards(tensor, tp_size, split_dim)
            except _BAD_TENSOR as exc:
                logger.error("put_tensor_with_tp %r: %s", key, exc)
                out[i] = INVALID_PARAMS
                continue
            keys += [self._tp_key(key, r, tp_size) for r in range(len(shards))]
            packed += shards
            owner += [i] * len(shards)
        for i, rc in zip(owner, self._put_packed(keys, packed, config), strict=True):
            out[i] = out[i] or rc
        return out

    def put_tensor_with_tp_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        """:meth:`put_tensor_with_tp` of the tensor object in registered memory."""
        return self.batch_put_tensor_with_tp_from(
            [key], [buffer_ptr], [size], tp_rank, tp_size, split_dim
        )[0]

    def batch_put_tensor_with_tp_from(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """:meth:`put_tensor_with_tp_from` for many buffers."""
        if not (len(base_keys) == len(buffer_ptrs) == len(sizes)):
            logger.error("batch_put_tensor_with_tp_from: keys, buffer_ptrs and sizes differ")
            return [INVALID_PARAMS] * len(base_keys)
        tensors: list[Any] = []
        for key, p, n in zip(base_keys, buffer_ptrs, sizes, strict=True):
            if not self._check_tensor_buffer(f"put_tensor_with_tp_from {key!r}", p, n):
                tensors.append(None)  # refused below, per key
                continue
            tensors.append(_fmt.unpack(self._host(int(p), int(n)), copy=False))
        return self.batch_put_tensor_with_tp(base_keys, tensors, tp_rank, tp_size, split_dim)

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

    def get_tensor_with_tp_into(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> Any:
        """:meth:`get_tensor_into` of this rank's shard (the whole tensor when ``tp_size``
        <= 1): a tensor sharing the registered memory, or None."""
        return self.get_tensor_into(self._tp_key(key, tp_rank, tp_size), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(
        self,
        base_keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> list[Any]:
        """:meth:`get_tensor_with_tp_into` for many keys."""
        keys = [self._tp_key(k, tp_rank, tp_size) for k in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    # ------------------------------------------------------------------ safetensors files
    def save_tensor_to_safetensor(self, key: str, file_name: Any = None) -> int:
        """Write the tensor under ``key`` to a safetensors file (``file_name``, default
        ``key``) holding one tensor named ``key``. 0; -1100 when ``key`` holds no tensor; -600
        when the file cannot be written or the ``safetensors`` package is missing."""
        tensor = self.get_tensor(key)
        if tensor is None:
            logger.error("save_tensor_to_safetensor: no tensor under %r", key)
            return TENSOR_NOT_FOUND
        try:
            from safetensors.torch import save_file

            save_file({key: tensor.contiguous()}, str(file_name if file_name else key))
        except (ImportError, OSError, *_BAD_TENSOR) as exc:
            logger.error("save_tensor_to_safetensor %r: %s", key, exc)
            return INVALID_PARAMS
        return 0

    def load_tensor_from_safetensor(self, *args: Any, **kwargs: Any) -> Any:
        """``load_tensor_from_safetensor(key=None, file_name)``: the first tensor in the
        safetensors file, also stored under ``key`` when one is given; None on failure."""
        names = ["key", "file_name"]
        given = dict(zip(names, args, strict=False))
        bad = set(kwargs) - set(names) or set(given) & set(kwargs) or len(args) > 2
        given.update(kwargs)
        if bad or "file_name" not in given:
            raise TypeError(
                "load_tensor_from_safetensor(): arguments are (key: object = None, file_name: str)"
            )
        key, file_name = given.get("key"), str(given["file_name"])
        try:
            from safetensors.torch import load_file

            tensors = load_file(file_name)
        except (ImportError, OSError, *_BAD_TENSOR) as exc:
            logger.error("load_tensor_from_safetensor %r: %s", file_name, exc)
            return None
        if not tensors:
            logger.error("load_tensor_from_safetensor %r: the file holds no tensor", file_name)
            return None
        tensor = next(iter(tensors.values()))
        if key is not None and self.put_tensor(str(key), tensor) != 0:
            return None
        return tensor


#: Published code of ``save_tensor_to_safetensor`` for a key that holds no tensor.
TENSOR_NOT_FOUND = -1100
