"""LMCache as the peer in ``mooncake-core bench vllm --compare-lmcache PYTHON``.

``PYTHON`` is a scratch venv's interpreter with LMCache installed
(``scripts/setup_lmcache_peer.sh``; it also sees the project's vLLM). The bench starts, in
the same run as our store connector: ``lmcache server`` (its multi-process cache server,
on loopback) and two vLLM servers run by that interpreter with vLLM's built-in
``LMCacheMPConnector`` in ``lmcache_driven`` transfer mode (shared memory; the default
mode pickles the KV and is several times slower here). ``LMCacheConnectorV1`` does not run
on a CPU ("No supported cpu connector found", then every request recomputes), so it is not
used. See ../shared/reference/lmcache-cpu.md-derived notes in docs/vllm.md.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from mooncake_vllm.bench_reap import ChildReaper

__all__ = ["check_lmcache", "LMCachePeer"]

_CHECK = (
    "import lmcache.cli.main, lmcache.v1.multiprocess.server\n"
    "from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector "
    "import LMCacheMPConnector\n"
)
_SHM = Path("/dev/shm")


def check_lmcache(python: str, timeout: float = 300.0) -> str | None:
    """None when ``python`` can run LMCache's server and connector; else one line saying why."""
    if not Path(python).exists():
        return f"{python} does not exist (run scripts/setup_lmcache_peer.sh)"
    try:
        r = subprocess.run(
            [python, "-c", _CHECK],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if r.returncode != 0:
        lines = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
        return f"{python} cannot import LMCache: {lines[-1] if lines else r.returncode}"
    return None


def _shm_names() -> set[str]:
    try:
        return set(os.listdir(_SHM))
    except OSError:
        return set()


class LMCachePeer:
    """One ``lmcache server`` and the vLLM servers that use it through ``LMCacheMPConnector``."""

    def __init__(self, python: str, work: Path, reaper: ChildReaper) -> None:
        from mooncake_vllm.testing import free_port

        self.python = python
        self.work = work
        self.reaper = reaper
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._shm_before = _shm_names()

    def start(self, l1_gb: int = 1) -> None:
        from mooncake_vllm.testing import engine_env, free_port

        argv = [
            "lmcache",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--chunk-size",
            "256",
            "--l1-size-gb",
            str(l1_gb),
            "--eviction-policy",
            "LRU",
            "--disable-observability",
            "--supported-transfer-mode",
            "auto",
            "--max-workers",
            "2",
            "--http-host",  # its HTTP API would take 0.0.0.0:8080 otherwise
            "127.0.0.1",
            "--http-port",
            str(free_port()),
        ]
        code = f"import sys; from lmcache.cli.main import main; sys.argv = {argv!r}; main()"
        log = open(self.work / "lmcache-server.log", "wb")  # noqa: SIM115
        self.proc = self.reaper.popen(
            [self.python, "-c", code],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=engine_env({"LMCACHE_DISABLE_BANNER": "1"}),
        )
        log.close()

    def wait_ready(self, timeout: float = 300.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"lmcache server exited with {self.proc.returncode}: {self._log_tail()}"
                )
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(
            f"lmcache server not listening after {timeout:.0f} s: {self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            lines = (self.work / "lmcache-server.log").read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(ln for ln in lines[-3:] if ln.strip())

    def transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": self.port,
                "lmcache.mp.mq_timeout": 60,
                "lmcache.mp.mp_transfer_mode": "lmcache_driven",
            },
        }

    def vllm_server(self, model: Path, name: str, env: dict[str, str], **common: Any) -> Any:
        """A ``VLLMServer`` run by LMCache's interpreter, with ``LMCacheMPConnector``."""
        from mooncake_vllm.testing import VLLMServer

        s = VLLMServer(
            model,
            name=name,
            log_path=self.work / f"{name}.log",
            env=env,
            kv_transfer_config=self.transfer_config(),
            **common,
        )
        s.cmd[0] = self.python
        return s

    def stop(self) -> list[str]:
        """Stop the server and remove the shared-memory files LMCache left; returns their
        names."""
        if self.proc is not None and self.proc.poll() is None:
            from mooncake_vllm.bench_reap import kill_groups

            kill_groups([self.proc.pid], timeout=15, procs=[self.proc])
        left = sorted(
            n for n in _shm_names() - self._shm_before if "lmcache" in n.lower() or "lmc" in n
        )
        for n in left:
            with contextlib.suppress(OSError):
                (_SHM / n).unlink()
        return left
