"""The same calls against the published wheel and against ours give the same answers.

Each script runs twice: with the published ``mooncake`` (scratch venv from
scripts/setup_mooncake_peer.sh; skipped with a reason when absent) and with ours through
``mooncake_core.compat.install()``. The expected answers below were taken from the published
wheel (0.3.13.post1); both sides must give them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import test_compat_store as harness

from mooncake_core.bench.published import peer

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = textwrap.dedent(
    """
    import ctypes, json, os, sys
    if os.environ.get("USE_MOONCAKE_CORE"):
        import mooncake_core.compat
        assert mooncake_core.compat.install()
    """
)

CONFIG_TYPES = PRELUDE + textwrap.dedent(
    """
    from mooncake.store import ReplicateConfig, SoftPinAction, ObjectDataType
    values = {"int": 3, "bool": True, "float": 2.5, "str": "x", "none": None,
              "list_str": ["a"], "list_int": [1], "tuple_str": ("a",), "neg": -1,
              "big": 1 << 70, "spa": SoftPinAction.ENABLE, "odt": ObjectDataType.KVCACHE,
              "bytes": b"x"}
    fields = ["replica_num", "nof_replica_num", "dfs_replica_num", "soft_pin_action",
              "soft_pin_ttl_ms", "with_hard_pin", "preferred_segment", "preferred_segments",
              "preferred_nof_segments", "prefer_alloc_in_same_node", "data_type", "group_ids"]
    r = {}
    for f in fields:
        row = {}
        for k, v in values.items():
            c = ReplicateConfig()
            try:
                setattr(c, f, v)
                row[k] = repr(getattr(c, f))
            except Exception as e:
                row[k] = type(e).__name__
        r[f] = row
    c = ReplicateConfig()
    r["str"] = str(c)
    for what, fn in [("new_attr", lambda: setattr(c, "nope", 1)),
                     ("ctor_arg", lambda: ReplicateConfig(1))]:
        try:
            fn()
            r[what] = "ok"
        except Exception as e:
            r[what] = type(e).__name__
    print(json.dumps(r))
    """
)

STORE_CALLS = PRELUDE + textwrap.dedent(
    """
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
    master, metadata = sys.argv[1], sys.argv[2]
    r = {}
    s = MooncakeDistributedStore()
    r["setup"] = s.setup("127.0.0.1", metadata, 32 << 20, 16 << 20, "tcp", "", master)
    r["ports"] = [int(s.get_hostname().rsplit(":", 1)[1])]
    for act in ["PRESERVE", "ENABLE", "DISABLE"]:
        for ttl in [None, 0, 5000]:
            c = ReplicateConfig()
            c.soft_pin_action = getattr(SoftPinAction, act)
            c.soft_pin_ttl_ms = ttl
            k = "sp_%s_%s" % (act, ttl)
            r[k] = [s.put(k, b"v", c), s.upsert(k, b"w", c), s.put_batch([k + "b"], [b"x"], c),
                    s.upsert_batch([k + "c"], [b"x"], c), s.put_parts(k + "p", b"x", config=c)]
    r["sp_untouched"] = s.get("sp_PRESERVE_None").decode()
    z = MooncakeDistributedStore()
    r["zero_setup"] = z.setup("127.0.0.1", metadata, 0, 0, "tcp", "", master)
    r["ports"].append(int(z.get_hostname().rsplit(":", 1)[1]))
    r["zero_bytes"] = [z.put("zk", b"hello"), z.upsert("zk2", b"hello"),
                       z.put_batch(["zk3"], [b"x"]), z.put_parts("zk4", b"x")]
    r["zero_get"] = [z.get("sp_PRESERVE_None").decode(), z.get_buffer("sp_PRESERVE_None") is None]
    buf = (ctypes.c_char * 4096)()
    p = ctypes.addressof(buf)
    r["zero_zero_copy"] = [z.register_buffer(p, 4096), z.put_from("zk5", p, 100),
                           z.get_into("sp_PRESERVE_None", p, 4096)]
    r["zero_put_from_landed"] = s.get_size("zk5")
    p2p = MooncakeDistributedStore()
    r["p2p_setup"] = p2p.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master)
    r["ports"].append(int(p2p.get_hostname().rsplit(":", 1)[1]))
    r["ports_in_range"] = all(12300 <= x <= 14300 for x in r["ports"])
    del r["ports"]
    p2p.close(); z.close(); s.close()
    print(json.dumps(r))
    """
)

CONFIG_LOADER = PRELUDE + textwrap.dedent(
    """
    import dataclasses, tempfile
    from mooncake.mooncake_config import (MooncakeConfig, DEFAULT_GLOBAL_SEGMENT_SIZE,
                                          DEFAULT_LOCAL_BUFFER_SIZE)

    def run(fn):
        try:
            return dataclasses.asdict(fn())
        except ValueError as e:  # the published raises ValueError; ours a subclass
            return "ValueError"
        except Exception as e:
            return type(e).__name__

    base = {"local_hostname": "h", "metadata_server": "P2PHANDSHAKE",
            "master_server_address": "127.0.0.1:50051"}
    files = {
        "minimal": base,
        "sizes": dict(base, global_segment_size="1.5gb", local_buffer_size="512 MB"),
        "size_int_str": dict(base, global_segment_size="4096", local_buffer_size=7),
        "size_k": dict(base, global_segment_size="3K", local_buffer_size="2t"),
        "size_bad": dict(base, global_segment_size="lots"),
        "size_empty": dict(base, global_segment_size=" "),
        "size_neg": dict(base, local_buffer_size=-1),
        "proto_upper": dict(base, protocol="RDMA", device_name="mlx5_0"),
        "proto_unknown": dict(base, protocol="carrier-pigeon"),
        "proto_empty": dict(base, protocol=""),
        "flags": dict(base, enable_ssd_offload="enable", enable_client_http_server="off",
                      ssd_offload_path=None, tenant_id=7, client_http_port="9400"),
        "flag_bad": dict(base, enable_ssd_offload="maybe"),
        "missing_master": {"local_hostname": "h", "metadata_server": "m"},
        "empty_host": dict(base, local_hostname=""),
    }
    r = {"defaults": [DEFAULT_GLOBAL_SEGMENT_SIZE, DEFAULT_LOCAL_BUFFER_SIZE]}
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            path = os.path.join(tmp, name + ".json")
            with open(path, "w") as fh:
                json.dump(data, fh)
            r["file_" + name] = run(lambda: MooncakeConfig.from_file(path))
        r["file_missing"] = run(lambda: MooncakeConfig.from_file(os.path.join(tmp, "no.json")))
        for k in [k for k in os.environ if k.startswith("MOONCAKE_")]:
            del os.environ[k]
        r["env_nothing"] = run(MooncakeConfig.load_from_env)
        os.environ["MOONCAKE_MASTER"] = "10.0.0.1:50051"
        r["env_master_only"] = run(MooncakeConfig.load_from_env)
        os.environ.update(MOONCAKE_PROTOCOL="Tcp", MOONCAKE_GLOBAL_SEGMENT_SIZE="64mb",
                          MOONCAKE_LOCAL_BUFFER_SIZE="16MB", MOONCAKE_OFFLOAD_ENABLED="yes",
                          MOONCAKE_CLIENT_HTTP_PORT="9555", MOONCAKE_TENANT_ID="t1",
                          MOONCAKE_LOCAL_HOSTNAME="node1", MOONCAKE_DEVICE="")
        r["env_full"] = run(MooncakeConfig.load_from_env)
        os.environ["MOONCAKE_CONFIG_PATH"] = os.path.join(tmp, "sizes.json")
        r["env_file"] = run(MooncakeConfig.load_from_env)
    r["direct"] = run(lambda: MooncakeConfig("h", "m", 1, 2, " TCP ", None, "a:1"))
    r["direct_neg"] = run(lambda: MooncakeConfig("h", "m", -1, 2, "tcp", None, "a:1"))
    print(json.dumps(r, sort_keys=True))
    """
)

GET_INTO_RANGES = PRELUDE + textwrap.dedent(
    """
    from mooncake.store import MooncakeDistributedStore
    master, metadata = sys.argv[1], sys.argv[2]
    r = {}
    s = MooncakeDistributedStore()
    r["setup"] = s.setup("127.0.0.1", metadata, 32 << 20, 16 << 20, "tcp", "", master)
    a = bytes(range(256)) * 4
    s.put("a", a); s.put("b", b"B" * 300)
    n = 8192
    b1 = (ctypes.c_char * n)(); p1 = ctypes.addressof(b1)
    b2 = (ctypes.c_char * n)(); p2 = ctypes.addressof(b2)
    r["reg"] = [s.register_buffer(p1, n), s.register_buffer(p2, n)]
    r["ok"] = s.get_into_ranges([p1, p2], [["a", "b"], ["a"]], [[[0, 100], [200]], [[10]]],
                                [[[0, 500], [5]], [[1000]]], [[[50, 60], [10]], [[24]]])
    r["ok_bytes"] = [ctypes.string_at(p1, 50) == a[:50],
                     ctypes.string_at(p1 + 100, 60) == a[500:560],
                     ctypes.string_at(p1 + 200, 10) == b"B" * 10,
                     ctypes.string_at(p2 + 10, 24) == a[1000:1024]]
    for name, args in {
        "missing": ([p1], [["nope", "a"]], [[[0], [0]]], [[[0], [0]]], [[[5], [5]]]),
        "src_oob": ([p1], [["a"]], [[[0]]], [[[1020]]], [[[10]]]),
        "src_past": ([p1], [["a"]], [[[0]]], [[[2000]]], [[[10]]]),
        "dst_oob": ([p1], [["a"]], [[[n - 5]]], [[[0]]], [[[10]]]),
        "unreg": ([4096], [["a"]], [[[0]]], [[[0]]], [[[10]]]),
        "zero": ([p1], [["a"]], [[[0]]], [[[0]]], [[[0]]]),
        "len_mismatch": ([p1, p2], [["a"]], [[[0]]], [[[0]]], [[[10]]]),
        "inner_mismatch": ([p1], [["a"]], [[[0, 1]]], [[[0]]], [[[10]]]),
        "empty": ([], [], [], [], []),
        "no_ranges": ([p1], [["a"]], [[[]]], [[[]]], [[[]]]),
    }.items():
        try:
            r[name] = s.get_into_ranges(*args)
        except Exception as e:
            r[name] = type(e).__name__ + ": " + str(e)[:100]
    s.close()
    print(json.dumps(r))
    """
)

EXPECTED_RANGES: dict[str, Any] = {
    "setup": 0,
    "reg": [0, 0],
    "ok": [[[50, 60], [10]], [[24]]],
    "ok_bytes": [True] * 4,
    "missing": [[[-704], [5]]],
    "src_oob": [[[-600]]],
    "src_past": [[[-600]]],
    "dst_oob": [[[-600]]],
    "unreg": [[[-600]]],
    "zero": [[[0]]],
    "len_mismatch": [[[-600]], [[-600]]],
    "inner_mismatch": [[[-600, -600]]],
    "empty": [],
    "no_ranges": [[[]]],
}

METADATA_SERVER = PRELUDE + textwrap.dedent(
    """
    import socket, time, urllib.error, urllib.request
    from mooncake.http_metadata_server import KVBootstrapServer, KVPoll

    def call(method, query, body=None):
        url = "http://127.0.0.1:%d/metadata%s" % (port, query)
        req = urllib.request.Request(url, data=body, method=method)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return [resp.status, resp.read().decode()]
        except urllib.error.HTTPError as e:
            return [e.code, None]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = KVBootstrapServer(port, "127.0.0.1")
    r = {"poll_before": srv.poll().name, "members": [(m.name, m.value) for m in KVPoll]}
    srv.run()
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    r["poll_running"] = srv.poll().name
    r["put"] = call("PUT", "?key=k1", b'{"a": 1}')
    r["get"] = call("GET", "?key=k1")
    r["get_missing"] = call("GET", "?key=nope")
    r["no_key"] = call("GET", "")
    r["blank_key"] = call("GET", "?key=%20")
    r["rpc_meta"] = [call("PUT", "?key=mooncake/rpc_meta/h", b"1"),
                     call("PUT", "?key=mooncake/rpc_meta/h", b"2")]
    r["overwrite"] = [call("PUT", "?key=k1", b"v2"), call("GET", "?key=k1")]
    r["post"] = call("POST", "?key=k1", b"x")
    r["delete"] = [call("DELETE", "?key=k1"), call("DELETE", "?key=k1")]
    srv.close()
    r["poll_closed"] = srv.poll().name
    print(json.dumps(r))
    """
)

EXPECTED_METADATA: dict[str, Any] = {
    "poll_before": "Failed",
    "members": [
        ["Failed", 0],
        ["Bootstrapping", 1],
        ["WaitingForInput", 2],
        ["Transferring", 3],
        ["Success", 4],
    ],
    "poll_running": "Success",
    "put": [200, "metadata updated"],
    "get": [200, '{"a": 1}'],
    "get_missing": [404, None],
    "no_key": [400, None],
    "blank_key": [400, None],
    "rpc_meta": [[200, "metadata updated"], [400, None]],
    "overwrite": [[200, "metadata updated"], [200, "v2"]],
    "post": [405, None],
    "delete": [[200, "metadata deleted"], [404, None]],
    "poll_closed": "Failed",
}

ASYNC_STORE = PRELUDE + textwrap.dedent(
    """
    import asyncio
    from mooncake.async_store import MooncakeDistributedStoreAsync, MooncakeDistributedStore
    master, metadata = sys.argv[1], sys.argv[2]
    s = MooncakeDistributedStoreAsync()
    r = {"subclass": issubclass(MooncakeDistributedStoreAsync, MooncakeDistributedStore)}
    r["setup"] = s.setup("127.0.0.1", metadata, 16 << 20, 16 << 20, "tcp", "", master)

    async def go():
        return [await s.async_put("ak", b"async!"), (await s.async_get("ak")).decode(),
                await s.async_is_exist("ak"), await s.async_remove("ak", force=True),
                await s.async_get_size("ak")]

    r["calls"] = asyncio.run(go())
    r["cached"] = s.async_put is s.async_put
    for name in ["async_nope", "nope", "async_"]:
        try:
            getattr(s, name)
            r[name] = "ok"
        except AttributeError:
            r[name] = "AttributeError"
    s.close()
    print(json.dumps(r))
    """
)

EXPECTED_ASYNC: dict[str, Any] = {
    "subclass": True,
    "setup": 0,
    "calls": [0, "async!", 1, 0, -704],
    "cached": True,
    "async_nope": "AttributeError",
    "nope": "AttributeError",
    "async_": "AttributeError",
}

ENGINE_PORTS = PRELUDE + textwrap.dedent(
    """
    from mooncake.engine import TransferEngine
    r = {"rc": [], "ports": []}
    for _ in range(3):
        te = TransferEngine()
        r["rc"].append(te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""))
        r["ports"].append(te.get_rpc_port())
    r["in_range"] = all(15000 <= p <= 17000 for p in r.pop("ports"))
    print(json.dumps(r))
    """
)

STORE_REST = PRELUDE + textwrap.dedent(
    """
    from mooncake.store import MooncakeDistributedStore
    master, metadata = sys.argv[1], sys.argv[2]
    r = {}
    s = MooncakeDistributedStore()
    r["setup"] = s.setup("127.0.0.1", metadata, 32 << 20, 16 << 20, "tcp", "", master)
    s.put("a", b"A" * 10)
    s.put("b", b"B" * 20)
    s.get("a")  # a read leases "a"
    r["batch_remove"] = s.batch_remove(["a", "b", "nope"])
    r["batch_remove_force"] = s.batch_remove(["a", "nope"], True)
    r["put_batch_mismatch"] = s.put_batch(["x", "y"], [b"1"])
    r["put_batch_empty"] = s.put_batch([], [])
    r["get_batch_empty"] = [x.decode() for x in s.get_batch([])]
    r["upsert_parts"] = [s.upsert_parts("up", b"1", b"2"), s.upsert_parts("up", b"3"),
                         s.get("up").decode()]
    r["batch_get_buffer"] = [None if h is None else bytes(memoryview(h)).decode()
                             for h in s.batch_get_buffer(["up", "nope"])]
    n = 1 << 16
    buf = (ctypes.c_char * n)()
    p = ctypes.addressof(buf)
    other = (ctypes.c_char * 4096)()
    q = ctypes.addressof(other)
    r["reg"] = s.register_buffer(p, n)
    ctypes.memmove(p, b"xyz" * 100, 300)
    r["upsert_from"] = [s.upsert_from("uf", p, 100), s.upsert_from("uf", p + 1, 50),
                        s.get("uf") == ctypes.string_at(p + 1, 50)]
    r["batch_upsert_from"] = s.batch_upsert_from(["uf", "ug"], [p, p + 2], [10, 20])
    r["put_from_unreg"] = s.put_from("pu", q, 10)
    r["get_into_unreg"] = s.get_into("uf", q, 100)
    r["batch_put_from_mismatch"] = s.batch_put_from(["m1", "m2"], [p], [10, 10])
    r["batch_get_into_mismatch"] = s.batch_get_into(["uf", "ug"], [p], [10, 10])
    r["multi_put"] = s.batch_put_from_multi_buffers(
        ["mb1", "mb2"], [[p, p + 100], [p + 200]], [[10, 20], [5]])
    r["multi_get"] = s.batch_get_into_multi_buffers(
        ["mb1", "mb2", "nope"], [[p + 1000, p + 2000], [p + 3000], [p + 4000]],
        [[15, 15], [5], [5]])
    r["multi_bytes"] = (ctypes.string_at(p + 1000, 15) + ctypes.string_at(p + 2000, 15)
                        == ctypes.string_at(p, 10) + ctypes.string_at(p + 100, 20))
    r["multi_get_small"] = s.batch_get_into_multi_buffers(["mb1"], [[p + 1000]], [[10]])
    r["get_size_after"] = [s.get_size("mb1"), s.get_size("mb2")]
    s.put("gs", b"S" * 7)  # get_size leases the key, as a get does
    r["get_size_leases"] = [s.get_size("gs"), s.remove("gs"), s.remove("gs", True)]
    s.put("ex", b"E" * 3)
    r["is_exist_then_remove"] = [s.is_exist("ex"), s.remove("ex"), s.remove("ex", True)]
    r["remove_all"] = s.remove_all(True)
    s.close()
    r["closed"] = [s.health_check()]
    print(json.dumps(r))
    """
)

# Calls on a store that is not set up, or closed, crashed the published one (SIGSEGV):
# not compared.
EXPECTED_REST: dict[str, Any] = {
    "setup": 0,
    "batch_remove": [-706, 0, -704],
    "batch_remove_force": [0, -704],
    "put_batch_mismatch": -600,
    "put_batch_empty": 0,
    "get_batch_empty": [""],
    "upsert_parts": [0, 0, "3"],
    "batch_get_buffer": ["3", None],
    "reg": 0,
    "upsert_from": [0, 0, True],
    "batch_upsert_from": [0, 0],
    "put_from_unreg": 0,
    "get_into_unreg": 10,
    "batch_put_from_mismatch": [-600, -600],
    "batch_get_into_mismatch": [-600, -600],
    "multi_put": [0, 0],
    "multi_get": [30, 5, -704],
    "multi_bytes": True,
    "multi_get_small": [-600],
    "get_size_after": [30, 5],
    "get_size_leases": [7, -706, 0],
    "is_exist_then_remove": [1, -706, 0],
    "remove_all": 6,
    "closed": [1],
}

SOFT_PIN_REFUSED = [-600] * 5
EXPECTED_STORE: dict[str, Any] = {
    "setup": 0,
    "sp_PRESERVE_None": [0] * 5,
    "sp_PRESERVE_0": SOFT_PIN_REFUSED,
    "sp_PRESERVE_5000": SOFT_PIN_REFUSED,
    "sp_ENABLE_None": [0] * 5,
    "sp_ENABLE_0": [0] * 5,
    "sp_ENABLE_5000": [0] * 5,
    "sp_DISABLE_None": [0] * 5,
    "sp_DISABLE_0": SOFT_PIN_REFUSED,
    "sp_DISABLE_5000": SOFT_PIN_REFUSED,
    "sp_untouched": "w",
    "zero_setup": 0,
    "zero_bytes": [-600] * 4,
    "zero_get": ["", True],
    "zero_zero_copy": [0, 0, 1],
    "zero_put_from_landed": 100,
    "p2p_setup": 0,
    "ports_in_range": True,
}

_T = "TypeError"
_INT_ROW = {
    "int": "3", "bool": "1", "float": _T, "str": _T, "none": _T, "list_str": _T,
    "list_int": _T, "tuple_str": _T, "neg": _T, "big": _T, "spa": "1", "odt": "1", "bytes": _T,
}  # fmt: skip
_FLAG_ROW = {
    "int": "True", "bool": "True", "float": "True", "str": _T, "none": "False",
    "list_str": _T, "list_int": _T, "tuple_str": _T, "neg": "True", "big": "True",
    "spa": _T, "odt": _T, "bytes": _T,
}  # fmt: skip
_LIST_ROW = {k: _T for k in _INT_ROW} | {"list_str": "['a']", "tuple_str": "['a']"}
EXPECTED_CONFIG: dict[str, Any] = {
    "replica_num": _INT_ROW,
    "nof_replica_num": _INT_ROW,
    "dfs_replica_num": _INT_ROW,
    "soft_pin_action": {k: _T for k in _INT_ROW} | {"spa": "<SoftPinAction.ENABLE: 1>"},
    "soft_pin_ttl_ms": _INT_ROW | {"none": "None"},
    "with_hard_pin": _FLAG_ROW,
    "preferred_segment": {k: _T for k in _INT_ROW} | {"str": "'x'", "bytes": "'x'"},
    "preferred_segments": _LIST_ROW,
    "preferred_nof_segments": _LIST_ROW,
    "prefer_alloc_in_same_node": _FLAG_ROW,
    "data_type": {k: _T for k in _INT_ROW} | {"odt": "<ObjectDataType.KVCACHE: 1>"},
    "group_ids": _LIST_ROW | {"none": "None"},
    "str": "ReplicateConfig: { replica_num: 1, nof_replica_num: 0, dfs_replica_num: 0, "
    "soft_pin_action: PRESERVE, soft_pin_ttl_ms: default, with_hard_pin: 0, "
    "preferred_segments: [], preferred_nof_segments: [], prefer_alloc_in_same_node: 0, "
    "data_type: UNKNOWN }",
    "new_attr": "AttributeError",
    "ctor_arg": "TypeError",
}


def _published_python() -> str:
    real = os.environ.get("MOONCAKE_PEER_PYTHON") or peer().default_peer_python()
    if real is None:
        pytest.skip(
            "no scratch venv with the published wheel; run scripts/setup_mooncake_peer.sh "
            "(or set MOONCAKE_PEER_PYTHON)"
        )
    return str(real)


def published_python_with(*modules: str) -> str:
    """The published wheel's python, if its scratch venv also imports ``modules`` (torch
    and safetensors come with ``scripts/setup_mooncake_peer.sh --torch``); else skip."""
    real = _published_python()
    probe = subprocess.run(
        [real, "-c", "import " + ", ".join(modules)], capture_output=True, timeout=120
    )
    if probe.returncode != 0:
        pytest.skip(
            f"the published wheel's scratch venv has no {'/'.join(modules)}; run "
            "scripts/setup_mooncake_peer.sh --torch"
        )
    return real


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "calls.py"
    path.write_text(text)
    return path


def _call(python: str, script: Path, ours: bool, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        [python, str(script), *args],
        capture_output=True,
        text=True,
        env=harness._env(ours),
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return data


def _diff(got: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    return {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}


@pytest.mark.timeout(60)
def test_replicate_config_types_ours(tmp_path: Path) -> None:
    got = _call(sys.executable, _script(tmp_path, CONFIG_TYPES), True)
    assert _diff(got, EXPECTED_CONFIG) == {}


@pytest.mark.timeout(60)
def test_replicate_config_types_published(tmp_path: Path) -> None:
    got = _call(_published_python(), _script(tmp_path, CONFIG_TYPES), False)
    assert _diff(got, EXPECTED_CONFIG) == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_soft_pin_zero_buffer_and_hostname_ours(tmp_path: Path) -> None:
    script = _script(tmp_path, STORE_CALLS)
    with harness.our_master() as (master, metadata):
        got = _call(sys.executable, script, True, master, metadata)
    assert _diff(got, EXPECTED_STORE) == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_soft_pin_zero_buffer_and_hostname_published(tmp_path: Path) -> None:
    real = _published_python()
    script = _script(tmp_path, STORE_CALLS)
    with harness.their_master(real) as (master, metadata):
        got = _call(real, script, False, master, metadata)
    assert _diff(got, EXPECTED_STORE) == {}


def test_mooncake_config_same_answers_as_published(tmp_path: Path) -> None:
    script = _script(tmp_path, CONFIG_LOADER)
    ours = _call(sys.executable, script, True)
    assert ours["file_sizes"]["global_segment_size"] == int(1.5 * (1 << 30))
    assert ours["file_proto_upper"]["protocol"] == "rdma"
    assert ours["env_nothing"] == "ValueError"
    theirs = _call(_published_python(), script, False)
    assert {k: (v, theirs.get(k)) for k, v in ours.items() if theirs.get(k) != v} == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_get_into_ranges_ours(tmp_path: Path) -> None:
    script = _script(tmp_path, GET_INTO_RANGES)
    with harness.our_master() as (master, metadata):
        got = _call(sys.executable, script, True, master, metadata)
    assert _diff(got, EXPECTED_RANGES) == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_get_into_ranges_published(tmp_path: Path) -> None:
    real = _published_python()
    script = _script(tmp_path, GET_INTO_RANGES)
    with harness.their_master(real) as (master, metadata):
        got = _call(real, script, False, master, metadata)
    assert _diff(got, EXPECTED_RANGES) == {}


@pytest.mark.timeout(60)
def test_http_metadata_server_ours(tmp_path: Path) -> None:
    got = _call(sys.executable, _script(tmp_path, METADATA_SERVER), True)
    assert _diff(got, EXPECTED_METADATA) == {}


@pytest.mark.timeout(60)
def test_http_metadata_server_published(tmp_path: Path) -> None:
    got = _call(_published_python(), _script(tmp_path, METADATA_SERVER), False)
    assert _diff(got, EXPECTED_METADATA) == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_async_store_ours(tmp_path: Path) -> None:
    script = _script(tmp_path, ASYNC_STORE)
    with harness.our_master() as (master, metadata):
        got = _call(sys.executable, script, True, master, metadata)
    assert _diff(got, EXPECTED_ASYNC) == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_async_store_published(tmp_path: Path) -> None:
    real = _published_python()
    script = _script(tmp_path, ASYNC_STORE)
    with harness.their_master(real) as (master, metadata):
        got = _call(real, script, False, master, metadata)
    assert _diff(got, EXPECTED_ASYNC) == {}


@pytest.mark.timeout(60)
def test_engine_p2p_port_range_ours(tmp_path: Path) -> None:
    got = _call(sys.executable, _script(tmp_path, ENGINE_PORTS), True)
    assert got == {"rc": [0, 0, 0], "in_range": True}


@pytest.mark.timeout(60)
def test_engine_p2p_port_range_published(tmp_path: Path) -> None:
    got = _call(_published_python(), _script(tmp_path, ENGINE_PORTS), False)
    assert got == {"rc": [0, 0, 0], "in_range": True}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_remaining_store_calls_ours(tmp_path: Path) -> None:
    script = _script(tmp_path, STORE_REST)
    with harness.our_master() as (master, metadata):
        got = _call(sys.executable, script, True, master, metadata)
    assert _diff(got, EXPECTED_REST) == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_remaining_store_calls_published(tmp_path: Path) -> None:
    real = _published_python()
    script = _script(tmp_path, STORE_REST)
    with harness.their_master(real) as (master, metadata):
        got = _call(real, script, False, master, metadata)
    assert _diff(got, EXPECTED_REST) == {}


PORT_ENV = PRELUDE + textwrap.dedent(
    """
    from mooncake.engine import TransferEngine
    from mooncake.store import MooncakeDistributedStore
    lo, hi = int(sys.argv[1]), int(sys.argv[2])
    r = {}
    te = TransferEngine()
    r["rc"] = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    port = te.get_rpc_port()
    r["engine_in"] = lo <= port <= hi
    if len(sys.argv) > 3:
        s = MooncakeDistributedStore()
        r["setup"] = s.setup("127.0.0.1", sys.argv[4], 16 << 20, 16 << 20, "tcp", "", sys.argv[3])
        client = int(s.get_hostname().rsplit(":", 1)[1])
        clo, chi = int(os.environ["MC_STORE_CLIENT_MIN_PORT"]), int(os.environ["MC_STORE_CLIENT_MAX_PORT"])
        r["client_in"] = clo <= client <= chi
        s.close()
    print(json.dumps(r))
    """  # noqa: E501 - the script as a user writes it
)

# (env, the range the engine's port must come from); as observed on the wheel: each end
# replaces its default on its own, a bad number or an empty range leaves the default.
PORT_CASES: list[tuple[dict[str, str], tuple[int, int]]] = [
    ({"MC_MIN_RPC_PORT": "{b}", "MC_MAX_RPC_PORT": "{b9}"}, (0, 9)),
    ({"MC_MAX_RPC_PORT": "15010"}, (15000, 15010)),
    ({"MC_MIN_RPC_PORT": "abc"}, (15000, 17000)),
    ({"MC_MIN_RPC_PORT": "{b9}", "MC_MAX_RPC_PORT": "{b}"}, (15000, 17000)),
    ({"MC_MIN_RPC_PORT": "0", "MC_MAX_RPC_PORT": "70000"}, (15000, 17000)),
]


def _free_range(lo: int, hi: int, n: int = 10) -> int:
    """A random ``base`` in [lo, hi) whose ports ``base .. base+n-1`` all bind now. Ranges stay
    below Linux's ephemeral ports (32768 on): a CI run saw the published store client, its
    whole range taken, fall back to a port outside it."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(lo, hi, 10)
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {n} free consecutive ports between {lo} and {hi}")


