"""``mooncake.dataproto_catalog`` and ``mooncake.reshard``: ours against the published
0.3.13 modules.

``dataproto_reshard_calls.py`` makes the same calls on both (a catalog's tags, rows,
fragments, pinned reads, appends, removals and drain, through ``DataProtoCatalogTransfer``
over a dict-backed ``MooncakeBundleTransfer``; the reshard contracts and their errors)
and prints every result plus every stored key. torch is hidden on both sides, so the
wheel side needs only numpy and msgpack in the scratch venv; it is skipped, saying how to
enable it, when that venv is absent. The ours-only test asserts the behaviour itself, so
it checks something where the wheel is not installed (CI).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import test_compat_parity as parity

from mooncake_core.bench.published import peer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("dataproto_reshard_calls.py")


def _start(python: str, side: str) -> subprocess.Popen[str]:
    env = dict(peer().mooncake_env(), GLOG_minloglevel="2")
    if side == "ours":
        env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen(
        [python, str(SCRIPT), side],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    data: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return data


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """Both runs, started at once."""
    try:
        theirs_python: str | None = parity.published_python_with("numpy", "msgpack")
    except pytest.skip.Exception as exc:
        theirs_python, reason = None, str(exc)
    procs = {"ours": _start(sys.executable, "ours")}
    if theirs_python is not None:
        procs["theirs"] = _start(theirs_python, "theirs")
    out: dict[str, Any] = {name: _result(proc) for name, proc in procs.items()}
    out.setdefault("theirs", reason if theirs_python is None else None)
    return out


def test_ours_answers_and_stores_as_the_published_modules(runs: dict[str, Any]) -> None:
    theirs, ours = runs["theirs"], runs["ours"]
    if isinstance(theirs, str):
        pytest.skip(theirs)
    assert theirs["module"] == "mooncake" and ours["module"] == "mooncake_core"
    assert len(theirs) > 100  # the run did the work
    diff = {k: (theirs.get(k), ours.get(k)) for k in set(theirs) | set(ours) if k != "module"}
    assert {k: v for k, v in diff.items() if v[0] != v[1]} == {}


def test_catalog_behaviour_on_ours(runs: dict[str, Any]) -> None:
    """The catalog's answers asserted on ours alone (runs without the wheel)."""
    ours = runs["ours"]
    assert ours["tags_merge"]["tags"] == [{"x": 2, "l": [1], "y": 3}]
    assert ours["e_keys_dup"] == ["error", "ValueError", "keys must be unique"]
    assert ours["e_tags_type"] == ["error", "TypeError", "tags must be mappings"]
    assert ours["publish_again"] == ours["publish_tags"]  # idempotent until acknowledged
    assert ours["publish_after_ack"]["tags"] == [{"t": 3}]
    # a published fragment: its id is the manifest key, its rows resolve in key order
    put, res = ours["put"], ours["resolve"]
    assert put["fields"] == ["ids", "score"] and ours["fragment_is_manifest_key"] is True
    assert res["read_token"] == 1 and res["keys"] == ["b", "a"]
    ((fid, handle),) = res["handles"].items()
    assert res["field_groups"] == [{"fields": ["ids", "score"], "locations": [[fid, 1], [fid, 0]]}]
    assert handle["type"] == "mooncake_dataproto_ref" and res["meta_info"] == {"step": 10}
    assert ours["read_fragment"]["ids"] == ["ndarray", "<i8", [2], [10, 11]]
    # append: the appended handle replaces the fragment; the old one is stale
    assert ours["append"]["fields"] == ["ids", "score", "adv"]
    assert ours["e_append_stale"][2].startswith("stale DataProto append handle")
    # retirement waits for pinned reads: removing row a frees its fragments at once,
    # except the pinned one, which goes (cleaned from the store) when its read ends
    assert ours["resolve_pin_a"]["read_token"] == 2
    assert len(ours["keys_pinned"]) == 3 and all("0008/" in k for k in ours["keys_pinned"])
    assert ours["keys_released"] == [] and ours["list_empty"] == {"p": {"c": {"z": 1}}}
    assert ours["calls"][-7:-2] == [
        "resolve",
        "remove",
        "ack_retired",
        "release_read",
        "ack_retired",
    ]
    assert ours["resolve_mixed"][2] == "conflicting DataProto meta_info value for 'step'"
    assert ours["e_drain_pinned"][2] == "cannot drain DataProto catalog with 1 active read(s)"
    assert ours["e_mismatch"][2].startswith("DataProto fragment management mismatch")
    assert ours["publish_append_stale"] == {
        "append_rejected": "stale DataProto append handle: 'nofrag'"
    }
    assert ours["publish_append_repeat"] == ours["publish_append_stale"]  # same operation id
    # drain removed every managed fragment from the store; the unmanaged one stays
    assert ours["keys_after_drain"] and all("/u/" in k for k in ours["keys_after_drain"])
    assert ours["e_update_drained"] == ["error", "RuntimeError", "DataProto catalog is drained"]
    assert ours["publish_append_drained"] == {"append_rejected": "DataProto catalog is drained"}
    assert ours["released"] == ["r1", "r2"] and ours["attached"] == ["r1", "r2"]


