"""A physical runtime view of one logical placement fragment (any resource kind)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from mooncake_core.compat.reshard.contracts.ids import PlacementFragmentId, RuntimeFragmentId

__all__ = ["RuntimeBindingFragment"]

_U64_MAX = (1 << 64) - 1
_TEXT_FIELDS = ("placement_fragment_id", "fragment_id", "worker_id", "endpoint", "device")


def _int_at_least(value: object, name: str, lowest: int) -> int:
    if type(value) is not int:  # bool is refused too
        raise ValueError(f"{name} must be an integer")
    if value < lowest:
        raise ValueError(f"{name} must be at least {lowest}")
    return value


def _u64(value: object, name: str, lowest: int = 0) -> int:
    number = _int_at_least(value, name, lowest)
    if number > _U64_MAX:
        raise ValueError(f"{name} must fit in an unsigned 64-bit integer")
    return number


def _span(address: object, nbytes: object) -> None:
    start = _u64(address, "address", 1)
    size = _u64(nbytes, "nbytes", 1)
    if start + size > _U64_MAX:
        raise ValueError("address range must fit in an unsigned 64-bit integer")


def _ints(values: object, name: str, lowest: int) -> tuple[int, ...]:
    if type(values) not in (tuple, list):  # not a subclass, not another sequence
        raise ValueError(f"{name} must be a tuple or list")
    items = cast(Sequence[object], values)
    return tuple(_int_at_least(v, f"{name}[{i}]", lowest) for i, v in enumerate(items))


def _dense_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Row-major strides in bytes of a dense array of ``shape``."""
    out: list[int] = []
    step = itemsize
    for extent in reversed(shape):
        out.append(step)
        step *= extent
    return tuple(reversed(out))


@dataclass(frozen=True)
class RuntimeBindingFragment:
    """A contiguous view (address, shape, byte strides) inside one allocation
    (``storage_address`` .. ``+ storage_nbytes``), bound to a placement fragment.

    Validated on construction; strides of extent-1 dimensions are normalised to the
    dense ones. ``owner`` (the framework object keeping the memory alive) is local to
    this process: it is not compared, not shown, and not pickled."""

    placement_fragment_id: PlacementFragmentId
    fragment_id: RuntimeFragmentId
    address: int
    nbytes: int
    worker_id: str
    endpoint: str
    device: str
    itemsize: int
    local_shape: tuple[int, ...]
    strides_bytes: tuple[int, ...]
    storage_address: int
    storage_nbytes: int
    storage_offset_bytes: int
    owner: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            if type(value) is not str or not value:
                raise ValueError(f"{name} must be a non-empty string")
        _span(self.address, self.nbytes)
        _int_at_least(self.itemsize, "runtime itemsize", 1)
        shape = _ints(self.local_shape, "runtime local_shape", 1)
        strides = _ints(self.strides_bytes, "runtime strides_bytes", 0)
        if len(shape) != len(strides):
            raise ValueError("runtime stride rank differs from local_shape")
        if any(n > 1 and s == 0 for n, s in zip(shape, strides, strict=True)):
            raise ValueError("runtime stride must be positive for non-singleton dimensions")
        dense = _dense_strides(shape, self.itemsize)
        strides = tuple(d if n == 1 else s for n, s, d in zip(shape, strides, dense, strict=True))
        object.__setattr__(self, "local_shape", shape)
        object.__setattr__(self, "strides_bytes", strides)
        _span(self.storage_address, self.storage_nbytes)
        offset = _u64(self.storage_offset_bytes, "storage_offset_bytes")
        if offset > _U64_MAX - self.storage_address:
            raise ValueError("normalized runtime address must fit in 64 bits")
        if self.address != self.storage_address + offset:
            raise ValueError("runtime address must equal storage_address plus storage_offset_bytes")
        if offset > self.storage_nbytes - self.nbytes:
            raise ValueError("runtime view exceeds storage allocation bounds")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle without ``owner``: a receiver must bind its own allocation."""
        return (
            type(self),
            (
                self.placement_fragment_id,
                self.fragment_id,
                self.address,
                self.nbytes,
                self.worker_id,
                self.endpoint,
                self.device,
                self.itemsize,
                self.local_shape,
                self.strides_bytes,
                self.storage_address,
                self.storage_nbytes,
                self.storage_offset_bytes,
            ),
        )
