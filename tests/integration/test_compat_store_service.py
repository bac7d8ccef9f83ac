"""The published command-line tools, the same command lines against the wheel and against us.

Each side starts its master with ``mooncake.cli.main()`` and the published
``mooncake_master`` flags, then ``mooncake.mooncake_store_service``'s ``sync_main()`` (the
``mc_store_rest_server`` script) with the published arguments and ``MOONCAKE_*`` variables,
and this test drives the REST routes over real HTTP. The same launcher scripts run with the
published wheel (scratch venv from scripts/setup_mooncake_peer.sh; skipped with a reason
when absent) and with ours through ``mooncake_core.compat.install()``. The expected answers
were taken from the published service (0.3.13.post1); both sides must give them.
``transfer_engine_topology_dump`` and ``transfer_engine_bench`` (``mooncake.cli_bench``)
are run the same way.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import test_compat_store as harness

from mooncake_core.bench.published import peer

PRELUDE = textwrap.dedent(
    """
    import os, sys
    if os.environ.get("USE_MOONCAKE_CORE"):
        import mooncake_core.compat
        assert mooncake_core.compat.install()
    """
)
LAUNCH = {
    "master": PRELUDE + "from mooncake.cli import main\nmain()\n",
    "service": PRELUDE + "from mooncake.mooncake_store_service import sync_main\n"
    "sys.exit(sync_main())\n",
    "topology": PRELUDE + "from mooncake.transfer_engine_topology_dump import main\n"
    "sys.exit(main())\n",
    "bench": PRELUDE + "from mooncake.cli_bench import main\nsys.exit(main())\n",
}


def _python(ours: bool) -> str:
    if ours:
        return sys.executable
    real = os.environ.get("MOONCAKE_PEER_PYTHON") or peer().default_peer_python()
    if real is None:
        pytest.skip(
            "no scratch venv with the published wheel; run scripts/setup_mooncake_peer.sh "
            "(or set MOONCAKE_PEER_PYTHON)"
        )
    return str(real)


def _wait_port(port: int, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited with {proc.returncode}: {proc.communicate()[1][-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


def _stop(proc: subprocess.Popen[str]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return int(proc.returncode)


@dataclass
class Side:
    ours: bool
    python: str
    scripts: dict[str, Path]
    env: dict[str, str]
    master: str
    metadata: str

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Any:
        return subprocess.Popen(
            [self.python, str(self.scripts[name]), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env or self.env,
        )

    def run(self, name: str, *args: str, env: dict[str, str] | None = None) -> Any:
        return subprocess.run(
            [self.python, str(self.scripts[name]), *args],
            capture_output=True,
            text=True,
            env=env or self.env,
            timeout=60,
        )


def _side(ours: bool, tmp: Path) -> Iterator[Side]:
    python = _python(ours)
    scripts = {}
    for name, text in LAUNCH.items():
        scripts[name] = tmp / f"{name}.py"
        scripts[name].write_text(text)
    env = harness._env(ours)
    free = peer().free_port
    rpc, http, metrics = free(), free(), free()
    # the published mooncake_master command line, through mooncake.cli.main()
    master = subprocess.Popen(
        [python, str(scripts["master"]), *peer().master_command(python, rpc, http, metrics)[1:]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        _wait_port(rpc, master)
        _wait_port(http, master)
        yield Side(
            ours, python, scripts, env, f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
        )
    finally:
        assert _stop(master) in (0, -signal.SIGTERM, 128 + signal.SIGTERM)


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Side]:
    yield from _side(True, tmp_path_factory.mktemp("ours"))


@pytest.fixture(scope="module")
def theirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Side]:
    yield from _side(False, tmp_path_factory.mktemp("theirs"))


def _call(base: str, method: str, path: str, body: Any = None, raw: bytes | None = None) -> Any:
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, ctype, out = r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        status, ctype, out = e.code, e.headers.get("Content-Type", ""), e.read()
    if ctype.startswith("application/json"):
        return [status, json.loads(out)]
    return [status, ctype.split(";")[0], out]


#: 1 MiB + 17 characters, multi-byte ones and a NUL among them
BIG = "".join("aé中\x00~"[i % 5] + chr(33 + i % 90) for i in range((1 << 19) + 9))


def _exercise(base: str) -> dict[str, Any]:
    """Every route: success paths, a missing key, bad input; then the service is still up."""
    r: dict[str, Any] = {}

    def c(name: str, *a: Any, **k: Any) -> Any:
        r[name] = _call(base, *a, **k)
        return r[name]

    c("put", "PUT", "/api/put", {"key": "k1", "value": "hello"})
    c("get", "GET", "/api/get/k1")
    c("put_dup", "PUT", "/api/put", {"key": "k1", "value": "other"})
    c("get_after_dup", "GET", "/api/get/k1")
    c("exist", "GET", "/api/exist/k1")
    c("exist_missing", "GET", "/api/exist/nope")
    c("get_missing", "GET", "/api/get/nope")
    c("put_big", "PUT", "/api/put", {"key": "big", "value": BIG})
    got = c("get_big", "GET", "/api/get/big")
    r["get_big"] = [got[0], got[1], got[2] == BIG.encode()]
    c("put_slash", "PUT", "/api/put", {"key": "a/b", "value": "s"})
    c("get_slash", "GET", "/api/get/a%2Fb")
    c("remove_leased", "DELETE", "/api/remove/k1")  # a read leases the object
    c("remove_missing", "DELETE", "/api/remove/nope")
    c("put_fresh", "PUT", "/api/put", {"key": "fresh", "value": "f"})
    c("remove", "DELETE", "/api/remove/fresh")
    c("exist_removed", "GET", "/api/exist/fresh")
    c("put_x", "PUT", "/api/put", {"key": "x1", "value": "1"})
    c("put_y", "PUT", "/api/put", {"key": "x2", "value": "2"})
    for k in ("k1", "big", "a%2Fb"):  # renew the leases: these stay
        _call(base, "GET", f"/api/get/{k}")
    c("remove_all", "DELETE", "/api/remove_all")
    c("after_remove_all", "GET", "/api/exist/x1")
    # bad input
    c("put_no_value", "PUT", "/api/put", {"key": "k2"})
    c("put_empty_key", "PUT", "/api/put", {"key": "", "value": "x"})
    c("put_empty_value", "PUT", "/api/put", {"key": "k3", "value": ""})
    for name, raw in [("put_not_json", b"notjson"), ("put_list", b"[1, 2]")]:
        got = _call(base, "PUT", "/api/put", raw=raw)
        r[name] = [got[0], sorted(got[1])]
    got = _call(base, "PUT", "/api/put", {"key": "k4", "value": 5})
    r["put_int_value"] = [got[0], sorted(got[1])]
    c("wrong_method", "POST", "/api/put", {"key": "k", "value": "x"})
    c("no_route", "GET", "/api/nothing")
    c("head", "HEAD", "/api/get/k1")
    c("still_up", "GET", "/api/get/k1")
    # memory segments
    got = c("mount", "POST", "/api/mount", {"size": 16 << 20})
    ids = got[1].get("segment_ids", [])
    r["mount"] = [got[0], got[1].get("status"), len(ids), got[1].get("allocated_size")]
    c("unmount", "POST", "/api/unmount", {"segment_ids": ids})
    c("unmount_again", "POST", "/api/unmount", {"segment_ids": ids})
    c("mount_zero", "POST", "/api/mount", {"size": 0})
    c("mount_str", "POST", "/api/mount", {"size": "1"})
    c("unmount_none", "POST", "/api/unmount", {})
    # file-backed segments: validation and failures
    c("reconf_bad", "POST", "/api/reconfigure", {"mode": "x"})
    c("reconf_prefill", "POST", "/api/reconfigure", {"mode": "prefill"})
    c("reconf_decode_no_path", "POST", "/api/reconfigure", {"mode": "decode"})
    c(
        "reconf_decode_missing_file",
        "POST",
        "/api/reconfigure",
        {"mode": "DECODE", "path": "/nonexistent/seg", "size": 1024},
    )
    c("shm_bad_name", "POST", "/api/mount_shm", {"name": "../x", "size": 10})
    c("shm_missing", "POST", "/api/mount_shm", {"name": f"nope-{uuid.uuid4().hex}", "size": 1024})
    c("unshm_none", "POST", "/api/unmount_shm", {})
    c("unshm_unknown", "POST", "/api/unmount_shm", {"segment_ids": ["nope"]})
    c("local_disk", "POST", "/api/unmount_local_disk", {})
    c("local_disk_malformed", "POST", "/api/unmount_local_disk", raw=b"xx")
    c("local_disk_list", "POST", "/api/unmount_local_disk", raw=b"[1]")
    c("local_disk_negative", "POST", "/api/unmount_local_disk", {"grace_period_seconds": -1})
    c("local_disk_float", "POST", "/api/unmount_local_disk", {"grace_period_seconds": 1.5})
    return r


_OK = [200, {"status": "success"}]
_BAD_GRACE = [
    400,
    {"error": "Invalid grace_period_seconds, must be a non-negative integer no greater than 3600"},
]
EXPECTED: dict[str, Any] = {
    "put": _OK,
    "get": [200, "application/octet-stream", b"hello"],
    "put_dup": _OK,
    "get_after_dup": [200, "application/octet-stream", b"hello"],
    "exist": [200, {"exists": True}],
    "exist_missing": [200, {"exists": False}],
    "get_missing": [404, {"error": "Key not found"}],
    "put_big": _OK,
    "get_big": [200, "application/octet-stream", True],
    "put_slash": _OK,
    "get_slash": [200, "application/octet-stream", b"s"],
    "remove_leased": [500, {"error": "Remove operation failed"}],
    "remove_missing": [500, {"error": "Remove operation failed"}],
    "put_fresh": _OK,
    "remove": _OK,
    "exist_removed": [200, {"exists": False}],
    "put_x": _OK,
    "put_y": _OK,
    "remove_all": [200, {"status": "success removed 2 keys"}],
    "after_remove_all": [200, {"exists": False}],
    "put_no_value": [400, {"error": "Missing key or value"}],
    "put_empty_key": [400, {"error": "Missing key or value"}],
    "put_empty_value": [500, {"error": "PUT operation failed"}],
    "put_not_json": [500, ["error"]],
    "put_list": [500, ["error"]],
    "put_int_value": [500, ["error"]],
    "wrong_method": [405, "text/plain", b"405: Method Not Allowed"],
    "no_route": [404, "text/plain", b"404: Not Found"],
    "head": [200, "application/octet-stream", b""],
    "still_up": [200, "application/octet-stream", b"hello"],
    "mount": [200, "success", 1, 16 << 20],
    "unmount": _OK,
    "unmount_again": [500, {"error": "Unmount and free failed, ret=-1"}],
    "mount_zero": [400, {"error": "Invalid size, must be a positive integer"}],
    "mount_str": [400, {"error": "Invalid size, must be a positive integer"}],
    "unmount_none": [400, {"error": "Missing segment_ids"}],
    "reconf_bad": [400, {"error": "Invalid mode. Use 'decode' or 'prefill'"}],
    "reconf_prefill": [200, {"status": "success", "mode": "prefill"}],
    "reconf_decode_no_path": [400, {"error": "Missing path or size for decode mode"}],
    "reconf_decode_missing_file": [
        500,
        {"error": "Mount failed, ret=-1; rolled back to prefill", "mode": "prefill"},
    ],
    "shm_bad_name": [400, {"error": "Missing or invalid name or size"}],
    "shm_missing": [500, {"error": "Mount failed, ret=-1"}],
    "unshm_none": [400, {"error": "Missing segment_ids"}],
    "unshm_unknown": [
        500,
        {"error": "Unmount failed for one or more segments", "failed_segment_ids": ["nope"]},
    ],
    "local_disk": _OK,
    "local_disk_malformed": [400, {"error": "Malformed JSON body"}],
    "local_disk_list": [400, {"error": "Request body must be a JSON object"}],
    "local_disk_negative": _BAD_GRACE,
    "local_disk_float": _BAD_GRACE,
}


MiB = 1 << 20


def _value(tag: str) -> str:
    """1 MiB of text that names ``tag``, found again in a segment's file byte for byte."""
    return (f"<{tag}:" + "".join(chr(48 + i % 75) for i in range(997)) + ">") * (MiB // 1000)


def _exercise_files(base: str, tmp: Path, shm: str) -> dict[str, Any]:
    """File-backed segments on a service that lends no memory of its own, so every object
    lands in the file mounted: reconfigure decode (twice: the second replaces the first),
    mount_shm / unmount_shm, reconfigure prefill; the bytes are found in the files."""
    r: dict[str, Any] = {}
    seg, shm_file = tmp / "decode.bin", Path("/dev/shm") / shm
    seg.write_bytes(b"")
    os.truncate(seg, 48 * MiB)

    def c(name: str, *a: Any, **k: Any) -> Any:
        r[name] = _call(base, *a, **k)
        return r[name]

    def ids(name: str) -> list[str]:  # ids differ per side: keep how many
        got = r[name]
        found = list(got[1].pop("segment_ids", None) or [])
        got[1]["ids"] = len(found)
        return found

    def put_found(name: str, key: str, where: Path) -> None:
        value = _value(key)
        c(name, "PUT", "/api/put", {"key": key, "value": value})
        got = _call(base, "GET", f"/api/get/{key}")
        r[name + "_read"] = got[:2] + [got[2] == value.encode()]
        r[name + "_in_file"] = where.read_bytes().find(value.encode()) >= 0

    c("put_no_segment", "PUT", "/api/put", {"key": "f0", "value": "x"})
    c("decode", "POST", "/api/reconfigure", {"mode": "decode", "path": str(seg), "size": 32 * MiB})
    first = ids("decode")
    put_found("put_first", "f1", seg)
    c(
        "decode_again",
        "POST",
        "/api/reconfigure",
        {"mode": "decode", "path": str(seg), "size": 16 * MiB, "offset": 32 * MiB},
    )
    second = ids("decode_again")
    r["replaced"] = bool(second) and set(first).isdisjoint(second)
    c("f1_after_replace", "GET", "/api/exist/f1")
    put_found("put_second", "f2", seg)
    r["f2_past_32MiB"] = seg.read_bytes().find(_value("f2").encode()) >= 32 * MiB
    c("unshm_old", "POST", "/api/unmount_shm", {"segment_ids": first})
    r["unshm_old"][1]["failed_segment_ids"] = len(r["unshm_old"][1].get("failed_segment_ids", []))
    c("prefill", "POST", "/api/reconfigure", {"mode": "prefill"})
    c("f2_after_prefill", "GET", "/api/exist/f2")
    try:
        shm_file.write_bytes(b"")
        os.truncate(shm_file, 16 * MiB)
        c("mount_shm", "POST", "/api/mount_shm", {"name": "/" + shm, "size": 16 * MiB})
        mounted = ids("mount_shm")
        put_found("put_shm", "f3", shm_file)
        c("unmount_shm", "POST", "/api/unmount_shm", {"segment_ids": mounted})
        c("f3_after_unmount", "GET", "/api/exist/f3")
    finally:
        shm_file.unlink(missing_ok=True)
    data = seg.read_bytes()
    r["file_kept"] = [_value(k).encode() in data for k in ("f1", "f2")]
    c("still_up", "PUT", "/api/put", {"key": "f4", "value": "x"})
    return r


_FOUND = {"_read": [200, "application/octet-stream", True], "_in_file": True}
EXPECTED_FILES: dict[str, Any] = {
    "put_no_segment": [500, {"error": "PUT operation failed"}],
    "decode": [200, {"status": "success", "mode": "decode", "ids": 1}],
    "put_first": _OK,
    **{"put_first" + k: v for k, v in _FOUND.items()},
    "decode_again": [200, {"status": "success", "mode": "decode", "ids": 1}],
    "replaced": True,
    "f1_after_replace": [200, {"exists": False}],
    "put_second": _OK,
    **{"put_second" + k: v for k, v in _FOUND.items()},
    "f2_past_32MiB": True,
    "unshm_old": [
        500,
        {"error": "Unmount failed for one or more segments", "failed_segment_ids": 1},
    ],
    "prefill": [200, {"status": "success", "mode": "prefill"}],
    "f2_after_prefill": [200, {"exists": False}],
    "mount_shm": [200, {"status": "success", "ids": 1}],
    "put_shm": _OK,
    **{"put_shm" + k: v for k, v in _FOUND.items()},
    "unmount_shm": _OK,
    "f3_after_unmount": [200, {"exists": False}],
    "file_kept": [True, True],
    "still_up": [500, {"error": "PUT operation failed"}],
}


def _service_env(side: Side) -> dict[str, str]:
    return dict(
        side.env,
        MOONCAKE_MASTER=side.master,
        MOONCAKE_TE_META_DATA_SERVER=side.metadata,
        MOONCAKE_LOCAL_HOSTNAME="127.0.0.1",
        MOONCAKE_GLOBAL_SEGMENT_SIZE="64mb",
        MOONCAKE_LOCAL_BUFFER_SIZE="32mb",
    )


def _service_run(side: Side) -> tuple[dict[str, Any], int]:
    port = peer().free_port()
    # -D overrides a config field, as published (a string, parsed as the field's type)
    svc = side.start(
        "service", "--port", str(port), "-Dglobal_segment_size=33554432", env=_service_env(side)
    )
    try:
        _wait_port(port, svc)
        got = _exercise(f"http://127.0.0.1:{port}")
    finally:
        rc = _stop(svc)
    return got, rc


def _files_run(side: Side, tmp: Path) -> tuple[dict[str, Any], int]:
    """A second service that lends no memory (global segment 0): objects only find room
    in the files mounted through the routes."""
    port = peer().free_port()
    svc = side.start(
        "service", "--port", str(port), "-Dglobal_segment_size=0", env=_service_env(side)
    )
    try:
        _wait_port(port, svc)
        got = _exercise_files(f"http://127.0.0.1:{port}", tmp, f"mc-svc-{uuid.uuid4().hex}")
    finally:
        rc = _stop(svc)
    return got, rc


def _diff(got: dict[str, Any], want: dict[str, Any] = EXPECTED) -> dict[str, Any]:
    return {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_store_service_routes_published(theirs: Side) -> None:
    got, rc = _service_run(theirs)
    assert _diff(got) == {}
    assert rc == 0  # SIGTERM: a clean stop


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_store_service_routes_ours(ours: Side) -> None:
    got, rc = _service_run(ours)
    assert _diff(got) == {}
    assert rc == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_store_service_file_segments_published(theirs: Side, tmp_path: Path) -> None:
    got, rc = _files_run(theirs, tmp_path)
    assert _diff(got, EXPECTED_FILES) == {}
    assert rc == 0


@pytest.mark.timeout(120)
def test_store_service_file_segments_ours(ours: Side, tmp_path: Path) -> None:
    got, rc = _files_run(ours, tmp_path)
    assert _diff(got, EXPECTED_FILES) == {}
    assert rc == 0


@pytest.mark.timeout(60)
def test_store_service_refusals_are_one_line(ours: Side) -> None:
    """Ours only (the published prints tracebacks): no configuration; no master; a port in
    use."""
    env = {k: v for k, v in ours.env.items() if not k.startswith("MOONCAKE_")}
    out = ours.run("service", "--port", "0", env=env)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert "mc_store_rest_server: configuration: " in out.stderr.splitlines()[-1]
    # a master that never answers: it says that it waits, then gives up after --max-wait-time
    absent = dict(_service_env(ours), MOONCAKE_MASTER=f"127.0.0.1:{peer().free_port()}")
    out = ours.run("service", "--port", "0", "--max-wait-time", "1", env=absent)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert "still waiting for the store master" in out.stderr
    assert "the store could not be set up within 1 s" in out.stderr.splitlines()[-1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = ours.run("service", "--port", str(port), env=_service_env(ours))
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert f"cannot serve on 127.0.0.1:{port}" in out.stderr.splitlines()[-1]


#: one process per side runs the tool's main() with several command lines in turn
TOPOLOGY_RUNS = PRELUDE + textwrap.dedent(
    """
    import contextlib, io, json
    from mooncake.transfer_engine_topology_dump import main
    out = {}
    for name, args in json.loads(sys.argv[1]):
        sys.argv = ["transfer_engine_topology_dump", *args]
        o, e = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            try:
                rc = main()
            except SystemExit as exc:
                rc = exc.code
        out[name] = [rc, o.getvalue(), e.getvalue()]
    print("RESULT " + json.dumps(out))
    """
)


def _topology(python: str, env: dict[str, str], tmp: Path) -> dict[str, Any]:
    custom = tmp / "topo.json"
    custom.write_text(json.dumps({"cpu:0": [["nosuchnic0"], ["nosuchnic1"]], "cpu:1": [[], []]}))
    bad = tmp / "bad.json"
    bad.write_text("[1]")
    runs = [
        ("discover", []),
        ("use_custom_without_env", ["--use-custom-topo"]),  # before a run sets the variable
        ("custom", ["--custom-topo-json", str(custom)]),
        ("custom_unreadable", ["--custom-topo-json", str(tmp / "none.json"), "--device-name", "x"]),
        ("custom_not_object", ["--custom-topo-json", str(bad)]),
        ("bad_backend", ["--backend", "x"]),
    ]
    script = tmp / "topology_runs.py"
    script.write_text(TOPOLOGY_RUNS)
    proc = subprocess.run(
        [python, str(script), json.dumps(runs)], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    r: dict[str, Any] = {}
    for name, (rc, stdout, stderr) in json.loads(line[len("RESULT ") :]).items():
        head, _, rest = stdout.partition(": ")
        doc = json.loads(rest) if rest.strip() else None
        shape = (
            sorted(doc) if isinstance(doc, dict) else None,
            all(isinstance(v, list) and len(v) == 2 for v in doc.values())
            if isinstance(doc, dict)
            else None,
        )
        r[name] = [rc, head.replace(str(tmp), "TMP"), shape, "error:" in stderr]
        if name == "custom":
            r["custom_doc"] = doc
    return r


EXPECTED_TOPOLOGY = {
    "discover": [0, "Local topology [te/discover]", (["cpu:0"], True), False],
    "custom": [0, "Local topology [te/custom (TMP/topo.json)]", (["cpu:0", "cpu:1"], True), False],
    "custom_doc": {"cpu:0": [[], []], "cpu:1": [[], []]},
    "custom_unreadable": [
        0,
        "Local topology [te/custom (TMP/none.json)]",
        (["cpu:0"], True),
        False,
    ],
    "custom_not_object": [1, "", (None, None), True],
    "use_custom_without_env": [1, "", (None, None), True],
    "bad_backend": [2, "", (None, None), True],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["ours", "published"])
def test_topology_dump_same_command_lines(which: str, tmp_path: Path) -> None:
    env = harness._env(which == "ours")
    env.pop("MC_CUSTOM_TOPO_JSON", None)
    got = _topology(_python(which == "ours"), env, tmp_path)
    assert {k: (got.get(k), v) for k, v in EXPECTED_TOPOLOGY.items() if got.get(k) != v} == {}


def _bench(side: Side, duration: int = 1) -> tuple[str, int]:
    common = [
        "--protocol=tcp",
        f"--metadata_server={side.metadata}",
        "--buffer_size=16777216",
    ]
    tport, iport = peer().free_port(), peer().free_port()
    target = side.start("bench", "--mode=target", f"--local_server_name=127.0.0.1:{tport}", *common)
    try:
        time.sleep(0.5)
        for _ in range(100):  # the target is up once its segment is in the metadata
            try:
                with urllib.request.urlopen(
                    side.metadata + f"?key=mooncake%2Fram%2F127.0.0.1%3A{tport}", timeout=5
                ) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert target.poll() is None, target.communicate()[1][-2000:]
            time.sleep(0.1)
        out = side.run(
            "bench",
            "--mode",
            "initiator",
            "-operation=write",
            f"--local_server_name=127.0.0.1:{iport}",
            f"--segment_id=127.0.0.1:{tport}",
            f"--duration={duration}",
            "--threads=2",
            "--batch_size=8",
            "--block_size=65536",
            "--report_unit=MiB",
            "--report_precision=1",
            *common,
        )
    finally:
        _stop(target)
    return out.stdout + out.stderr, out.returncode


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_transfer_engine_bench_command_line_ours(ours: Side) -> None:
    text, rc = _bench(ours)
    assert rc == 0, text[-2000:]
    m = re.search(
        r"Test completed: duration ([\d.]+), batch count (\d+), throughput ([\d.]+) MiB/s", text
    )
    assert m is not None, text[-2000:]
    assert int(m.group(2)) > 0 and float(m.group(3)) > 0


@pytest.mark.parametrize(
    ("args", "word"),
    [
        (["--protocol=nvlink"], "--protocol=nvlink"),
        (["--backend=tent"], "--backend=tent"),
        (["--nic_priority_matrix=m.json"], "--nic_priority_matrix"),
        (["--no_such_flag=1"], "no_such_flag"),
        (["--threads=x"], "--threads"),
        (["--mode", "initiator", "--duration"], "--duration"),
    ],
)
def test_transfer_engine_bench_refuses_in_one_line(
    args: list[str], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Flags we cannot honour: one line, exit status 1, before any engine starts."""
    from mooncake_core.compat.cli_tools import bench_main

    assert bench_main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and word in err, err