def _port_env_runs(python: str, tmp_path: Path, ours: bool, master: tuple[str, str]) -> list[Any]:
    script = _script(tmp_path, PORT_ENV)
    out = []
    for i, (env_t, (lo, hi)) in enumerate(PORT_CASES):
        base = _free_range(20000, 27000)
        env = harness._env(ours)
        env.update({k: v.format(b=base, b9=base + 9) for k, v in env_t.items()})
        if (lo, hi) == (0, 9):
            lo, hi = base, base + 9
        args = [str(lo), str(hi)]
        if i == 0:  # the store client's own pair, with a master
            cbase = _free_range(27000, 32000)
            env.update(
                {"MC_STORE_CLIENT_MIN_PORT": str(cbase), "MC_STORE_CLIENT_MAX_PORT": str(cbase + 9)}
            )
            args += list(master)
        res = subprocess.run(
            [python, str(script), *args], capture_output=True, text=True, env=env, timeout=120
        )
        assert res.returncode == 0, res.stderr[-3000:]
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


EXPECTED_PORTS = [{"rc": 0, "engine_in": True, "setup": 0, "client_in": True}] + [
    {"rc": 0, "engine_in": True}
] * (len(PORT_CASES) - 1)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rpc_and_client_port_env_ours(tmp_path: Path) -> None:
    with harness.our_master() as master:
        assert _port_env_runs(sys.executable, tmp_path, True, master) == EXPECTED_PORTS


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rpc_and_client_port_env_published(tmp_path: Path) -> None:
    real = _published_python()
    with harness.their_master(real) as master:
        assert _port_env_runs(real, tmp_path, False, master) == EXPECTED_PORTS


