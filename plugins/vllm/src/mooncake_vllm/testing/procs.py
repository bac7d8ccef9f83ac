"""Helper processes of the engine tests and benchmarks: the store master, and their shutdown.

- :class:`StoreMaster` runs ``mooncake-core master`` in a subprocess on free loopback
  ports. Like :class:`~mooncake_vllm.testing.server.VLLMServer` it runs under
  ``setpriv --pdeathsig TERM``: it gets SIGTERM when the process that started it dies,
  however that dies (a killed pytest run left orphan masters behind).
- :func:`stop_process` ends one subprocess: SIGTERM, then SIGKILL if it does not exit.

Importing this module does not import vLLM, torch or transformers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from mooncake_vllm.testing.server import _DIE_WITH_US, engine_env, free_port

__all__ = ["StoreMaster", "stop_process"]


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """SIGTERM ``proc`` and wait up to ``timeout`` s; then SIGKILL it. A no-op once it exited."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class StoreMaster:
    """``mooncake-core master`` on free loopback ports (``addr`` for clients, ``http_url``).

    Args:
        log_path: where its stdout/stderr go.
        args: extra command-line arguments.
        env: extra environment variables.
    """

    def __init__(
        self,
        log_path: str | os.PathLike[str],
        *,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.addr = f"127.0.0.1:{self.rpc_port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = Path(log_path)
        self.cmd = [
            sys.executable,
            "-m",
            "mooncake_core",
            "master",
            "--rpc-port",
            str(self.rpc_port),
            "--http-port",
            str(self.http_port),
            *(args or []),
        ]
        self.env = engine_env(env)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> StoreMaster:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [*_DIE_WITH_US, *self.cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
        )
        log.close()
        return self

    def wait_ready(self, timeout: float = 60.0) -> StoreMaster:
        """Wait until the RPC and HTTP ports accept connections; raise if the master exited."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        waiting = [self.rpc_port, self.http_port]
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"store master exited with {self.proc.returncode}; log: {self.log_path}"
                )
            try:
                with socket.create_connection(("127.0.0.1", waiting[0]), timeout=1):
                    waiting.pop(0)
                if not waiting:
                    return self
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(
            f"store master not listening after {timeout:.0f} s; log: {self.log_path}"
        )

    def kill(self) -> None:
        """SIGKILL (a crash, as fault tests want it) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)

    def __enter__(self) -> StoreMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
