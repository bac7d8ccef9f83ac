"""Standalone client + ``setup_dummy`` (issue 16 §1), with real processes.

A master (ours), the standalone client service started the published way
(``mooncake.cli_client.main()`` with ``mooncake_client`` flags, which execs
``mooncake-core client``), a dummy client in another process (the compat
``MooncakeDistributedStore.setup_dummy``), and a normal :class:`StoreClient` in the test
process. Bytes must round-trip exactly both ways; a dummy that dies must not take the
service down nor leave its shared memory mapped there; a dead service must make dummy
calls fail at once with the published codes. One test runs the same script against the
published wheel's ``mooncake_client`` (skipped without the scratch venv) and compares
the return codes.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from store_support import Master

from mooncake_core.compat import store_dummy
from mooncake_core.compat.cli_client import check_flags
from mooncake_core.compat.store import MooncakeDistributedStore
from mooncake_core.store import StoreClient
from mooncake_core.store.standalone_client import ipc_address, recv_msg, send_msg

pytestmark = [pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
_START = (
    "import sys, mooncake_core.compat as c; c.install(force=True); "
    "import mooncake.cli_client as m; sys.exit(m.main())"
)
# the opt-in `mooncake_client` console script (extras/mooncake-client)
_SCRIPT = (
    "import sys; from mooncake_core.cli.standalone_client import published_main as m; sys.exit(m())"
)


class Service(Master):
    """The standalone client, started as ``python -m mooncake.cli_client FLAGS`` (or
    ``start``: the console script's code) on ``port`` (0: a free one). Stopped like the
    master helper it reuses (``stop``)."""

    def __init__(
        self, tmp: Path, master: str, name: str, port: int = 0, start: str = _START
    ) -> None:
        self.ready = tmp / f"{name}-{time.monotonic_ns()}.json"
        self.log = open(tmp / f"{name}.log", "ab")  # noqa: SIM115
        cmd = [
            PY,
            "-c",
            start,
            f"--master_server_address={master}",
            "--port",
            str(port),
            "--global_segment_size",
            "64 MB",
            "--local_buffer_size=16MB",
            "--ready-file",
            str(self.ready),
        ]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + 30
        while not self.ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"client service did not start: {self.tail()}")
            time.sleep(0.02)
        info = json.loads(self.ready.read_text())
        self.port = int(info["port"])
        self.address = f"127.0.0.1:{self.port}"
        assert int(info["pid"]) == self.proc.pid  # exec kept the PID, as published

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-2000:]

    def shared_mappings(self) -> int:
        maps = Path(f"/proc/{self.proc.pid}/maps").read_text()
        return sum("memfd:mooncake-core-" in line for line in maps.splitlines())


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    m = Master(tmp_path_factory.mktemp("dummy-master"))
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def service(master: Master, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    s = Service(tmp_path_factory.mktemp("dummy-svc"), master.address, "svc")
    try:
        yield s
    finally:
        s.stop()


# The dummy process: writes its objects, reads the normal client's, reports codes.
DUMMY = textwrap.dedent(
    r"""
    import ctypes, json, random, sys, time
    import mooncake_core.compat
    mooncake_core.compat.install(force=True)
    from mooncake.store import MooncakeDistributedStore

    addr, mode = sys.argv[1], sys.argv[2]
    s = MooncakeDistributedStore()
    r = {"setup": s.setup_dummy(64 << 20, 4 << 20, addr)}
    big = random.Random(1).randbytes((3 << 20) + 5)
    n = 2 << 20
    a = s.alloc_from_mem_pool(n)
    if mode == "hold":
        r["reg"] = s.register_buffer(a, n)
        ctypes.memmove(a, big, n)
        r["put_from"] = s.put_from("dummy/held", a, n)
        print(json.dumps(r), flush=True)
        time.sleep(60)
    r["hostname"] = s.get_hostname()
    r["put"] = s.put("dummy/bytes", big)
    zc = random.Random(2).randbytes(n)
    r["reg"] = [s.register_buffer(a, n), s.register_buffer(a, n)]
    ctypes.memmove(a, zc, n)
    r["put_from"] = s.put_from("dummy/zc", a, n)
    b = s.alloc_from_mem_pool(n)
    s.register_buffer(b, n)
    r["get_into"] = s.get_into("normal/obj", b, n)
    want = random.Random(3).randbytes(r["get_into"])
    r["get_into_ok"] = ctypes.string_at(b, r["get_into"]) == want
    r["get_ok"] = s.get("normal/obj") == random.Random(3).randbytes(len(s.get("normal/obj")))
    r["batch_put_from"] = s.batch_put_from(["dummy/b0", "dummy/b1"], [a, a + 4096], [4096, 100])
    r["batch_get_into"] = s.batch_get_into(
        ["dummy/b0", "dummy/b1", "nope"], [b, b + 4096, b + 8192], [4096, 4096, 10])
    r["batch_ok"] = (ctypes.string_at(b, 4096) == zc[:4096]
                     and ctypes.string_at(b + 4096, 100) == zc[4096:4196])
    r["put_batch"] = s.put_batch(["dummy/p0", "dummy/p1"], [b"x" * 10, b"yy"])
    r["get_batch"] = [x.decode() for x in s.get_batch(["dummy/p0", "dummy/p1", "nope"])]
    r["exist"] = [s.is_exist("dummy/zc"), s.is_exist("nope"),
                  s.batch_is_exist(["dummy/p0", "nope"])]
    r["size"] = [s.get_size("dummy/bytes"), s.get_size("nope")]
    r["remove"] = [s.remove("dummy/p1", True), s.remove("nope")]
    r["health"] = s.health_check()
    # bad input: the published codes
    r["alloc0"] = s.alloc_from_mem_pool(0)
    r["too_big"] = s.put("dummy/too-big", b"z" * ((4 << 20) + 1))
    r["empty"] = s.put("dummy/empty", b"")
    r["not_pool"] = s.put_from("dummy/np", ctypes.addressof(ctypes.create_string_buffer(64)), 64)
    r["reg_partial"] = s.register_buffer(a + 4096, 4096)
    c = s.alloc_from_mem_pool(4096)
    r["unregistered"] = s.get_into("dummy/b0", c, 4096)
    r["unreg"] = [s.unregister_buffer(b), s.unregister_buffer(b)]
    r["after_unreg"] = s.get_into("dummy/b0", b, 4096)
    r["close"] = s.close()
    print(json.dumps(r), flush=True)
    """
)


def _dummy(service: Service, mode: str = "run") -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [PY, "-c", DUMMY, service.address, mode],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_dummy_bytes_round_trip_both_ways(master: Master, service: Service) -> None:
    obj = random.Random(3).randbytes((1 << 20) + 11)
    with StoreClient(master=master.address, segment_size=0) as normal:
        normal.put("normal/obj", obj)
        proc = _dummy(service)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        r = json.loads(out.strip().splitlines()[-1])
        assert r["setup"] == 0 and r["hostname"] == ""
        assert r["put"] == 0 and r["put_from"] == 0 and r["reg"] == [0, 0]
        assert r["get_into"] == len(obj) and r["get_into_ok"] and r["get_ok"]
        assert r["batch_put_from"] == [0, 0]
        assert r["batch_get_into"] == [4096, 100, -704] and r["batch_ok"]
        assert r["put_batch"] == 0 and r["get_batch"] == ["x" * 10, "yy", ""]
        assert r["exist"] == [1, 0, [1, 0]]
        assert r["size"] == [(3 << 20) + 5, -704]
        assert r["remove"] == [0, -704] and r["health"] == 0
        # published codes for bad input (docs/compat.md, observed on the 0.3.13 wheel)
        assert r["alloc0"] == 0 and r["too_big"] == -600 and r["empty"] == -600
        assert r["not_pool"] == -600 and r["reg_partial"] == -1 and r["unregistered"] == -600
        assert r["unreg"] == [0, -1] and r["after_unreg"] == -600 and r["close"] == 0
        # what the dummy wrote, read by a normal client: exact bytes
        assert normal.get("dummy/bytes") == random.Random(1).randbytes((3 << 20) + 5)
        assert normal.get("dummy/zc") == random.Random(2).randbytes(2 << 20)
    # the dummy exited: its memory is no longer mapped in the service
    _wait(lambda: service.shared_mappings() == 0, "the dummy's mappings to go")


def _wait(cond: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_killed_dummy_frees_its_memory_and_service_keeps_serving(
    master: Master, service: Service
) -> None:
    proc = _dummy(service, "hold")
    try:
        assert proc.stdout is not None
        r = json.loads(proc.stdout.readline())
        assert r == {"setup": 0, "reg": 0, "put_from": 0}
        assert service.shared_mappings() == 2  # its local buffer and its registered buffer
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _wait(lambda: service.shared_mappings() == 0, "the killed dummy's mappings to go")
    assert service.proc.poll() is None
    # bad input on the socket: an answer naming it, or the connection closed; never a crash
    for junk in (b"\xff\xff\xff\x7f", b"\x03\x00\x00\x00{{{", b"\x02\x00\x00\x00[]"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(5)
            raw.connect(ipc_address(service.port))
            raw.sendall(junk)
            raw.recv(4096)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(5)
        raw.connect(ipc_address(service.port))
        send_msg(raw, {"op": "map", "id": 1, "size": 1 << 40})  # no fd
        answer, _ = recv_msg(raw)
        assert answer["ok"] is False and "file descriptor" in answer["error"][1]
        send_msg(raw, {"op": "get_into", "key": "dummy/held", "id": 9, "off": 0, "n": 8})
        answer, _ = recv_msg(raw)
        assert answer["ok"] is False and answer["error"][0] == "InvalidArgument"
    assert service.proc.poll() is None
    # the service still serves, and what the dead dummy put is still readable
    s = MooncakeDistributedStore()
    assert s.setup_dummy(0, 1 << 20, service.address) == 0
    try:
        n = 2 << 20
        a = s.alloc_from_mem_pool(n)
        assert s.register_buffer(a, n) == 0
        assert s.get_into("dummy/held", a, n) == n
        # the service wrote straight into this process's shared memory
        assert ctypes.string_at(a, n) == random.Random(1).randbytes((3 << 20) + 5)[:n]
    finally:
        assert s.close() == 0


def test_service_absent_bad_address_death_and_restart(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store_dummy, "CONNECT_WAIT_S", 0.3)
    s = MooncakeDistributedStore()
    from store_support import free_port

    caplog.set_level(logging.ERROR, logger="mooncake_core.compat.store")
    assert s.setup_dummy(0, 1 << 20, f"127.0.0.1:{free_port()}") == -1
    assert len(caplog.records) == 1 and "no client service answers" in caplog.text
    for bad in ("garbage", "127.0.0.1", "", "127.0.0.1:0", "127.0.0.1:99999"):
        assert s.setup_dummy(0, 1 << 20, bad) == -1, bad
    for args in ((-1, 0, "127.0.0.1:1"), (1.5, 0, "127.0.0.1:1"), (0, 0, 5)):
        with pytest.raises(TypeError):
            s.setup_dummy(*args)
    assert s.put("k", b"v") == -600  # never attached
    assert s.alloc_from_mem_pool(64) == 0

    # a master of its own: the killed service's segment stays registered until its client's
    # TTL runs out, and a later test's put placed there on the module's master would fail
    master = Master(tmp_path, name="death-master")
    svc = Service(tmp_path, master.address, "svc-dies")
    try:
        assert s.setup_dummy(0, 1 << 20, svc.address) == 0
        assert s.put("dies/k", b"v" * 100) == 0 and s.get("dies/k") == b"v" * 100
        a = s.alloc_from_mem_pool(4096)
        assert s.register_buffer(a, 4096) == 0
        svc.proc.kill()
        svc.proc.wait(timeout=10)
        t0 = time.monotonic()
        assert s.put("dies/k2", b"v") == -900
        assert s.get("dies/k") == b""
        assert s.is_exist("dies/k") == -900
        assert s.put_from("dies/k3", a, 4096) == -900
        assert s.get_into("dies/k", a, 4096) == -900
        assert s.health_check() == 2
        assert s.alloc_from_mem_pool(4096) != 0  # local memory, as published
        assert time.monotonic() - t0 < 2.0
        # the service comes back at the same address (started by the mooncake_client console
        # script's code): the same store re-attaches on its next call (local buffer and
        # registered buffer passed again) and moves exact bytes
        svc.stop()
        svc = Service(tmp_path, master.address, "svc-back", port=svc.port, start=_SCRIPT)
        value = random.Random(5).randbytes(300_000)
        assert s.put("back/k", value) == 0  # the first call after the restart
        assert s.get("back/k") == value and s.health_check() == 0
        assert svc.shared_mappings() == 2
        pattern = random.Random(6).randbytes(4096)
        ctypes.memmove(a, pattern, 4096)
        assert s.put_from("back/zc", a, 4096) == 0
        ctypes.memset(a, 0, 4096)
        assert s.get_into("back/zc", a, 4096) == 4096 and ctypes.string_at(a, 4096) == pattern
        assert s.unregister_buffer(a) == 0
        _wait(lambda: svc.shared_mappings() == 1, "the unregistered buffer to go")
        assert s.close() == 0
        assert s.put("back/k2", b"v") != 0  # closed: no re-attach
        _wait(lambda: svc.shared_mappings() == 0, "the closed dummy's mappings to go")
    finally:
        svc.stop()
        master.stop()


def test_cli_client_flags_one_line() -> None:
    assert check_flags(["--port=0", "--host", "127.0.0.1", "--noenable_offload"]) is None
    assert check_flags(["--global_segment_size", "4 GB", "--ready-file", "x"]) is None
    line = check_flags(["--port", "1", "--bogus_flag=3"])
    assert line is not None and "unknown flag --bogus_flag" in line
    line = check_flags(["--flagfile=x"])
    assert line is not None and "--flagfile is not supported" in line
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(
        [PY, "-c", _START, "--bogus_flag"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "--bogus_flag" in p.stderr


# ------------------------------------------------------------------ the published wheel
CODES = textwrap.dedent(
    r"""
    import ctypes, json, os, sys
    if os.environ.get("USE_MOONCAKE_CORE"):
        import mooncake_core.compat
        mooncake_core.compat.install(force=True)
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    r = {"setup": s.setup_dummy(16 << 20, 1 << 20, sys.argv[1])}
    r["hostname"] = s.get_hostname()
    r["put"] = s.put("cmp/a", b"hello")
    r["get"] = s.get("cmp/a").decode()
    r["too_big"] = s.put("cmp/big", b"z" * ((1 << 20) + 1))
    r["exact"] = s.put("cmp/exact", b"z" * (1 << 20))
    r["empty"] = s.put("cmp/empty", b"")
    r["alloc0"] = s.alloc_from_mem_pool(0)
    a = s.alloc_from_mem_pool(8192)
    r["alloc"] = a != 0
    r["unregistered"] = s.put_from("cmp/u", a, 100)
    r["reg_partial"] = s.register_buffer(a + 4096, 4096)
    r["reg"] = [s.register_buffer(a, 8192), s.register_buffer(a, 8192)]
    ctypes.memmove(a, b"q" * 8192, 8192)
    r["put_from"] = s.put_from("cmp/z", a, 8192)
    r["get_into_small"] = s.get_into("cmp/z", a, 100)
    r["get_into"] = s.get_into("cmp/z", a, 8192)
    r["missing"] = [s.get_into("cmp/none", a, 10), s.get_size("cmp/none"), s.is_exist("cmp/none"),
                    s.remove("cmp/none"), s.get("cmp/none").decode()]
    r["batch_get_into"] = s.batch_get_into(["cmp/z", "cmp/none"], [a, a + 8190], [8192, 2])
    ctypes.memmove(a, b"0123456789" * 30, 300)
    r["multi_put"] = s.batch_put_from_multi_buffers(["cmp/m"], [[a, a + 4096]], [[100, 200]])
    r["multi_get"] = s.batch_get_into_multi_buffers(
        ["cmp/m", "cmp/none"], [[a + 1000, a + 2000], [a + 3000]], [[100, 200], [10]])
    r["multi_ok"] = (ctypes.string_at(a + 1000, 100) == ctypes.string_at(a, 100)
                     and ctypes.string_at(a + 2000, 200) == ctypes.string_at(a + 4096, 200))
    r["not_pool"] = s.put_from("cmp/np", ctypes.addressof(ctypes.create_string_buffer(64)), 64)
    r["unreg"] = [s.unregister_buffer(a), s.unregister_buffer(a)]
    r["remove"] = [s.remove(k, True) for k in ("cmp/a", "cmp/exact", "cmp/z", "cmp/m")]
    r["close"] = s.close()
    print(json.dumps(r), flush=True)
    """
)


@pytest.mark.slow
def test_same_codes_as_published_mooncake_client(service: Service, tmp_path: Path) -> None:
    from mooncake_core.bench.published import peer

    real = peer().default_peer_python()
    if real is None or not (Path(real).parent / "mooncake_client").exists():
        pytest.skip("no scratch venv with the published wheel (scripts/setup_mooncake_peer.sh)")
    p = peer()
    env = p.mooncake_env()
    env["GLOG_minloglevel"] = "3"
    rpc, http, metrics, port = p.free_port(), p.free_port(), p.free_port(), p.free_port()
    procs = [
        subprocess.Popen(
            p.master_command(real, rpc, http, metrics),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        _wait(lambda: _listening(rpc) and _listening(http), "the published master", 30)
        procs.append(
            subprocess.Popen(
                [
                    str(Path(real).parent / "mooncake_client"),
                    f"--master_server_address=127.0.0.1:{rpc}",
                    f"--metadata_server=http://127.0.0.1:{http}/metadata",
                    "--host=127.0.0.1",
                    f"--port={port}",
                    "--global_segment_size=32MB",
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        _wait(lambda: _listening(port), "the published mooncake_client", 30)
        theirs = subprocess.run(
            [real, "-c", CODES, f"127.0.0.1:{port}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert theirs.returncode == 0, theirs.stderr[-2000:]
    ours = subprocess.run(
        [PY, "-c", CODES, service.address],
        env=dict(os.environ, PYTHONPATH=str(ROOT), USE_MOONCAKE_CORE="1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ours.returncode == 0, ours.stderr[-2000:]
    t = json.loads(theirs.stdout.strip().splitlines()[-1])
    o = json.loads(ours.stdout.strip().splitlines()[-1])
    assert o["setup"] == 0 and o["get_into"] == 8192 and len(o) == len(t) == 24
    assert o["multi_put"] == [0] and o["multi_get"] == [300, -704] and o["multi_ok"]
    assert {k: v for k, v in o.items() if v != t.get(k)} == {}, (o, t)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
