"""Two-phase puts that place an object again when a holder cannot be written.

A put is ``put_start`` (the master places the replicas) -> the write -> ``put_end``. A holder
that died keeps its segments on the master until its client TTL runs out, so the master may
place an object there; the write then fails (:class:`~mooncake_core.store.client_core.
HolderUnreachable`). Such a put revokes and asks the master again, naming the segments it could
not write (``exclude`` of ``put_start`` / ``batch_put_start``): the master places it on the other
segments and marks the holders of the named ones suspect, so no writer is sent there until they
heartbeat again (``MasterState.report_unreachable``). A put is placed at most
:data:`PLACEMENTS` times; when no other segment can take it, the write's error stands. A put
through a reservation whose holder failed comes here with that failure
(:mod:`~mooncake_core.store.lending`).

- :class:`PlacementRetry`: the part of the client that puts in two phases.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from mooncake_core.errors import NoSpace, StoreError, TransportError
from mooncake_core.store import protocol as P
from mooncake_core.store.buffers import LocalBuffer
from mooncake_core.store.client_core import ClientCore, HolderUnreachable, Job
from mooncake_core.store.protocol import ReplicaCfg, SliceW

__all__ = ["PLACEMENTS", "PlacementRetry", "PutLost"]

logger = logging.getLogger(__name__)

PLACEMENTS = 3  # placements of one put: the first, and again after each holder that failed


class PutLost(P.InvalidArgument):
    """put_end found no pending put (a new leader never saw put_start): put again."""


def _nowhere(key: str, failed: HolderUnreachable, why: BaseException) -> HolderUnreachable:
    """The error of a put whose holder failed and that no other segment could take."""
    return HolderUnreachable(
        f"put {key!r}: {failed}; no other segment could take it: {why}", failed.segments
    )


class PlacementRetry(ClientCore):
    """Two-phase puts, placed again when a holder cannot be written (see module doc)."""

    def _revoke(self, key: str, token: int) -> None:
        try:
            self._call("put_revoke", (self.client_id, key, token))
        except (StoreError, OSError):
            pass

    def _start_put(
        self,
        key: str,
        length: int,
        cfg: ReplicaCfg,
        avoid: set[str],
        failed: HolderUnreachable | None,
    ) -> tuple[int, list[list[SliceW]]]:
        """``put_start`` of ``key`` (the token and the replicas), off the segments in ``avoid``.
        ``failed``: the write of it that failed (which put those segments in ``avoid``); when no
        other segment can take it, that failure is raised (with why), not the master's error."""
        args: tuple[object, ...] = (self.client_id, key, length, cfg)
        if avoid:  # only then: a master from before ``exclude`` takes the others
            args = (*args, sorted(avoid))

        def start() -> Any:
            return self._call("put_start", args)

        try:
            token, reps = self._retrying(start, f"put {key!r}")
        except (NoSpace, P.InvalidArgument) as exc:
            if failed is None:
                raise
            raise _nowhere(key, failed, exc) from exc
        return int(token), [[SliceW._make(s) for s in rep] for rep in reps]

    def _put_once(
        self,
        key: str,
        local: LocalBuffer,
        cfg: ReplicaCfg,
        failed: HolderUnreachable | None = None,
    ) -> None:
        """Put ``key`` in two phases; ``failed``: a write of it that already failed (through a
        reservation), whose segments the master is told to avoid."""
        avoid: set[str] = set(failed.segments) if failed is not None else set()
        for placement in range(PLACEMENTS):
            gen = self.rpc.generation()
            token, reps = self._start_put(key, local.length, cfg, avoid, failed)
            try:
                self._write([(local, rep) for rep in reps])
            except HolderUnreachable as exc:
                self._revoke(key, token)
                failed = exc
                avoid |= exc.segments
                if placement + 1 < PLACEMENTS:
                    logger.info("put %r: %s; placing it on other segments", key, exc)
                continue
            except BaseException:
                self._revoke(key, token)
                raise
            try:
                self._call("put_end", (self.client_id, key, token))
            except P.InvalidArgument as exc:
                # the leader changed after our write: if the old leader committed it, it is there
                if self._call("exists", (key,)):
                    return
                raise PutLost(str(exc)) from exc
            if reps:
                self._where.remember(key, gen, int(token), local.length, self._rank(reps)[0])
            return
        assert failed is not None
        raise failed

    def _batch_put_two_phase(
        self,
        keys: Sequence[str],
        locals_: list[LocalBuffer],
        cfg: ReplicaCfg,
        failed: dict[int, HolderUnreachable] | None = None,
    ) -> list[BaseException | None]:
        """Put many objects: one ``batch_put_start``, one transfer batch, one ``batch_put_end``,
        and again for the objects whose holders failed. ``failed``: index -> a write of that
        object that already failed (through a reservation)."""
        n = len(keys)
        out: list[BaseException | None] = [None] * n
        failed = dict(failed or {})
        avoid: set[str] = {g for e in failed.values() for g in e.segments}
        todo = list(range(n))
        for placement in range(PLACEMENTS):
            params: tuple[object, ...] = (
                self.client_id,
                [keys[i] for i in todo],
                [locals_[i].length for i in todo],
                cfg,
            )
            if avoid:
                params = (*params, sorted(avoid))

            def start(p: tuple[object, ...] = params) -> Any:
                return self._call("batch_put_start", p)

            try:
                res = self._retrying(start, "batch_put_start")
            except P.InvalidArgument as exc:  # a master from before ``exclude``
                if not avoid:
                    raise
                for i in todo:
                    out[i] = _nowhere(keys[i], failed[i], exc) if i in failed else exc
                return out
            jobs: list[Job] = []
            started: list[tuple[int, int]] = []  # (index, token)
            for i, (code, tok, reps) in zip(todo, res, strict=True):
                if code != 0:
                    err = P.error_for(code, str(tok))
                    nowhere = i in failed and code in (P.Code.NO_SPACE, P.Code.INVALID)
                    out[i] = _nowhere(keys[i], failed[i], err) if nowhere else err
                    continue
                started.append((i, int(tok)))
                for rep in reps:
                    jobs.append((i, locals_[i], [SliceW._make(s) for s in rep]))
            bad = self._batch_move("write", jobs, out)
            if started:
                ends = self._call(
                    "batch_put_end",
                    (
                        self.client_id,
                        [keys[i] for i, _ in started],
                        [tok for _, tok in started],
                        [i not in bad for i, _ in started],
                    ),
                )
                for (i, _), (code, msg) in zip(started, ends, strict=True):
                    if code != 0 and out[i] is None:
                        out[i] = P.error_for(code, msg)
            # place again the objects whose holders failed (not those that failed otherwise)
            todo = [i for i in bad if isinstance(out[i], TransportError)]
            if not todo or placement + 1 == PLACEMENTS:
                for i in todo:
                    out[i] = HolderUnreachable(f"put {keys[i]!r}: {out[i]}", bad[i])
                break
            for i in todo:
                failed[i] = HolderUnreachable(f"put {keys[i]!r}: {out[i]}", bad[i])
                avoid |= bad[i]
                out[i] = None
            logger.info(
                "batch put: %d object(s) could not be written into %s; placing them on other "
                "segments",
                len(todo),
                ", ".join(sorted(avoid)),
            )
        return out