REPLICAS = PRELUDE + textwrap.dedent(
    """
    from mooncake.store import (MooncakeDistributedStore, ReplicaStatus, Descriptor, COMPLETE,
                                UNDEFINED, INITIALIZED, REMOVED)
    master, metadata = sys.argv[1], sys.argv[2]
    r = {}
    s = MooncakeDistributedStore()
    r["setup"] = s.setup("127.0.0.1", metadata, 64 << 20, 16 << 20, "tcp", "", master)
    value = bytes(range(256)) * 4
    s.put("a", value)
    d = s.get_replica_desc("a")
    rep = d[0]
    r["one"] = [len(d), str(rep.status), int(rep.status), rep.status == 3,
                rep.is_memory_replica(), rep.is_disk_replica(), rep.is_local_disk_replica()]
    bd = rep.get_memory_descriptor().buffer_descriptor
    r["desc"] = [bd.size, bd.transport_endpoint == s.get_hostname(),
                 ctypes.string_at(bd.buffer_address, bd.size) == value,
                 repr(bd) == "<Descriptor size=%d buffer_address=%d transport_endpoint=%s>" % (
                     bd.size, bd.buffer_address, bd.transport_endpoint)]
    try:
        rep.get_disk_descriptor()
        r["disk"] = "ok"
    except Exception as e:
        r["disk"] = [type(e).__name__, str(e)]
    r["leased"] = s.remove("a")
    r["missing"] = s.get_replica_desc("nope")
    s.put("b", b"y" * 10)
    r["batch"] = [[k, len(v), v[0].get_memory_descriptor().buffer_descriptor.size]
                  for k, v in s.batch_get_replica_desc(["b", "nope", "b", "a"]).items()]
    r["batch_empty"] = s.batch_get_replica_desc([])
    r["status_names"] = [m.name for m in ReplicaStatus.__members__.values()]
    r["status_ints"] = [int(x) for x in (UNDEFINED, INITIALIZED, COMPLETE, REMOVED)]
    e = Descriptor()
    r["new_descriptor"] = [e.size, e.buffer_address, e.transport_endpoint]
    s.close()
    print(json.dumps(r))
    """
)

