"""Reading rows of object columns by index moves only those rows' bytes.

One script per side (ours on our master; the published 0.3.13 module on its own
``mooncake_master`` when ``.scratch/mooncake-venv`` exists) puts a DataProto with 20 000
rows of object columns (strings, dicts, numeric lists, ndarrays, nested dicts with arrays,
bytes, nullable floats, ndarrays of mixed ndim with nulls) and a dense field, in 1 MiB
chunks, from a holder store, and reads it from a second store that lends no memory (every
byte crosses the transfer engine): whole, by an index list (repeats, any order, rows far
apart) and by a slice. The rows read must equal the whole read's rows, value for value,
and the bytes moved (the reader engine's ``bytes_read``; the store's ``get`` and
``get_into_ranges`` answers) must be a small fraction of the whole read's.
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

SCRIPT = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import numpy as np
    if os.environ.get("USE_MOONCAKE_CORE"):
        import mooncake_core.compat
        assert mooncake_core.compat.install(force=True)
    from mooncake.store import MooncakeDistributedStore
    import mooncake.structured_object_store as sos

    master, metadata = sys.argv[1], sys.argv[2]
    N = 20000

    class Counting:
        def __init__(self, s):
            self._s, self.got, self.ranged = s, 0, 0
        def get(self, key):
            v = self._s.get(key)
            self.got += len(v)
            return v
        def get_into_ranges(self, *args):
            res = self._s.get_into_ranges(*args)
            self.ranged += sum(n for b in res for k in b for n in k if n > 0)
            return res
        def __getattr__(self, name):
            return getattr(self._s, name)

    def col(values):
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    rng = np.random.default_rng(7)
    lens = rng.integers(20, 400, N)
    data = {
        "batch": {"ids": np.arange(N * 4, dtype=np.int64).reshape(N, 4)},
        "non_tensor_batch": {
            "text": col(["t%d:" % i + "x" * int(lens[i]) for i in range(N)]),
            "info": col([{"id": i, "tag": "g" * (i % 40)} for i in range(N)]),
            "seq": col([list(range(i % 23)) for i in range(N)]),
            "arr": col([np.arange(i % 31, dtype=np.float32) + i for i in range(N)]),
            "nested": col([{"a": np.arange(i % 5), "s": "n%d" % i} for i in range(N)]),
            "blob": col([bytes([i % 251]) * (i % 97) for i in range(N)]),
            "score": col([None if i % 9 == 0 else i / 4 for i in range(N)]),
            "grid": col([None if i % 11 == 0 else np.arange(6).reshape(2, 3) + i
                         if i % 3 == 0 else np.arange(i % 5) for i in range(N)]),
        },
        "meta_info": {},
    }

    def canon(v):
        if isinstance(v, np.ndarray):
            return ["nd", v.dtype.str, list(v.shape), canon(v.tolist())]
        if isinstance(v, dict):
            return {k: canon(x) for k, x in sorted(v.items())}
        if isinstance(v, (list, tuple)):
            return [canon(x) for x in v]
        if isinstance(v, bytes):
            return ["b", v.hex()]
        if isinstance(v, np.generic):
            return canon(v.item())
        return v

    def digest(v):
        return hashlib.sha256(json.dumps(canon(v)).encode()).hexdigest()

    def main(holder, reader):
        r = {"setup": [
            holder.setup("127.0.0.1", metadata, 256 << 20, 64 << 20, "tcp", "", master),
            reader.setup("127.0.0.1", metadata, 0, 64 << 20, "tcp", "", master),
        ]}
        ref = sos.MooncakeBundleTransfer(holder, key_prefix="pp").put_dataproto(
            data, partition="p", chunk_bytes=1 << 20
        )
        handle = sos.export_dataproto_ref(ref)
        r["codecs"] = {n: e["codec"] for n, e in handle["encoded_non_tensor"].items()}
        counting = Counting(reader)
        t = sos.MooncakeBundleTransfer(counting, key_prefix="pp")

        def engine_bytes():
            client = getattr(reader, "_client", None)
            return None if client is None else client.engine.stats["bytes_read"]

        def read(rows):
            counting.got = counting.ranged = 0
            before = engine_bytes()
            got = t.get_dataproto(sos.import_dataproto_ref(handle), rows=rows)
            after = engine_bytes()
            moved = None if before is None else after - before
            return got, {"get": counting.got, "ranges": counting.ranged, "engine": moved}

        whole, r["whole_bytes"] = read(None)
        idx = [5, 17, 9000, 17, 19999, 0, 12345]
        some, r["idx_bytes"] = read(idx)
        part, r["slice_bytes"] = read(slice(100, 150))
        nt = "non_tensor_batch"
        r["idx_equal"] = {
            n: [canon(some[nt][n][k]) == canon(whole[nt][n][i]) for k, i in enumerate(idx)]
            for n in data[nt]
        }
        r["slice_equal"] = {
            n: [canon(v) for v in part[nt][n]] == [canon(v) for v in whole[nt][n][100:150]]
            for n in data[nt]
        }
        sample = range(0, N, 97)
        r["whole_equal"] = {
            n: [canon(whole[nt][n][i]) for i in sample] == [canon(data[nt][n][i]) for i in sample]
            for n in data[nt]
        }
        r["ids_equal"] = bool((np.asarray(some["batch"]["ids"]) == data["batch"]["ids"][idx]).all())
        r["idx_digest"] = {n: digest(list(some[nt][n])) for n in data[nt]}
        r["text_rows"] = [some[nt]["text"][k][:8] for k in range(len(idx))]
        print(json.dumps(r))

    holder = MooncakeDistributedStore()
    reader = MooncakeDistributedStore()
    try:
        main(holder, reader)
    finally:
        holder.close()
        reader.close()
    """
)

