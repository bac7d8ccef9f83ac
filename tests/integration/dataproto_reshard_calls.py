"""One script for both implementations of ``mooncake.dataproto_catalog`` and
``mooncake.reshard`` (parity test: tests/integration/test_compat_dataproto_reshard.py).

``python dataproto_reshard_calls.py ours|theirs``: ``theirs`` imports the published
modules (run by the wheel's python), ``ours`` installs our compat layer first. torch is
hidden on both sides (the catalog's fragments here hold numpy columns), so the wheel side
needs only numpy and msgpack. UUIDs are deterministic so both write the same keys. Prints
one JSON line: per call its result (or error type and message), and every stored key
with its bytes' sha256 (manifests in full).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import pickle
import sys
import uuid
from typing import Any

import numpy as np

SIDE = sys.argv[1]
sys.modules["torch"] = None  # type: ignore[assignment]  # the same no-torch paths on both
if SIDE == "ours":
    import mooncake_core.compat

    assert mooncake_core.compat.install(force=True)

import mooncake.dataproto_catalog as dc  # noqa: E402
import mooncake.reshard as rs  # noqa: E402
import mooncake.structured_object_store as sos  # noqa: E402
from reshard_weight_calls import weight_calls  # noqa: E402

_counter = iter(range(1, 1 << 30))
uuid.uuid4 = lambda: uuid.UUID(int=next(_counter))
out: dict[str, Any] = {"module": dc.DataProtoCatalog.__module__.split(".")[0]}


def plain(value: Any) -> Any:
    """JSON-safe, order-free where the published order is a set's (retired handles)."""
    if isinstance(value, enum.Enum):
        return ["enum", type(value).__name__, plain(value.value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return [type(value).__name__, fields]
    if isinstance(value, dict):
        res = {str(k): plain(v) for k, v in value.items()}
        if "retired_handles" in res:
            res["retired_handles"] = sorted(res["retired_handles"], key=json.dumps)
        return res
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return ["ndarray", value.dtype.str, list(value.shape), value.tolist()]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return type(value).__name__


def call(label: str, fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        value = fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001 - the error itself is the result
        out[label] = ["error", type(exc).__name__, str(exc)]
        return None
    out[label] = plain(value)
    return value


class DictStore:
    """The smallest BundleStore: put / get / remove / is_exist over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def put(self, key: str, value: Any, config: Any = None) -> int:
        self.data[key] = bytes(value)
        return 0

    def get(self, key: str) -> bytes:
        return self.data.get(key, b"")

    def remove(self, key: str, force: bool = False) -> int:
        return 0 if self.data.pop(key, None) is not None else -704

    def is_exist(self, key: str) -> int:
        return 1 if key in self.data else 0


class Proto:
    """A DataProto-like object: ``batch``, ``non_tensor_batch``, ``meta_info``, rows."""

    def __init__(self, columns: dict[str, Any], meta: dict[str, Any]) -> None:
        self.batch: dict[str, Any] = {}
        self.non_tensor_batch = columns
        self.meta_info = meta

    def __len__(self) -> int:
        return len(next(iter(self.non_tensor_batch.values())))


def rows(n: int, base: int, **extra: Any) -> Proto:
    cols = {"ids": np.arange(base, base + n, dtype=np.int64)}
    cols.update({k: np.asarray(v) for k, v in extra.items()})
    return Proto(cols, {"step": base})


# -- DataProtoCatalog alone: tags, validation ------------------------------------------
cat = dc.DataProtoCatalog()
call("tags", cat.update, "p", ["a", "b"], tags=[{"x": 1}, {"x": 2, "l": [1]}])
call("tags_merge", cat.update, "p", ["b"], tags=[{"y": 3}])
update_cases: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("e_part", ("", ["a"]), {"tags": [{}]}),
    ("e_part_type", (3, ["a"]), {"tags": [{}]}),
    ("e_keys_str", ("p", "ab"), {"tags": [{}]}),
    ("e_keys_dup", ("p", ["a", "a"]), {"tags": [{}, {}]}),
    ("e_keys_empty", ("p", []), {"tags": []}),
    ("e_keys_blank", ("p", ["a", ""]), {"tags": [{}, {}]}),
    ("e_tags_len", ("p", ["a"]), {"tags": [{}, {}]}),
    ("e_tags_type", ("p", ["a"]), {"tags": [1]}),
    ("e_nothing", ("p", ["a"]), {}),
    ("e_handle", ("p", ["a"]), {"handle": {"type": "other"}}),
]
for label, args, kw in update_cases:
    call(label, cat.update, *args, **kw)
call("list_all", cat.list)
call("list_p", cat.list, "p")
call("list_none", cat.list, "nope")
call("e_list", cat.list, "")
call("e_resolve_nofields", cat.resolve, "p", ["a"])
call("e_resolve_missing", cat.resolve, "p", ["a", "zz"])
call("e_resolve_fields", cat.resolve, "p", ["a"], [])
call("publish_tags", cat.publish, "op-1", "q", ["k"], tags=[{"t": 1}])
call("publish_again", cat.publish, "op-1", "q", ["k"], tags=[{"t": 2}])
call("ack_publication", cat.ack_publication, "op-1")
call("publish_after_ack", cat.publish, "op-1", "q", ["k"], tags=[{"t": 3}])
call("e_publish_op", cat.publish, "", "q", ["k"], tags=[{}])
call("e_ack_op", cat.ack_publication, None)
call("remove_missing", cat.remove, "zz", ["a"])
call("remove_q", cat.remove, "q", ["k", "other"])
call("release_unknown", cat.release_read, 99)

# -- through DataProtoCatalogTransfer over a real bundle transfer ------------------------
store = DictStore()
t = sos.MooncakeBundleTransfer(store, key_prefix="cat")
catalog = dc.DataProtoCatalog()
calls: list[str] = []


def catalog_call(method: str, *args: Any, **kw: Any) -> Any:
    calls.append(method)
    return getattr(catalog, method)(*args, **kw)


ct = dc.DataProtoCatalogTransfer(t, catalog_call)
first = call(
    "put",
    ct.put,
    rows(2, 10, score=[0.5, 1.5]),
    partition="p",
    keys=["a", "b"],
    tags=[{"s": 0}] * 2,
)
call("e_put_rows", ct.put, rows(3, 0), partition="p", keys=["a", "b"])
call("e_put_nothing", ct.put, None, partition="p", keys=["c"])
call("put_tags_only", ct.put, None, partition="p", keys=["c"], tags=[{"z": 1}])
got = call("resolve", ct.resolve, "p", ["b", "a"])
call("e_not_ready", catalog.resolve, "p", ["a", "c"])
call("e_field_unknown", catalog.resolve, "p", ["a"], ["nope"])
fid, handle = next(iter(got["handles"].items())) if got else ("", {})
out["fragment_is_manifest_key"] = (
    fid
    == sos.import_dataproto_ref(handle)
    .stage_refs[next(iter(sos.import_dataproto_ref(handle).stage_refs))]
    .manifest_key
)
call("read_fragment", t.get, handle, type="dict")
call("e_append_overwrite", ct.append, fid, handle, rows(2, 0), partition="p", keys=["a", "b"],
     stage="s2", overwrite=True)  # fmt: skip
call("e_append_rows", ct.append, fid, handle, rows(3, 0), partition="p", keys=["a", "b"], stage="x")
call("e_append_part", ct.append, fid, handle, rows(2, 0), partition="q", keys=["a", "b"], stage="x")
appended = call(
    "append",
    ct.append,
    fid,
    handle,
    Proto({"adv": np.array([0.25, -1.0])}, {"step": 10}),
    partition="p",
    keys=["a", "b"],
    stage="s2",
)
call("e_append_stale", ct.append, fid, handle, Proto({"v": np.zeros(2)}, {}), partition="p",
     keys=["a", "b"], stage="s3")  # fmt: skip
call("resolve_after_append", catalog.resolve, "p", ["a", "b"], ["ids", "adv"])
call("resolve_selected", catalog.resolve, "p", ["a"], ["adv"])
# a second fragment takes over field "ids" of row a; the first stays (b and pin hold it)
call("put_over", ct.put, rows(1, 20), partition="p", keys=["a"], tags=[{"s": 1}])
call("resolve_mixed", catalog.resolve, "p", ["a", "b"])
call("e_drain_pinned", catalog.drain)
call("remove_b", ct.remove, "p", ["b"])
out["keys_before_release"] = sorted(store.data)
call("release", ct.release_read, got["read_token"] if got else 0)
call("release_again", ct.release_read, got["read_token"] if got else 0)
out["keys_after_release"] = sorted(store.data)
call("list_after", ct.list, "p")
# a pinned read delays retirement: row a's fragments go when it is removed, except the
# pinned one, which goes when its read is released
got2 = call("resolve_pin_a", ct.resolve, "p", ["a"], ["ids"])
call("remove_a", ct.remove, "p", ["a"])
out["keys_pinned"] = sorted(store.data)
call("release_a", ct.release_read, got2["read_token"] if got2 else 0)
out["keys_released"] = sorted(store.data)
call("list_empty", ct.list)
# unmanaged handles (update): never retired; the same fragment published: mismatch
plain_ref = t.put(rows(2, 30), type="dataproto", partition="u")
plain_handle = sos.export_dataproto_ref(plain_ref)
call("update_handle", catalog.update, "u", ["x", "y"], handle=plain_handle)
call("e_mismatch", catalog.publish, "op-m", "u", ["x", "y"], handle=plain_handle)
call("e_rows_handle", catalog.update, "u", ["x"], handle=plain_handle)
call("remove_u", catalog.remove, "u", ["x", "y"])
call("publish_append_stale", catalog.publish_append, "op-s", "nofrag", "p", ["a"],
     previous_handle=plain_handle, handle=plain_handle)  # fmt: skip
call("publish_append_repeat", catalog.publish_append, "op-s", "", "", [],
     previous_handle={}, handle={})  # fmt: skip
call("e_publish_append_fid", catalog.publish_append, "op-t", "", "p", ["a"],
     previous_handle=plain_handle, handle=plain_handle)  # fmt: skip
out["calls"] = calls
call("drain", ct.drain)
out["keys_after_drain"] = sorted(store.data)
call("e_update_drained", catalog.update, "p", ["a"], tags=[{}])
call("publish_append_drained", catalog.publish_append, "op-d", "f", "p", ["a"],
     previous_handle={}, handle={})  # fmt: skip
call("list_drained", catalog.list)
call("ack_retired_none", catalog.ack_retired, [])
# results attached to an output are released through the transfer
released: list[Any] = []
t.release_result = released.append
holder = Proto({"i": np.zeros(1)}, {})
ct.attach_results(holder, ["r1", "r2"])
out["attached"] = getattr(holder, "_mooncake_catalog_results", None)
ct.release_result(holder)
out["released"] = released
call("close", ct.close)
out["objects"] = {
    k: json.loads(v) if k.endswith("manifest") else hashlib.sha256(v).hexdigest()[:16]
    for k, v in sorted(store.data.items())
}

# -- mooncake.reshard (contracts) -----------------------------------------------------
out["reshard"] = sorted(n for n in dir(rs) if not n.startswith("_"))
call("kind", rs.ResourceKind, "kv_cache")
call("kind_eq", lambda: rs.ResourceKind.MODEL_WEIGHT == "model_weight")
call("e_kind", rs.ResourceKind, "weights")
from mooncake.reshard import contracts as rc  # noqa: E402

call("contracts_all", lambda: sorted(rc.__all__))
frag_args: dict[str, Any] = {
    "placement_fragment_id": "pf",
    "fragment_id": "rf",
    "address": 4096,
    "nbytes": 24,
    "worker_id": "w0",
    "endpoint": "127.0.0.1:1",
    "device": "cpu",
    "itemsize": 4,
    "local_shape": [2, 1, 3],
    "strides_bytes": [12, 0, 4],
    "storage_address": 4000,
    "storage_nbytes": 200,
    "storage_offset_bytes": 96,
}
frag = call("fragment", rc.RuntimeBindingFragment, **frag_args, owner=object())
out["fragment_pickle"] = plain(pickle.loads(pickle.dumps(frag))) if frag else None
frag_cases: list[tuple[str, dict[str, Any]]] = [
    ("e_f_id", {"fragment_id": ""}),
    ("e_f_worker", {"worker_id": 5}),
    ("e_f_addr0", {"address": 0}),
    ("e_f_addr_bool", {"address": True}),
    ("e_f_nbytes", {"nbytes": 0}),
    ("e_f_wrap", {"address": (1 << 64) - 8, "nbytes": 16}),
    ("e_f_big", {"nbytes": 1 << 64}),
    ("e_f_itemsize", {"itemsize": 0}),
    ("e_f_shape_type", {"local_shape": (2, 3)[0]}),
    ("e_f_shape_zero", {"local_shape": [2, 0, 3]}),
    ("e_f_stride_rank", {"strides_bytes": [12, 4]}),
    ("e_f_stride_zero", {"strides_bytes": [0, 0, 4]}),
    ("e_f_stride_neg", {"strides_bytes": [12, -1, 4]}),
    ("e_f_not_base", {"storage_offset_bytes": 95}),
    ("e_f_bounds", {"storage_nbytes": 100}),
    ("e_f_off_wrap", {"storage_offset_bytes": 1 << 64}),
    ("tuple_shape", {"local_shape": (2, 1, 3), "strides_bytes": (12, 8, 4)}),
]
for label, change in frag_cases:
    call(label, rc.RuntimeBindingFragment, **{**frag_args, **change})
if frag is not None:
    call("e_frozen", setattr, frag, "address", 1)
    call("eq_ignores_owner", lambda: frag == rc.RuntimeBindingFragment(**frag_args, owner=1))


@dataclasses.dataclass
class Placement:
    resource_id: str = "r"
    resource_kind: Any = rs.ResourceKind.MODEL_WEIGHT
    placement_id: str = "pl"
    digest: str = "d"


@dataclasses.dataclass
class Binding:
    resource_id: str = "r"
    resource_kind: Any = rs.ResourceKind.MODEL_WEIGHT
    placement_id: str = "pl"
    placement_digest: str = "d"


for label, binding in [
    ("bind_ok", Binding()),
    ("bind_kind", Binding(resource_kind=rs.ResourceKind.KV_CACHE)),
    ("bind_id", Binding(resource_id="s")),
    ("bind_pl", Binding(placement_id="x")),
    ("bind_digest", Binding(placement_digest="x")),
]:
    call(label, rc.validate_resource_binding_identity, Placement(), binding)
call("ids", lambda: [rc.TensorId("t"), rc.LeaseId("l"), rc.TopologyId.__name__])
weight_calls(call, out)
sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