EXPECTED_REPLICAS: dict[str, Any] = {
    "setup": 0,
    "one": [1, "ReplicaStatus.COMPLETE", 3, False, True, False, False],
    "desc": [1024, True, True, True],
    "disk": ["RuntimeError", "Expected DiskDescriptor"],
    "leased": -706,
    "missing": [],
    "batch": [["a", 1, 1024], ["b", 1, 10]],
    "batch_empty": {},
    "status_names": ["UNDEFINED", "INITIALIZED", "PROCESSING", "COMPLETE", "REMOVED", "FAILED"],
    "status_ints": [0, 1, 3, 4],
    "new_descriptor": [0, 0, ""],
}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_replica_descriptors_ours(tmp_path: Path) -> None:
    script = _script(tmp_path, REPLICAS)
    with harness.our_master() as (master, metadata):
        got = _call(sys.executable, script, True, master, metadata)
    assert _diff(got, EXPECTED_REPLICAS) == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_replica_descriptors_published(tmp_path: Path) -> None:
    real = _published_python()
    script = _script(tmp_path, REPLICAS)
    with harness.their_master(real) as (master, metadata):
        got = _call(real, script, False, master, metadata)
    assert _diff(got, EXPECTED_REPLICAS) == {}


SEGMENTS = PRELUDE + textwrap.dedent(
    """
    from mooncake.store import MooncakeDistributedStore
    master, metadata = sys.argv[1], sys.argv[2]
    r = {}
    s = MooncakeDistributedStore()
    r["setup"] = s.setup("127.0.0.1", metadata, 16 << 20, 16 << 20, "tcp", "", master)
    def alloc(*a):
        try:
            d = s.allocate_and_mount_segment(*a)
        except TypeError:
            return "TypeError"
        return [d["ret"], len(d["segment_ids"]), d["allocated_size"]], d["segment_ids"]
    res = {}
    for name, args in [("32m", (32 << 20,)), ("1m", (1 << 20,)), ("17m", (17 << 20,)),
                       ("zero", (0,)), ("neg", (-1,)), ("proto", (16 << 20, "rdma", "cpu:0"))]:
        out = alloc(*args)
        r["alloc_" + name] = out if out == "TypeError" else out[0]
        res[name] = [] if out == "TypeError" else out[1]
    # the extra segments hold objects: 24 MiB do not fit in the first 16 MiB segment
    n = 24 << 20
    buf = (ctypes.c_char * n)()
    p = ctypes.addressof(buf)
    ctypes.memset(p, 7, n)
    r["reg"] = s.register_buffer(p, n)
    r["put_big"] = s.put_from("big", p, n)
    r["got_big"] = s.get_size("big")
    r["free"] = s.unmount_and_free_segment(res["32m"] + res["1m"] + res["17m"] + res["proto"], 0)
    r["free_again"] = s.unmount_and_free_segment(res["32m"], 0)
    r["free_unknown"] = s.unmount_and_free_segment(["bogus"], 0)
    r["free_setup_segment"] = s.unmount_and_free_segment([s.get_hostname()], 0)
    r["big_after"] = s.is_exist("big")
    r["put_after"] = [s.put_from("small", p, 1 << 20), s.get_size("small")]
    r["alloc_again"] = alloc(16 << 20)[0]
    # mount A and B, free A, mount C: every id differs and B keeps its objects
    a, b = alloc(16 << 20)[1], alloc(16 << 20)[1]
    ids = res["32m"] + res["1m"] + res["17m"] + res["proto"] + a + b
    r["free_a"] = s.unmount_and_free_segment(a, 0)
    out_c = alloc(16 << 20)
    r["alloc_c"] = out_c[0]
    ids += out_c[1]
    r["ids_unique"] = [len(ids), len(set(ids))]
    r["put_fills"] = [s.put_from("fill%d" % i, p, 8 << 20) for i in range(5)]
    r["free_b"] = s.unmount_and_free_segment(b, 0)
    r["alloc_d"] = alloc(16 << 20)[0]
    r["fills_readable"] = [s.get_into("fill%d" % i, p, n) in (8 << 20, -704) for i in range(5)]
    s.close()
    print(json.dumps(r))
    """
)

