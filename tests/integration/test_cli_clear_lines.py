"""Every command fails as one clear line on stderr, never a traceback (issue 16).

Each check runs the real ``mooncake-core`` command in a subprocess and asserts its exit
status, that stderr is exactly one line (or, where the command says that it waits, the
waiting lines and then one), and that no "Traceback" appears.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from tests_support import free_port  # type: ignore[import-not-found]

import mooncake_core

pytestmark = pytest.mark.timeout(180)

ERR = "mooncake-core: error: "


def mc(
    *args: str, timeout: float = 90, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mooncake_core", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def one_line(out: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The single stderr line of a failed command (exit 2), containing every needle."""
    lines = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert len(lines) == 1 and lines[0].startswith(ERR), out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port something else listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield int(s.getsockname()[1])
    finally:
        s.close()


def test_version_on_every_command() -> None:
    want = f"mooncake-core {mooncake_core.__version__}"
    for args in (
        ("--version",),
        ("proxy", "--version"),  # before its required --prefill/--decode
        ("master", "--version"),
        ("store", "--version"),
        ("metadata-server", "--version"),
        ("bench", "--version"),
        ("simulate", "--version"),
        ("--log-level", "DEBUG", "demo", "--version"),
    ):
        out = mc(*args)
        assert out.returncode == 0, (args, out.stderr)
        assert out.stdout.strip().splitlines() == [want], (args, out.stdout)
        assert out.stderr == "", (args, out.stderr)