COLUMNS = ["text", "info", "seq", "arr", "nested", "blob", "score", "grid"]


def _run(python: str, script: Path, ours: bool, master: str, metadata: str) -> dict[str, Any]:
    out = subprocess.run(
        [python, str(script), master, metadata],
        capture_output=True,
        text=True,
        env=harness._env(ours),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("structured_partial") / "partial_rows.py"
    path.write_text(SCRIPT)
    return path


@pytest.fixture(scope="module")
def ours(script: Path) -> dict[str, Any]:
    with harness.our_master() as (master, metadata):
        return _run(sys.executable, script, True, master, metadata)


@pytest.mark.timeout(120)
def test_index_rows_of_object_columns_move_only_their_bytes(ours: dict[str, Any]) -> None:
    assert ours["setup"] == [0, 0]
    assert ours["codecs"] == {
        "text": "utf8_ragged", "info": "msgpack_ragged", "seq": "typed_ragged",
        "arr": "typed_ragged", "nested": "structured_recursive", "blob": "bytes_ragged",
        "score": "ndarray", "grid": "typed_ragged",
    }  # fmt: skip
    # the rows equal the whole read's rows, column by column, the dense field too
    assert ours["whole_equal"] == {c: True for c in COLUMNS}
    assert ours["idx_equal"] == {c: [True] * 7 for c in COLUMNS}
    assert ours["slice_equal"] == {c: True for c in COLUMNS}
    assert ours["ids_equal"] is True
    assert ours["text_rows"][:3] == ["t5:xxxxx", "t17:xxxx", "t9000:xx"]
    # what moved: the whole read is every payload (> 8 MB), the 7 rows a few KB of
    # offsets, rows and the stage's manifest and metadata
    whole, idx, part = ours["whole_bytes"], ours["idx_bytes"], ours["slice_bytes"]
    assert whole["engine"] > 8_000_000 and whole["get"] > 8_000_000
    assert idx["engine"] < 200_000, idx
    assert idx["ranges"] < 20_000, idx
    assert idx["engine"] * 50 < whole["engine"]
    assert part["engine"] < 300_000, part


@pytest.mark.timeout(180)
def test_the_published_module_reads_the_same_rows(ours: dict[str, Any], script: Path) -> None:
    """The same script on the wheel, whose module also reads index rows of object columns
    with ``get_into_ranges``: the same codecs, the same rows (compared by digest), and a
    read of the same order of bytes. Its slice read of the nested (structured_recursive)
    column does not give the whole read's rows; ours does."""
    python = parity.published_python_with("numpy", "msgpack")
    with harness.their_master(python) as (master, metadata):
        theirs = _run(python, script, False, master, metadata)
    assert theirs["setup"] == [0, 0] and theirs["codecs"] == ours["codecs"]
    assert theirs["idx_equal"] == {c: [True] * 7 for c in COLUMNS}
    # the wheel's slice read of a structured_recursive column differs from its own whole
    # read's rows (ours: test above); index reads agree
    assert theirs["slice_equal"] == {c: c != "nested" for c in COLUMNS}
    assert theirs["idx_digest"] == ours["idx_digest"]
    assert theirs["text_rows"] == ours["text_rows"]
    assert 0 < theirs["idx_bytes"]["ranges"] < 20_000, theirs["idx_bytes"]
    # it reads the stage's manifest and metadata again for each member (~430 KB here);
    # ours once per stage per read (~30 KB)
    assert theirs["idx_bytes"]["get"] < 1_000_000, theirs["idx_bytes"]
