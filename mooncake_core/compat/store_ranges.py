"""``get_into_ranges`` of ``mooncake.store``'s ``MooncakeDistributedStore``, as a mixin.

Byte ranges of objects copied into registered buffers, with the published per-range answers
(bytes copied, -704 for a missing key, -600 for a range outside the object or the buffer and
for lists of unequal length; tests/integration/test_compat_parity.py). The method relies on
the store's ``_run`` and ``_host``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from mooncake_core.compat.store_types import INVALID_PARAMS, OBJECT_NOT_FOUND, _code
from mooncake_core.errors import MooncakeError

if TYPE_CHECKING:
    from mooncake_core.store import StoreClient

__all__ = ["RangeMethods"]

logger = logging.getLogger("mooncake_core.compat.store")
T = TypeVar("T")


class RangeMethods:
    """``get_into_ranges``."""

    if TYPE_CHECKING:  # provided by MooncakeDistributedStore

        def _run(self, what: str, fn: Callable[[StoreClient], T]) -> T | int: ...
        def _host(self, addr: int, n: int) -> memoryview: ...

    def get_into_ranges(
        self,
        buffer_ptrs: list[int],
        all_keys: list[list[str]],
        all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]],
        all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]:
        """Copy byte ranges of objects into registered buffers: for buffer ``i``, key
        ``all_keys[i][j]`` and range ``k``, ``all_sizes[i][j][k]`` bytes from offset
        ``all_src_offsets[i][j][k]`` of the object to ``buffer_ptrs[i] +
        all_dst_offsets[i][j][k]``. Per range: the bytes copied, -704 (missing key) or -600
        (range outside the object or the registered buffer; lists of unequal length)."""
        if not (len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets)) or not (
            len(all_keys) == len(all_src_offsets) == len(all_sizes)
        ):
            logger.error("get_into_ranges: the five lists differ in length")
            return [[[INVALID_PARAMS]] for _ in buffer_ptrs]
        wanted = sorted({k for keys in all_keys for k in keys})
        got = self._run("get_into_ranges", lambda c: c.get_batch(wanted)) if wanted else []
        if isinstance(got, int):
            return [[[got] * len(r) for r in dst] for dst in all_dst_offsets]
        objects = dict(zip(wanted, got, strict=True))
        out: list[list[list[int]]] = []
        for i, base in enumerate(buffer_ptrs):
            keys, dst, src, sizes = (
                all_keys[i],
                all_dst_offsets[i],
                all_src_offsets[i],
                all_sizes[i],
            )
            if not len(keys) == len(dst) == len(src) == len(sizes):
                logger.error("get_into_ranges: buffer %d: keys and ranges differ in length", i)
                out.append(
                    [
                        [INVALID_PARAMS] * (len(d) if j < len(dst) else 1)
                        for j, d in enumerate(dst[: len(keys)] or [[0]] * len(keys))
                    ]
                )
                continue
            row: list[list[int]] = []
            for key, d, s_, n in zip(keys, dst, src, sizes, strict=True):
                row.append(self._copy_ranges(key, objects.get(key), int(base), d, s_, n))
            out.append(row)
        return out

    def _copy_ranges(
        self,
        key: str,
        data: bytes | None,
        base: int,
        dst: list[int],
        src: list[int],
        sizes: list[int],
    ) -> list[int]:
        if not len(dst) == len(src) == len(sizes):
            logger.error("get_into_ranges %r: offsets and sizes differ in length", key)
            return [INVALID_PARAMS] * len(dst)
        if data is None:
            return [OBJECT_NOT_FOUND] * len(dst)
        res: list[int] = []
        for d, s_, n in zip(dst, src, sizes, strict=True):
            d, s_, n = int(d), int(s_), int(n)
            if n == 0:
                res.append(0)
                continue
            if d < 0 or s_ < 0 or n < 0 or s_ + n > len(data):
                logger.error("get_into_ranges %r: range %d+%d is outside the object", key, s_, n)
                res.append(INVALID_PARAMS)
                continue
            try:
                self._host(base + d, n)[:] = data[s_ : s_ + n]
            except (MooncakeError, ValueError) as exc:
                logger.error("get_into_ranges %r: %s", key, exc)
                res.append(_code(exc))
                continue
            res.append(n)
        return res
