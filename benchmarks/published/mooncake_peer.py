"""Run the PUBLISHED Mooncake (in its own venv) from our benchmarks, for comparison.

- :func:`run_mooncake_transfer_bench`: two processes with the published
  ``mooncake.engine.TransferEngine`` over TCP on loopback (metadata ``P2PHANDSHAKE``):
  write/read GB/s at 16 and 64 MiB, batch 32 x 1 MiB, 64 KiB read p50/p99.
- :func:`run_mooncake_store_bench`: the published ``mooncake_master`` with its embedded
  HTTP metadata server on free loopback ports, a holder process (contributes the memory)
  and a reader process (contributes none) using ``MooncakeDistributedStore`` with
  protocol tcp: put_from/get_into GB/s at 64 KiB, 1, 16, 64 MiB; batch 32 x 1 MiB;
  64 KiB get p50/p99; ``is_exist`` ops/s over 10k keys.

``python`` is the interpreter of a venv that has ``mooncake-transfer-engine-non-cuda``
(``scripts/setup_mooncake_peer.sh`` makes one and prints its path). The code that runs
inside that venv is in ``_mooncake_transfer.py`` / ``_mooncake_store.py`` next to this
file; it imports nothing from ``mooncake_core``. This module runs in our venv: the core's
benchmarks load it by path (:func:`mooncake_core.bench.published.peer`), as it lives in
the checkout's ``benchmarks/published/``, not in the runtime package. Every process started
here is stopped before the function returns, also on failure.

Blocking: each function runs for seconds (quick) to tens of seconds. Raises
:class:`~mooncake_core.errors.MooncakeError` with the tail of the failing process's
log when the published package misbehaves.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

from mooncake_core import config
from mooncake_core.errors import MooncakeError

__all__ = [
    "run_mooncake_transfer_bench",
    "run_mooncake_store_bench",
    "mooncake_env",
    "master_command",
    "default_peer_python",
    "free_port",
    "TRANSFER_SCRIPT",
    "STORE_SCRIPT",
]

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
TRANSFER_SCRIPT = _HERE / "_mooncake_transfer.py"
STORE_SCRIPT = _HERE / "_mooncake_store.py"
HOLDER_SEGMENT = 512 << 20


def default_peer_python() -> str | None:
    """The scratch venv's python (``$MOONCAKE_PEER_VENV`` or ``<repo>/.scratch/mooncake-venv``)
    if it exists."""
    venv = config.env_str("MOONCAKE_PEER_VENV") or str(
        _HERE.parent.parent / ".scratch" / "mooncake-venv"
    )
    py = Path(venv) / "bin" / "python"
    return str(py) if py.is_file() else None


def master_command(python: str, rpc: int, http: int, metrics: int) -> list[str]:
    """The published ``mooncake_master`` of ``python``'s venv on loopback: RPC on ``rpc``, the
    embedded HTTP metadata server on ``http``, metrics on ``metrics``, no periodic report."""
    return [
        str(Path(python).parent / "mooncake_master"),
        f"--rpc_port={rpc}",
        "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_port={http}",
        "--http_metadata_server_host=127.0.0.1",
        f"--metrics_port={metrics}",
        "--metrics_host=127.0.0.1",
        "--enable_metric_reporting=false",
    ]


def mooncake_env() -> dict[str, str]:
    """Environment for the published processes: loopback TCP, quiet glog, no stray config."""
    env = dict(config.environment())
    for k in ("MOONCAKE_CONFIG_PATH", "PYTHONPATH"):
        env.pop(k, None)
    env.update(
        {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "GLOG_minloglevel": "1", "PYTHONUNBUFFERED": "1"}
    )
    return env


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class _Procs:
    """Processes started for one benchmark; all stopped on exit."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[str]]] = []
        self._files: list[IO[str]] = []

    def start(
        self, name: str, argv: list[str], *, stdin: bool = False, stdout: bool = True
    ) -> subprocess.Popen[str]:
        err = open(self.workdir / f"{name}.log", "w")  # closed in stop_all
        self._files.append(err)
        p = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout else err,
            stderr=err,
            text=True,
            env=mooncake_env(),
            cwd=self.workdir,
        )
        self.procs.append((name, p))
        return p

    def log(self, name: str) -> str:
        return _tail(self.workdir / f"{name}.log")

    def stop_all(self) -> None:
        for _, p in reversed(self.procs):
            if p.stdin is not None and not p.stdin.closed:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for _, p in reversed(self.procs):
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for f in self._files:
            f.close()


def _readline(p: subprocess.Popen[str], what: str, procs: _Procs, name: str, timeout: float) -> str:
    """First stdout line of ``p`` (within ``timeout`` seconds), else an error with its log."""
    assert p.stdout is not None
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    ready = sel.select(timeout)
    sel.close()
    line = p.stdout.readline() if ready else ""
    if not line:
        raise MooncakeError(
            f"published mooncake {name} gave no {what} within {timeout:.0f}s "
            f"(exit {p.poll()}); its log ends:\n{procs.log(name)}"
        )
    return line.strip()


