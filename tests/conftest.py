"""Shared fixtures: free loopback ports, a real etcd server, peer processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PEER_SCRIPT = Path(__file__).resolve().parent / "integration" / "peer_proc.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """A real etcd (Debian's etcd-server) on free loopback ports, data dir on /dev/shm."""

    def __init__(self) -> None:
        exe = shutil.which("etcd") or "/usr/bin/etcd"
        if not os.path.exists(exe):
            pytest.skip(
                "etcd is not installed (scripts/setup.sh installs Debian's etcd-server as root)"
            )
        self.exe = exe
        self.client_port = free_port()
        self.peer_port = free_port()
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.data = tempfile.mkdtemp(prefix="mc-etcd-", dir=base)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self) -> None:
        c, p = self.client_port, self.peer_port
        self.log = open(os.path.join(self.data, "etcd.log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--name",
                "t",
                "--data-dir",
                os.path.join(self.data, "d"),
                "--listen-client-urls",
                f"http://127.0.0.1:{c}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{c}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{p}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{p}",
                "--initial-cluster",
                f"t=http://127.0.0.1:{p}",
            ],
            stdout=self.log,
            stderr=self.log,
        )
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(f"{self.http}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self.proc.returncode}; see {self.data}/etcd.log"
                )
            time.sleep(0.1)
        raise RuntimeError("etcd did not become healthy within 20 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    srv = EtcdServer()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture()
def etcd_url(etcd_server: EtcdServer) -> str:
    """``etcd://127.0.0.1:PORT`` of the session's real etcd server."""
    return etcd_server.url


class Peer:
    """A transfer-engine peer in its own process, driven by JSON lines over stdin/stdout."""

    def __init__(
        self,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        e = dict(os.environ)
        e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
        e.update(env or {})
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, str(PEER_SCRIPT), *(args or [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=e,
            bufsize=1,
        )
        hello = self._read(timeout=60)
        self.name: str = hello["name"]
        self.pid: int = hello["pid"]

    def _read(self, timeout: float = 60) -> dict[str, Any]:
        assert self.proc.stdout is not None
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError("peer process did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process exited ({self.proc.poll()})")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def call(self, cmd: str, timeout: float = 60, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=10)
            except (OSError, RuntimeError, TimeoutError, ValueError):
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture()
def spawn_peer() -> Iterator[Any]:
    peers: list[Peer] = []

    def make(**kw: Any) -> Peer:
        p = Peer(**kw)
        peers.append(p)
        return p

    yield make
    for p in peers:
        p.close()
