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

A holder that dies after a session started makes the writes into its segments fail. As the
store's two-phase puts do (:mod:`~mooncake_core.store.placement_retry`), a key whose write
failed on a holder is then placed again, whole, off the segments that failed (at most
``PLACEMENTS - 1`` times), and this call's ranges are written there; the session goes on with
the new placement. Only while no earlier call of the session wrote bytes of the key: those
were in the caller's buffers, which we cannot read again. Such a key is dropped: its range
write, later ones and its session's end give TRANSFER_FAIL (-800).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from mooncake_core.compat.store_types import (
    INVALID_PARAMS,
    TRANSFER_FAIL,
    ReplicateConfig,
    _code,
)
from mooncake_core.errors import MooncakeError, ObjectNotFound
from mooncake_core.store.buffers import LocalBuffer
from mooncake_core.store.client_core import HolderUnreachable
from mooncake_core.store.placement_retry import PLACEMENTS
from mooncake_core.store.protocol import ReplicaCfg, SliceW

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


@dataclass
class _PutSession:
    """An open put session of one key: its placement and what was written into it."""

    token: int
    size: int
    cfg: ReplicaCfg
    reps: list[list[SliceW]]
    written: bool = False  # a range call returned success with bytes of it
    lost: str = ""  # why its placement was dropped (a holder failed, see module doc)
    ended: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)  # one write or end at a time


Ranges = list[tuple[int, int, int]]  # (local address, length, offset in the object)


def _jobs(ranges: Ranges, reps: list[list[SliceW]]) -> list[tuple[LocalBuffer, list[SliceW]]]:
    return [(LocalBuffer(p, n, False), _window(rep, o, n)) for p, n, o in ranges for rep in reps]


def _write_ranges(c: StoreClient, key: str, sess: _PutSession, ranges: Ranges) -> int:
    """Write ``ranges`` of ``key`` into its session's placement, placed again when a holder
    fails and no earlier call wrote bytes of it (module doc); the bytes written, or a code.
    The caller holds ``sess.lock``."""
    total = sum(n for _p, n, _o in ranges)
    if sess.lost:
        logger.error("put ranges %r: %s", key, sess.lost)
        return TRANSFER_FAIL
    try:
        c._write(_jobs(ranges, sess.reps))
    except HolderUnreachable as exc:
        if sess.written:
            c._revoke(key, sess.token)
            sess.lost = (
                "a holder of its placement failed after an earlier range call of this session "
                "wrote bytes of it there; those cannot be written again elsewhere (they were in "
                f"the caller's buffers): the object is dropped, put it in a new session ({exc})"
            )
            logger.error("put ranges %r: %s", key, sess.lost)
            return TRANSFER_FAIL
        return _place_again(c, key, sess, ranges, exc)
    except (MooncakeError, OSError) as exc:
        logger.error("put ranges %r: %s", key, exc)
        return _code(exc)
    sess.written = sess.written or total > 0
    return total


def _place_again(
    c: StoreClient, key: str, sess: _PutSession, ranges: Ranges, failed: HolderUnreachable
) -> int:
    """Place ``key`` again off the segments that failed and write ``ranges`` there (see
    :meth:`~mooncake_core.store.placement_retry.PlacementRetry._put_once`)."""
    total = sum(n for _p, n, _o in ranges)
    avoid = set(failed.segments)
    for _ in range(PLACEMENTS - 1):  # the session's start was the first placement
        c._revoke(key, sess.token)
        logger.info("put ranges %r: %s; placing it on other segments", key, failed)
        try:
            sess.token, sess.reps = c._start_put(key, sess.size, sess.cfg, avoid, failed)
        except (MooncakeError, OSError) as exc:
            sess.lost = f"its placement was dropped after a holder failed: {exc}"
            logger.error("put ranges %r: %s", key, exc)
            return _code(exc)
        try:
            c._write(_jobs(ranges, sess.reps))
        except HolderUnreachable as exc:
            failed = exc
            avoid |= exc.segments
            continue
        except (MooncakeError, OSError) as exc:  # not the holders: the session keeps the placement
            logger.error("put ranges %r: %s", key, exc)
            return _code(exc)
        sess.written = total > 0
        return total
    c._revoke(key, sess.token)
    sess.lost = f"placed {PLACEMENTS} times, its holders failed each time: {failed}"
    logger.error("put ranges %r: %s", key, sess.lost)
    return _code(failed)


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
                    token, reps = c._start_put(key, int(size), cfg, set(), None)
                except (MooncakeError, OSError) as exc:
                    logger.error("batch_put_session_start %r: %s", key, exc)
                    out.append(_code(exc))
                    continue
                with lock:
                    puts[key] = _PutSession(token, int(size), cfg, reps)
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
        bytes written, -600 (a range outside the object, no session, unequal lists) or -800
        (the write failed; see the module doc for a holder that died)."""
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
                if any(
                    int(o) < 0 or int(n) < 0 or int(o) + int(n) > sess.size
                    for o, n in zip(offs, ns, strict=True)
                ):
                    logger.error(
                        "put ranges %r: a range falls outside the %d-byte object", key, sess.size
                    )
                    out.append(INVALID_PARAMS)
                    continue
                ranges = [
                    (int(p), int(n), int(o))
                    for p, n, o in zip(ptrs, ns, offs, strict=True)
                    if int(n) > 0
                ]
                with sess.lock:
                    if sess.ended:  # ended or revoked meanwhile
                        logger.error("put ranges %r: no open put session", key)
                        out.append(INVALID_PARAMS)
                        continue
                    out.append(_write_ranges(c, key, sess, ranges))
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
                with sess.lock:  # after a range write in flight
                    sess.ended = True
                if sess.lost:  # already revoked
                    if rpc == "put_end":
                        logger.error("%s %r: not stored: %s", what, key, sess.lost)
                    out.append(TRANSFER_FAIL if rpc == "put_end" else 0)
                    continue
                try:
                    c._call(rpc, (c.client_id, key, sess.token))
                except (MooncakeError, OSError) as exc:
                    logger.error("%s %r: %s", what, key, exc)
                    out.append(_code(exc))
                    continue
                out.append(0)
            return out

        res = self._run(what, run)
        return [res] * len(keys) if isinstance(res, int) else res

    def batch_put_session_end(self, keys: list[str]) -> list[int]:
        """Commit: the objects become readable. Per key 0, -600 without a session, -800 for
        one dropped after a holder failed (module doc)."""
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
