"""A child process spoken to in JSON lines (used by benchmarks and tests to drive workers).

The child reads one JSON object per line on its stdin (``{"cmd": ..., ...}``) and writes
one JSON object per line on its stdout: first a greeting, then one answer per request.
An answer with an ``"error"`` key is raised as :class:`WorkerError`. Lines on stdout that
are not JSON objects (a library printing) are skipped. A reader thread moves the child's
lines into a queue, so a timeout never leaves half a line behind.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = ["JsonLinesProcess", "WorkerError"]

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """The child answered a request with ``{"error": ...}``, or it exited."""


class JsonLinesProcess:
    """Start ``cmd`` with pipes for stdin and stdout and talk to it in JSON lines.

    Args:
        cmd: the command line.
        env: its environment (default this process's).
        label: how errors name it.
        hello_timeout: seconds to wait for its greeting (``hello``); 0 reads none.
        stderr: where its stderr goes (default inherited).
        cwd: its working directory.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        label: str = "worker",
        hello_timeout: float = 60.0,
        stderr: int | IO[Any] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> None:
        self.label = label
        self.proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            bufsize=1,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._pump = threading.Thread(target=self._read_lines, name=f"{label}-out", daemon=True)
        self._pump.start()
        self.hello: dict[str, Any] = self.read(hello_timeout) if hello_timeout else {}

    def _read_lines(self) -> None:
        out = self.proc.stdout
        assert out is not None
        try:
            for line in out:
                self._lines.put(line)
        except (OSError, ValueError):
            pass
        self._lines.put(None)

    def send(self, cmd: str, **kw: Any) -> None:
        """Send one request ``{"cmd": cmd, **kw}``."""
        stdin = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        stdin.flush()

    def read(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next answer.

        Raises:
            TimeoutError: none within ``timeout`` seconds.
            WorkerError: the child exited, or answered with an ``"error"``.
        """
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{self.label} did not answer within {timeout:g}s") from None
            if line is None:
                self._lines.put(None)  # every later read sees the exit too
                raise WorkerError(f"{self.label} exited ({self.proc.poll()})")
            text = line.strip()
            if not text.startswith("{"):
                if text:
                    logger.debug("%s printed: %s", self.label, text[:200])
                continue
            out: dict[str, Any] = json.loads(text)
            if "error" in out:
                raise WorkerError(str(out["error"]))
            return out

    def call(self, cmd: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        """Send a request and return its answer."""
        self.send(cmd, **kw)
        return self.read(timeout)

    def kill(self) -> None:
        """SIGKILL it (if it still runs) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self, timeout: float = 10.0) -> None:
        """Ask it to ``exit`` and wait; kill it when it does not go within ``timeout``."""
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=timeout)
                self.proc.wait(timeout)
            except (OSError, WorkerError, TimeoutError, ValueError, subprocess.TimeoutExpired):
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
