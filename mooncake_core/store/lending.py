"""Reservation lending: one-RPC puts into extents the master lent this client.

The master may lend a client an extent of a segment (``reserve``); the client then places
objects inside it itself, writes their bytes and commits each with one ``put_commit``
(``batch_put_commit`` for a batch). When the master takes early commits (no HA) the commit
is sent before the write, so the master answers while the bytes travel, and a one-way
``put_confirm`` follows on the same connection.

Any doubt (a master that failed over, a write that failed, a reservation the master no
longer knows: :class:`~mooncake_core.store.protocol.ReservationGone`) retires the extent and
the object is put in two phases instead. When the write failed on the holder's side (a holder
that died) every extent on that holder's segments is dropped and the two-phase put avoids them
(:mod:`~mooncake_core.store.placement_retry`). Retired extents go back to the master with the next
``reserve`` once no write into them is in flight.

- :class:`Lent`: one lent extent as the client tracks it.
- :class:`ReservationLending`: the part of the client that puts through reservations.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mooncake_core.errors import ObjectExists, StoreError, TransportError
from mooncake_core.store import protocol as P
from mooncake_core.store.allocator import align
from mooncake_core.store.buffers import LocalBuffer
from mooncake_core.store.client_core import ClientCore, HolderUnreachable
from mooncake_core.store.protocol import Extent, ReplicaCfg, SliceW
from mooncake_core.store.rpc import Pending

__all__ = ["Lent", "ReservationLending"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Lent:
    """A reservation the master lent us: we allocate from ``next`` up to ``end`` ourselves."""

    rid: int
    segment: str
    peer: str
    base: int
    host: str
    next: int
    end: int
    expires: float  # local monotonic time after which we stop starting writes into it
    generation: (
        int  # the master connection's generation when it was lent (see MasterRPC.generation)
    )
    inflight: int = 0
    dead: bool = False  # a write or commit failed: never use again
    retired: bool = False  # replaced by a newer one
    released: bool = False

    def slice(self, off: int, length: int) -> SliceW:
        """The replica slice of ``length`` bytes at ``off`` inside the segment."""
        return SliceW(self.segment, self.peer, self.base + off, length, self.host)


class ReservationLending(ClientCore):
    """Puts through reservations (see module doc); state is set by ``StoreClient.__init__``."""

    reservations: bool  # config.store.client_reservations
    _lent_lock: threading.Lock
    _lent: dict[tuple[str, str], Lent]  # (preferred segment, strategy) -> current reservation
    _lent_release: list[int]  # rids to hand back with the next reserve
    _lent_refused: dict[tuple[str, str], float]  # no reservation to ask for before this time

    def _slot(self, cfg: ReplicaCfg, size: int, count: int = 0) -> tuple[Lent, int] | None:
        """A free range of ``size`` bytes in our reservation for ``cfg`` (asking the master for
        one if needed; ``count``: objects of about ``size`` about to follow, for the size of a
        new one)."""
        with self._lent_lock:
            return self._slot_locked(cfg, size, count, self.rpc.generation())

    def _slots(self, cfg: ReplicaCfg, sizes: Sequence[int]) -> list[tuple[Lent, int]]:
        """Ranges for objects of ``sizes`` (a batch) while our reservations have room: a prefix
        of them."""
        out: list[tuple[Lent, int]] = []
        with self._lent_lock:
            gen = self.rpc.generation()
            for i, n in enumerate(sizes):
                slot = self._slot_locked(cfg, n, len(sizes) - i, gen)
                if slot is None:
                    break
                out.append(slot)
        return out

    def _slot_locked(
        self, cfg: ReplicaCfg, size: int, count: int, generation: int
    ) -> tuple[Lent, int] | None:
        """:meth:`_slot` with ``_lent_lock`` held; ``generation``: the master connections'
        generation now."""
        need = align(size)
        k = (cfg.preferred_segment, cfg.strategy)
        now = time.monotonic()
        lent = self._lent.get(k)
        # a master that died may come back without knowing the extent: never write there again
        if lent is not None and generation != lent.generation:
            lent.dead = True
        if (
            lent is not None
            and not lent.dead
            and now < lent.expires
            and lent.next + need <= lent.end
        ):
            off = lent.next
            lent.next += need
            lent.inflight += 1
            return lent, off
        if lent is not None:
            del self._lent[k]
            self._retire(lent)
        if now < self._lent_refused.get(k, 0.0):
            return None
        release, self._lent_release = self._lent_release, []
        try:
            gen = self.rpc.generation()
            rid, ext, ttl = self._call("reserve", (self.client_id, size, cfg, release, count))
        except (StoreError, OSError) as exc:
            logger.debug("no reservation (%s); putting in two phases", exc)
            self._lent_release = release + self._lent_release  # hand them back with a later call
            self._lent_refused[k] = now + 1.0
            return None
        if not rid:
            self._lent_refused[k] = now + 1.0
            return None
        e = Extent._make(ext)
        # use it for half its ttl at most: the master keeps it for the whole ttl after each commit
        if self.rpc.generation() != gen:  # answered by a master we reconnected to during the call
            self._lent_release.append(int(rid))
            return None
        lent = Lent(
            int(rid),
            str(e.segment),
            str(e.peer),
            int(e.base),
            str(e.host),
            int(e.offset) + need,
            int(e.offset) + int(e.length),
            now + float(ttl) / 2,
            gen,
            inflight=1,
        )
        self._lent[k] = lent
        return lent, int(e.offset)

    def _retire(self, lent: Lent) -> None:
        """Stop using a reservation; it goes back to the master once no write into it is in
        flight."""
        lent.retired = True
        self._release_if_idle(lent)

    def _release_if_idle(self, lent: Lent) -> None:
        """Queue a retired or dead reservation for release (with the next ``reserve``) when idle;
        once."""
        if lent.inflight == 0 and (lent.retired or lent.dead) and not lent.released:
            lent.released = True
            self._lent_release.append(lent.rid)

    def _done_with(self, slots: Sequence[tuple[Lent, int]]) -> None:
        """The writes into ``slots`` are over (landed or not)."""
        with self._lent_lock:
            for lent, _ in slots:
                lent.inflight -= 1
                self._release_if_idle(lent)

    def _put_reserved(self, key: str, local: LocalBuffer, cfg: ReplicaCfg) -> bool:
        """Put through a reservation: write, then one ``put_commit``. False: not done, put in two
        phases. A write that failed on the holder's side raises
        :class:`~mooncake_core.store.client_core.HolderUnreachable` (every reservation on its
        segments is dropped; the caller places the object elsewhere)."""
        slot = self._slot(cfg, local.length)
        if slot is None:
            return False
        lent, off = slot
        try:
            sl = lent.slice(off, local.length)
            if self._early:
                done = self._put_early(key, local, cfg, lent, off, sl)
                if done is not None:
                    return done
            try:
                self._write([(local, [sl])])
            except HolderUnreachable as exc:
                self._holder_failed(exc.segments)
                raise
            except BaseException:
                lent.dead = True  # the holder may be gone: do not write there again
                raise
            t0 = time.monotonic()
            gen = self.rpc.generation()
            try:
                res = self._call(
                    "put_commit", (self.client_id, key, lent.rid, off, local.length, cfg)
                )
            except P.ReservationGone as exc:
                if self._committed_at(
                    key, lent.segment, off
                ):  # a retried commit after a leader change
                    return True
                logger.info("put %r: %s; putting in two phases", key, exc)
                lent.dead = True
                return False
            except ObjectExists:
                if self._committed_at(
                    key, lent.segment, off
                ):  # our commit, answered by a leader that then died
                    return True
                raise
            ttl, token = (float(res[0]), int(res[1])) if isinstance(res, list) else (float(res), 0)
            with self._lent_lock:
                lent.expires = max(lent.expires, t0 + ttl / 2)
            self._where.remember(key, gen, token, local.length, [sl])
            return True
        finally:
            self._done_with([slot])

    def _put_early(
        self, key: str, local: LocalBuffer, cfg: ReplicaCfg, lent: Lent, off: int, sl: SliceW
    ) -> bool | None:
        """Put through a reservation with the commit sent before the write, so the master answers
        while the bytes travel; then a one-way ``put_confirm`` on the same connection.

        Until that confirm the master keeps the object invisible and makes every request on its
        key wait; if the connection closes first, it drops the object. The put returns only when
        both the write and the commit are acknowledged and the confirm is sent, so a reader
        asking after it returns sees the object. Returns like :meth:`_put_reserved`; None: the
        commit could not be sent, commit after the write instead.
        """
        # the generation _slot just checked the reservation against (an older one can only make
        # the location remembered below unused, never wrongly used)
        gen = lent.generation
        pend = self.rpc.start(
            "put_commit", (self.client_id, key, lent.rid, off, local.length, cfg, True)
        )
        if pend is None:
            return None
        try:
            self._write([(local, [sl])])
        except BaseException as exc:
            lent.dead = True  # the holder may be gone: do not write there again
            if isinstance(exc, HolderUnreachable):
                self._holder_failed(exc.segments)
            self.rpc.abandon(pend)  # closing the connection drops the early commit
            raise
        resp = self.rpc.answer(pend)
        if (
            resp is None
        ):  # the connection failed: an early commit it carried is dropped by the master
            lent.dead = True
            return False
        try:
            res = self.rpc.result(resp)
        except (P.ReservationGone, P.EarlyCommitsOff) as exc:
            self.rpc.release(pend)
            logger.info("put %r: %s; putting in two phases", key, exc)
            lent.dead = True
            return False
        except P.NotLeader:
            self.rpc.abandon(pend)
            lent.dead = True
            return False
        except P.UnknownClient as exc:
            self._register_again(pend, exc)
            lent.dead = True  # a reservation of the forgotten client is gone
            return False
        except BaseException:
            self.rpc.release(pend)
            raise
        ttl, token = float(res[0]), int(res[1])
        if time.monotonic() - pend.sent < ttl / 2:
            sent = self.rpc.tell(pend, "put_confirm", (self.client_id, key, token, True, False))
            if not sent:  # we cannot know whether the confirm got through
                lent.dead = True
                if self._committed_at(key, lent.segment, off):
                    return True
                return False
        else:
            # a slow write: the early commit may be near its timeout, so confirm and wait for the
            # answer
            self.rpc.release(pend)
            try:
                self._call("put_confirm", (self.client_id, key, token, True, True))
            except P.InvalidArgument:
                lent.dead = True
                return False
        with self._lent_lock:
            lent.expires = max(lent.expires, pend.sent + ttl / 2)
        self._where.remember(key, gen, token, local.length, [sl])
        return True

    def _holder_failed(self, segments: frozenset[str]) -> None:
        """A write into ``segments`` failed on the holder's side: never use our reservations there
        again (they go back to the master with the next ``reserve``; the master lends none on a
        holder a writer could not reach until it heartbeats again)."""
        with self._lent_lock:
            for lent in self._lent.values():
                if lent.segment in segments:
                    lent.dead = True

    def _committed_at(self, key: str, segment: str, offset: int) -> bool:
        try:
            info = self._call("query_key", (key,))
        except (StoreError, OSError):
            return False
        return any(
            len(rep) == 1 and rep[0]["segment"] == segment and rep[0]["offset"] == offset
            for rep in info.get("replicas", [])
        )

    def _release_reservations(self, end: float) -> None:
        with self._lent_lock:
            rids = self._lent_release + [lent.rid for lent in self._lent.values()]
            self._lent.clear()
            self._lent_release = []
        left = end - time.monotonic()
        if rids and left > 0:
            try:
                self.rpc.call(
                    "reserve",
                    (self.client_id, 0, ReplicaCfg(), rids),
                    timeout=left,
                    failover_s=left,
                )
            except (StoreError, OSError) as exc:
                logger.debug("releasing reservations at close: %s", exc)

    def _batch_put_reserved(
        self,
        keys: Sequence[str],
        locals_: list[LocalBuffer],
        cfg: ReplicaCfg,
        out: list[BaseException | None],
        failed: dict[int, HolderUnreachable],
    ) -> list[int]:
        """Put ``keys`` into our reservations: one ``batch_put_commit`` (sent before the write when
        the master takes early commits, then a one-way ``batch_put_confirm``), one transfer batch.

        Sets ``out[i]`` for the keys that failed; returns the indexes still to put in two phases,
        ``failed[i]`` telling those whose write failed on the holder's side.
        """
        n = len(keys)
        slots = self._slots(cfg, [x.length for x in locals_])
        gen = self.rpc.failovers  # _slots just checked the idle connections
        m = len(slots)
        rest = list(range(m, n))
        if not slots:
            return rest
        try:
            sls = [lent.slice(off, locals_[j].length) for j, (lent, off) in enumerate(slots)]
            params = (
                self.client_id,
                list(keys[:m]),
                [lent.rid for lent, _ in slots],
                [off for _, off in slots],
                [x.length for x in locals_[:m]],
                cfg,
            )
            pend = self.rpc.start("batch_put_commit", (*params, True)) if self._early else None
            try:
                bad = self._batch_write([(j, locals_[j], [sls[j]]) for j in range(m)], out)
                wrote = [j not in bad for j in range(m)]
            except BaseException:
                if pend is not None:
                    self.rpc.abandon(pend)  # closing the connection drops the early commits
                for lent, _ in slots:
                    lent.dead = True
                raise
            moved: list[int] = []  # the holder failed: placed elsewhere, in two phases
            for j in sorted(bad):
                slots[j][0].dead = True  # the holder may be gone: do not write there again
                if isinstance(out[j], TransportError):
                    failed[j] = HolderUnreachable(f"put {keys[j]!r}: {out[j]}", {sls[j].segment})
                    out[j] = None
                    moved.append(j)
            if moved:
                gone = frozenset(sls[j].segment for j in moved)
                logger.info(
                    "batch put: %d object(s) could not be written into %s; placing them on "
                    "other segments",
                    len(moved),
                    ", ".join(sorted(gone)),
                )
                self._holder_failed(gone)
            if pend is not None:
                committed = list(range(m))  # committed before the write; confirmed or dropped
                res = self._batch_commit_answer(pend)
            else:  # committed after the write: what landed only
                committed = [j for j in range(m) if wrote[j]]
                res = (
                    self._call(
                        "batch_put_commit",
                        (
                            self.client_id,
                            [keys[j] for j in committed],
                            [slots[j][0].rid for j in committed],
                            [slots[j][1] for j in committed],
                            [locals_[j].length for j in committed],
                            cfg,
                            False,
                        ),
                    )
                    if committed
                    else []
                )
            if (
                res is None
            ):  # nothing committed (the master drops the early commits of a failed connection)
                for lent, _ in slots:
                    lent.dead = True
                return [j for j in range(m) if wrote[j]] + moved + rest
            again: list[int] = []
            confirm: list[int] = []
            token_of = {j: int(r[2]) for j, r in zip(committed, res, strict=True)}
            ttl = float("inf")
            for j, (code, msg, _token) in zip(committed, res, strict=True):  # msg: ttl if OK
                if code == 0:
                    ttl = min(ttl, float(msg))
                    confirm.append(j)
                    continue
                if not wrote[j]:
                    continue  # the write's error stands
                if code == P.Code.RESERVATION_GONE:
                    slots[j][0].dead = True
                    again.append(j)
                elif (
                    code == P.Code.EXISTS
                    and pend is None
                    and self._committed_at(keys[j], slots[j][0].segment, slots[j][1])
                ):
                    continue  # our commit, answered by a leader that then died
                else:
                    out[j] = P.error_for(int(code), str(msg))
            got = (
                self._batch_confirm(
                    pend,
                    [keys[j] for j in confirm],
                    [token_of[j] for j in confirm],
                    [wrote[j] for j in confirm],
                    ttl,
                )
                if pend is not None
                else [None] * len(confirm)
            )
            for j, err in zip(confirm, got, strict=True):
                if not wrote[j]:
                    continue  # confirmed as failed; the write's error stands
                if err is not None:
                    out[j] = err
                else:
                    self._where.remember(keys[j], gen, token_of[j], locals_[j].length, [sls[j]])
            return again + moved + rest
        finally:
            self._done_with(slots)

    def _register_again(self, pend: Pending, exc: BaseException) -> None:
        """An early commit's answer said the master forgot us: give its connection back and register
        again (or raise ``exc`` if we are closing)."""
        self.rpc.release(pend)
        if self._closed:
            raise exc
        logger.warning("the master forgot client %s; registering again", self.client_id)
        self._remount()

    def _batch_commit_answer(self, pend: Pending) -> list[Any] | None:
        """The per-key answer to an early ``batch_put_commit``; None when nothing was committed."""
        resp = self.rpc.answer(pend)
        if resp is None:
            return None
        try:
            res: list[Any] = self.rpc.result(resp)
        except P.UnknownClient as exc:
            self._register_again(pend, exc)
            return None
        except P.NotLeader:
            self.rpc.abandon(pend)
            return None
        except P.InvalidArgument as exc:
            self.rpc.release(pend)
            logger.info("batch put: %s; putting in two phases", exc)
            return None
        except BaseException:
            self.rpc.release(pend)
            raise
        return res

    def _batch_confirm(
        self, pend: Pending, keys: list[str], tokens: list[int], ok: list[bool], ttl: float
    ) -> list[BaseException | None]:
        """Confirm (or drop, for failed writes) the early commits of a batch: one-way on the
        commit's connection, or with an answer when the write took so long that the commits may have
        expired. Per key: None, or the master's refusal (when it answered)."""
        if not keys:
            self.rpc.release(pend)
            return []
        args = (self.client_id, keys, tokens, ok)
        if time.monotonic() - pend.sent < ttl / 2:
            if self.rpc.tell(pend, "batch_put_confirm", (*args, False)):
                return [None] * len(keys)
            # we cannot know whether it got through: again, with an answer (a repeat is refused
            # per key, so a refusal of a key whose object exists means the first one landed)
        else:
            self.rpc.release(pend)
        res = self._call("batch_put_confirm", (*args, True))
        out: list[BaseException | None] = []
        for k, (code, msg) in zip(keys, res, strict=True):
            out.append(
                None
                if code == 0 or self._call("exists", (k,))
                else P.error_for(int(code), str(msg))
            )
        return out
