"""The published store's tensor object format (``put_tensor`` and friends), byte for byte.

An object written by the published ``MooncakeDistributedStore.put_tensor`` (0.3.13) is a
304-byte header followed by the tensor's bytes in C order. Read off the wheel's objects
(``tests/integration/test_compat_parity.py`` compares the bytes of both), little-endian:

====== ========= ==================================================================
offset type      field
====== ========= ==================================================================
0      u32       magic ``0x4D4F4F4E`` (the bytes ``NOOM``)
4      u16       version, 1
6      u16       header size, 304
8      i32       dtype code (:data:`DTYPE_CODES`)
12     i32       number of dimensions (at most 8)
16     u32       layout: 0 whole tensor, 1 a tensor-parallel shard
24     u64       offset of the data (304)
32     u64       data bytes
40     i64[8]    shape of the whole tensor, -1 in unused slots
104    i64[8]    shape of the stored tensor (the same unless a shard)
168    u32       number of parallel axes (at most 4)
176    32 bytes  per axis: u32 kind (0 DP, 1 TP, 2 EP, 3 PP), u32 the axis' index,
                 u32 rank, u32 size, u32 split_dim (0xFFFFFFFF: none), u32 the stage id
                 (PP) or expert id (EP), u64 the shard's extent along split_dim (TP)
====== ========= ==================================================================

The rest of the header is zero. A tensor stored in TP shards by
``put_tensor_with_parallelism`` (or in writer partitions) also has a 96-byte manifest
object (:func:`manifest`): u32 magic ``0x574D414E`` (``NAMW``), u16 version 1, u16 size 96,
i32 dtype code, i32 number of dimensions, u32 split_dim, u32 number of shards, 8 zero bytes,
i64[8] the whole tensor's shape (-1 in unused slots). Torch is imported lazily (only these
functions need it).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

__all__ = [
    "DTYPE_CODES",
    "HEADER_SIZE",
    "MAGIC",
    "Axis",
    "Manifest",
    "Shard",
    "TensorFormatError",
    "header",
    "is_tensor_object",
    "manifest",
    "pack",
    "unpack",
    "unpack_header",
    "unpack_manifest",
]

MAGIC = 0x4D4F4F4E
VERSION = 1
HEADER_SIZE = 304
MAX_DIMS = 8
_FIXED = struct.Struct("<IHHiiIIQQ")  # magic .. data bytes (40 bytes)
_DIMS = struct.Struct("<8q")
_AXIS = struct.Struct("<IIIIIIQ")
_GLOBAL_AT, _SHAPE_AT, _AXES_AT, _AXIS_AT = 40, 104, 168, 176
MAX_AXES = 4
MANIFEST_MAGIC = 0x574D414E
MANIFEST_SIZE = 96
_MANIFEST = struct.Struct("<IHHiiII8x")  # magic .. number of shards (32 bytes)

#: torch dtype name -> the published code (the dtypes the published store accepts).
DTYPE_CODES: dict[str, int] = {
    "float32": 0,
    "float64": 1,
    "int8": 2,
    "uint8": 3,
    "int16": 4,
    "uint16": 5,
    "int32": 6,
    "uint32": 7,
    "int64": 8,
    "uint64": 9,
    "bool": 10,
    "float16": 11,
    "bfloat16": 12,
    "float8_e4m3fn": 13,
    "float8_e5m2": 14,
}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


class TensorFormatError(ValueError):
    """Not a tensor, a dtype the format has no code for, or bytes that are not a tensor object."""


class Shard(NamedTuple):
    """A tensor-parallel shard: ``rank`` of ``size`` along ``split_dim`` of ``whole_shape``."""

    rank: int
    size: int
    split_dim: int
    whole_shape: tuple[int, ...]


class Axis(NamedTuple):
    """One parallel axis of a stored shard (see the table above)."""

    kind: int  # 0 DP, 1 TP, 2 EP, 3 PP
    rank: int
    size: int
    split_dim: int = -1  # -1: none
    ident: int = 0  # the stage id (PP) or expert id (EP)
    extent: int = 0  # the shard's extent along split_dim (TP)


class Manifest(NamedTuple):
    """A sharded tensor's manifest: ``size`` shards along ``split_dim`` of ``whole_shape``."""

    dtype: str
    split_dim: int
    size: int
    whole_shape: tuple[int, ...]