EXPECTED_SEGMENTS: dict[str, Any] = {
    "setup": 0,
    "alloc_32m": [0, 1, 33554432],
    "alloc_1m": [0, 1, 16777216],
    "alloc_17m": [0, 1, 33554432],
    "alloc_zero": [-1, 0, 0],
    "alloc_neg": "TypeError",
    "alloc_proto": [0, 1, 16777216],
    "reg": 0,
    "put_big": 0,
    "got_big": 25165824,
    "free": 0,
    "free_again": -1,
    "free_unknown": -1,
    "free_setup_segment": -1,
    "big_after": 0,
    "put_after": [0, 1048576],
    "alloc_again": [0, 1, 16777216],
    "free_a": 0,
    "alloc_c": [0, 1, 16777216],
    "ids_unique": [7, 7],
    "put_fills": [0] * 5,
    "free_b": 0,
    "alloc_d": [0, 1, 16777216],
    "fills_readable": [True] * 5,
}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_segments_mounted_at_run_time_ours(tmp_path: Path) -> None:
    script = _script(tmp_path, SEGMENTS)
    with harness.our_master() as (master, metadata):
        got = _call(sys.executable, script, True, master, metadata)
    assert _diff(got, EXPECTED_SEGMENTS) == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_segments_mounted_at_run_time_published(tmp_path: Path) -> None:
    real = _published_python()
    script = _script(tmp_path, SEGMENTS)
    with harness.their_master(real) as (master, metadata):
        got = _call(real, script, False, master, metadata)
    assert _diff(got, EXPECTED_SEGMENTS) == {}