def test_reshard_contracts_on_ours(runs: dict[str, Any]) -> None:
    ours = runs["ours"]
    assert ours["reshard"] == [
        "PlacementManifest", "ResourceKind", "ResourceManifest", "RuntimeBindingManifest",
        "contracts",
    ]  # fmt: skip
    assert ours["kind"] == ["enum", "ResourceKind", "kv_cache"] and ours["kind_eq"] is True
    frag = ours["fragment"][1]
    assert frag["strides_bytes"] == [12, 12, 4]  # the extent-1 stride made dense
    assert ours["fragment_pickle"][1]["owner"] is None  # the owner does not travel
    assert ours["eq_ignores_owner"] is True
    assert ours["e_f_wrap"][2] == "address range must fit in an unsigned 64-bit integer"
    assert ours["e_f_bounds"][2] == "runtime view exceeds storage allocation bounds"
    assert ours["bind_ok"] is None and ours["bind_digest"][1] == "ValueError"


#: what the published 0.3.13 package answers for the script's placement and stored
#: manifest (the sha256 of their canonical JSON, and the content-derived ids), so that
#: byte identity is checked where the wheel is absent too
PUBLISHED_PLACEMENT = [
    "a5b3defee822c03d9fcd7871710317f428dc57baa8d3d4889a1626ca187ecd06",
    "sha256:b25a449f48eaabb7af53cf51282c6cf7df4a8b681be3714545e62ad3226a9756",
    "model_weight",
]
PUBLISHED_TOPOLOGY_ID = "sha256:3e6812609f7fa8817c3a14120f5dce1a823dd690a7048432738da83a52562288"
PUBLISHED_WEIGHT_MANIFEST = "c9b40ecf5884490e3ab3f155ec4d9b4ac2a57ab979d8008ec14717fc48f68dde"


