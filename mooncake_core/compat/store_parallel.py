"""The ``*_with_parallelism*`` tensor calls of ``mooncake.store``, as a mixin, and their types
``ParallelAxis``, ``TensorParallelism`` and ``ReadTarget``.

Worked out by running the published wheel (0.3.13) against its own master and reading back
the keys and bytes it wrote (tests/integration/test_compat_parity.py runs the same script on
both). Objects are in the published tensor format (:mod:`.tensor_format`: a 304-byte header
whose parallel axes describe the shard, then the data), under these keys:

========================================= ==================================================
what was put                              objects
========================================= ==================================================
no parallelism, no writer partition        ``key``: the whole tensor
TP axis (rank r of n, split_dim d): the    ``key_tp_r`` (the tensor given is rank r's shard;
tensor is the shard                        the whole shape is its shape with dim d times n)
                                           and ``key__parallelism_manifest`` (96 bytes)
DP / PP / EP axes (one or more), also     ``key__dp_rOFn`` / ``__tp_rOFn_sdD`` /
with a TP axis: the tensor is the whole    ``__ep_rOFn_eidE`` / ``__pp_rOFn_sidS`` (in this
(the TP rank's chunk is stored)            order; ``_eidE`` / ``_sidS`` whenever an expert /
                                           stage id is set); with TP also the manifest
writer partition (rank, size, split_dim):  ``key__writer_rOFn_sdD`` (chunk r of the tensor
the tensor is the whole                    along d) and ``key__writer_manifest``
``*_from`` with a TP axis: the buffer      every shard ``key_tp_0`` .. ``key_tp_{n-1}``, no
holds the whole tensor                     manifest (as ``put_tensor_with_tp_from``)
========================================= ==================================================

Refused with -600: two axes of one kind, rank outside
``[0, size)``, a TP axis without ``split_dim`` or one outside the tensor, a ``split_dim`` on a
DP/PP/EP axis, PP without ``stage_id``, EP without ``expert_id``, a writer partition with a
parallelism or one that does not split evenly. Puts keep an existing object (0), upserts
replace it. Reads (``ReadTarget.mode``): ``as_stored`` without a parallelism reads ``key``;
``full`` gathers the TP shards a manifest lists (or ``key_tp_0..n-1`` of the TP axis given)
or the writer partitions, and without either reads ``key``; ``shard`` reads the named shard,
re-splitting a TP-sharded tensor when the requested size differs from the stored one. What
cannot be read gives None. The ``*_into`` reads leave a tensor object (header and data) in the
buffer and return a tensor that shares it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from mooncake_core.compat import tensor_format as _fmt
from mooncake_core.compat.store_types import INVALID_PARAMS, ReplicateConfig
from mooncake_core.errors import MooncakeError

if TYPE_CHECKING:
    from mooncake_core.store import StoreClient

__all__ = ["ParallelAxis", "ParallelMethods", "ReadTarget", "TensorParallelism"]

logger = logging.getLogger("mooncake_core.compat.store")
T = TypeVar("T")

KINDS = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}
MODES = ("as_stored", "full", "shard")
_MANIFEST, _WRITER_MANIFEST = "__parallelism_manifest", "__writer_manifest"
_BAD = (_fmt.TensorFormatError, AttributeError, IndexError, TypeError, ValueError, RuntimeError)


def _typed(name: str, value: Any, kinds: tuple[type, ...], optional: bool = False) -> Any:
    if (value is None and optional) or (isinstance(value, kinds) and value is not None):
        return value
    want = "/".join(k.__name__ for k in kinds) + (" or None" if optional else "")
    raise TypeError(f"{name}: incompatible function arguments; expected {want}")


class ParallelAxis:
    """One axis of a tensor's parallel layout: ``kind`` (``dp``, ``tp``, ``ep``, ``pp``; any
    case), ``rank`` of ``size``, ``split_dim`` (TP), ``expert_id`` (EP), ``stage_id`` (PP)."""

    __slots__ = ("_kind", "_rank", "_size", "_split_dim", "_expert_id", "_stage_id")

    def __init__(self) -> None:
        self._kind, self._rank, self._size = "", 0, 1
        self._split_dim: int | None = None
        self._expert_id: int | None = None
        self._stage_id: int | None = None

    kind = property(
        lambda self: self._kind,
        lambda self, v: setattr(self, "_kind", _typed("kind", v, (str,))),
    )
    rank = property(
        lambda self: self._rank,
        lambda self, v: setattr(self, "_rank", _typed("rank", v, (int,))),
    )
    size = property(
        lambda self: self._size,
        lambda self, v: setattr(self, "_size", _typed("size", v, (int,))),
    )
    split_dim = property(
        lambda self: self._split_dim,
        lambda self, v: setattr(self, "_split_dim", _typed("split_dim", v, (int,), True)),
    )
    expert_id = property(
        lambda self: self._expert_id,
        lambda self, v: setattr(self, "_expert_id", _typed("expert_id", v, (int,), True)),
    )
    stage_id = property(
        lambda self: self._stage_id,
        lambda self, v: setattr(self, "_stage_id", _typed("stage_id", v, (int,), True)),
    )


class TensorParallelism:
    """A tensor's parallel layout: ``axes``, a list of :class:`ParallelAxis`."""

    __slots__ = ("_axes",)

    def __init__(self) -> None:
        self._axes: list[ParallelAxis] = []

    @property
    def axes(self) -> list[ParallelAxis]:
        return list(self._axes)

    @axes.setter
    def axes(self, value: list[ParallelAxis]) -> None:
        ok = isinstance(value, (list, tuple)) and all(isinstance(a, ParallelAxis) for a in value)
        _typed("axes", value if ok else None, (list, tuple))
        self._axes = list(value)