REPLICA_CLEAR = PRELUDE + textwrap.dedent(
    """
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    master, metadata = sys.argv[1], sys.argv[2]
    r = {}
    s, t = MooncakeDistributedStore(), MooncakeDistributedStore()
    r["setup"] = [x.setup("127.0.0.1", metadata, 32 << 20, 16 << 20, "tcp", "", master)
                  for x in (s, t)]
    hs, ht = s.get_hostname(), t.get_hostname()
    two, ons, ont = ReplicateConfig(), ReplicateConfig(), ReplicateConfig()
    two.replica_num, ons.preferred_segment, ont.preferred_segment = 2, hs, ht
    r["puts"] = [s.put("r2", b"2" * 100, two), s.put("s1", b"s" * 100, ons),
                 s.put("t1", b"t" * 100, ont), t.put("byt", b"y" * 100, ons),
                 s.put("s2", b"s" * 100, ons), s.put("lz", b"z" * 100, ons)]
    r["lz"] = s.get("lz").decode()[:1]  # a read leases "lz"
    r["segment"] = s.batch_replica_clear(["s1", "t1", "byt", "nope"], hs)
    r["segment_partial"] = s.batch_replica_clear(["r2"], hs)  # one of its 2 replicas is on hs
    r["leased"] = s.batch_replica_clear(["lz"])
    r["other_client"] = t.batch_replica_clear(["s2"])
    r["bogus_segment"] = s.batch_replica_clear(["s2"], "nope:1")
    r["empty"] = s.batch_replica_clear([])
    r["dups"] = s.batch_replica_clear(["t1", "s2", "s2"])
    r["t_wrong_segment"] = t.batch_replica_clear(["byt"], ht)
    r["t_own"] = t.batch_replica_clear(["byt"])
    for name, args in [("str", ("abc",)), ("ints", (["a", 1],)), ("seg_int", (["a"], 3))]:
        try:
            r["type_" + name] = s.batch_replica_clear(*args)
        except TypeError:
            r["type_" + name] = "TypeError"
    r["after"] = [s.is_exist(k) for k in ["s1", "t1", "byt", "s2", "lz"]]
    r["r2_replicas"] = len(s.get_replica_desc("r2"))
    r["offload_reads"] = s.get_offload_rpc_read_count()
    # replica copy/move tasks between the two clients' segments
    import time
    from mooncake.store import (TaskStatus, TaskType, PENDING, PROCESSING, FAILED, SUCCESS,
                                REPLICA_COPY, REPLICA_MOVE)
    names = {hs: "s", ht: "t"}
    def where(k):
        return sorted(names.get(x.get_memory_descriptor().buffer_descriptor.transport_endpoint,
                                "?") for x in s.get_replica_desc(k))
    def wait(tid):
        for _ in range(80):
            q, rc = s.query_task(tid)
            if q is not None and q.status in (TaskStatus.SUCCESS, TaskStatus.FAILED):
                break
            time.sleep(0.125)
        if q is None:
            return [rc, tid]
        return [rc, str(q.type), str(q.status), q.message,
                q.created_at_ms_epoch <= q.last_updated_at_ms_epoch,
                [type(x).__name__ for x in q.id + q.assigned_client]]
    r["cp_put"] = [s.put("cp", b"c" * 100, ons), s.put("mv", b"m" * 100, ons)]
    tid, rc = s.create_copy_task("cp", [ht])
    r["copy"] = [rc, type(tid).__name__, len(tid), wait(tid), where("cp"), t.get("cp")[:2].decode()]
    tid, rc = s.create_copy_task("cp", [ht, hs])
    r["copy_held"] = [rc, wait(tid)[2], where("cp")]
    tid, rc = s.create_move_task("mv", hs, ht)
    r["move"] = [rc, wait(tid), s.get("mv") == b"m" * 100, where("mv")]
    r["move_refused"] = [s.create_move_task(*a) for a in [("mv", ht, ht), ("mv", hs, ht),
                         ("nope", hs, ht), ("mv", "nope:1", ht), ("mv", ht, "nope:1")]]
    r["copy_refused"] = [s.create_copy_task(*a) for a in [("nope", [ht]), ("cp", ["nope:1"]),
                                                          ("cp", [])]]
    r["query_unknown"] = s.query_task((1, 2))
    for name, fn, args in [("copy_str", s.create_copy_task, ("cp", ht)),
                           ("copy_ints", s.create_copy_task, ("cp", [1])),
                           ("move_int", s.create_move_task, ("cp", hs, 1)),
                           ("query_int", s.query_task, (5,)),
                           ("query_str", s.query_task, (("a", "b"),))]:
        try:
            r["type_" + name] = fn(*args)
        except TypeError:
            r["type_" + name] = "TypeError"
    r["task_enums"] = [[int(x) for x in (PENDING, PROCESSING, FAILED, SUCCESS)],
                       [int(x) for x in (REPLICA_COPY, REPLICA_MOVE)], str(SUCCESS),
                       repr(REPLICA_MOVE), TaskStatus.SUCCESS == 3, TaskType(1).name]
    s.close(); t.close()
    print(json.dumps(r))
    """
)

