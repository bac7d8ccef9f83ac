"""Put and get sessions of ``mooncake.store``: objects written and read by byte ranges.

Published (0.3.13), checked by running the wheel (``test_compat_parity.py``):

- ``batch_put_session_start(keys, sizes, config)``: reserve each object's replicas without
  writing (per key 0 or a negative code); the object is not visible until its session
  ends. ``batch_put_from_multi_buffer_ranges(keys, all_buffer_ptrs, all_sizes,
  all_dst_offsets)``: write ``all_sizes[i][j]`` bytes from ``all_buffer_ptrs[i][j]`` at
  offset ``all_dst_offsets[i][j]`` of object ``i`` (per key the bytes written; -600 when a
  range falls outside the object or the key has no open session).
  ``batch_put_session_end(keys)`` makes the objects readable, ``batch_put_session_revoke``
  drops them (per key 0, -600 without a session).
- ``batch_get_session_start(keys)``: look the replicas up once (per key 0, -704 missing);
  ``batch_get_into_multi_buffer_ranges(keys, all_buffer_ptrs, all_sizes,
  all_src_offsets)`` reads ranges from them (per key the bytes read, -600 outside the
  object or without a session); ``batch_get_session_end(keys)`` forgets them (0).

Ours: a put session is our master's two-phase put (``put_start`` reserves the replicas,
``put_end`` commits, ``put_revoke`` drops); the ranges are written straight into every
replica by the transfer engine. The master reclaims a put that is not ended within its
``put_timeout_s``. A get session keeps the replica list a read gets (which grants the
usual read lease); ranges are read from the first replica.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from mooncake_core.compat.store_types import INVALID_PARAMS, ReplicateConfig, _code
from mooncake_core.errors import MooncakeError, ObjectNotFound
from mooncake_core.store.buffers import LocalBuffer
from mooncake_core.store.protocol import SliceW

if TYPE_CHECKING:
    from mooncake_core.store import StoreClient

__all__ = ["SessionMethods"]

logger = logging.getLogger("mooncake_core.compat.store")
T = TypeVar("T")


def _window(slices: Sequence[SliceW], off: int, n: int) -> list[SliceW]:
    """The parts of a replica's ``slices`` that hold bytes ``[off, off + n)`` of the object."""
    out: list[SliceW] = []
    pos = 0
    for s in slices:
        lo, hi = max(off, pos), min(off + n, pos + s.length)
        if lo < hi:
            out.append(s._replace(addr=s.addr + (lo - pos), length=hi - lo))
        pos += s.length
    return out


