"""Processes of ``mooncake-core bench soak``: etcd, masters, store nodes, workers; RSS sampling.

Everything listens on 127.0.0.1 and lives in one temporary directory (logs, etcd data).
"""

from __future__ import annotations

import json
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from mooncake_core.errors import ConfigError, MetadataError
from mooncake_core.etcd import etcd_command, etcd_executable, find_etcd, wait_etcd_healthy


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_of(pid: int) -> tuple[int, int, int] | None:
    """(VmRSS, RssAnon, RssShmem) of ``pid`` in bytes, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    vals = {"VmRSS": 0, "RssAnon": 0, "RssShmem": 0}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in vals:
            vals[key] = int(rest.split()[0]) * 1024
    return vals["VmRSS"], vals["RssAnon"], vals["RssShmem"]


_MEMFD = re.compile(r"/memfd:mooncake-(\d+)")


def mapped_engine_memory(pid: int) -> dict[int, int]:
    """Bytes of each process's engine memory (memfd ``mooncake-<owner pid>``) that ``pid``
    maps, by owner pid (its own included); empty once it is gone."""
    out: dict[int, int] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            text = f.read()
    except OSError:
        return out
    for line in text.splitlines():
        m = _MEMFD.search(line)
        if m:
            lo, _, hi = line.split(maxsplit=1)[0].partition("-")
            owner = int(m.group(1))
            out[owner] = out.get(owner, 0) + int(hi, 16) - int(lo, 16)
    return out


class Proc:
    """A child process with a label, its log in the run directory."""

    def __init__(self, label: str, cmd: list[str], logdir: Path, **kw: Any) -> None:
        self.label = label
        self.log = open(logdir / f"{label}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=kw.pop("stdout", self.log), stderr=self.log, **kw)
        self.pid = self.proc.pid
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Etcd(Proc):
    """Debian's etcd on free loopback ports, data in the run directory."""

    def __init__(self, logdir: Path) -> None:
        if find_etcd() is None:
            raise ConfigError("bench soak: etcd is not installed (apt-get install etcd-server)")
        c, p = free_port(), free_port()
        self.url = f"etcd://127.0.0.1:{c}"
        cmd = etcd_command(
            etcd_executable(), str(logdir / "etcd-data"), f"127.0.0.1:{c}", f"127.0.0.1:{p}", "soak"
        )
        super().__init__("etcd", cmd, logdir)
        try:
            wait_etcd_healthy(f"http://127.0.0.1:{c}", self.proc, 30, log_hint=f"{logdir}/etcd.log")
        except MetadataError as exc:
            raise RuntimeError(str(exc)) from None


def _wait_file(path: Path, p: Proc, timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            data: dict[str, Any] = json.loads(path.read_text())
            return data
        if not p.alive():
            raise RuntimeError(f"{p.label} exited with {p.proc.returncode}; see its log")
        time.sleep(0.05)
    raise RuntimeError(f"{p.label} not ready within {timeout:.0f}s")


MC = [sys.executable, "-m", "mooncake_core", "--log-level", "WARNING"]


class MasterProc(Proc):
    """``mooncake-core master`` with HA on the run's etcd."""

    def __init__(self, label: str, logdir: Path, etcd: str, cluster: str, extra: list[str]) -> None:
        ready = logdir / f"{label}.ready.json"
        cmd = [*MC, "master", "--rpc-port", "0", "--http-port", "0", "--ready-file", str(ready)]
        cmd += ["--ha", etcd, "--cluster-id", cluster, *extra]
        super().__init__(label, cmd, logdir)
        info = _wait_file(ready, self, 60)
        self.http_port = int(info["http_port"])

    def http(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=5) as r:
            return str(r.read().decode())

    def role(self) -> str:
        try:
            return str(json.loads(self.http("/role"))["role"])
        except (OSError, ValueError, KeyError):
            return "down"

    def wait_role(self, role: str, timeout: float) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.role() == role:
                return time.monotonic() - t0
            time.sleep(0.05)
        raise RuntimeError(f"{self.label} did not become {role} within {timeout:.0f}s")


class StoreNode(Proc):
    """``mooncake-core store`` lending a pre-faulted segment."""

    def __init__(self, label: str, logdir: Path, etcd: str, cluster: str, size: int) -> None:
        ready = logdir / f"{label}.{time.monotonic_ns()}.ready.json"
        cmd = [*MC, "store", "--master", etcd, "--cluster-id", cluster]
        cmd += ["--segment-size", str(size), "--prefault", "--ready-file", str(ready)]
        super().__init__(label, cmd, logdir)
        _wait_file(ready, self, 60)


class WorkerProc(Proc):
    """A :mod:`~mooncake_core.bench.soak_worker` process, spoken to in JSON lines."""

    def __init__(self, label: str, logdir: Path, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "mooncake_core.bench.soak_worker", *args]
        super().__init__(
            label, cmd, logdir, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.hello = self.read(90)

    def read(self, timeout: float) -> dict[str, Any]:
        out = self.proc.stdout
        assert out is not None
        sel = selectors.DefaultSelector()
        sel.register(out, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                raise TimeoutError(f"{self.label} did not answer within {timeout:.0f}s")
        finally:
            sel.close()
        line = out.readline()
        if not line:
            raise RuntimeError(f"{self.label} exited ({self.proc.poll()}); see its log")
        data: dict[str, Any] = json.loads(line)
        return data

    def send(self, cmd: dict[str, Any]) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps(cmd) + "\n")
        stdin.flush()

    def call(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        self.send(cmd)
        return self.read(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "exit"})
            except OSError:
                pass
        super().stop(timeout)