def test_a_port_in_use_is_one_line_naming_port_and_command(held_port: int) -> None:
    p = str(held_port)
    for command, args in (
        ("master", ("master", "--rpc-port", p, "--http-port", "-1")),
        ("master", ("master", "--rpc-port", "0", "--http-port", p)),
        ("metadata-server", ("metadata-server", "--port", p)),
        (
            "proxy",
            ("proxy", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2")
            + ("--port", p, "--wait-upstreams", "0"),
        ),
    ):
        line = one_line(mc(*args), f"port {p}", "already in use")
        assert line.startswith(f"{ERR}{command}:"), line


def test_store_transfer_port_in_use(held_port: int, tmp_path: Path) -> None:
    master = subprocess.Popen(
        [sys.executable, "-m", "mooncake_core", "master", "--rpc-port", "0", "--http-port", "-1"]
        + ["--ready-file", str(tmp_path / "m.json")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 30
        while not (tmp_path / "m.json").exists():
            assert master.poll() is None and time.monotonic() < end, "master did not start"
            time.sleep(0.1)
        import json

        rpc = json.loads((tmp_path / "m.json").read_text())["rpc_port"]
        env = dict(os.environ, MOONCAKE_TRANSFER_PORT=str(held_port), MOONCAKE_LOG_LEVEL="ERROR")
        out = mc("store", "--master", f"127.0.0.1:{rpc}", "--segment-size", "1MB", env=env)
        one_line(out, "store:", f"port {held_port}", "already in use")
    finally:
        master.terminate()
        master.wait(10)


@pytest.mark.parametrize(
    ("url", "item"),
    [
        ("etcd://127.0.0.1:x", "'127.0.0.1:x'"),
        ("etcd://127.0.0.1:2379,127.0.0.1:99999", "'127.0.0.1:99999'"),
        ("etcd://127.0.0.1:2379,,127.0.0.1:2380", "empty endpoint"),
        ("http://127.0.0.1:2379", "'http://'"),
        ("etcd://127.0.0.1:2379/v3", "'127.0.0.1:2379/v3'"),
        ("etcd://:2379", "':2379'"),
    ],
)
def test_malformed_etcd_lists_name_the_bad_item(url: str, item: str) -> None:
    one_line(mc("master", "--rpc-port", "0", "--http-port", "-1", "--ha", url), item)
    one_line(mc("store", "--master", url, "--wait-master", "1"), item)


def test_unreachable_etcd_is_one_line_after_a_bounded_wait() -> None:
    port = free_port()
    t0 = time.monotonic()
    out = mc("master", "--rpc-port", "0", "--http-port", "-1", "--ha", f"etcd://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 60
    one_line(out, f"cannot reach etcd at 127.0.0.1:{port}", "within")


def _without(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment where importing ``modules`` fails as if they were not installed."""
    for m in modules:
        (tmp_path / m).mkdir()
        (tmp_path / m / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{m}'\", name={m!r})\n"
        )
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path)


def test_missing_optional_packages_name_the_extra(tmp_path: Path) -> None:
    env = _without(tmp_path, "zmq", "torch", "aetcd", "matplotlib")
    trace = Path(__file__).resolve().parents[1] / "data" / "conversation_excerpt.jsonl"
    out = mc("simulate", "--trace", str(trace), "--limit", "20", "--plot", str(tmp_path), env=env)
    one_line(out, "matplotlib", "pip install 'mooncake-core[plot]'")
    one_line(mc("bench", "ep", "--quick", env=env), "torch", "pip install 'mooncake-core[ep]'")
    out = mc(
        "proxy",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
        "--port",
        "0",
        "--wait-upstreams",
        "0",
        "--policy",
        "global-cache",
        "--no-tokenize",
        "--kv-events",
        f"tcp://127.0.0.1:{free_port()}",
        env=env,
    )
    one_line(out, "pyzmq", "pip install 'mooncake-core[proxy]'")
    out = mc(
        "master", "--rpc-port", "0", "--http-port", "-1", "--ha", "etcd://127.0.0.1:2379", env=env
    )
    one_line(out, "aetcd", "pip install 'mooncake-core[etcd]'")


def test_store_says_it_waits_for_an_absent_master(tmp_path: Path) -> None:
    port = free_port()
    out = mc("store", "--master", f"127.0.0.1:{port}", "--wait-master", "4")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    waiting = [ln for ln in lines if f"waiting for the master at 127.0.0.1:{port} (" in ln]
    assert waiting and waiting[0].endswith("(0 s)"), out.stderr
    assert len(waiting) == len(lines) - 1, out.stderr  # nothing else but the final line
    assert lines[-1].startswith(ERR) and f"127.0.0.1:{port}" in lines[-1], out.stderr

    # the master comes late: the store waits, says so, then mounts its memory
    ready = tmp_path / "store.json"
    err = open(tmp_path / "store.err", "w+")  # noqa: SIM115
    store = subprocess.Popen(
        [sys.executable, "-m", "mooncake_core", "store", "--master", f"127.0.0.1:{port}"]
        + ["--segment-size", "1MB", "--wait-master", "60", "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL,
        stderr=err,
    )
    master = None
    try:
        end = time.monotonic() + 30
        while "waiting for the master" not in (tmp_path / "store.err").read_text():
            assert store.poll() is None and time.monotonic() < end, "no waiting line"
            time.sleep(0.1)
        master = subprocess.Popen(
            [sys.executable, "-m", "mooncake_core", "master", "--rpc-port", str(port)]
            + ["--http-port", "-1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + 60
        while not ready.exists():
            assert store.poll() is None and time.monotonic() < end, (
                tmp_path / "store.err"
            ).read_text()
            time.sleep(0.1)
    finally:
        for proc in (store, master):
            if proc is not None:
                proc.terminate()
                proc.wait(10)
        err.close()
    assert "Traceback" not in (tmp_path / "store.err").read_text()


def test_bad_log_level_is_one_line() -> None:
    one_line(mc("plugins", "--log-level", "loud"), "--log-level", "'loud'")
    one_line(mc("--log-level", "chatty", "plugins"), "--log-level", "'chatty'")
    assert mc("plugins", "--log-level", "warning").returncode == 0


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = b"ok" if self.path == "/health" else b"no"
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_proxy_checks_its_upstreams_at_start() -> None:
    base = ["proxy", "--port", "0"]
    one_line(
        mc(*base, "--prefill", "127.0.0.1:8100", "--decode", "http://127.0.0.1:2"),
        "--prefill",
        "'127.0.0.1:8100'",
        "http(s) URL",
    )
    one_line(
        mc(*base, "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:x"),
        "--decode",
        "'http://127.0.0.1:x'",
    )
    dead1, dead2 = free_port(), free_port()
    t0 = time.monotonic()
    out = mc(
        *base,
        "--prefill",
        f"http://127.0.0.1:{dead1}",
        "--decode",
        f"http://127.0.0.1:{dead2}",
        "--wait-upstreams",
        "1",
    )
    assert time.monotonic() - t0 < 30
    one_line(out, f"prefill http://127.0.0.1:{dead1}", f"decode http://127.0.0.1:{dead2}")

    live = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=live.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{live.server_address[1]}"
    try:
        for upstreams in (
            ("--prefill", url, "--decode", url, "--wait-upstreams", "10"),  # both answer
            ("--prefill", url, "--decode", f"http://127.0.0.1:{dead2}", "--wait-upstreams", "0"),
        ):
            proc = subprocess.Popen(
                [sys.executable, "-m", "mooncake_core", *base, *upstreams],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                assert proc.stdout is not None
                first = proc.stdout.readline()
                assert first.startswith("proxy listening on http://127.0.0.1:"), (
                    first,
                    proc.poll(),
                )
            finally:
                proc.terminate()
                _, err = proc.communicate(timeout=10)
            assert "Traceback" not in err, err
    finally:
        live.shutdown()
