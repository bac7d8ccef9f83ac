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