EXPECTED_CLEAR: dict[str, Any] = {
    "setup": [0, 0],
    "puts": [0] * 6,
    "lz": "z",
    "segment": ["s1"],
    "leased": [],
    "other_client": [],
    "bogus_segment": [],
    "empty": [],
    "dups": ["t1", "s2"],
    "t_wrong_segment": [],
    "t_own": ["byt"],
    "type_str": "TypeError",
    "type_ints": "TypeError",
    "type_seg_int": "TypeError",
    "after": [0, 0, 0, 0, 1],
    "offload_reads": 0,
    "cp_put": [0, 0],
    "copy": [
        0,
        "tuple",
        2,
        [
            0,
            "TaskType.REPLICA_COPY",
            "TaskStatus.SUCCESS",
            "Task completed successfully",
            True,
            ["int"] * 4,
        ],
        ["s", "t"],
        "cc",
    ],
    "copy_held": [0, "TaskStatus.SUCCESS", ["s", "t"]],
    "move": [
        0,
        [
            0,
            "TaskType.REPLICA_MOVE",
            "TaskStatus.SUCCESS",
            "Task completed successfully",
            True,
            ["int"] * 4,
        ],
        True,
        ["t"],
    ],
    "move_refused": [
        [[0, 0], -600],
        [[0, 0], -600],
        [[0, 0], -704],
        [[0, 0], -600],
        [[0, 0], -600],
    ],
    "copy_refused": [[[0, 0], -704], [[0, 0], -600], [[0, 0], -600]],
    "query_unknown": [None, -1400],
    "type_copy_str": "TypeError",
    "type_copy_ints": "TypeError",
    "type_move_int": "TypeError",
    "type_query_int": "TypeError",
    "type_query_str": "TypeError",
    "task_enums": [
        [0, 1, 2, 3],
        [0, 1],
        "TaskStatus.SUCCESS",
        "<TaskType.REPLICA_MOVE: 1>",
        False,
        "REPLICA_MOVE",
    ],
}
# with a segment name, an object kept elsewhere too loses just that segment's replica
CLEAR_PARTIAL = {"segment_partial": ["r2"], "r2_replicas": 1}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_batch_replica_clear_ours(tmp_path: Path) -> None:
    script = _script(tmp_path, REPLICA_CLEAR)
    with harness.our_master() as (master, metadata):
        got = _call(sys.executable, script, True, master, metadata)
    assert _diff(got, EXPECTED_CLEAR | CLEAR_PARTIAL) == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_batch_replica_clear_published(tmp_path: Path) -> None:
    real = _published_python()
    script = _script(tmp_path, REPLICA_CLEAR)
    with harness.their_master(real) as (master, metadata):
        got = _call(real, script, False, master, metadata)
    assert _diff(got, EXPECTED_CLEAR | CLEAR_PARTIAL) == {}