class ReadTarget:
    """What a read wants: ``mode`` (``as_stored``, ``full`` or ``shard``; any case) and the
    ``parallelism`` it reads for."""

    __slots__ = ("_mode", "_parallelism")

    def __init__(self) -> None:
        self._mode = "as_stored"
        self._parallelism: TensorParallelism | None = None

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        mode = str(_typed("mode", value, (str,))).lower()
        if mode not in MODES:
            raise RuntimeError("Unsupported ReadTarget mode")
        self._mode = mode

    @property
    def parallelism(self) -> TensorParallelism | None:
        return self._parallelism

    @parallelism.setter
    def parallelism(self, value: TensorParallelism | None) -> None:
        self._parallelism = _typed("parallelism", value, (TensorParallelism,), True)


class _Refused(ValueError):
    """A layout the published store refuses (-600)."""


def _axes(p: Any) -> list[tuple[str, ParallelAxis]]:
    """The validated axes of a parallelism, as ``(kind, axis)``; :class:`_Refused` if bad."""
    if not isinstance(p, TensorParallelism) or not p.axes:
        raise _Refused("parallelism is required (a TensorParallelism with axes)")
    out: list[tuple[str, ParallelAxis]] = []
    for a in p.axes:
        kind = a.kind.lower()
        if kind not in KINDS:
            raise _Refused(f"unsupported parallel axis kind: {a.kind}")
        if not (a.size >= 1 and 0 <= a.rank < a.size):
            raise _Refused(f"invalid rank/size for axis {kind}")
        if any(k == kind for k, _ in out):
            raise _Refused("duplicate axis kinds are not supported")
        if (kind == "tp") != (a.split_dim is not None):
            raise _Refused(f"{kind.upper()} axis " + ("requires split_dim" if kind == "tp"
                           else "must not provide split_dim"))  # fmt: skip
        if kind == "pp" and a.stage_id is None:
            raise _Refused("PP axis requires stage_id")
        if kind == "ep" and a.expert_id is None:
            raise _Refused("EP axis requires expert_id")
        out.append((kind, a))
    return out


def _suffix(axes: list[tuple[str, ParallelAxis]], tp_rank: int | None = None) -> str:
    """The key suffix of a shard on ``axes`` (``tp_rank`` replaces the TP axis' rank)."""
    out = ""
    for kind, a in sorted(axes, key=lambda x: KINDS[x[0]]):
        rank = tp_rank if kind == "tp" and tp_rank is not None else a.rank
        out += f"__{kind}_{rank}of{a.size}"
        out += f"_sd{a.split_dim}" if kind == "tp" else ""
        out += "" if a.expert_id is None else f"_eid{a.expert_id}"
        out += "" if a.stage_id is None else f"_sid{a.stage_id}"
    return out


