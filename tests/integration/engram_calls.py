"""One script for both ``mooncake.store.EngramStore`` implementations (parity test).

``python engram_calls.py MASTER METADATA`` against a running master: the published wheel's
python with its ``mooncake_master``, or ours (``USE_MOONCAKE_CORE=1``: our compat layer is
installed first) with ours. Prints one JSON line: per call its result, or ``["error",
type, first line of the message]``. The tables are made from ``np.arange`` so that the test
can rebuild them (``tables()``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

if os.environ.get("USE_MOONCAKE_CORE"):
    import mooncake_core.compat

    assert mooncake_core.compat.install()

DIM = 4
VOCAB = [5, 3, 7]


def tables() -> list[np.ndarray]:
    return [
        (np.arange(n * DIM, dtype=np.float32) + 1000 * h).reshape(n, DIM) / 8
        for h, n in enumerate(VOCAB)
    ]


#: row-id inputs, all of shape [B, L, H] = [2, 3, 3] unless named otherwise
IDS = np.array([[[0, 2, 6], [4, 1, 0], [4, 0, 3]], [[1, 1, 1], [3, 2, 5], [0, 0, 0]]])


def main() -> None:
    from mooncake.store import EngramStore, EngramStoreConfig, MooncakeDistributedStore

    master, metadata = sys.argv[1], sys.argv[2]
    r: dict[str, Any] = {}

    def call(name: str, fn: Callable[[], Any]) -> Any:
        try:
            got = fn()
        except Exception as exc:  # every error is part of the answer
            r[name] = ["error", type(exc).__name__, (str(exc).splitlines() or [""])[0]]
            return None
        r[name] = got.tolist() if isinstance(got, np.ndarray) else got
        return got

    s = MooncakeDistributedStore()
    r["setup"] = s.setup("127.0.0.1", metadata, 64 << 20, 16 << 20, "tcp", "", master)

    # the config: defaults, setter types, validation when a store is made from it
    c = EngramStoreConfig()
    r["defaults"] = [c.embedding_dim, c.table_vocab_sizes]
    for name, attr, value in [
        ("dim_float", "embedding_dim", 2.0),
        ("dim_str", "embedding_dim", "4"),
        ("dim_big", "embedding_dim", 1 << 31),
        ("dim_bool", "embedding_dim", True),
        ("vocab_tuple", "table_vocab_sizes", (1, 2)),
        ("vocab_float", "table_vocab_sizes", [1.0]),
        ("vocab_big", "table_vocab_sizes", [1 << 63]),
        ("vocab_neg", "table_vocab_sizes", [-1]),
        ("vocab_int", "table_vocab_sizes", 3),
    ]:
        call("cfg_" + name, lambda a=attr, v=value: (setattr(c, a, v), getattr(c, a))[1])
    call("cfg_new_attr", lambda: setattr(c, "nope", 1))
    call("cfg_ctor_arg", lambda: EngramStoreConfig(3))
    c.table_vocab_sizes = [2]
    call("cfg_vocab_copy", lambda: (c.table_vocab_sizes.append(9), c.table_vocab_sizes)[1])
    for name, dim, vocab in [
        ("zero_dim", 0, [3]),
        ("neg_dim", -1, [3]),
        ("no_tables", 4, []),
        ("zero_vocab", 4, [3, 0]),
        ("neg_vocab", 4, [-3]),
    ]:
        bad = EngramStoreConfig()
        bad.embedding_dim, bad.table_vocab_sizes = dim, vocab
        call("ctor_" + name, lambda b=bad: EngramStore(1, b, s).get_store_keys())

    c = EngramStoreConfig()
    c.embedding_dim, c.table_vocab_sizes = DIM, list(VOCAB)
    call("ctor_bad_store", lambda: EngramStore(1, c, 5))
    call("ctor_layer_big", lambda: EngramStore(1 << 31, c, s))
    call("ctor_layer_float", lambda: EngramStore(1.0, c, s))
    call("ctor_no_config", lambda: EngramStore(1, None, s))
    call("keys_layer_min", lambda: EngramStore(-(1 << 31), c, s).get_store_keys())
    call("keys_layer_bool", lambda: EngramStore(True, c, s).get_store_keys())
    call("keys_kw", lambda: EngramStore(layer_id=4, config=c, store=s).get_store_keys())

    e = EngramStore(9, c, s)
    c.embedding_dim = 8  # the store keeps its own copy
    r["shape"] = [e.get_num_heads(), e.get_embedding_dim(), e.get_table_vocab_sizes()]
    wide = EngramStore(9, c, s)  # the same layer read as if rows were twice as wide
    c.embedding_dim = DIM
    keys = call("keys", e.get_store_keys)
    call("lookup_before_populate", lambda: e.lookup(IDS))
    call("remove_before_populate", e.remove_from_store)

    t = tables()
    bad_inputs: list[tuple[str, Any]] = [
        ("tuple", tuple(t)),
        ("none", None),
        ("empty", []),
        ("too_few", t[:2]),
        ("too_many", [*t, t[0]]),
        ("nested_list", [t[0].tolist(), t[1], t[2]]),
        ("str_array", [np.full((5, DIM), "a"), t[1], t[2]]),
        ("one_d", [t[0].ravel(), t[1], t[2]]),
        ("three_d", [t[0][..., None], t[1], t[2]]),
        ("rows", [t[0][:4], t[1], t[2]]),
        ("cols", [t[0], t[1][:, :3], t[2]]),
        ("swapped", [t[1], t[0], t[2]]),
        ("late_not_array", [t[0][:4], t[1], "x"]),
    ]
    for name, buffers in bad_inputs:
        call("populate_" + name, lambda b=buffers: e.populate(b))
    call("exist_after_bad", lambda: s.batch_is_exist(keys))
    # float64, Fortran order and strided views are converted to C-order float32
    mixed = [t[0].astype(np.float64), np.asfortranarray(t[1]), np.repeat(t[2], 2, axis=1)[:, ::2]]
    call("populate", lambda: e.populate(mixed))
    call("exist", lambda: s.batch_is_exist(keys))
    call("sizes", lambda: [s.get_size(k) for k in keys])
    call("bytes_equal", lambda: [s.get(k) == a.tobytes() for k, a in zip(keys, t, strict=True)])
    call("populate_again", lambda: e.populate(t))
    call("populate_again_bad_shape", lambda: e.populate([t[0][:4], t[1], t[2]]))

    lookups: list[tuple[str, Any]] = [
        ("int64", IDS),
        ("int32_fortran", np.asfortranarray(IDS.astype(np.int32))),
        ("float", IDS + 0.75),
        ("object", IDS.astype(object)),
        ("str_digits", IDS.astype(str)),
        ("list", IDS.tolist()),
        ("tuple", tuple(tuple(tuple(h) for h in lv) for lv in IDS.tolist())),
        ("list_of_arrays", list(IDS)),
        ("bools_list", [[[True, False, True]]]),
        ("one_row", IDS[:1, :1]),
    ]
    for name, ids in lookups:
        call("lookup_" + name, lambda i=ids: e.lookup(i))
    got = e.lookup(IDS)
    r["lookup_meta"] = [got.dtype.name, list(got.shape), got.flags.c_contiguous]
    r["lookup_writable"] = bool(got.flags.writeable)
    other = EngramStore(9, c, s)  # another handle on the same layer reads the same tables
    call("lookup_other_handle", lambda: other.lookup(IDS[1:]))
    call("populate_other_handle", lambda: other.populate(t))
    call("lookup_wide_row0", lambda: wide.lookup([[[0, 0, 0]]]))
    call("lookup_wide_past_end", lambda: wide.lookup([[[2, 0, 0]]]))
    bad_ids: list[tuple[str, Any]] = [
        ("2d", IDS[0]),
        ("4d", IDS[..., None]),
        ("heads", IDS[..., :2]),
        ("no_heads", np.zeros((1, 1, 0), np.int64)),
        ("empty_b", np.zeros((0, 1, 3), np.int64)),
        ("empty_l", np.zeros((1, 0, 3), np.int64)),
        ("str_array", np.array([[["a", "b", "c"]]])),
        ("none_array", np.array([[[None, 1, 1]]], dtype=object)),
        ("out_of_range", [[[5, 0, 0]]]),
        ("out_of_range_h1", [[[0, 3, 0]]]),
        ("last_row", [[[4, 2, 6]]]),
        ("negative", [[[-1, 0, 0]]]),
        ("nan", np.array([[[np.nan, 0, 0]]])),
        ("uint64_big", np.array([[[1 << 63, 0, 0]]], dtype=np.uint64)),
        ("list_empty", []),
        ("list_empty_l", [[]]),
        ("list_empty_h", [[[]]]),
        ("list_heads", [[[0, 1]]]),
        ("list_ragged_h", [[[0, 1, 2], [0, 1]]]),
        ("list_ragged_l", [[[0, 1, 2]], [[0, 1, 2], [0, 0, 0]]]),
        ("list_2d", [[0, 1, 2]]),
        ("list_float", [[[1.5, 0, 0]]]),
        ("list_str", [[["1", 0, 0]]]),
        ("list_big", [[[1 << 70, 0, 0]]]),
        ("list_none", [[[None, 0, 0]]]),
        ("str", "abc"),
        ("int", 3),
        ("np_int", np.int64(3)),
        ("none", None),
    ]
    for name, ids in bad_ids:
        call("lookup_bad_" + name, lambda i=ids: e.lookup(i))

    call("remove_leased", e.remove_from_store)
    call("remove_force", lambda: e.remove_from_store(force=True))
    call("remove_again", lambda: e.remove_from_store(True))
    call("exist_after_remove", lambda: s.batch_is_exist(keys))
    call("lookup_after_remove", lambda: e.lookup(IDS))
    call("lookup_other_after_remove", lambda: other.lookup(IDS))
    # one table gone under the layer: lookups fail, the count says what was there
    call("repopulate", lambda: e.populate(t))
    call("drop_one", lambda: s.remove(keys[1], True))
    call("lookup_one_missing", lambda: e.lookup(IDS))
    call("populate_one_missing", lambda: e.populate(t))
    call("remove_one_missing", lambda: e.remove_from_store(True))
    # an unpopulated layer: remove finds nothing to remove
    call("remove_nothing", lambda: EngramStore(10, c, s).remove_from_store())

    n = EngramStore(11, c)  # no store: keys and shape work, store calls fail
    call("none_keys", n.get_store_keys)
    call("none_populate", lambda: n.populate(t))
    call("none_populate_bad", lambda: n.populate(t[:1]))
    call("none_lookup", lambda: n.lookup(IDS))
    call("none_lookup_bad", lambda: n.lookup(IDS[0]))
    call("none_remove", n.remove_from_store)
    call("none_remove_force", lambda: n.remove_from_store(True))

    s.close()
    print(json.dumps(r))


if __name__ == "__main__":
    main()
