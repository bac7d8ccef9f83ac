"""Engine processes for the multi-process checks.

``python -m mooncake_conformance.worker SPEC_JSON`` builds the harness of a
:class:`~mooncake_conformance.harness.HarnessSpec` in a fresh process, says
``{"ready": pid}``, then answers one JSON request per stdin line with one JSON line
(``{"ok": result}`` or ``{"error": "..."}``). :class:`Worker` is the parent's side.

Requests: ``keys``, ``save``, ``lookup``, ``load``, ``fill_pages`` (content of a token
prefix), ``expected_digests`` and ``read_digests`` (sha256 of page bytes, to compare
across processes without shipping pages), ``churn`` (see
:func:`~mooncake_conformance.scenarios.churn`) and ``exit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import selectors
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from mooncake_conformance.harness import EngineHarness, HarnessSpec, build_harness
from mooncake_conformance.scenarios import churn, expected_pages, fill_pages
from mooncake_core.config import environment

__all__ = ["Worker", "serve"]


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


def serve(spec: HarnessSpec) -> int:
    """Run the request loop on stdin/stdout until ``exit`` or EOF."""
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the engine prints must not corrupt the protocol
    h = build_harness(spec)
    try:
        out.write(json.dumps({"ready": os.getpid()}) + "\n")
        out.flush()
        for line in sys.stdin:
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
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake_conformance.worker", spec.to_json()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=e,
            bufsize=1,
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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m mooncake_conformance.worker SPEC_JSON", file=sys.stderr)
        return 2
    return serve(HarnessSpec.from_json(args[0]))


if __name__ == "__main__":
    raise SystemExit(main())