def _split(tensor: Any, rank: int, size: int, dim: int) -> Any:
    shape = tuple(int(d) for d in tensor.shape)
    if not 0 <= dim < len(shape):
        raise _Refused(f"split_dim {dim} out of range")
    if shape[dim] % size:
        raise _Refused("only uniform sharding is supported")
    ext = shape[dim] // size
    return tensor.narrow(dim, rank * ext, ext)


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _objects(
    key: str, tensor: Any, par: Any, writer: Any, whole_buffer: bool
) -> list[tuple[str, bytes]]:
    """The objects one put writes (see the module doc); :class:`_Refused` if refused."""
    shape = tuple(int(d) for d in tensor.shape)  # AttributeError for a non-tensor, as published
    if writer is not None:
        if par is not None:
            raise _Refused("writer_partition cannot be combined with parallelism")
        r, n, d = (getattr(writer, f, None) for f in ("rank", "size", "split_dim"))
        if not all(isinstance(v, int) for v in (r, n, d)):
            raise _Refused("writer_partition must provide rank, size, and split_dim")
        assert isinstance(r, int) and isinstance(n, int) and isinstance(d, int)
        if not (n >= 1 and 0 <= r < n):
            raise _Refused("invalid writer partition")
        part = _split(tensor, r, n, d)
        axis = _fmt.Axis(1, r, n, d, 0, int(part.shape[d]))
        return [
            (f"{key}__writer_{r}of{n}_sd{d}", _fmt.pack(part, axes=[axis], whole_shape=shape)),
            (key + _WRITER_MANIFEST, _fmt.manifest(_dtype(tensor), d, n, shape)),
        ]
    if par is None:
        return [(key, _fmt.pack(tensor))]
    axes = _axes(par)
    tp = next((a for k, a in axes if k == "tp"), None)
    if tp is None or len(axes) > 1:  # with other axes the tensor is the whole one
        part, ids = tensor, {"pp": "stage_id", "ep": "expert_id"}  # ids recorded in the header
        if tp is not None:
            part = _split(tensor, tp.rank, tp.size, int(tp.split_dim or 0))
        packed = [
            _fmt.Axis(1, a.rank, a.size, int(a.split_dim or 0), 0, int(part.shape[a.split_dim]))
            if k == "tp"
            else _fmt.Axis(KINDS[k], a.rank, a.size, -1, getattr(a, ids[k]) if k in ids else 0)
            for k, a in axes
        ]
        out = [(key + _suffix(axes), _fmt.pack(part, axes=packed, whole_shape=shape))]
        if tp is not None:
            man = _fmt.manifest(_dtype(tensor), int(tp.split_dim or 0), tp.size, shape)
            out.append((key + _MANIFEST, man))
        return out
    a = axes[0][1]
    r, n, d = a.rank, a.size, int(a.split_dim or 0)
    if not 0 <= d < len(shape):
        raise _Refused(f"split_dim {d} out of range")
    if whole_buffer:  # *_from: every shard of the whole tensor, no manifest
        out = []
        for i in range(n):
            part = _split(tensor, i, n, d)
            axis = _fmt.Axis(1, i, n, d, 0, int(part.shape[d]))
            out.append((f"{key}_tp_{i}", _fmt.pack(part, axes=[axis], whole_shape=shape)))
        return out
    whole = tuple(x * n if i == d else x for i, x in enumerate(shape))
    axis = _fmt.Axis(1, r, n, d, 0, shape[d])
    return [
        (f"{key}_tp_{r}", _fmt.pack(tensor, axes=[axis], whole_shape=whole)),
        (key + _MANIFEST, _fmt.manifest(_dtype(tensor), d, n, whole)),
    ]


