"""Child reaping for ``mooncake-core bench vllm``: no server outlives the bench, however it ends.

Every process the bench starts (vLLM servers, the store master, an LMCache server) runs in a
process group of its own, and :class:`ChildReaper` stops each group on every exit path:

- a normal return or an exception: the phases' ``finally`` blocks, then :meth:`ChildReaper.reap`;
- SIGINT, SIGTERM, SIGHUP (Ctrl-C, ``timeout``, a closed terminal): a handler reaps, then
  exits with 128 + the signal number;
- interpreter exit by any other path: an ``atexit`` hook;
- SIGKILL of the bench, which no handler sees: a watchdog process (its own session, so a
  signal to the bench's group does not reach it) holds the other end of a pipe; when the
  pipe closes without a "done" line, it sends SIGTERM to every group it was told about,
  then SIGKILL to what is left 15 s later.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import Any, Protocol

__all__ = ["ChildReaper", "kill_groups"]

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_WATCHDOG = r"""
import os, signal, sys, time
groups = set()
done = False
for line in sys.stdin:
    op, _, arg = line.strip().partition(" ")
    if op == "+":
        groups.add(int(arg))
    elif op == "-":
        groups.discard(int(arg))
    elif op == "done":
        done = True
        break
if not done and groups:
    for sig, pause in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 0.0)):
        for g in list(groups):
            try:
                os.killpg(g, sig)
            except ProcessLookupError:
                groups.discard(g)
        end = time.monotonic() + pause
        while groups and time.monotonic() < end:
            for g in list(groups):
                try:
                    os.killpg(g, 0)
                except ProcessLookupError:
                    groups.discard(g)
            time.sleep(0.2)
"""


class _Server(Protocol):
    """What the reaper needs of a server object (``VLLMServer`` has it)."""

    proc: subprocess.Popen[bytes] | None

    def stop(self, sig: int = ...) -> None: ...


def kill_groups(
    pgids: list[int], timeout: float = 20.0, procs: list[subprocess.Popen[bytes]] | None = None
) -> None:
    """SIGTERM each process group, wait up to ``timeout`` s in all, then SIGKILL what is left.

    ``procs``: the group leaders that are our own children, polled while waiting (a dead
    child stays a zombie, and so a member of its group, until it is waited for)."""
    alive = set(pgids)
    for g in list(alive):
        try:
            os.killpg(g, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            alive.discard(g)
    end = time.monotonic() + timeout
    while alive and time.monotonic() < end:
        for p in procs or ():
            p.poll()
        for g in list(alive):
            try:
                os.killpg(g, 0)
            except (ProcessLookupError, PermissionError):
                alive.discard(g)
        time.sleep(0.1)
    for g in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGKILL)


class ChildReaper:
    """Tracks the bench's children (each the leader of its own process group) and stops them.

    Use :meth:`install` once, :meth:`popen` for plain subprocesses (it starts them in a new
    session), :meth:`server` for ``VLLMServer`` objects (they start their own session) and
    :meth:`sync` after servers (re)start, so the watchdog knows their current groups.
    """

    def __init__(self) -> None:
        self._servers: list[_Server] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._told: set[int] = set()
        self._lock = threading.Lock()
        self._reaped = False
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._old: dict[int, Any] = {}

    # ------------------------------------------------------------------ set-up
    def install(self) -> ChildReaper:
        """Signal handlers (main thread only), the atexit hook and the watchdog."""
        atexit.register(self.reap)
        if threading.current_thread() is threading.main_thread():
            for s in _SIGNALS:
                self._old[s] = signal.signal(s, self._on_signal)
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:  # the handlers and atexit still cover every exit but SIGKILL
            logger.warning("bench vllm: no watchdog process (%s); SIGKILL would leak servers", exc)
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        for s in _SIGNALS:  # a second Ctrl-C must not interrupt the reaping
            signal.signal(s, signal.SIG_IGN)
        name = signal.Signals(signum).name
        print(f"[bench vllm] {name}: stopping every server this bench started", flush=True)
        self.reap()
        raise SystemExit(128 + signum)

    def _tell(self, line: str) -> None:
        wd = self._watchdog
        if wd is None or wd.stdin is None:
            return
        try:
            wd.stdin.write(line.encode() + b"\n")
            wd.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            self._watchdog = None

    # ------------------------------------------------------------------ tracking
    def popen(self, cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        """``subprocess.Popen`` in a new session, tracked."""
        p: subprocess.Popen[bytes] = subprocess.Popen(cmd, start_new_session=True, **kw)
        with self._lock:
            self._procs.append(p)
        self.sync()
        return p

    def server(self, s: Any) -> Any:
        """Track a ``VLLMServer`` (started or not); returns it."""
        with self._lock:
            self._servers.append(s)
        self.sync()
        return s

    def _groups(self) -> list[int]:
        procs = [s.proc for s in self._servers] + list(self._procs)
        return [p.pid for p in procs if p is not None and p.poll() is None]

    def sync(self) -> None:
        """Tell the watchdog the current process groups (servers restart on a new port)."""
        with self._lock:
            now = set(self._groups())
            for g in now - self._told:
                self._tell(f"+ {g}")
            for g in self._told - now:
                self._tell(f"- {g}")
            self._told = now

    # ------------------------------------------------------------------ stopping
    def reap(self) -> None:
        """Stop every tracked process group (idempotent); the watchdog then exits."""
        with self._lock:
            if self._reaped:
                return
            self._reaped = True
            groups = self._groups()
        if groups:
            procs = [s.proc for s in self._servers if s.proc is not None] + self._procs
            kill_groups(groups, procs=procs)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(1)
        for s in self._servers:
            if s.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    s.proc.wait(1)
        self._tell("done")
        if self._watchdog is not None:
            with contextlib.suppress(OSError, ValueError):
                if self._watchdog.stdin is not None:
                    self._watchdog.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(5)
        atexit.unregister(self.reap)
        for signum, old in self._old.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, old)