def _result(p: subprocess.Popen[str], procs: _Procs, name: str, timeout: float) -> dict[str, Any]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise MooncakeError(
            f"published mooncake {name} did not finish within {timeout:.0f}s; log:\n"
            f"{procs.log(name)}"
        ) from None
    lines = [ln for ln in out.splitlines() if ln.strip()]
    if p.returncode != 0 or not lines:
        raise MooncakeError(
            f"published mooncake {name} failed (exit {p.returncode}); output: {out[-500:]!r}; "
            f"log:\n{procs.log(name)}"
        )
    res: dict[str, Any] = json.loads(lines[-1])
    return res


def _check_python(python: str) -> None:
    if not Path(python).is_file():
        raise MooncakeError(
            f"no Python at {python!r}; run scripts/setup_mooncake_peer.sh and pass the path "
            "it prints"
        )


def run_mooncake_transfer_bench(python: str, quick: bool) -> dict[str, Any]:
    """Published engine, two processes, TCP on loopback.

    Returns keys ``tcp_write_gbps_16m``, ``tcp_read_gbps_16m``, ``tcp_write_gbps_64m``,
    ``tcp_read_gbps_64m``, ``tcp_batch_write_32x1m``, ``tcp_batch_read_32x1m`` (GB/s,
    medians over rounds), ``lat64k_p50_us``, ``lat64k_p99_us`` (64 KiB read), ``rounds``,
    ``wall_s``.
    """
    _check_python(python)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mc-peer-") as tmp, ExitStack() as stack:
        procs = _Procs(Path(tmp))
        stack.callback(procs.stop_all)
        target = procs.start("target", [python, str(TRANSFER_SCRIPT), "target"], stdin=True)
        info = _readline(target, "segment address", procs, "target", 60)
        argv = [python, str(TRANSFER_SCRIPT), "initiator", info] + (["--quick"] if quick else [])
        res = _result(procs.start("initiator", argv), procs, "initiator", 300)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    logger.info("published mooncake transfer bench: %s", res)
    return res


def _wait_port(port: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def run_mooncake_store_bench(python: str, quick: bool) -> dict[str, Any]:
    """Published master + holder + reader, protocol tcp on loopback.

    Returns ``put_gbps_<size>`` / ``get_gbps_<size>`` for 64k, 1m, 16m, 64m (put_from /
    get_into), ``put_gbps_16m``, ``get_gbps_16m``, ``batch_put_gbps_32x1m``,
    ``batch_get_gbps_32x1m``, ``get64k_p50_us``, ``get64k_p99_us``, ``meta_ops_per_s``
    (is_exist over 10k keys), ``rounds``, ``wall_s``.
    """
    _check_python(python)
    master_bin = Path(python).parent / "mooncake_master"
    if not master_bin.is_file():
        raise MooncakeError(
            f"{master_bin} not found; the venv of {python!r} lacks "
            "mooncake-transfer-engine-non-cuda"
        )
    t0 = time.monotonic()
    rpc, http, metrics = free_port(), free_port(), free_port()
    master_addr = f"127.0.0.1:{rpc}"
    metadata = f"http://127.0.0.1:{http}/metadata"
    with tempfile.TemporaryDirectory(prefix="mc-peer-") as tmp, ExitStack() as stack:
        procs = _Procs(Path(tmp))
        stack.callback(procs.stop_all)
        master = procs.start(
            "master",
            master_command(python, rpc, http, metrics),
            stdout=False,
        )
        deadline = time.monotonic() + 30
        if not (_wait_port(rpc, deadline) and _wait_port(http, deadline)):
            raise MooncakeError(
                f"mooncake_master did not listen on {rpc}/{http} (exit {master.poll()}); log:\n"
                f"{procs.log('master')}"
            )
        holder = procs.start(
            "holder",
            [python, str(STORE_SCRIPT), "holder", master_addr, metadata, str(HOLDER_SEGMENT)],
            stdin=True,
        )
        line = _readline(holder, "ready line", procs, "holder", 60)
        if line != "ready":
            raise MooncakeError(
                f"published mooncake holder said {line!r}; log:\n{procs.log('holder')}"
            )
        argv = [python, str(STORE_SCRIPT), "reader", master_addr, metadata] + (
            ["--quick"] if quick else []
        )
        res = _result(procs.start("reader", argv), procs, "reader", 400)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    logger.info("published mooncake store bench: %s", res)
    return res


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/published/mooncake_peer.py [transfer|store|all] [--quick]
    [--python PY]``."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("what", nargs="?", default="all", choices=["transfer", "store", "all"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--python", default=None, help="python of the venv with the published wheel")
    args = ap.parse_args(argv)
    py = args.python or default_peer_python()
    if py is None:
        ap.error("no --python given and no scratch venv; run scripts/setup_mooncake_peer.sh")
    out: dict[str, Any] = {}
    if args.what in ("transfer", "all"):
        out["transfer"] = run_mooncake_transfer_bench(py, args.quick)
    if args.what in ("store", "all"):
        out["store"] = run_mooncake_store_bench(py, args.quick)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