class ParallelMethods:
    """``put/upsert/get_tensor_with_parallelism`` and their ``batch_`` / ``_from`` /
    ``_into`` forms (see module doc)."""

    if TYPE_CHECKING:  # provided by MooncakeDistributedStore

        def _run(self, what: str, fn: Callable[[StoreClient], T]) -> T | int: ...
        def _upsert(self, key: str, put: Callable[[], int]) -> int: ...
        def _refused(self, what: str, config: Any, staged: bool) -> bool: ...
        def _host(self, addr: int, n: int) -> memoryview: ...
        def _put_packed(
            self, keys: list[str], packed: list[bytes], config: Any = None
        ) -> list[int]: ...
        @staticmethod
        def _tensor_or_none(key: str, raw: bytes | None) -> Any: ...

    # ------------------------------------------------------------------ writes
    def _par_put(
        self,
        what: str,
        keys: list[str],
        tensors: list[Any],
        pars: Any,
        config: Any,
        writers: Any,
        upsert: bool,
        whole_buffer: bool = False,
    ) -> list[int]:
        if config is not None and not isinstance(config, ReplicateConfig):
            raise TypeError(f"{what}(): config must be a ReplicateConfig")
        n = len(keys)
        if len(tensors) != n:
            logger.error("%s: values and keys must have the same length", what)
            return [INVALID_PARAMS] * n
        if pars is not None and writers is not None:
            logger.error("%s: writer_partitions cannot be combined with parallelisms", what)
            return [INVALID_PARAMS] * n
        for name, lst in (("parallelisms", pars), ("writer_partitions", writers)):
            if lst is not None and len(lst) != n:
                logger.error("%s: keys and %s must have the same length", what, name)
                return [INVALID_PARAMS] * n
        if self._refused(what, config, staged=False):
            return [INVALID_PARAMS] * n
        out = [0] * n
        for i, (key, tensor) in enumerate(zip(keys, tensors, strict=True)):
            par = pars[i] if pars is not None else None
            writer = writers[i] if writers is not None else None
            if tensor is None:  # a *_from buffer that held no tensor object
                out[i] = INVALID_PARAMS
                continue
            try:
                objs = _objects(key, tensor, par, writer, whole_buffer)
            except (_Refused, _fmt.TensorFormatError) as exc:
                logger.error("%s %r: %s", what, key, exc)
                out[i] = INVALID_PARAMS
                continue
            for name, blob in objs:

                def put(name: str = name, blob: bytes = blob) -> int:
                    return self._put_packed([name], [blob], config)[0]

                out[i] = out[i] or (self._upsert(name, put) if upsert else put())
        return out

    def _tensors_from(self, what: str, ptrs: list[int], sizes: list[int]) -> list[Any]:
        out: list[Any] = []
        for p, n in zip(ptrs, sizes, strict=False):
            try:
                out.append(_fmt.unpack(self._host(int(p), int(n)), copy=False))
            except (MooncakeError, *_BAD) as exc:
                logger.error("%s: invalid tensor object metadata: %s", what, exc)
                out.append(None)
        return out

    def put_tensor_with_parallelism(
        self,
        key: str,
        tensor: Any,
        parallelism: Any = None,
        config: Any = None,
        writer_partition: Any = None,
    ) -> int:
        """Store ``tensor`` as the shard ``parallelism`` names, or partition ``writer_partition``
        of it, or whole (see module doc); 0 or a negative code."""
        _typed("key", key, (str,))
        wp = None if writer_partition is None else [writer_partition]
        par = None if parallelism is None else [parallelism]
        return self._par_put("put_tensor_with_parallelism", [key], [tensor], par, config, wp,
                             False)[0]  # fmt: skip

    def upsert_tensor_with_parallelism(
        self,
        key: str,
        tensor: Any,
        parallelism: Any = None,
        config: Any = None,
        writer_partition: Any = None,
    ) -> int:
        """:meth:`put_tensor_with_parallelism`, replacing existing objects."""
        _typed("key", key, (str,))
        wp = None if writer_partition is None else [writer_partition]
        par = None if parallelism is None else [parallelism]
        return self._par_put("upsert_tensor_with_parallelism", [key], [tensor], par, config, wp,
                             True)[0]  # fmt: skip

    def batch_put_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list[Any],
        parallelisms: Any = None,
        config: Any = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        """:meth:`put_tensor_with_parallelism` per key; per key 0 or a negative code."""
        return self._par_put("batch_put_tensor_with_parallelism", list(keys), list(tensors_list),
                             parallelisms, config, writer_partitions, False)  # fmt: skip

    def batch_upsert_tensor_with_parallelism(
        self,
        keys: list[str],
        tensors_list: list[Any],
        parallelisms: Any = None,
        config: Any = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        """:meth:`upsert_tensor_with_parallelism` per key."""
        return self._par_put("batch_upsert_tensor_with_parallelism", list(keys),
                             list(tensors_list), parallelisms, config, writer_partitions,
                             True)  # fmt: skip

    def put_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: Any = None,
        config: Any = None,
        writer_partition: Any = None,
    ) -> int:
        """:meth:`put_tensor_with_parallelism` of the whole tensor object in registered memory
        (with a TP axis: all its shards)."""
        return self.batch_put_tensor_with_parallelism_from(
            [key], [buffer_ptr], [size],
            None if parallelism is None else [parallelism], config,
            None if writer_partition is None else [writer_partition],
        )[0]  # fmt: skip

    def upsert_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: Any = None,
        config: Any = None,
        writer_partition: Any = None,
    ) -> int:
        """:meth:`put_tensor_with_parallelism_from`, replacing existing objects."""
        return self.batch_upsert_tensor_with_parallelism_from(
            [key], [buffer_ptr], [size],
            None if parallelism is None else [parallelism], config,
            None if writer_partition is None else [writer_partition],
        )[0]  # fmt: skip

    def batch_put_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: Any = None,
        config: Any = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        """:meth:`put_tensor_with_parallelism_from` per buffer."""
        return self._par_from("batch_put_tensor_with_parallelism_from", keys, buffer_ptrs, sizes,
                              parallelisms, config, writer_partitions, False)  # fmt: skip

    def batch_upsert_tensor_with_parallelism_from(
        self,
        keys: list[str],
        buffer_ptrs: list[int],
        sizes: list[int],
        parallelisms: Any = None,
        config: Any = None,
        writer_partitions: Any = None,
    ) -> list[int]:
        """:meth:`upsert_tensor_with_parallelism_from` per buffer."""
        return self._par_from("batch_upsert_tensor_with_parallelism_from", keys, buffer_ptrs,
                              sizes, parallelisms, config, writer_partitions, True)  # fmt: skip

    def _par_from(
        self, what: str, keys: list[str], ptrs: list[int], sizes: list[int], pars: Any,
        config: Any, writers: Any, upsert: bool,
    ) -> list[int]:  # fmt: skip
        if not len(keys) == len(ptrs) == len(sizes):
            logger.error("%s: keys, buffer_ptrs and sizes differ in length", what)
            return [INVALID_PARAMS] * len(keys)
        tensors = self._tensors_from(what, ptrs, sizes)
        return self._par_put(what, list(keys), tensors, pars, config, writers, upsert, True)

    # ------------------------------------------------------------------ reads
    def _fetch_shards(self, keys: list[str]) -> list[bytes | None]:
        res = self._run("get tensor shards", lambda c: c.get_batch(keys))
        return [None] * len(keys) if isinstance(res, int) else list(res)

    def _gather_shards(self, keys: list[str], dim: int) -> Any:
        """The whole tensor from its shards (None if one is missing or not a tensor)."""
        import torch

        parts = [self._tensor_or_none(k, raw) for k, raw in zip(keys, self._fetch_shards(keys),
                 strict=True)]  # fmt: skip
        if any(p is None for p in parts):
            logger.error("get_tensor_with_parallelism: missing shard source among %s", keys)
            return None
        return torch.cat(parts, dim)

    def _par_blob(self, key: str, target: Any) -> bytes | None:
        """The tensor object (header and data) a read with ``target`` gives, or None."""
        if target is not None and not isinstance(target, ReadTarget):
            logger.error("ReadTarget must provide mode and parallelism")
            return None
        mode, par = ("as_stored", None) if target is None else (target.mode, target.parallelism)
        if par is None:
            if mode == "shard":
                logger.error("get_tensor_with_parallelism: parallelism is required")
                return None
            if mode == "full":
                (wm,) = self._fetch_shards([key + _WRITER_MANIFEST])
                if wm is not None:
                    m = _fmt.unpack_manifest(wm)
                    names = [f"{key}__writer_{i}of{m.size}_sd{m.split_dim}" for i in range(m.size)]
                    whole = self._gather_shards(names, m.split_dim)
                    return None if whole is None else _fmt.pack(whole)
            return self._fetch_shards([key])[0]
        if mode == "as_stored":
            logger.error("get_tensor_with_parallelism: unsupported ReadTarget mode")
            return None
        axes = _axes(par)
        tp = next((a for k, a in axes if k == "tp"), None)
        if tp is None:
            if mode == "full":
                logger.error("get_tensor_with_parallelism: full reconstruction requires a TP axis")
                return None
            return self._fetch_shards([key + _suffix(axes)])[0]
        r, n, d = tp.rank, tp.size, int(tp.split_dim or 0)
        if len(axes) > 1:  # TP with other axes: the named shard, or all TP ranks of it
            if mode == "shard":
                return self._fetch_shards([key + _suffix(axes)])[0]
            whole = self._gather_shards([key + _suffix(axes, i) for i in range(n)], d)
            return None if whole is None else _fmt.pack(whole)
        pm, wm = self._fetch_shards([key + _MANIFEST, key + _WRITER_MANIFEST])
        if pm is None:
            if mode == "full":  # shards of put_tensor_with_tp: as many as the axis names
                whole = self._gather_shards([f"{key}_tp_{i}" for i in range(n)], d)
                return None if whole is None else _fmt.pack(whole)
            if wm is not None:
                m = _fmt.unpack_manifest(wm)
                if (m.size, m.split_dim) != (n, d):
                    logger.error("get_tensor_with_parallelism: no shard matched the layout")
                    return None
                return self._fetch_shards([f"{key}__writer_{r}of{n}_sd{d}"])[0]
            return self._fetch_shards([f"{key}_tp_{r}"])[0]
        m = _fmt.unpack_manifest(pm)
        uniform = d == m.split_dim and d < len(m.whole_shape) and m.whole_shape[d] % n == 0
        if mode == "shard" and (not uniform or n == m.size):
            return self._fetch_shards([f"{key}_tp_{r}"])[0]  # the stored shard (as published)
        if not uniform:
            logger.error("get_tensor_with_parallelism: split_dim mismatch or uneven split")
            return None
        whole = self._gather_shards([f"{key}_tp_{i}" for i in range(m.size)], d)
        if whole is None:
            return None
        if mode == "full":
            return _fmt.pack(whole)
        part = _split(whole, r, n, d)
        axis = _fmt.Axis(1, r, n, d, 0, int(part.shape[d]))
        return _fmt.pack(part, axes=[axis], whole_shape=m.whole_shape)

    def _par_read(self, key: str, target: Any) -> bytes | None:
        try:
            return self._par_blob(key, target)
        except (_Refused, *_BAD) as exc:
            logger.error("get_tensor_with_parallelism %r: %s", key, exc)
            return None

    def get_tensor_with_parallelism(self, key: str, target: Any = None) -> Any:
        """The tensor ``target`` asks for (see module doc), or None."""
        return self._tensor_or_none(key, self._par_read(key, target))

    def batch_get_tensor_with_parallelism(self, keys: list[str], targets: Any = None) -> list[Any]:
        """:meth:`get_tensor_with_parallelism` per key (``targets``: one per key, or None)."""
        if targets is not None and len(targets) != len(keys):
            logger.error("batch_get_tensor_with_parallelism: keys and targets differ in length")
            return [None] * len(keys)
        ts = targets if targets is not None else [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, ts, strict=True)]

    def get_tensor_with_parallelism_into(
        self, key: str, buffer_ptr: int, size: int, target: Any = None
    ) -> Any:
        """:meth:`get_tensor_with_parallelism` into registered memory: the tensor object
        lands at ``buffer_ptr``; returns a tensor sharing it, or None."""
        blob = self._par_read(key, target)
        if blob is None or not _fmt.is_tensor_object(blob):
            return None
        if len(blob) > int(size):
            logger.error("get_tensor_with_parallelism_into %r: buffer too small", key)
            return None
        try:
            view = self._host(int(buffer_ptr), len(blob))
            view[:] = blob
            return _fmt.unpack(view, copy=False)
        except (MooncakeError, *_BAD) as exc:
            logger.error("get_tensor_with_parallelism_into %r: %s", key, exc)
            return None

    def batch_get_tensor_with_parallelism_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], targets: Any = None
    ) -> list[Any]:
        """:meth:`get_tensor_with_parallelism_into` per key."""
        n = len(keys)
        if not n == len(buffer_ptrs) == len(sizes) or (targets is not None and len(targets) != n):
            logger.error("batch_get_tensor_with_parallelism_into: the lists differ in length")
            return [None] * n
        ts = targets if targets is not None else [None] * n
        return [
            self.get_tensor_with_parallelism_into(k, p, s, t)
            for k, p, s, t in zip(keys, buffer_ptrs, sizes, ts, strict=True)
        ]