class Header(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    data_bytes: int
    shard: Shard | None


def _dims(shape: tuple[int, ...]) -> bytes:
    return _DIMS.pack(*shape, *([-1] * (MAX_DIMS - len(shape))))


def header(
    dtype: str,
    shape: tuple[int, ...],
    data_bytes: int,
    shard: Shard | None = None,
    *,
    axes: list[Axis] | None = None,
    whole_shape: tuple[int, ...] | None = None,
) -> bytes:
    """The 304-byte header of a tensor of ``dtype`` (a torch dtype name) and ``shape``: a
    whole tensor, a TP ``shard``, or a shard on ``axes`` of ``whole_shape``."""
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise TensorFormatError(f"dtype {dtype} is not supported by the tensor format")
    if len(shape) > MAX_DIMS:
        raise TensorFormatError(f"{len(shape)} dimensions; the tensor format holds at most 8")
    if shard is not None:
        extent = shape[shard.split_dim]
        axes = [Axis(1, shard.rank, shard.size, shard.split_dim, 0, extent)]
        whole_shape = shard.whole_shape
    if axes and len(axes) > MAX_AXES:
        raise TensorFormatError(f"{len(axes)} parallel axes; the tensor format holds at most 4")
    out = bytearray(HEADER_SIZE)
    layout = 1 if axes else 0
    _FIXED.pack_into(
        out, 0, MAGIC, VERSION, HEADER_SIZE, code, len(shape), layout, 0, HEADER_SIZE, data_bytes
    )
    out[_SHAPE_AT : _SHAPE_AT + _DIMS.size] = _dims(shape)
    whole = shape if whole_shape is None else whole_shape
    out[_GLOBAL_AT : _GLOBAL_AT + _DIMS.size] = _dims(whole)
    if axes:
        struct.pack_into("<I", out, _AXES_AT, len(axes))
        m = 0xFFFFFFFF
        for i, a in enumerate(axes):
            at = _AXIS_AT + i * _AXIS.size
            _AXIS.pack_into(
                out, at, a.kind, i, a.rank & m, a.size & m, a.split_dim & m, a.ident & m, a.extent
            )
    return bytes(out)


def manifest(dtype: str, split_dim: int, size: int, whole_shape: tuple[int, ...]) -> bytes:
    """The 96-byte manifest of a tensor stored in ``size`` shards along ``split_dim``."""
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise TensorFormatError(f"dtype {dtype} is not supported by the tensor format")
    head = _MANIFEST.pack(
        MANIFEST_MAGIC, VERSION, MANIFEST_SIZE, code, len(whole_shape), split_dim, size
    )
    return head + _dims(whole_shape)


def unpack_manifest(data: bytes | memoryview) -> Manifest:
    """A manifest's fields; :class:`TensorFormatError` if ``data`` is not one."""
    if len(data) < MANIFEST_SIZE:
        raise TensorFormatError(f"{len(data)} bytes: too short for a manifest")
    magic, version, size, code, ndim, split_dim, n = _MANIFEST.unpack_from(data)
    dtype = _CODE_DTYPES.get(code)
    if magic != MANIFEST_MAGIC or version != VERSION or size != MANIFEST_SIZE or dtype is None:
        raise TensorFormatError("not a tensor manifest (bad magic, version or dtype)")
    if not 0 <= ndim <= MAX_DIMS or not 0 <= split_dim < max(ndim, 1) or n < 1:
        raise TensorFormatError(f"bad manifest ({ndim} dimensions, split_dim {split_dim})")
    whole = _DIMS.unpack_from(data, _MANIFEST.size)[:ndim]
    return Manifest(dtype, split_dim, n, tuple(whole))


def _contiguous_bytes(tensor: Any) -> tuple[str, tuple[int, ...], bytes]:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TensorFormatError(f"not a torch tensor: {type(tensor).__name__}")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPE_CODES:
        raise TensorFormatError(f"dtype {dtype} is not supported by the tensor format")
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return dtype, tuple(int(d) for d in t.shape), raw


def pack(
    tensor: Any,
    shard: Shard | None = None,
    *,
    axes: list[Axis] | None = None,
    whole_shape: tuple[int, ...] | None = None,
) -> bytes:
    """Header and data of ``tensor`` (a CPU copy is taken of other devices' tensors)."""
    dtype, shape, raw = _contiguous_bytes(tensor)
    head = header(dtype, shape, len(raw), shard, axes=axes, whole_shape=whole_shape)
    return head + raw


def is_tensor_object(data: bytes | memoryview) -> bool:
    """True when ``data`` starts with the format's magic, version and header size."""
    if len(data) < 8:
        return False
    magic, version, size = struct.unpack_from("<IHH", data)
    return bool(magic == MAGIC and version == VERSION and size == HEADER_SIZE)


def unpack_header(data: bytes | memoryview) -> Header:
    """The header of a tensor object; :class:`TensorFormatError` if ``data`` is not one."""
    if len(data) < HEADER_SIZE:
        raise TensorFormatError(f"{len(data)} bytes: too short for a tensor header")
    if not is_tensor_object(data):
        raise TensorFormatError("not a tensor object (bad magic or version)")
    _, _, _, code, ndim, layout, _, offset, nbytes = _FIXED.unpack_from(data)
    dtype = _CODE_DTYPES.get(code)
    if dtype is None or not 0 <= ndim <= MAX_DIMS or offset != HEADER_SIZE:
        raise TensorFormatError(f"bad tensor header (dtype code {code}, {ndim} dimensions)")
    shape = _DIMS.unpack_from(data, _SHAPE_AT)[:ndim]
    shard = None
    if layout == 1 and struct.unpack_from("<I", data, _AXES_AT)[0] >= 1:
        _, _, rank, size, split_dim, _, _ = _AXIS.unpack_from(data, _AXIS_AT)
        whole = _DIMS.unpack_from(data, _GLOBAL_AT)[:ndim]
        shard = Shard(rank, size, split_dim, tuple(whole))
    return Header(dtype, tuple(shape), int(nbytes), shard)


def unpack(data: bytes | memoryview, *, copy: bool = True) -> Any:
    """The tensor in a tensor object. With ``copy=False`` the tensor shares ``data``'s memory
    (``data`` must then be writable, e.g. a view of registered memory)."""
    import torch

    head = unpack_header(data)
    if len(data) < HEADER_SIZE + head.data_bytes:
        raise TensorFormatError(
            f"tensor object holds {len(data) - HEADER_SIZE} data bytes, header says "
            f"{head.data_bytes}"
        )
    dtype = getattr(torch, head.dtype)
    shape = head.shape or (1,)  # a 0-d tensor comes back with shape [1], as published
    if head.data_bytes == 0:
        return torch.empty(shape, dtype=dtype)
    body = memoryview(data)[HEADER_SIZE : HEADER_SIZE + head.data_bytes]
    buf: Any = bytearray(body) if copy else body
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)
