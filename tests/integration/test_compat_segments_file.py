"""File-backed segments (``mount_segment(path)`` / ``unmount_segment``) and
``bind_to_numa_node``: the same script on ours and on the published 0.3.13 wheel.

The segment script (a holder that lends no memory of its own, so every object lands in
the file; a reader in another process): refusals (missing file, directory, unaligned
offset, a range past the end, negative and float sizes, not set up), two segments over one
file (offset 0 and 48 MiB), eight 1 MiB objects whose bytes are found in the file at the
place the store put them and read back by the other process, then ``unmount_segment`` with
a bad id next to a good one (-1, the good one still withdrawn: the objects that lay there
are gone, the others stay), ids of the other kind refused both ways, the file keeping its
bytes. The wheel part needs ``.scratch/mooncake-venv`` (skipped without it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import test_compat_parity as parity
import test_compat_store as harness

PRELUDE = textwrap.dedent(
    """
    import json, os, subprocess, sys
    if os.environ.get("USE_MOONCAKE_CORE"):
        import mooncake_core.compat
        assert mooncake_core.compat.install(force=True)
    """
)

SEGMENTS = PRELUDE + textwrap.dedent(
    """
    from mooncake.store import MooncakeDistributedStore
    master, metadata, where = sys.argv[1], sys.argv[2], sys.argv[3]
    MiB = 1 << 20

    def value(i):
        return (b"KEY%03d-" % i * (MiB // 7 + 1))[:MiB]

    if len(sys.argv) > 4:  # the reader: which of the keys on stdin it reads back whole
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", metadata, 0, 16 * MiB, "tcp", "", master) == 0
        print("ready", flush=True)
        for line in sys.stdin:
            keys = line.split()
            print(json.dumps([s.get(k) == value(int(k[1:])) for k in keys]), flush=True)
        s.close()
        sys.exit(0)

    def call(fn):
        try:
            res = fn()
        except Exception as e:
            return type(e).__name__
        if isinstance(res, dict):  # ids differ per side: keep how many
            return {k: (len(v) if k == "segment_ids" else v) for k, v in sorted(res.items())}
        return res

    path = os.path.join(where, "segment.bin")
    with open(path, "wb") as f:
        f.truncate(64 * MiB)
    r = {}
    s = MooncakeDistributedStore()
    r["not_set_up"] = [call(lambda: s.mount_segment(path, MiB)),
                       call(lambda: s.unmount_segment([]))]
    r["setup"] = s.setup("127.0.0.1", metadata, 0, 16 * MiB, "tcp", "", master)
    r["missing"] = call(lambda: s.mount_segment(os.path.join(where, "nope"), MiB))
    r["directory"] = call(lambda: s.mount_segment(where, MiB))
    r["zero"] = call(lambda: s.mount_segment(path, 0))
    r["unaligned"] = call(lambda: s.mount_segment(path, MiB, 5))
    r["past_end"] = call(lambda: s.mount_segment(path, 32 * MiB, 48 * MiB))
    r["negative"] = call(lambda: s.mount_segment(path, -1))
    r["float"] = call(lambda: s.mount_segment(path, 1.5))
    first = s.mount_segment(path, 48 * MiB)
    second = s.mount_segment(path, 16 * MiB, 48 * MiB)
    r["mounted"] = [first["ret"], len(first["segment_ids"]), second["ret"],
                    len(second["segment_ids"]), sorted(first)]
    keys = ["k%d" % i for i in range(8)]
    r["put"] = [s.put(k, value(i)) for i, k in enumerate(keys)]
    data = open(path, "rb").read()
    at = [data.find(value(i)) for i in range(8)]
    r["in_file"] = [a >= 0 and a % 4096 == 0 for a in at]
    reader = subprocess.Popen([sys.executable, __file__, master, metadata, where, "reader"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "ready"

    def read_back():
        reader.stdin.write(" ".join(keys) + "\\n")
        reader.stdin.flush()
        return json.loads(reader.stdout.readline())

    r["read_by_other"] = read_back()
    alloc = s.allocate_and_mount_segment(16 * MiB)
    r["cross"] = [s.unmount_segment(alloc["segment_ids"]),
                  s.unmount_and_free_segment(first["segment_ids"])]
    r["unmount_first"] = s.unmount_segment(first["segment_ids"] + ["no-such-segment"])
    in_second = [a >= 48 * MiB for a in at]
    r["left_after_first"] = [s.is_exist(k) == int(sec) for k, sec in zip(keys, in_second)]
    r["read_after_first"] = [ok == sec for ok, sec in zip(read_back(), in_second)]
    r["unmount_again"] = s.unmount_segment(first["segment_ids"])
    r["unmount_second"] = s.unmount_segment(second["segment_ids"], 0)
    r["left"] = [s.is_exist(k) for k in keys]
    r["read_after_all"] = read_back()
    r["empty"] = s.unmount_segment([])
    r["bad_ids"] = call(lambda: s.unmount_segment("abc"))
    r["file_kept"] = open(path, "rb").read() == data
    r["free_alloc"] = s.unmount_and_free_segment(alloc["segment_ids"])
    reader.stdin.close()
    reader.wait(30)
    s.close()
    r["closed"] = [call(lambda: s.mount_segment(path, MiB)), call(lambda: s.unmount_segment([]))]
    print(json.dumps(r), flush=True)
    """
)

EXPECTED_SEGMENTS: dict[str, Any] = {
    "not_set_up": [{"ret": -1, "segment_ids": 0}, -1],
    "setup": 0,
    "missing": {"ret": -1, "segment_ids": 0},
    "directory": {"ret": -1, "segment_ids": 0},
    "zero": {"ret": 0, "segment_ids": 0},
    "unaligned": {"ret": -1, "segment_ids": 0},
    "past_end": {"ret": -1, "segment_ids": 0},
    "negative": "TypeError",
    "float": "TypeError",
    "mounted": [0, 1, 0, 1, ["ret", "segment_ids"]],
    "put": [0] * 8,
    "in_file": [True] * 8,
    "read_by_other": [True] * 8,
    "cross": [-1, -1],
    "unmount_first": -1,
    "left_after_first": [True] * 8,
    "read_after_first": [True] * 8,
    "unmount_again": -1,
    "unmount_second": 0,
    "left": [0] * 8,
    "read_after_all": [False] * 8,
    "empty": 0,
    "bad_ids": "TypeError",
    "file_kept": True,
    "free_alloc": 0,
    "closed": [{"ret": -1, "segment_ids": 0}, -1],
}

NUMA = PRELUDE + textwrap.dedent(
    """
    from mooncake.store import bind_to_numa_node
    def cpus():
        return sorted(os.sched_getaffinity(0))
    def call(fn):
        try:
            return repr(fn())
        except Exception as e:
            return type(e).__name__
    node0 = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, node0[-1:])
    r = {"narrowed": cpus() == node0[-1:]}
    r["bad"] = [call(lambda: bind_to_numa_node(n)) for n in (64, 2)] + [cpus() == node0[-1:]]
    r["all"] = [call(lambda: bind_to_numa_node(-1)), cpus() == node0]  # libnuma: all nodes
    os.sched_setaffinity(0, node0[-1:])
    r["types"] = [call(lambda: bind_to_numa_node(v)) for v in ("0", 0.0, None)]
    r["node0"] = [call(lambda: bind_to_numa_node(0)), cpus() == node0]
    r["keyword"] = call(lambda: bind_to_numa_node(node=0))
    print(json.dumps(r), flush=True)
    """
)

EXPECTED_NUMA = {
    "narrowed": True,
    "bad": ["None", "None", True],
    "all": ["None", True],
    "types": ["TypeError"] * 3,
    "node0": ["None", True],
    "keyword": "None",
}


def _script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "calls.py"
    path.write_text(text)
    return path


def _call(python: str, argv: list[str], ours: bool) -> dict[str, Any]:
    out = subprocess.run(
        [python, *argv], capture_output=True, text=True, env=harness._env(ours), timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


def _diff(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    return {k: (got.get(k), v) for k, v in want.items() if got.get(k) != v}


def _numa_node0_is_all_cpus() -> bool:
    import os

    from mooncake_core.compat.store_numa import node_cpus

    return node_cpus(0) == set(os.sched_getaffinity(0)) and len(os.sched_getaffinity(0)) > 1


@pytest.mark.timeout(120)
def test_file_segments_ours(tmp_path: Path) -> None:
    script = _script(tmp_path, SEGMENTS)
    with harness.our_master() as (master, metadata):
        got = _call(sys.executable, [str(script), master, metadata, str(tmp_path)], True)
    assert _diff(got, EXPECTED_SEGMENTS) == {}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_file_segments_published(tmp_path: Path) -> None:
    python = parity.published_python_with("numpy")
    script = _script(tmp_path, SEGMENTS)
    with harness.their_master(python) as (master, metadata):
        got = _call(python, [str(script), master, metadata, str(tmp_path)], False)
    assert _diff(got, EXPECTED_SEGMENTS) == {}


@pytest.mark.skipif(
    not _numa_node0_is_all_cpus(), reason="needs one NUMA node holding every CPU we may use"
)
@pytest.mark.parametrize("side", ["ours", "published"])
def test_bind_to_numa_node(tmp_path: Path, side: str) -> None:
    python = sys.executable if side == "ours" else parity.published_python_with("numpy")
    got = _call(python, [str(_script(tmp_path, NUMA))], side == "ours")
    assert _diff(got, EXPECTED_NUMA) == {}
