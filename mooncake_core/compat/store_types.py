"""Values of ``mooncake.store`` other than the store: return codes, enums, ``ReplicateConfig``.

The published ``ErrorCode`` values we can tell apart (and :data:`ERROR_CODES`, which maps
our exceptions onto them), ``SoftPinAction``, ``ObjectDataType`` and its module-level
constants, :class:`ReplicateConfig` with the published field types (a wrong type raises
``TypeError`` where the published class does) and :class:`BufferHandle`.
:mod:`mooncake_core.compat.store` re-exports every name.
"""

from __future__ import annotations

import ctypes
import enum
import numbers
import operator
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_core.errors import (
    LeaseExpired,
    MasterUnavailable,
    NoSpace,
    ObjectExists,
    ObjectNotFound,
    SegmentError,
    TransportError,
)
from mooncake_core.store.protocol import InvalidArgument, ObjectBusy

# Published ErrorCode values for the failures we can tell apart.
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200  # no space for the object
INVALID_PARAMS = -600  # bad key/size/buffer, buffer too small, double registration
INVALID_READ = -701  # the read outlived its lease
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706  # remove of a leased / pinned / busy object without force
TRANSFER_FAIL = -800
RPC_FAIL = -900  # master unreachable

#: Our exception class -> published code (first match wins; order matters).
ERROR_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (ObjectNotFound, OBJECT_NOT_FOUND),
    (ObjectExists, OBJECT_ALREADY_EXISTS),
    (ObjectBusy, OBJECT_HAS_LEASE),
    (NoSpace, NO_AVAILABLE_HANDLE),
    (LeaseExpired, INVALID_READ),
    (MasterUnavailable, RPC_FAIL),
    (InvalidArgument, INVALID_PARAMS),
    (SegmentError, INVALID_PARAMS),
    (ValueError, INVALID_PARAMS),
    (TransportError, TRANSFER_FAIL),
    (OSError, RPC_FAIL),
)

_DEFAULT_SOFT_PIN_TTL_MS = 30 * 60 * 1000


def _code(exc: BaseException) -> int:
    for cls, code in ERROR_CODES:
        if isinstance(exc, cls):
            return code
    return INTERNAL_ERROR


