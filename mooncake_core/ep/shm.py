"""Same-host shared-memory data plane for dispatch and combine (the optional transport).

Contract:

- Each rank owns two *send buffers*, one for dispatch rows and one for combine rows. They
  are the transfer engine's memfd-backed :class:`~mooncake_core.transfer.memory.ManagedBuffer`
  (what its shared-memory transport hands to same-host peers), so a peer maps one through
  ``/proc/<pid>/fd/<fd>`` and reads it with plain tensor ops: one memcpy per byte, instead
  of the two kernel copies, the syscalls and the per-peer phases of loopback TCP.
- A sender writes its rows into its own buffer *before* the phase's header exchange. The
  exchange carries, per receiver, the buffer's descriptor ``(pid, fd, generation)`` and the
  row offsets, and it is also the barrier: when it returns, every member's rows of that
  phase are written.
- Header exchanges go through *mailboxes* (:meth:`ShmPlane.post` / :meth:`ShmPlane.collect`):
  each rank has a small control buffer with two slots; exchange ``c`` of an epoch uses slot
  ``c % 2``. A rank writes one row per member, then the slot's sequence word
  (``epoch << 32 | c + 1``); a reader waits until every member's slot shows that word, then
  reads its row. No thread hand-offs and no sockets: the wait spins a few times, then
  sleeps in 20 us steps (giving the core to the members it waits for). It fails with
  :class:`MailboxFailure` when a member's slot shows the *abort* word of this epoch
  (the member left it, see :meth:`abort_slot`), when
  a member's process is gone (checked in ``/proc`` every few milliseconds; a zombie counts
  as gone), or at the timeout (a hung member). That the rows and data written before the
  sequence word are visible once it is relies on x86-64's total store order; elsewhere
  (:data:`MAILBOX_OK` false) the engine exchanges headers over the group.
- Reuse needs no further synchronization. A member reads a peer's rows (and mailbox slot)
  of exchange ``c`` before it posts exchange ``c + 1``, and the peer overwrites them only
  after exchange ``c + 1`` completed, which needs every member's post. The same holds for
  the first exchanges of a new epoch, which come after the install probe's collectives.
- A buffer that must grow is replaced by a new one with a new generation; readers remap it
  when a header names a generation they have not mapped. Generations start at a random
  base, so a restarted process that got the same pid is never confused with its
  predecessor.
- Whether an epoch uses this plane is decided collectively when the epoch is installed
  (:meth:`ShmPlane.probe_row` / :meth:`ShmPlane.probe`): every member must report the
  same host identity (boot id and namespaces, as the transfer engine's shm transport checks)
  and map every other member's buffers; otherwise payloads go over the group's all-to-all.
  CPU tensors only.

Thread-safety: not thread-safe; owned by one :class:`~mooncake_core.ep.engine.ElasticEP`.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import platform
import random
import time
from typing import Any

import numpy as np
import torch

from mooncake_core.errors import EPError
from mooncake_core.transfer.memory import ManagedBuffer
from mooncake_core.transfer.topology import host_identity

__all__ = ["COMBINE", "DISPATCH", "MAILBOX_OK", "MailboxFailure", "ShmPlane", "host_key"]

logger = logging.getLogger(__name__)

DISPATCH = 0
COMBINE = 1
_CTRL = 2
_PROBE = 6  # values per member in the install probe
_PAGE = 1 << 16
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_LIVENESS_S = 0.005
MAILBOX_OK = platform.machine().lower() in ("x86_64", "amd64")
"""Mailbox headers need total store order (see the module doc)."""


class MailboxFailure(EPError):
    """A header exchange through the mailboxes failed: a member aborted, died or hung."""


def host_key() -> int:
    """This host's shared-memory identity as a non-negative int63 (for a tensor header)."""
    digest = hashlib.blake2b(host_identity().encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _gone(pid: int) -> bool:
    """True if ``pid`` has exited (a zombie that its parent has not reaped counts)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    at = stat.rfind(b")") + 2
    return stat[at : at + 1] in (b"Z", b"X")


class _Own:
    """One of this rank's buffers."""

    def __init__(self, nbytes: int, gen: int):
        self.buf = ManagedBuffer(nbytes, prefault=True)
        self.gen = gen
        self.tensor: torch.Tensor = torch.from_numpy(self.buf.numpy())

    def close(self) -> None:
        # Drop our tensor first: ManagedBuffer keeps the mapping alive while a view exists.
        del self.tensor
        self.buf.close()


class _Peer:
    """A peer's buffer mapped into this process."""

    def __init__(self, pid: int, fd: int, gen: int):
        path = f"/proc/{pid}/fd/{fd}"
        f = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(f).st_size
            self.mm = mmap.mmap(f, size, flags=mmap.MAP_SHARED | _MAP_POPULATE)
        finally:
            os.close(f)
        self.gen = gen
        self.tensor: torch.Tensor = torch.frombuffer(self.mm, dtype=torch.uint8)

    def close(self) -> None:
        del self.tensor
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view; the mapping goes with it
            pass


class ShmPlane:
    """This rank's send buffers and mailbox, and its mappings of the other members' ones.

    Args:
        initial_bytes: first size of each send buffer (they grow on demand).
        max_members: most members an epoch can have (mailbox rows).
        row_width: most int64 values in one header row.
    """

    def __init__(self, initial_bytes: int = 1 << 20, max_members: int = 1, row_width: int = 1):
        self.pid = os.getpid()
        self.host = host_key()
        self._next_gen = random.getrandbits(40) + 1
        self._rows = max_members
        self._width = row_width
        self._slot = 1 + max_members * row_width  # sequence word, then one row per member
        self._own: list[_Own] = [
            self._alloc(initial_bytes),
            self._alloc(initial_bytes),
            self._alloc(2 * self._slot * 8),
        ]
        self._ctrl: Any = self._own[_CTRL].buf.numpy().view(np.int64)
        self._peers: dict[tuple[int, int], _Peer] = {}
        self._boxes: list[Any] = []  # each member's mailbox (int64 numpy view), by index
        self._pids: list[int] = []

    def _alloc(self, nbytes: int) -> _Own:
        gen, self._next_gen = self._next_gen, self._next_gen + 1
        size = -(-max(nbytes, 1) // _PAGE) * _PAGE
        return _Own(size, gen)

    # ------------------------------------------------------------------ own buffers
    def send(self, which: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of this rank's ``which`` buffer as uint8 (grown, with a new generation,
        when too small). Write the phase's rows here before its header exchange."""
        own = self._own[which]
        if own.buf.length < nbytes:
            size = max(nbytes + nbytes // 4, 2 * own.buf.length)
            new = self._alloc(size)
            own.close()
            self._own[which] = own = new
            logger.debug("EP shm %s buffer grown to %d bytes", ("dispatch", "combine")[which], size)
        return own.tensor[:nbytes]

    def own(self, which: int) -> torch.Tensor:
        """The whole ``which`` buffer of this rank as uint8."""
        return self._own[which].tensor

    def descriptor(self, which: int) -> tuple[int, int, int]:
        """``(pid, fd, generation)`` of this rank's ``which`` buffer, for headers."""
        own = self._own[which]
        return self.pid, own.buf.fd, own.gen

    # ------------------------------------------------------------------ peers' buffers
    def peer(self, which: int, pid: int, fd: int, gen: int) -> torch.Tensor:
        """A member's ``which`` buffer as uint8, mapped once per generation.

        Raises:
            OSError: the buffer cannot be mapped (other host, no permission, process gone).
        """
        if pid == self.pid:
            return self._own[which].tensor
        key = (pid, which)
        hit = self._peers.get(key)
        if hit is not None and hit.gen == gen:
            return hit.tensor
        new = _Peer(pid, fd, gen)
        if hit is not None:
            hit.close()
        self._peers[key] = new
        return new.tensor

    def retain(self, pids: set[int]) -> None:
        """Unmap the buffers of processes that are no longer members."""
        for key in [k for k in self._peers if k[0] not in pids]:
            self._peers.pop(key).close()

    # ------------------------------------------------------------------ epoch probe
    @staticmethod
    def no_probe_row() -> torch.Tensor:
        """The probe row of a rank without shared memory (makes every member say no)."""
        return torch.tensor([-1] + [0] * (_PROBE - 1), dtype=torch.int64)

    def probe_row(self) -> torch.Tensor:
        """``[host, pid, fd, gen]`` of the dispatch buffer and ``[fd, gen]`` of the mailbox,
        all-gathered when an epoch is installed."""
        pid, fd, gen = self.descriptor(DISPATCH)
        _, cfd, cgen = self.descriptor(_CTRL)
        return torch.tensor([self.host, pid, fd, gen, cfd, cgen], dtype=torch.int64)

    def probe(self, rows: torch.Tensor) -> bool:
        """Can this rank use the plane with the members whose ``probe_row`` are ``rows``
        (in member order)? Maps their buffers and mailboxes."""
        table = rows.view(-1, _PROBE).tolist()
        self._boxes, self._pids = [], []
        if len(table) > self._rows or any(int(r[0]) != self.host for r in table):
            return False
        self.retain({int(r[1]) for r in table})
        boxes = []
        for _host, pid, fd, gen, cfd, cgen in table:
            try:
                self.peer(DISPATCH, int(pid), int(fd), int(gen))
                box = self.peer(_CTRL, int(pid), int(cfd), int(cgen))
            except OSError as exc:
                logger.warning(
                    "EP shm: cannot map the buffers of pid %d (%s); using the group", pid, exc
                )
                return False
            boxes.append(box.numpy().view(np.int64))
        self._boxes, self._pids = boxes, [int(r[1]) for r in table]
        return True

    # ------------------------------------------------------------------ mailboxes
    def post(self, seq: int, rows: list[list[int]]) -> None:
        """Publish exchange ``seq``'s rows (row ``j`` for member ``j``) in slot ``seq % 2``."""
        base = (seq & 1) * self._slot
        w = len(rows[0]) if rows else 0
        if len(rows) > self._rows or w > self._width:
            raise EPError(f"mailbox rows {len(rows)}x{w} exceed {self._rows}x{self._width}")
        if rows:
            block = self._ctrl[base + 1 : base + 1 + len(rows) * self._width]
            block.reshape(len(rows), self._width)[:, :w] = rows
        self._ctrl[base] = seq  # last: readers trust the rows once they see this word

    def collect(
        self, seq: int, me: int, width: int, timeout_s: float, abort: int
    ) -> list[list[int]]:
        """Wait for exchange ``seq`` of every member; return the rows addressed to ``me``.

        Raises:
            MailboxFailure: a member posted ``abort``, its process is gone, or ``timeout_s``
                passed.
        """
        base = (seq & 1) * self._slot
        boxes = self._boxes
        pending = [i for i in range(len(boxes)) if i != me]
        spins = 0
        start = time.monotonic()
        next_check = start + _LIVENESS_S
        while True:
            still = []
            for i in pending:
                word = int(boxes[i][base])
                if word == seq:
                    continue
                if word == abort:
                    raise MailboxFailure(f"member {i} (pid {self._pids[i]}) left the epoch")
                still.append(i)
            pending = still
            if not pending:
                break
            spins += 1
            if spins < 10:
                continue
            time.sleep(20e-6)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _LIVENESS_S
                dead = [self._pids[i] for i in pending if _gone(self._pids[i])]
                if dead:
                    raise MailboxFailure(f"member process(es) {dead} are gone")
                if now - start > timeout_s:
                    raise MailboxFailure(
                        f"members {pending} did not post exchange {seq & 0xFFFFFFFF} within "
                        f"{timeout_s:.1f}s"
                    )
        lo = base + 1 + me * self._width
        return [box[lo : lo + width].tolist() for box in boxes]

    def abort_slot(self, seq: int, word: int) -> None:
        """Write ``word`` (the epoch's abort word) into exchange ``seq``'s slot: members
        waiting there for this rank fail at once. The other slot keeps the last completed
        exchange, which a slow member may still be reading."""
        if self._ctrl is not None:
            self._ctrl[(seq & 1) * self._slot] = word

    def close(self) -> None:
        self._boxes, self._ctrl = [], None
        for p in self._peers.values():
            p.close()
        self._peers.clear()
        for own in self._own:
            own.close()
        self._own = []