def test_reshard_weight_on_ours(runs: dict[str, Any]) -> None:
    """Placements, runtime bindings and stored manifests on ours alone."""
    ours = runs["ours"]
    # the canonical JSON and ids are the published ones, byte for byte
    assert ours["placement_digest"] == PUBLISHED_PLACEMENT
    assert hashlib.sha256(ours["placement_json"].encode()).hexdigest() == PUBLISHED_PLACEMENT[0]
    assert ours["topology"] == [PUBLISHED_TOPOLOGY_ID, 2, ["w0", "w1"]]
    assert ours["wm_digest"] == PUBLISHED_WEIGHT_MANIFEST
    assert '"created_at":"2026-12-02T00:00:00Zé"' in ours["wm_json"]  # UTF-8, not \\u escapes
    assert ours["round_trip_equal"] is True and ours["wm_round_trip"] is True
    assert ours["pl_parts_same"] is True  # parts in any order: the same placement
    # what the JSON reader refuses
    assert ours["j_dup"][2] == "duplicate JSON field: revision"
    assert ours["j_nan"][2] == "non-finite JSON number is unsupported: NaN"
    assert ours["j_pid"][2] == "placement_id does not match canonical logical content"
    assert ours["j_gen_bool"][2] == "weight_generation must be an integer at least 0"
    assert ours["j_drop_frag"][2] == "global placement tensor is not fully covered: qkv"
    assert ours["e_pl_alias"][2] == "alias group is not declared consistently for tensor: lm_head"
    # runtime bindings: aliases may share an address; other overlaps are refused
    assert ours["bind_ok"] is None
    assert ours["e_bind_all"][2] == "missing runtime binding participant: w1"
    assert ours["e_bind_overlap"][2].startswith("runtime binding address ranges overlap: rt-qkv")
    assert ours["e_bind_alloc"][2].startswith("runtime binding storage allocation ranges overlap")
    assert (
        ours["wm_e_range"][2] == "stored fragment object ranges overlap: s2 and s3 in g/payload/1"
    )
    geometry = {k: ours[k] for k in ours if k.startswith("g_") and k != "g_contains_rank"}
    assert [k for k, v in geometry.items() if v is True] == [
        "g_contains", "g_cover", "g_ov1", "g_ov2", "g_ov3", "g_regions",
    ]  # fmt: skip


def test_reshard_planner_on_ours(runs: dict[str, Any]) -> None:
    """Plans between the script's placements (tp=2 <-> tp=1, stored -> tp=2, a split on
    the last dimension) on ours alone; the figures are what the published planner gives."""
    ours = runs["ours"]
    down = ours["plan_2_to_1"]
    assert [op[0] for op in down["ops"]] == ["qkv", "qkv", "lm_head", "norm", "embed"]
    assert down["total_bytes"] == 176  # each tensor once: 64 + 16 + 48 + 48
    # sources: DP replica 0, the first tp rank for the replicated tensors
    assert [[e[0], e[3]] for e in down["source_executors"]] == [["w0", [0, 2, 3, 4]], ["w1", [1]]]
    assert down["routes"] == [[0, None, 0, None, [0, 1, 2, 4]], [0, 0, 0, None, [3]]]
    stored = ours["plan_stored"]
    assert stored["identity"] == PUBLISHED_WEIGHT_MANIFEST and stored["ids"][0] is None
    assert len(stored["ops"]) == 8 and stored["total_bytes"] == 288  # both ranks filled
    strided = ours["plan_strided_raw"]["ops"]
    assert [op[3:] for op in strided] == [
        [[0, 3], [4, 3], 12, 0, 12, [4], [24], [12]],
        [[0, 0], [4, 3], 0, 0, 12, [4], [24], [12]],
    ]
    assert ours["segments"] == [[0, 0, 12], [24, 12, 12], [48, 24, 12], [72, 36, 12]]
    assert ours["region_props"] == [4, 48, 12, 4, 0, 0, 24, 12]
    assert ours["pickled_equal"] is True
    assert ours["e_plan_limit"][2] == "logical transfer plan exceeds max_transfer_regions: 3"
    assert ours["e_plan_layout"][2] == "layout mismatch for tensor norm"
    assert ours["e_region_canon"][2] == "transfer region loop geometry is not canonical"
    assert ours["e_segments"][2] == "transfer region exceeds max_segments: 4 > 3"


def test_the_modules_import_as_mooncake_names() -> None:
    code = (
        "import mooncake_core.compat as c; c.install(force=True);"
        "import mooncake.dataproto_catalog as d, mooncake.reshard.contracts.ids as i;"
        "from mooncake.reshard.contracts import RuntimeBindingFragment as R;"
        "import mooncake_core.compat.reshard.contracts as ours;"
        "print(d.__name__, i.__name__, R is ours.RuntimeBindingFragment);"
        "import mooncake.reshard.nope"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=60,
    )
    assert out.stdout.split() == [
        "mooncake_core.compat.dataproto_catalog",
        "mooncake_core.compat.reshard.contracts.ids",
        "True",
    ], out.stderr
    assert "ModuleNotFoundError: No module named 'mooncake.reshard.nope'" in out.stderr
