"""Engine processes for the multi-process checks.

``python -m mooncake_conformance.worker SPEC_JSON`` builds the harness of a
:class:`~mooncake_conformance.harness.HarnessSpec` in a fresh process, says
``{"ready": pid}``, then answers one JSON request per stdin line with one JSON line
(``{"ok": result}`` or ``{"error": "..."}``). :class:`Worker` is the parent's side.

Requests: ``keys``, ``save``, ``lookup``, ``load``, ``fill_pages`` (content of a token
prefix), ``expected_digests`` and ``read_digests`` (sha256 of page bytes, to compare
across processes without shipping pages), ``churn`` (see
:func:`~mooncake_conformance.scenarios.churn`) and ``exit``.

Engine imports take seconds (vLLM: about 10 s of CPU). When the harness factory's module
defines ``preload()`` (a function importing the engine's heavy modules), workers of that
factory are forked from a *zygote*: one process per factory that ran ``preload()`` once
(``python -m mooncake_conformance.worker --zygote FACTORY``). The zygote forks only while
it runs a single Python thread; otherwise, or when it cannot start, workers start fresh as above.
Set ``MOONCAKE_CONFORMANCE_ZYGOTE=0`` to always start them fresh.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import io
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from mooncake_conformance.harness import EngineHarness, HarnessSpec, build_harness
from mooncake_conformance.scenarios import churn, expected_pages, fill_pages
from mooncake_core.config import env_flag, environment
from mooncake_core.transfer.procfs import start_time

__all__ = ["Worker", "serve"]

logger = logging.getLogger(__name__)


def _handle(h: EngineHarness, req: Mapping[str, Any]) -> Any:
    op = req["op"]
    if op == "keys":
        return h.page_keys(req["tokens"])
    if op == "save":
        return h.save(req["tokens"], req["slots"])
    if op == "lookup":
        return h.lookup(req["tokens"])
    if op == "load":
        return h.load(req["tokens"], req["slots"])
    if op == "fill_pages":
        fill_pages(h, req["tokens"], req["slots"])
        return None
    if op == "expected_digests":
        return [
            hashlib.sha256(b).hexdigest()
            for b in expected_pages(h, req["tokens"], req["n"], h.num_slots - 1)
        ]
    if op == "read_digests":
        return [hashlib.sha256(h.read(s)).hexdigest() for s in req["slots"]]
    if op == "churn":
        st = churn(
            h,
            req["shared"],
            req["seed"],
            req["pages"],
            rounds=req.get("rounds", 0),
            duration_s=req.get("duration_s", 0.0),
        )
        return st.as_dict()
    raise ValueError(f"unknown request {op!r}")


def serve(spec: HarnessSpec, inp: Any = None, out: Any = None) -> int:
    """Run the request loop on ``inp``/``out`` (default stdin/stdout) until ``exit`` or EOF."""
    inp = sys.stdin if inp is None else inp
    if out is None:
        out = sys.stdout
        sys.stdout = sys.stderr  # whatever the engine prints must not corrupt the protocol
    h = build_harness(spec)
    try:
        out.write(json.dumps({"ready": os.getpid()}) + "\n")
        out.flush()
        for line in inp:
            req = json.loads(line)
            if req["op"] == "exit":
                out.write(json.dumps({"ok": None}) + "\n")
                out.flush()
                break
            try:
                resp: dict[str, Any] = {"ok": _handle(h, req)}
            except Exception as exc:  # reported to the parent, which decides
                resp = {"error": f"{type(exc).__name__}: {exc}"}
            out.write(json.dumps(resp) + "\n")
            out.flush()
    finally:
        h.close()
    return 0


class Worker:
    """A harness in its own process (the parent's handle).

    Args:
        spec: what to build there.
        env: extra environment variables.
        start_timeout_s: how long building the harness may take (engine imports are slow).
    """

    def __init__(
        self,
        spec: HarnessSpec,
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        e = dict(environment())
        e.update(env or {})
        self.spec = spec
        zygote = _zygote_for(spec.factory, e)
        forked = zygote.fork(spec) if zygote is not None else None
        self.proc: _Proc = (
            forked
            if forked is not None
            else subprocess.Popen(
                [sys.executable, "-m", "mooncake_conformance.worker", spec.to_json()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=e,
                bufsize=1,
            )
        )
        self.pid = int(self._read(start_timeout_s)["ready"])

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                raise TimeoutError(f"worker {self.proc.pid} did not answer within {timeout:.0f} s")
        finally:
            sel.close()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.pid} exited with {self.proc.wait()}")
        resp: dict[str, Any] = json.loads(line)
        return resp

    def call(self, op: str, timeout: float = 120.0, **kw: Any) -> Any:
        """Send one request; returns its result or raises ``RuntimeError`` with the worker's
        error."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        resp = self._read(timeout)
        if "error" in resp:
            raise RuntimeError(f"worker {self.proc.pid}: {resp['error']}")
        return resp.get("ok")

    def send(self, op: str, **kw: Any) -> None:
        """Send a request without waiting (pair with :meth:`result`)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 120.0) -> Any:
        resp = self._read(timeout)
        if "error" in resp:
            raise RuntimeError(f"worker {self.proc.pid}: {resp['error']}")
        return resp.get("ok")

    def close(self) -> None:
        """Ask the worker to exit; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=20)
                self.proc.wait(20)
            except (OSError, RuntimeError, TimeoutError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class _Proc(Protocol):
    """What :class:`Worker` uses of its process: a ``Popen`` or a :class:`_Forked` one."""

    pid: int
    stdin: Any
    stdout: Any

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class _Forked:
    """A worker forked by a zygote: not our child, so it is watched through ``/proc``."""

    def __init__(self, pid: int, stdin: Any, stdout: Any) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self._started = start_time(pid)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and (
            self._started is None or start_time(self.pid) != self._started
        ):
            self.returncode = -1  # the zygote reaps it; its status is not ours to read
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return rc

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class _Zygote:
    """The parent's handle on a zygote process (see the module doc)."""

    def __init__(self, factory: str, env: Mapping[str, str]) -> None:
        self.factory = factory
        self.lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = ours
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mooncake_conformance.worker",
                    "--zygote",
                    factory,
                    str(theirs.fileno()),
                ],
                stdin=subprocess.DEVNULL,
                stdout=None,  # the zygote points its stdout at stderr (see zygote())
                env=dict(env),
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        self.sock.settimeout(180.0)
        hello = self._recv()
        self.forkable = bool(hello.get("forkable"))
        if not self.forkable:
            logger.info("conformance workers of %s start fresh: %s", factory, hello.get("why"))

    def _recv(self) -> dict[str, Any]:
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = self.sock.recv(4096)
            if not chunk:
                raise RuntimeError(f"the conformance zygote of {self.factory} exited")
            buf += chunk
        out: dict[str, Any] = json.loads(buf)
        return out

    def fork(self, spec: HarnessSpec) -> _Forked | None:
        """A worker for ``spec`` forked from the zygote (None: start one fresh instead)."""
        if not self.forkable:
            return None
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            with self.lock:
                msg = json.dumps({"spec": spec.to_json()}).encode() + b"\n"
                socket.send_fds(self.sock, [msg], [to_child_r, from_child_w])
                reply = self._recv()
        except (OSError, RuntimeError, ValueError) as exc:
            logger.warning(
                "conformance zygote of %s failed (%s); starting fresh", spec.factory, exc
            )
            self.forkable = False
            for fd in (to_child_w, from_child_r):
                os.close(fd)
            return None
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        return _Forked(
            int(reply["pid"]),
            io.TextIOWrapper(io.FileIO(to_child_w, "w"), line_buffering=True),
            io.TextIOWrapper(io.BufferedReader(io.FileIO(from_child_r, "r"))),
        )

    def close(self) -> None:
        self.sock.close()  # the zygote exits on EOF; its workers are the tests' to close
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_zygotes: dict[tuple[str, str], _Zygote | None] = {}
_zygotes_lock = threading.Lock()