class SessionMethods:
    """Put/get sessions, mixed into the store."""

    if TYPE_CHECKING:  # provided by MooncakeDistributedStore

        def _run(self, what: str, fn: Callable[[StoreClient], T]) -> T | int: ...

        def _refused(self, what: str, config: ReplicateConfig | None, staged: bool) -> bool: ...

    def _sessions(self) -> tuple[threading.Lock, dict[str, Any], dict[str, Any]]:
        found: tuple[threading.Lock, dict[str, Any], dict[str, Any]] | None = getattr(
            self, "_session_state", None
        )
        if found is None:
            found = (threading.Lock(), {}, {})
            self._session_state = found
        return found

    # ------------------------------------------------------------------ put sessions
    def batch_put_session_start(
        self, keys: list[str], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        """Reserve each object (``sizes[i]`` bytes); per key 0 or a negative code."""
        if len(keys) != len(sizes):
            logger.error("batch_put_session_start: %d keys but %d sizes", len(keys), len(sizes))
            return [INVALID_PARAMS] * len(keys)
        if self._refused("batch_put_session_start", config, staged=False):
            return [INVALID_PARAMS] * len(keys)
        kw = (config or ReplicateConfig()).kwargs()
        lock, puts, _gets = self._sessions()

        def run(c: StoreClient) -> list[int]:
            cfg = c._cfg(**kw)
            out = []
            for key, size in zip(keys, sizes, strict=True):
                try:
                    token, reps = c._call("put_start", (c.client_id, key, int(size), cfg))
                except (MooncakeError, OSError) as exc:
                    logger.error("batch_put_session_start %r: %s", key, exc)
                    out.append(_code(exc))
                    continue
                with lock:
                    puts[key] = (
                        int(token),
                        int(size),
                        [[SliceW._make(s) for s in r] for r in reps],
                    )
                out.append(0)
            return out

        res = self._run("batch_put_session_start", run)
        return [res] * len(keys) if isinstance(res, int) else res

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_dst_offsets: list[list[int]],
    ) -> list[int]:
        """Write ranges of registered memory into objects of open put sessions; per key the
        bytes written, or -600 (a range outside the object, no session, unequal lists)."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_dst_offsets):
            logger.error("batch_put_from_multi_buffer_ranges: the four lists differ in length")
            return [INVALID_PARAMS] * len(keys)
        lock, puts, _gets = self._sessions()

        def run(c: StoreClient) -> list[int]:
            out = []
            for key, ptrs, ns, offs in zip(
                keys, all_buffer_ptrs, all_sizes, all_dst_offsets, strict=True
            ):
                with lock:
                    sess = puts.get(key)
                if sess is None or not len(ptrs) == len(ns) == len(offs):
                    logger.error("put ranges %r: no open put session, or unequal lists", key)
                    out.append(INVALID_PARAMS)
                    continue
                _token, size, reps = sess
                if any(
                    int(o) < 0 or int(n) < 0 or int(o) + int(n) > size
                    for o, n in zip(offs, ns, strict=True)
                ):
                    logger.error(
                        "put ranges %r: a range falls outside the %d-byte object", key, size
                    )
                    out.append(INVALID_PARAMS)
                    continue
                jobs = [
                    (LocalBuffer(int(p), int(n), False), _window(rep, int(o), int(n)))
                    for p, n, o in zip(ptrs, ns, offs, strict=True)
                    if int(n) > 0
                    for rep in reps
                ]
                try:
                    c._move("write", jobs)
                except (MooncakeError, OSError) as exc:
                    logger.error("put ranges %r: %s", key, exc)
                    out.append(_code(exc))
                    continue
                out.append(sum(int(n) for n in ns))
            return out

        res = self._run("batch_put_from_multi_buffer_ranges", run)
        return [res] * len(keys) if isinstance(res, int) else res

    def _finish_puts(self, what: str, rpc: str, keys: list[str]) -> list[int]:
        lock, puts, _gets = self._sessions()

        def run(c: StoreClient) -> list[int]:
            out = []
            for key in keys:
                with lock:
                    sess = puts.pop(key, None)
                if sess is None:
                    logger.error("%s %r: no open put session", what, key)
                    out.append(INVALID_PARAMS)
                    continue
                try:
                    c._call(rpc, (c.client_id, key, sess[0]))
                except (MooncakeError, OSError) as exc:
                    logger.error("%s %r: %s", what, key, exc)
                    out.append(_code(exc))
                    continue
                out.append(0)
            return out

        res = self._run(what, run)
        return [res] * len(keys) if isinstance(res, int) else res

    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        """Commit: the objects become readable. Per key 0, -600 without a session."""
        return self._finish_puts("batch_put_session_end", "put_end", keys)

    def batch_put_session_revoke(self, keys: list[str]) -> list[int]:
        """Drop the reserved objects. Per key 0, -600 without a session."""
        return self._finish_puts("batch_put_session_revoke", "put_revoke", keys)

    # ------------------------------------------------------------------ get sessions
    def batch_get_session_start(self, keys: list[str]) -> list[int]:
        """Look each object's replicas up once; per key 0 or -704 (missing)."""
        lock, _puts, gets = self._sessions()

        def run(c: StoreClient) -> list[int]:
            out = []
            for key in keys:
                try:
                    size, reps = c.replicas(key)
                except ObjectNotFound:
                    out.append(_code(ObjectNotFound(key)))
                    continue
                except (MooncakeError, OSError) as exc:
                    logger.error("batch_get_session_start %r: %s", key, exc)
                    out.append(_code(exc))
                    continue
                with lock:
                    gets[key] = (size, reps)
                out.append(0)
            return out

        res = self._run("batch_get_session_start", run)
        return [res] * len(keys) if isinstance(res, int) else res

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: list[str],
        all_buffer_ptrs: list[list[int]],
        all_sizes: list[list[int]],
        all_src_offsets: list[list[int]],
    ) -> list[int]:
        """Read ranges of objects of open get sessions into registered memory; per key the
        bytes read, or -600 (a range outside the object, no session, unequal lists)."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_src_offsets):
            logger.error("batch_get_into_multi_buffer_ranges: the four lists differ in length")
            return [INVALID_PARAMS] * len(keys)
        lock, _puts, gets = self._sessions()

        def run(c: StoreClient) -> list[int]:
            out = []
            for key, ptrs, ns, offs in zip(
                keys, all_buffer_ptrs, all_sizes, all_src_offsets, strict=True
            ):
                with lock:
                    sess = gets.get(key)
                if sess is None or not sess[1] or not len(ptrs) == len(ns) == len(offs):
                    logger.error("get ranges %r: no open get session, or unequal lists", key)
                    out.append(INVALID_PARAMS)
                    continue
                size, reps = sess
                if any(
                    int(o) < 0 or int(n) < 0 or int(o) + int(n) > size
                    for o, n in zip(offs, ns, strict=True)
                ):
                    logger.error(
                        "get ranges %r: a range falls outside the %d-byte object", key, size
                    )
                    out.append(INVALID_PARAMS)
                    continue
                jobs = [
                    (LocalBuffer(int(p), int(n), True), _window(reps[0], int(o), int(n)))
                    for p, n, o in zip(ptrs, ns, offs, strict=True)
                    if int(n) > 0
                ]
                try:
                    c._move("read", jobs)
                except (MooncakeError, OSError) as exc:
                    logger.error("get ranges %r: %s", key, exc)
                    out.append(_code(exc))
                    continue
                out.append(sum(int(n) for n in ns))
            return out

        res = self._run("batch_get_into_multi_buffer_ranges", run)
        return [res] * len(keys) if isinstance(res, int) else res

    def batch_get_session_end(self, keys: list[str]) -> int:
        """Forget the replicas looked up for ``keys``; 0."""
        lock, _puts, gets = self._sessions()
        with lock:
            for key in keys:
                gets.pop(key, None)
        return 0
