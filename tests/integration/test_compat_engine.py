"""The compat ``TransferEngine`` driven the way Mooncake's own examples drive the real one.

- Two processes (target + initiator), ``P2PHANDSHAKE`` names ``host:port``,
  ``allocate_managed_buffer`` / ``register_memory``, ``transfer_sync_write/read``, batch
  async + status, ``transfer_submit_write`` + ``transfer_check_status``, byte-exact.
- ``compat.install()`` then ``from mooncake.engine import TransferEngine`` in a fresh
  interpreter without the real package.
- API shape: the SAME script runs against the published wheel (scratch venv from
  scripts/setup_mooncake_peer.sh) and against ours; the return codes must agree.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mooncake_core.bench.published import peer
from mooncake_core.compat.engine import (
    ERR_ADDRESS_OVERLAPPED,
    TransferEngine,
    TransferNotify,
    TransferOpcode,
)

ROOT = Path(__file__).resolve().parents[2]

# Runs unchanged on the published package and on ours (USE_MOONCAKE_CORE=1 installs ours
# as ``mooncake`` first). Only API names, argument names and return codes are used.
SCRIPT = textwrap.dedent(
    r"""
    import ctypes, hashlib, json, os, random, sys, time
    if os.environ.get("USE_MOONCAKE_CORE"):
        import mooncake_core.compat
        assert mooncake_core.compat.install()
    from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode

    role, protocol = sys.argv[1], sys.argv[2]
    N = (5 << 20) + 12345          # not a multiple of any slice size
    OFF = 7                        # unaligned offsets on both sides
    HOLD = 8 << 20

    te = TransferEngine()
    rc_init = te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    port = te.get_rpc_port()

    if role == "target":
        addr = te.allocate_managed_buffer(HOLD)
        raw = ctypes.create_string_buffer(1 << 20)
        raw_addr = ctypes.addressof(raw)
        rc_reg = te.register_memory(raw_addr, 1 << 20)
        te.write_bytes_to_buffer(addr, b"hello from the target", 21)
        print(json.dumps({"name": "127.0.0.1:%d" % port, "addr": addr, "raw": raw_addr,
                          "rc_init": rc_init, "rc_reg": rc_reg}), flush=True)
        sys.stdin.readline()        # the initiator is done
        body = te.read_bytes_from_buffer(addr + OFF, N)
        print(json.dumps({"sha": hashlib.sha256(body).hexdigest(),
                          "raw_head": te.read_bytes_from_buffer(raw_addr, 16).hex(),
                          "notifies": sorted([n.name, n.msg] for n in te.get_notifies())}),
              flush=True)
        sys.exit(0)

    info = json.loads(sys.argv[3])
    peer, raddr, rraw = info["name"], info["addr"], info["raw"]
    r = {"rc_init": rc_init, "port_is_int": isinstance(port, int) and port > 0,
         "opcodes": [int(TransferOpcode.Read), int(TransferOpcode.Write)]}
    local = te.allocate_managed_buffer(HOLD)
    r["alloc_ok"] = isinstance(local, int) and local > 0
    rng = random.Random(42)
    data = bytes(rng.getrandbits(8) for _ in range(N))
    r["wbytes"] = te.write_bytes_to_buffer(local + OFF, data, N)
    # single synchronous ops, keyword names as in the published binding
    r["read_hello"] = te.transfer_sync_read(target_hostname=peer, buffer=local + HOLD - 64,
                                            peer_buffer_address=raddr, length=21)
    r["hello"] = te.read_bytes_from_buffer(local + HOLD - 64, 21).decode()
    r["write"] = te.transfer_sync_write(peer, local + OFF, raddr + OFF, N)
    # read it back into another (unaligned) place of a second buffer
    local2 = te.allocate_managed_buffer(HOLD)
    r["read"] = te.transfer_sync_read(peer, local2 + 3, raddr + OFF, N)
    r["read_exact"] = te.read_bytes_from_buffer(local2 + 3, N) == data
    r["sha"] = hashlib.sha256(data).hexdigest()
    # batch sync: 8 pieces of 64 KiB + 1 into the target's registered raw memory and back
    k = 8; n = (64 << 10) + 1
    bufs = [local + i * n for i in range(k)]
    remote = [rraw + i * n for i in range(k)]
    r["bwrite"] = te.batch_transfer_sync_write(peer, bufs, remote, [n] * k)
    r["bread"] = te.batch_transfer_sync_read(peer, [local2 + i * n for i in range(k)], remote,
                                             [n] * k)
    r["bexact"] = (te.read_bytes_from_buffer(local2, k * n)
                   == te.read_bytes_from_buffer(local, k * n))
    # async batches, several in flight, then wait for all
    ids = [te.batch_transfer_async_write(peer, [local + OFF], [raddr + OFF], [N]),
           te.batch_transfer_async_read(peer, [local2 + i * n for i in range(k)], remote, [n] * k),
           te.batch_transfer_async(peer, [local2 + (7 << 20)], [raddr], [4096],
                                   TransferOpcode.Read)]
    r["async_ids_ok"] = all(isinstance(b, int) and b != 0 for b in ids)
    r["async_status"] = te.get_batch_transfer_status(ids)
    # submit + poll
    bid = te.transfer_submit_write(peer, local + OFF, raddr + OFF, N)
    deadline = time.time() + 30
    while (st := te.transfer_check_status(bid)) == 0 and time.time() < deadline:
        time.sleep(0.001)
    r["check_status"] = st
    # transfer_sync with a notification
    r["notify"] = te.transfer_sync(peer, local, rraw, 16, TransferOpcode.Write,
                                   TransferNotify("done", "42"))
    # failures: unregistered local memory, remote address outside registered memory, dead peer
    r["bad_local"] = te.transfer_sync_read(peer, 4096, raddr, 16)
    r["bad_remote"] = te.transfer_sync_read(peer, local, 16, 16)
    r["bad_peer"] = te.transfer_sync_write("127.0.0.1:1", local, raddr, 16)
    r["bad_lists"] = te.batch_transfer_sync_write(peer, [local], [raddr, raddr], [16])
    r["async_bad_peer"] = te.batch_transfer_async_write("127.0.0.1:1", [local], [raddr], [16])
    r["zero_len"] = te.transfer_sync_read(peer, local, raddr, 0)
    # registration codes
    extra = ctypes.create_string_buffer(8192)
    ea = ctypes.addressof(extra)
    r["reg"] = [te.register_memory(ea, 8192), te.register_memory(ea, 8192),
                te.unregister_memory(ea), te.unregister_memory(ea)]
    r["batch_reg"] = [te.batch_register_memory([ea, ea + 4096], [4096, 4096]),
                      te.batch_unregister_memory([ea, ea + 4096])]
    r["probe"] = [te.send_probe(peer), te.send_probe("127.0.0.1:1")]
    first = te.get_first_buffer_address(peer)
    r["first_addr_ok"] = isinstance(first, int) and first > 0
    topo = json.loads(te.get_local_topology())
    r["topology_ok"] = isinstance(topo, dict) and all(k.startswith("cpu:") for k in topo)
    r["notify_obj"] = [TransferNotify("a", "b").name, TransferNotify("a", "b").msg]
    r["free"] = [te.free_managed_buffer(local2, HOLD), te.free_managed_buffer(local, HOLD)]
    print(json.dumps(r), flush=True)
    """
)


def _run_pair(
    python: str, script: Path, protocol: str, env: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(target info, initiator results, target final report)."""
    target = subprocess.Popen(
        [python, str(script), "target", protocol],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert target.stdout is not None and target.stdin is not None
        line = target.stdout.readline()
        assert line, (
            "target printed nothing; stderr: "
            f"{target.stderr.read()[-3000:] if target.stderr else ''}"
        )
        info = json.loads(line)
        init = subprocess.run(
            [python, str(script), "initiator", protocol, line.strip()],
            capture_output=True,
            text=True,
            env=env,
            timeout=90,
        )
        assert init.returncode == 0, f"initiator failed: {init.stderr[-3000:]}"
        res = json.loads(init.stdout.strip().splitlines()[-1])
        target.stdin.write("done\n")
        target.stdin.flush()
        final = json.loads(target.stdout.readline())
        assert target.wait(20) == 0
        return info, res, final
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()


def _env(ours: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    env.pop("MOONCAKE_CONFIG_PATH", None)
    if ours:
        env["USE_MOONCAKE_CORE"] = "1"
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    else:
        env.pop("USE_MOONCAKE_CORE", None)
        env.pop("PYTHONPATH", None)
        env["GLOG_minloglevel"] = "2"
    return env


def _check_pair(info: dict[str, Any], res: dict[str, Any], final: dict[str, Any]) -> None:
    assert info["rc_init"] == 0 and info["rc_reg"] == 0
    assert res["rc_init"] == 0 and res["port_is_int"] and res["alloc_ok"]
    assert res["hello"] == "hello from the target"
    for key in (
        "read_hello",
        "write",
        "read",
        "bwrite",
        "bread",
        "async_status",
        "notify",
        "zero_len",
        "wbytes",
    ):
        assert res[key] == 0, (key, res[key])
    assert res["read_exact"] and res["bexact"] and res["async_ids_ok"]
    assert res["check_status"] == 1
    assert final["sha"] == res["sha"], "target memory differs from what the initiator wrote"
    assert final["notifies"] == [["done", "42"]]
    for key in ("bad_local", "bad_remote", "bad_peer", "bad_lists"):
        assert res[key] < 0, (key, res[key])
    assert res["async_bad_peer"] == 0


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("compat") / "te_example.py"
    p.write_text(SCRIPT)
    return p


# ---------------------------------------------------------------------- two processes, ours
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("protocol", ["tcp", "rdma"])
def test_two_processes_like_mooncake_examples(script: Path, protocol: str) -> None:
    info, res, final = _run_pair(sys.executable, script, protocol, _env(ours=True))
    _check_pair(info, res, final)
    assert res["reg"] == [0, -7, 0, -3]
    assert res["batch_reg"] == [0, 0]
    assert res["probe"] == [0, -102]
    assert res["first_addr_ok"] and res["topology_ok"]
    assert res["free"] == [0, 0]
    assert res["opcodes"] == [0, 1]


# --------------------------------------------------------------------- same script, published wheel
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_same_script_against_published_wheel(script: Path) -> None:
    real = os.environ.get("MOONCAKE_PEER_PYTHON") or peer().default_peer_python()
    if real is None:
        pytest.skip(
            "no scratch venv with the published wheel; run scripts/setup_mooncake_peer.sh "
            "(or set MOONCAKE_PEER_PYTHON)"
        )
    probe = subprocess.run(
        [real, "-c", "import mooncake.engine"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        pytest.skip(
            f"the published mooncake does not import in {real}: {probe.stderr.strip()[-300:]}"
        )
    theirs = _run_pair(real, script, "tcp", _env(ours=False))
    ours = _run_pair(sys.executable, script, "tcp", _env(ours=True))
    _check_pair(*theirs)
    _check_pair(*ours)
    # every return code and check the script records must agree
    assert {k: v for k, v in ours[1].items() if k != "sha"} == {
        k: v for k, v in theirs[1].items() if k != "sha"
    }
    assert ours[2]["notifies"] == theirs[2]["notifies"]


# ---------------------------------------------------------------------- install()
@pytest.mark.timeout(60)
def test_install_provides_mooncake_engine_in_fresh_interpreter() -> None:
    code = textwrap.dedent(
        """
        import importlib.util, sys
        assert importlib.util.find_spec("mooncake") is None, "real package present"
        import mooncake_core.compat as c
        assert c.install() is True and c.install() is True
        from mooncake.engine import TransferEngine, TransferOpcode, TransferNotify
        import mooncake, mooncake.engine
        assert TransferEngine is c.engine.TransferEngine
        assert mooncake.engine is c.engine
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert te.get_rpc_port() > 0
        a = te.allocate_managed_buffer(4096)
        assert te.write_bytes_to_buffer(a, b"xyz", 3) == 0
        assert te.read_bytes_from_buffer(a, 3) == b"xyz"
        te.close()
        print("ok")
        """
    )
    env = _env(ours=True)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=50
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.timeout(60)
def test_install_leaves_a_real_package_alone(tmp_path: Path) -> None:
    fake = tmp_path / "mooncake"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    code = textwrap.dedent(
        """
        import mooncake_core.compat as c
        assert c.install() is False
        import mooncake
        assert getattr(mooncake, "REAL", False)
        assert c.install(force=True) is True
        import mooncake.engine
        assert mooncake.engine.TransferEngine is c.engine.TransferEngine
        print("ok")
        """
    )
    env = _env(ours=True)
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=50
    )
    assert out.returncode == 0, out.stderr[-3000:]


# ----------------------------------------------------------------- in-process: codes and edge cases
@pytest.fixture()
def pair() -> Any:
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
    yield a, b
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_return_codes_in_process(pair: Any) -> None:
    a, b = pair
    pa = f"127.0.0.1:{a.get_rpc_port()}"
    ra, lb = a.allocate_managed_buffer(1 << 20), b.allocate_managed_buffer(1 << 20)
    assert ra and lb
    assert b.write_bytes_to_buffer(lb, b"0123456789", 10) == 0
    assert b.transfer_sync(pa, lb, ra + 100, 10, TransferOpcode.Write) == 0
    assert a.read_bytes_from_buffer(ra + 100, 10) == b"0123456789"
    # sizes and lists
    assert b.transfer_sync_write(pa, lb, ra, -1) < 0
    assert b.batch_transfer_sync_read(pa, [], [], []) < 0
    assert b.batch_transfer_async_read(pa, [lb], [ra], [1, 2]) == 0
    # unknown / released batch ids fail instead of crashing
    assert b.transfer_check_status(987654) == -1
    assert b.get_batch_transfer_status([987654]) == -1
    bid = b.transfer_submit_write(pa, lb, ra, 16)
    assert b.get_batch_transfer_status([bid]) == 0
    assert b.transfer_check_status(bid) == -1
    # buffers outside registered memory are refused, not written
    junk = ctypes.create_string_buffer(64)
    assert b.write_bytes_to_buffer(ctypes.addressof(junk), b"x", 1) == -1
    assert b.read_bytes_from_buffer(ctypes.addressof(junk), 1) == b""
    assert b.write_bytes_to_buffer(lb, b"abc", 5) == -1
    # registering over a registered range: the overlap code, told apart by the error's type
    assert b.register_memory(lb + 4096, 4096) == ERR_ADDRESS_OVERLAPPED
    # managed buffers
    assert b.free_managed_buffer(lb + 1, 10) == -1
    assert b.allocate_managed_buffer(0) == 0
    # uninitialized engine
    fresh = TransferEngine()
    assert fresh.get_rpc_port() == 0
    assert fresh.transfer_sync_write(pa, lb, ra, 8) == -1
    assert fresh.register_memory(lb, 8) == -1
    assert fresh.get_notifies() == []
    # get_first_buffer_address: own name and a peer
    assert a.get_first_buffer_address(pa) == ra
    assert b.get_first_buffer_address(pa) == ra
    assert b.get_first_buffer_address("127.0.0.1:1") == 0
    assert TransferNotify("n", "m") == TransferNotify("n", "m")


@pytest.mark.timeout(60)
def test_upstream_env_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "7")
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "", "tcp", "") == 0  # empty metadata -> P2PHANDSHAKE
    try:
        eng = te.get_engine()
        assert eng.config.transfer.timeout_s == 7.0
        assert eng.config.transfer.listen_host == "127.0.0.1"
        assert eng.config.metadata_server == "P2PHANDSHAKE"
        assert eng.name == f"127.0.0.1:{te.get_rpc_port()}"
    finally:
        te.close()


@pytest.mark.timeout(30)
def test_initialize_ext_and_bad_metadata() -> None:
    te = TransferEngine()
    assert te.initialize_ext("127.0.0.1", "", "tcp", "", "p2p") == 0
    te.close()
    bad = TransferEngine()
    assert bad.initialize("127.0.0.1", "nosuch://x", "tcp", "") == -1