class SoftPinAction(enum.IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


# The published module exports the ObjectDataType members at module level too.
UNKNOWN = ObjectDataType.UNKNOWN
KVCACHE = ObjectDataType.KVCACHE
TENSOR = ObjectDataType.TENSOR
WEIGHT = ObjectDataType.WEIGHT
SAMPLE = ObjectDataType.SAMPLE
ACTIVATION = ObjectDataType.ACTIVATION
GRADIENT = ObjectDataType.GRADIENT
OPTIMIZER_STATE = ObjectDataType.OPTIMIZER_STATE
METADATA = ObjectDataType.METADATA
GENERAL = ObjectDataType.GENERAL


def _size_t(name: str, value: Any) -> int:
    """An unsigned 64-bit integer as pybind11 accepts it (ints, bools, enums; not floats)."""
    try:
        n = operator.index(value)
    except TypeError:
        n = -1
    if not 0 <= n < 1 << 64:
        raise TypeError(
            f"ReplicateConfig.{name}: expected a non-negative int, got {type(value).__name__}"
            f" {value!r}"
        )
    return n


def _opt_size_t(name: str, value: Any) -> int | None:
    return None if value is None else _size_t(name, value)


def _flag(name: str, value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, numbers.Number) and not isinstance(value, enum.Enum):
        return bool(value)
    raise TypeError(f"ReplicateConfig.{name}: expected a bool, got {type(value).__name__}")


def _text(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode()
    raise TypeError(f"ReplicateConfig.{name}: expected a str, got {type(value).__name__}")


def _texts(name: str, value: Any) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(
            f"ReplicateConfig.{name}: expected a list of str, got {type(value).__name__}"
        )
    return [_text(name, v) for v in value]


def _opt_texts(name: str, value: Any) -> list[str] | None:
    return None if value is None else _texts(name, value)


def _member_of(kind: type[enum.Enum]) -> Callable[[str, Any], Any]:
    def convert(name: str, value: Any) -> Any:
        if not isinstance(value, kind):
            raise TypeError(
                f"ReplicateConfig.{name}: expected a {kind.__name__}, got {type(value).__name__}"
            )
        return value

    return convert


class _Typed:
    """A ``ReplicateConfig`` attribute that converts (or refuses, with ``TypeError``) what
    is assigned, as the published pybind11 class does."""

    def __init__(self, convert: Callable[[str, Any], Any], default: Callable[[], Any]) -> None:
        self.convert = convert
        self.default = default
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, "_v_" + self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        object.__setattr__(obj, "_v_" + self.name, self.convert(self.name, value))


_FIELDS = (
    "replica_num",
    "nof_replica_num",
    "dfs_replica_num",
    "soft_pin_action",
    "soft_pin_ttl_ms",
    "with_hard_pin",
    "preferred_segment",
    "preferred_segments",
    "preferred_nof_segments",
    "prefer_alloc_in_same_node",
    "data_type",
    "group_ids",
    "tenant_id",
)


class ReplicateConfig:
    """Per-put placement options (attribute names, types and defaults of the published class).

    Assigning a value of the wrong type raises ``TypeError`` as the published class does;
    unknown attributes raise ``AttributeError``.

    Used here: ``replica_num``, ``with_hard_pin``, ``soft_pin_action`` (ENABLE pins softly
    for ``soft_pin_ttl_ms``, default 30 min), ``preferred_segment`` (else the first of
    ``preferred_segments``), ``prefer_alloc_in_same_node`` (local-first placement).
    Kept but without effect: ``nof_replica_num``, ``dfs_replica_num``,
    ``preferred_nof_segments``, ``data_type``, ``group_ids``.
    Ours only: ``tenant_id`` ("" = the store's own): a put naming another tenant than the one
    its store was set up with (``setup(..., tenant_id=...)``) is refused, so a writer never
    charges a tenant's quota or namespace it did not mean to.
    """

    __slots__ = tuple("_v_" + f for f in _FIELDS)

    replica_num = _Typed(_size_t, lambda: 1)
    nof_replica_num = _Typed(_size_t, lambda: 0)
    dfs_replica_num = _Typed(_size_t, lambda: 0)
    soft_pin_action = _Typed(_member_of(SoftPinAction), lambda: SoftPinAction.PRESERVE)
    soft_pin_ttl_ms = _Typed(_opt_size_t, lambda: None)
    with_hard_pin = _Typed(_flag, lambda: False)
    preferred_segment = _Typed(_text, lambda: "")
    preferred_segments = _Typed(_texts, list)
    preferred_nof_segments = _Typed(_texts, list)
    prefer_alloc_in_same_node = _Typed(_flag, lambda: False)
    data_type = _Typed(_member_of(ObjectDataType), lambda: ObjectDataType.UNKNOWN)
    group_ids = _Typed(_opt_texts, lambda: None)
    tenant_id = _Typed(_text, lambda: "")

    def __init__(self) -> None:
        for name in _FIELDS:
            field: _Typed = type(self).__dict__[name]
            object.__setattr__(self, "_v_" + name, field.default())

    def __repr__(self) -> str:
        return (
            f"ReplicateConfig(replica_num={self.replica_num}, with_hard_pin={self.with_hard_pin}, "
            f"soft_pin_action={self.soft_pin_action.name}, "
            f"preferred_segment={self.preferred_segment!r})"
        )

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else str(self.soft_pin_ttl_ms)
        return (
            f"ReplicateConfig: {{ replica_num: {self.replica_num}, "
            f"nof_replica_num: {self.nof_replica_num}, dfs_replica_num: {self.dfs_replica_num}, "
            f"soft_pin_action: {self.soft_pin_action.name}, soft_pin_ttl_ms: {ttl}, "
            f"with_hard_pin: {int(self.with_hard_pin)}, "
            f"preferred_segments: [{', '.join(self.preferred_segments)}], "
            f"preferred_nof_segments: [{', '.join(self.preferred_nof_segments)}], "
            f"prefer_alloc_in_same_node: {int(self.prefer_alloc_in_same_node)}, "
            f"data_type: {self.data_type.name} }}"
        )

    def problem(self, tenant: str | None = None) -> str | None:
        """Why a put with this config is refused (-600 in the published store), or None.
        ``tenant``: the putting store's tenant ("" the default one; None: not checked)."""
        own = (tenant or "default") if tenant is not None else None
        if own is not None and self.tenant_id and self.tenant_id != own:
            return f"config.tenant_id {self.tenant_id!r} is not this store's tenant {own!r}"
        if self.soft_pin_ttl_ms is not None and self.soft_pin_action != SoftPinAction.ENABLE:
            return (
                f"soft_pin_ttl_ms={self.soft_pin_ttl_ms} needs soft_pin_action ENABLE"
                f" (it is {self.soft_pin_action.name})"
            )
        return None

    def kwargs(self) -> dict[str, Any]:
        """The matching :class:`StoreClient` put keywords."""
        soft = 0.0
        if self.soft_pin_action == SoftPinAction.ENABLE:
            ms = self.soft_pin_ttl_ms if self.soft_pin_ttl_ms else _DEFAULT_SOFT_PIN_TTL_MS
            soft = ms / 1000.0
        seg = self.preferred_segment or (
            self.preferred_segments[0] if self.preferred_segments else ""
        )
        return {
            "replica_num": int(self.replica_num),
            "preferred_segment": seg,
            "hard_pin": bool(self.with_hard_pin),
            "soft_pin_ttl_s": soft,
            "strategy": "local-first" if self.prefer_alloc_in_same_node else "",
        }


class BufferHandle(bytearray):
    """An object's bytes held in local memory: buffer protocol, ``ptr()`` and ``size()``."""

    def ptr(self) -> int:
        if not self:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        return len(self)


#: The published client picks its port in this range (12300-14300), as observed on the wheel.