def _zygote_for(factory: str, env: Mapping[str, str]) -> _Zygote | None:
    """The zygote of ``factory`` for workers with environment ``env``, started on first use;
    None when workers of this factory start fresh."""
    if not env_flag("MOONCAKE_CONFORMANCE_ZYGOTE", True):
        return None
    # the same zygote for every check: pytest's per-check variable is left out of the key
    key = (
        factory,
        json.dumps(sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST")),
    )
    with _zygotes_lock:
        if key not in _zygotes:
            zygote: _Zygote | None = None
            modname = factory.partition(":")[0]
            try:
                if callable(getattr(importlib.import_module(modname), "preload", None)):
                    zygote = _Zygote(factory, env)
            except Exception as exc:  # workers then start fresh, as without a zygote
                logger.warning("no conformance zygote for %s: %s", factory, exc)
            _zygotes[key] = zygote
        return _zygotes[key]


@atexit.register
def _close_zygotes() -> None:
    with _zygotes_lock:
        for z in _zygotes.values():
            if z is not None:
                z.close()
        _zygotes.clear()


def zygote(factory: str, fd: int) -> int:
    """The zygote's loop: preload, then fork one worker per request until EOF."""
    sock = socket.socket(fileno=fd)
    modname = factory.partition(":")[0]
    # Anything written to stdout, now or by a handler the preload binds to it, goes to stderr:
    # a forked worker speaks its protocol on pipes of its own, never on fd 1.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        importlib.import_module(modname).preload()
        # Python threads would be lost in a fork while holding its locks; native ones that
        # the engine's libraries start at import (torch: one) register fork handlers, as
        # for torch's own forked data loaders
        n = threading.active_count()
        hello = {"forkable": n == 1, "why": f"{n} Python threads after preload()" if n > 1 else ""}
    except Exception as exc:  # the parent starts its workers fresh
        hello = {"forkable": False, "why": f"preload() failed: {type(exc).__name__}: {exc}"}
    sock.sendall(json.dumps(hello).encode() + b"\n")
    if not hello["forkable"]:
        return 0
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked workers are reaped by the kernel
    buf = b""
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 2)
        if not msg:
            return 0
        buf += msg
        if not buf.endswith(b"\n"):
            for f in fds:
                os.close(f)
            continue
        req, buf = json.loads(buf), b""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                sock.close()
                inp = io.TextIOWrapper(io.BufferedReader(io.FileIO(fds[0], "r")))
                out = io.TextIOWrapper(io.FileIO(fds[1], "w"), line_buffering=True)
                code = serve(HarnessSpec.from_json(req["spec"]), inp, out)
                out.flush()
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        for f in fds:
            os.close(f)
        sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "--zygote":
        return zygote(args[1], int(args[2]))
    if len(args) != 1:
        print("usage: python -m mooncake_conformance.worker SPEC_JSON", file=sys.stderr)
        return 2
    return serve(HarnessSpec.from_json(args[0]))


if __name__ == "__main__":
    raise SystemExit(main())
