"""``get_into_ranges`` of ``mooncake.store``'s ``MooncakeDistributedStore``, as a mixin.

Byte ranges of objects copied into registered buffers, with the published per-range answers
(bytes copied, -704 for a missing key, -600 for a range outside the object or the buffer and
for lists of unequal length; tests/integration/test_compat_parity.py). Only the ranges move:
one ``batch_get_replica_list`` call looks every key up, then each range is read from the
part of the replica that holds it, straight into the caller's buffer, all keys in one
transfer batch (another replica is tried, per key, when that fails). The method relies on
the store's ``_run`` and ``_host``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from mooncake_core.compat.store_sessions import _window
from mooncake_core.compat.store_types import INVALID_PARAMS, _code
from mooncake_core.errors import MooncakeError, TransportError
from mooncake_core.store import protocol as P
from mooncake_core.store.buffers import LocalBuffer
from mooncake_core.store.protocol import SliceW

if TYPE_CHECKING:
    from mooncake_core.store import StoreClient

__all__ = ["RangeMethods"]

logger = logging.getLogger("mooncake_core.compat.store")
T = TypeVar("T")
#: one range to read: (buffer index, key index, range index, local view, source offset)
_Job = tuple[int, int, int, LocalBuffer, int]


def _lookup(c: StoreClient, keys: list[str]) -> list[tuple[int, list[list[SliceW]]] | int]:
    """Per key ``(size, replicas ranked best first)``, or the published error code."""
    rows = c._call("batch_get_replica_list", (keys,))
    out: list[tuple[int, list[list[SliceW]]] | int] = []
    for key, row in zip(keys, rows, strict=True):
        code, size, reps = row[0], row[1], row[2]
        if code == P.Code.RETRY:  # e.g. a promotion from SSD: the single lookup waits for it
            try:
                size, ranked = c.replicas(key)
            except (MooncakeError, OSError) as exc:
                out.append(_code(exc))
                continue
            out.append((int(size), c._rank(ranked)))
        elif code != 0:
            out.append(_code(P.error_for(code, str(size))))
        else:
            out.append((int(size), c._rank([[SliceW._make(s) for s in rep] for rep in reps])))
    return out


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
        (range outside the object or the registered buffer; lists of unequal length).
        Only the ranges' bytes are read."""
        if not (len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets)) or not (
            len(all_keys) == len(all_src_offsets) == len(all_sizes)
        ):
            logger.error("get_into_ranges: the five lists differ in length")
            return [[[INVALID_PARAMS]] for _ in buffer_ptrs]
        wanted = list(dict.fromkeys(k for keys in all_keys for k in keys))
        found = self._run("get_into_ranges", lambda c: _lookup(c, wanted)) if wanted else []
        if isinstance(found, int):
            return [[[found] * len(r) for r in dst] for dst in all_dst_offsets]
        where = dict(zip(wanted, found, strict=True))
        out: list[list[list[int]]] = []
        jobs: dict[str, list[_Job]] = {}
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
            for j, (key, d, s_, n) in enumerate(zip(keys, dst, src, sizes, strict=True)):
                row.append(self._check_ranges(key, where[key], int(base), d, s_, n))
                for k, got in enumerate(row[-1]):
                    if got > 0:
                        view = self._host(int(base) + int(d[k]), got)
                        jobs.setdefault(key, []).append(
                            (i, j, k, LocalBuffer(view, None, True), int(s_[k]))
                        )
            out.append(row)
        if jobs:
            failed = self._run("get_into_ranges", lambda c: _read(c, jobs, where))
            for key, code in failed.items() if isinstance(failed, dict) else []:
                for i, j, k, _view, _src in jobs[key]:
                    out[i][j][k] = code
            if isinstance(failed, int):
                for i, j, k, _view, _src in (x for js in jobs.values() for x in js):
                    out[i][j][k] = failed
        return out

    def _check_ranges(
        self,
        key: str,
        found: tuple[int, list[list[SliceW]]] | int,
        base: int,
        dst: list[int],
        src: list[int],
        sizes: list[int],
    ) -> list[int]:
        """Per range the bytes it will copy, or its error code (nothing is read yet)."""
        if not len(dst) == len(src) == len(sizes):
            logger.error("get_into_ranges %r: offsets and sizes differ in length", key)
            return [INVALID_PARAMS] * len(dst)
        if isinstance(found, int):
            return [found] * len(dst)
        size = found[0]
        res: list[int] = []
        for d, s_, n in zip(dst, src, sizes, strict=True):
            d, s_, n = int(d), int(s_), int(n)
            if n == 0:
                res.append(0)
                continue
            if d < 0 or s_ < 0 or n < 0 or s_ + n > size:
                logger.error("get_into_ranges %r: range %d+%d is outside the object", key, s_, n)
                res.append(INVALID_PARAMS)
                continue
            try:
                self._host(base + d, n)
            except (MooncakeError, ValueError) as exc:
                logger.error("get_into_ranges %r: %s", key, exc)
                res.append(_code(exc))
                continue
            res.append(n)
        return res


def _read(
    c: StoreClient,
    jobs: dict[str, list[_Job]],
    where: dict[str, tuple[int, list[list[SliceW]]] | int],
) -> dict[str, int]:
    """Read every job's range from its key's best replica in one batch, then the keys that
    failed from their other replicas; the keys that still failed, with their error code."""
    keys = list(jobs)
    ranked = {k: w[1] for k, w in where.items() if k in jobs and not isinstance(w, int)}
    batch = [
        (n, view, _window(ranked[key][0], src, view.length))
        for n, key in enumerate(keys)
        for _i, _j, _k, view, src in jobs[key]
    ]
    bad = c._batch_move("read", batch, None)
    failed: dict[str, int] = {}
    for n in sorted(bad):
        key = keys[n]
        for rep in ranked[key][1:]:
            try:
                c._move("read", [(v, _window(rep, s, v.length)) for *_ij, v, s in jobs[key]])
                break
            except (TransportError, OSError):
                continue
        else:
            logger.error("get_into_ranges %r: no replica could be read", key)
            failed[key] = _code(TransportError(key))
    return failed