SESSIONS = PRELUDE + textwrap.dedent(
    """
    from mooncake.store import MooncakeDistributedStore
    master, metadata = sys.argv[1], sys.argv[2]
    r = {}
    s = MooncakeDistributedStore()
    r["setup"] = s.setup("127.0.0.1", metadata, 32 << 20, 16 << 20, "tcp", "", master)
    n = 1 << 16
    buf = (ctypes.c_char * n)()
    p = ctypes.addressof(buf)
    r["reg"] = s.register_buffer(p, n)
    ctypes.memmove(p, bytes(range(256)) * 256, n)
    r["start"] = s.batch_put_session_start(["a", "b", "c"], [100, 50, 10])
    r["hidden_during"] = s.is_exist("a")
    r["ranges"] = s.batch_put_from_multi_buffer_ranges(
        ["a", "b"], [[p, p + 1000], [p + 2000]], [[60, 40], [50]], [[0, 60], [0]])
    r["ranges_outside"] = s.batch_put_from_multi_buffer_ranges(["a"], [[p]], [[10]], [[95]])
    r["ranges_no_session"] = s.batch_put_from_multi_buffer_ranges(["zz"], [[p]], [[10]], [[0]])
    r["end"] = s.batch_put_session_end(["a", "b", "zz"])
    r["revoke"] = s.batch_put_session_revoke(["c", "zz"])
    r["after"] = [s.get_size("a"), s.get_size("b"), s.is_exist("c")]
    a = s.get("a")
    r["a_bytes"] = a == ctypes.string_at(p, 60) + ctypes.string_at(p + 1000, 40)
    r["b_bytes"] = s.get("b") == ctypes.string_at(p + 2000, 50)
    r["get_start"] = s.batch_get_session_start(["a", "b", "nope"])
    r["get_ranges"] = s.batch_get_into_multi_buffer_ranges(
        ["a", "b", "nope"], [[p + 5000, p + 6000], [p + 7000], [p + 8000]],
        [[10, 20], [50], [5]], [[0, 50], [0], [0]])
    r["got_bytes"] = [ctypes.string_at(p + 5000, 10) == a[:10],
                      ctypes.string_at(p + 6000, 20) == a[50:70],
                      ctypes.string_at(p + 7000, 50) == s.get("b")]
    r["get_outside"] = s.batch_get_into_multi_buffer_ranges(["a"], [[p]], [[10]], [[95]])
    r["get_end"] = s.batch_get_session_end(["a", "b", "nope"])
    r["get_after_end"] = s.batch_get_into_multi_buffer_ranges(["a"], [[p + 5000]], [[10]], [[0]])
    s.close()
    print(json.dumps(r))
    """
)

EXPECTED_SESSIONS: dict[str, Any] = {
    "setup": 0,
    "reg": 0,
    "start": [0, 0, 0],
    "hidden_during": 0,
    "ranges": [100, 50],
    "ranges_outside": [-600],
    "ranges_no_session": [-600],
    "end": [0, 0, -600],
    "revoke": [0, -600],
    "after": [100, 50, 0],
    "a_bytes": True,
    "b_bytes": True,
    "get_start": [0, 0, -704],
    "get_ranges": [30, 50, -600],
    "got_bytes": [True, True, True],
    "get_outside": [-600],
    "get_end": 0,
    "get_after_end": [-600],
}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_put_and_get_sessions_ours(tmp_path: Path) -> None:
    script = _script(tmp_path, SESSIONS)
    with harness.our_master() as (master, metadata):
        got = _call(sys.executable, script, True, master, metadata)
    assert _diff(got, EXPECTED_SESSIONS) == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_put_and_get_sessions_published(tmp_path: Path) -> None:
    real = _published_python()
    script = _script(tmp_path, SESSIONS)
    with harness.their_master(real) as (master, metadata):
        got = _call(real, script, False, master, metadata)
    assert _diff(got, EXPECTED_SESSIONS) == {}
