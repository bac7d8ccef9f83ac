"""One script for both ``mooncake.structured_object_store`` implementations (parity test).

``python structured_calls.py ours|theirs dict|compat``: ``theirs`` imports the published
module (run by the wheel's python), ``ours`` installs our compat layer first. ``dict`` is a
dict-backed BundleStore; ``compat`` (ours only) the same four calls on our
``MooncakeDistributedStore`` connected to an in-process master of ours, plus a round trip
through that whole store (its ``put_tensor`` path). Where the python has Pillow, PIL images
in object columns too (``out["pil"]`` says whether). UUIDs are made deterministic so that
both sides write the same keys. Prints one JSON line: per call its result (or error type
and message), and every stored key with its bytes' sha256 (manifest and meta in full).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
import uuid
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

try:
    from PIL import Image
except ImportError:  # the wheel's scratch venv without Pillow: the image cases are left out
    Image = None  # type: ignore[assignment]

SIDE, STORE = sys.argv[1], sys.argv[2]


class DictStore:
    """The smallest BundleStore: put / get / remove / is_exist over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.groups: dict[str, Any] = {}

    def put(self, key: str, value: Any, config: Any = None) -> int:
        self.data[key] = bytes(value)
        self.groups[key] = getattr(config, "group_ids", None)
        return 0

    def get(self, key: str) -> bytes:
        return self.data.get(key, b"")

    def remove(self, key: str, force: bool = False) -> int:
        return 0 if self.data.pop(key, None) is not None else -704

    def is_exist(self, key: str) -> int:
        return 1 if key in self.data else 0


class PlainView(DictStore):
    """The same four calls on a real store (ours, on our master): nothing else of the
    store is visible, so both modules take the plain put/get paths they take on a dict."""

    def __init__(self, real: Any) -> None:
        super().__init__()
        self.real = real

    def put(self, key: str, value: Any, config: Any = None) -> int:
        self.groups[key] = getattr(config, "group_ids", None)
        return int(self.real.put(key, bytes(value)))

    def get(self, key: str) -> bytes:
        return bytes(self.real.get(key))

    def remove(self, key: str, force: bool = False) -> int:
        return int(self.real.remove(key, force))

    def is_exist(self, key: str) -> int:
        return int(self.real.is_exist(key))


def load_module() -> Any:
    if SIDE == "ours":
        import mooncake_core.compat

        assert mooncake_core.compat.install(force=True)
    import mooncake.structured_object_store as mod

    return mod


sos = load_module()
master = None
if STORE == "dict":
    store: Any = DictStore()
else:
    from mooncake_core.compat.store import MooncakeDistributedStore
    from mooncake_core.store.master import MasterServer

    master = MasterServer(rpc_port=0, http_port=-1).start_in_thread()
    full = MooncakeDistributedStore()
    rc = full.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 8 << 20, "tcp", "", master.address)
    assert rc == 0, rc
    store = PlainView(full)
_counter = iter(range(1, 1 << 30))
uuid.uuid4 = lambda: uuid.UUID(int=next(_counter))
written: set[str] = set()
_put = store.put


def _tracking_put(key: str, value: Any, config: Any = None) -> int:
    written.add(key)
    return int(_put(key, value) if config is None else _put(key, value, config=config))


store.put = _tracking_put
for name in ("put_tensor", "pub_tensor"):
    fn = getattr(store, name, None)
    if fn is not None:

        def tracked(key: str, *a: Any, _fn: Any = fn, **kw: Any) -> int:
            written.add(key)
            return int(_fn(key, *a, **kw))

        setattr(store, name, tracked)
out: dict[str, Any] = {}


def sha(data: Any) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()[:16]


def describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return ["nested", str(value.dtype), describe(value.values()), describe(value.offsets())]
        flat = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return ["tensor", str(value.dtype), list(value.shape), sha(flat.tobytes())]
    if isinstance(value, np.ndarray):
        if value.dtype == object:  # a decoded object column: its rows
            return ["objects", list(value.shape), [describe(v) for v in value.ravel()]]
        return ["ndarray", value.dtype.str, list(value.shape), sha(value.tobytes())]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ["bytes", sha(value)]
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if Image is not None and isinstance(value, Image.Image):
        palette = value.getpalette()
        pal = None if palette is None else sha(bytes(palette))
        pixels = sha(value.tobytes())
        return ["image", value.mode, list(value.size), pixels, value.format, pal, value.readonly]
    name = type(value).__name__
    return "tensor_object_buffer" if "TensorObjectBuffer" in name else name


def call(label: str, fn: Any, *args: Any, **kw: Any) -> Any:
    try:
        value = fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001 - the error itself is the result
        out[label] = ["error", type(exc).__name__, str(exc)]
        return None
    out[label] = describe(value)
    return value


def ref_of(ref: Any) -> Any:
    return None if ref is None else {"key": ref.manifest_key, "manifest": ref.manifest}


t = sos.MooncakeBundleTransfer(store, key_prefix="/pfx/")
out["prefix"] = t.key_prefix
gen = torch.Generator().manual_seed(7)
tensor = torch.randn(6, 3, generator=gen)
half = torch.randn(4, 5, generator=gen).to(torch.bfloat16)
arr = np.arange(24, dtype=np.float32).reshape(6, 4)
ints = np.arange(10, dtype=np.int64)

# bundles
r = call(
    "put_bundle",
    t.put_bundle,
    b"meta-bytes",
    {"a": b"x" * 10, "e": b"", "c": bytearray(3)},
    chunk_bytes=4,
)
out["put_bundle_ref"] = ref_of(r)
# structured objects
members: dict[str, Any] = {"arr": arr, "ints": ints, "raw": b"raw-bytes", "t": tensor, "h": half}
members["scalar"] = torch.tensor(3.5)
members["nested"] = torch.nested.nested_tensor(
    [torch.arange(3.0), torch.arange(5.0)], layout=torch.jagged
)
r2 = call("put_object", t.put_object, members, chunk_bytes=40, partition="p1")
out["put_object_ref"] = ref_of(r2)
call("get_object", t.get_object, r2)
call("get_object_by_key", t.get_object, {"manifest_key": r2.manifest_key})
r3 = call("put_object_value", t.put_object, arr)
call("get_object_value", t.get_object, r3)
spec = t.read_spec(r2).select_members(["arr", "t", "ints"])
spec = (
    spec.slice_member("arr", 0, 1, 6, 2).slice_member("t", 0, 2, 5).slice_member("ints", 0, -3, 100)
)
call("materialize_sliced", lambda: t.materialize(spec).objects)
dest = np.zeros((6, 4), dtype=np.float32)
call(
    "materialize_into",
    lambda: t.materialize_into(t.read_spec(r2).select_members(["arr"]), {"arr": dest}).objects,
)
out["dest_after"] = describe(dest)
call("metadata", lambda: t.materialize(t.read_spec(r2).select_members(["raw"])).metadata)
buf = (ctypes.c_uint8 * 4096)()
dst = sos.tensor_object_buffer(ctypes.addressof(buf), 4096, owner=buf)
call(
    "into_tensor_buffer",
    lambda: t.materialize_into(t.read_spec(r2).select_members(["t"]), {"t": dst}).objects,
)
out["tensor_buffer_head"] = sha(bytes(buf)[: 304 + tensor.nbytes])
call(
    "nested_sliced",
    lambda: (
        t.materialize(
            t.read_spec(r2).select_members(["nested"]).slice_member("nested", 0, 1, 2)
        ).objects
    ),
)
# errors
for label, fn, args, kw in [
    ("err_partition", t.put_bundle, (b"m", {}), {"partition": "a/b"}),
    ("err_name", t.put_bundle, (b"m", {"": b"x"}), {}),
    ("err_meta", t.put_bundle, (123, {}), {}),
    ("err_buffer", t.put_bundle, (b"m", {"x": 5}), {}),
    ("err_chunk", t.put_bundle, (b"m", {}), {"chunk_bytes": 0}),
    ("err_inflight", t.put_bundle, (b"m", {}), {"max_inflight_put": 0}),
    ("err_mode", t.put_bundle, (b"m", {}), {"policy": sos.BundleTransferPolicy(put_mode="x")}),
    ("err_payload", sos.StructuredObjectPayload, ({},), {}),
    (
        "err_reserved",
        t.put_structured_object,
        (sos.StructuredObjectPayload({sos.STRUCTURED_FIELD_SPECS_KEY: 1}, {}),),
        {},
    ),
    ("err_layout", t.put_structured_object, (sos.StructuredObjectPayload({"layout": 3}, {}),), {}),
    ("err_json", t.put_structured_object, (sos.StructuredObjectPayload({"x": object()}, {}),), {}),
    ("err_none_selected", t.materialize, (t.read_spec(r2).select_members([]),), {}),
    ("err_unknown", t.materialize, (t.read_spec(r2).select_members(["nope"]),), {}),
    (
        "err_slice_bytes",
        t.materialize,
        (t.read_spec(r2).select_members(["raw"]).slice_member("raw", 0, 0, 1),),
        {},
    ),
    (
        "err_slice_axis",
        t.materialize,
        (t.read_spec(r2).select_members(["arr"]).slice_member("arr", 1, 0, 1),),
        {},
    ),
    (
        "err_step",
        t.materialize,
        (t.read_spec(r2).select_members(["t"]).slice_member("t", 0, 0, 4, 2),),
        {},
    ),
    (
        "err_dest_shape",
        t.materialize_into,
        (t.read_spec(r2).select_members(["arr"]), {"arr": np.zeros(3)}),
        {},
    ),
    (
        "err_dest_type",
        t.materialize_into,
        (t.read_spec(r2).select_members(["arr"]), {"arr": b"x"}),
        {},
    ),
    (
        "err_dest_tensor",
        t.materialize_into,
        (t.read_spec(r2).select_members(["t"]), {"t": dest}),
        {},
    ),
    ("err_missing_manifest", t.get_object, ({"manifest_key": "pfx/default/none/manifest"},), {}),
    ("err_no_key", t.get_object, ({},), {}),
    ("err_bad_manifest", t.get_object, ({"manifest": {"version": 2}},), {}),
    ("err_key_prefix", sos.MooncakeBundleTransfer, (store,), {"key_prefix": "//"}),
    ("err_export", sos.export_dataproto_ref, (1,), {}),
    (
        "err_import",
        sos.import_dataproto_ref,
        ({"type": "mooncake_dataproto_ref", "version": 9},),
        {},
    ),
    (
        "err_import_kind",
        sos.import_dataproto_ref,
        ({"type": "mooncake_dataproto_ref", "version": 1},),
        {},
    ),
    (
        "err_import_stage",
        sos.import_dataproto_ref,
        (
            {
                "type": "mooncake_dataproto_ref",
                "version": 1,
                "kind": "bundle_stages",
                "stage_refs": {"s": {}},
                "field_index": {},
            },
        ),
        {},
    ),
    ("remove_missing", t.remove_bundle, ({"manifest_key": "pfx/default/gone/manifest"},), {}),
    ("is_handle", sos.is_dataproto_ref_handle, ({"type": "mooncake_dataproto_ref"},), {}),
]:
    call(label, fn, *args, **kw)
call("remove_bundle", t.remove_bundle, r)
out["after_remove"] = sorted(k for k in written if store.is_exist(k) == 1)
# DataProto paths (dense fields)
batch = {"x": torch.arange(8.0).reshape(4, 2), "y": np.arange(4, dtype=np.int32), "lr": 0.5}
d = call("put_dict", t.put, batch, type="dict", namespace="ns", stage="s1")
if d is not None:
    out["handle"] = sos.export_dataproto_ref(d)
    call("get_dict", t.get, d, type="dict")
    call("get_rows", t.get, out["handle"], type="dict", rows=slice(1, 4, 2))
    call("get_indices", t.get, d, type="dict", rows=[3, 0])
    call("get_fields", t.get_dataproto, d, fields=["y"], meta_info_keys=[])
    call("view", t.dataproto_manifest_view, d)
    d2 = call(
        "append_same", t.append_dataproto_fields, d, {"batch": {"z": torch.ones(4, 3)}}, stage="s1"
    )
    d3 = call(
        "append_new", t.append_dataproto_fields, d2, {"batch": {"w": torch.zeros(4)}}, stage="s2"
    )
    if d3 is not None:
        out["handle3"] = sos.export_dataproto_ref(d3)
        call("get_after_append", t.get_dataproto, d3)
        call("err_dup", t.append_dataproto_fields, d3, {"batch": {"w": torch.zeros(4)}}, stage="s2")
        call(
            "err_size", t.append_dataproto_fields, d3, {"batch": {"v": torch.zeros(5)}}, stage="s2"
        )
        call("cleanup_append", t.cleanup_dataproto_append, d2, d3)
        call("get_previous", t.get_dataproto, d2)
        call("cleanup", t.cleanup_dataproto, d2)
    call("err_type", t.put, batch, type="list")
    call("err_rows", t.get, d, rows=[9])
    call("err_fields", t.get, d, fields=["nope"])
    call("err_both", t.get, d, fields=["x"], batch_fields=["x"])


class Box:
    """A ``data_cls`` with ``from_dict`` (as verl's DataProto has)."""

    @staticmethod
    def from_dict(batch: Any, non_tensor: Any, meta_info: Any) -> dict[str, Any]:
        return {"b": batch, "n": non_tensor, "m": meta_info}


holder = SimpleNamespace(
    batch={"a": torch.arange(6).reshape(3, 2)},
    non_tensor_batch={"b": np.arange(3.0)},
    meta_info={"k": "v"},
)
d4 = call("put_attrs", t.put_dataproto, holder, stage="s", partition="q")
if d4 is not None:
    call("get_cls", t.get_dataproto, d4, data_cls=Box)
    call("get_member_slice", t.get, d4, rows=sos.StructuredMemberSlice(0, 0, 3, 2))
    new = {"batch": {"a": torch.ones(3, 2)}, "non_tensor_batch": {"b": np.zeros(3)}}
    d5 = call("overwrite", t.append_dataproto_fields, d4, new, stage="s", overwrite=True)
    call(
        "err_dangling",
        t.append_dataproto_fields,
        d4,
        {"batch": {"a": torch.ones(3, 2)}},
        stage="s",
        overwrite=True,
    )
    if d5 is not None:
        call("get_overwritten", t.get, d5)
        call("release", lambda: t.release_result(t.get(d5)))
        call("cleanup5", t.cleanup_dataproto, d5)
meta_schema = {"lst": sos.FieldSchema("auto", metadata={"section": "meta_info"})}
d6 = call(
    "schema_meta",
    t.put,
    {"a": torch.zeros(2), "lst": [1, 2]},
    type="dict",
    field_schemas=meta_schema,
)
if d6 is not None:
    out["schema_meta_handle"] = sos.export_dataproto_ref(d6)
    call("cleanup6", t.cleanup_dataproto, out["schema_meta_handle"])
d7 = call("put_empty", t.put, {}, type="dict")
if d7 is not None:
    out["empty_handle"] = sos.export_dataproto_ref(d7)
wrong_section = {"a": sos.FieldSchema("auto", metadata={"section": "meta_info"})}
call("err_schema_section", t.put, {"batch": {"a": torch.zeros(2)}}, field_schemas=wrong_section)
bad_section = {"a": sos.FieldSchema("auto", metadata={"section": "x"})}
call("err_bad_section", t.put, {"a": torch.zeros(2)}, type="dict", field_schemas=bad_section)
call("err_ambiguous", t.put, {"a": torch.zeros(2), "b": np.zeros(3)}, type="dict")
call("err_not_mapping", t.put, [1, 2], type="dict")
raw = (ctypes.c_uint8 * 96)()
rd = call("raw_dest", sos.raw_destination, ctypes.addressof(raw), 96, owner=raw)
if rd is not None:
    call(
        "raw_into",
        lambda: t.materialize_into(t.read_spec(r2).select_members(["arr"]), {"arr": rd}).objects,
    )
    out["raw_after"] = sha(bytes(raw))


def stored(prefix: str) -> dict[str, Any]:
    """The stored keys under ``prefix``: manifests and meta in full, the rest by sha256."""
    found = {}
    for key in sorted(k for k in written if k.startswith(prefix) and store.is_exist(k) == 1):
        data = bytes(store.get(key))
        text = key.endswith("/manifest") or key.endswith("/meta")
        found[key] = data.decode() if text else sha(data)
    return found


# object-dtype columns: codec inference (one codec per column, or per leaf of the
# expanded dict / list structure when a leaf holds arrays, tensors or bytes)
columns: dict[str, Any] = {
    "x": ints[:4],
    "names": ["a", "b\u00e9", None, ""],
    "info": [{"k": 1, "s": "x"}, {"k": 2}, None, {"s": "y", "l": [1, 2]}],
    "seq": [[1, 2], [3], [], None],
    "arr": [np.arange(3.0), np.arange(4.0), None, np.arange(1.0)],
    "grid": [
        np.ones((2, 3), np.int32),
        np.zeros((1, 3), np.int32),
        None,
        np.ones((0, 3), np.int32),
    ],
    "same": [np.arange(2, dtype=np.int16) + i for i in range(4)],
    "nested": [{"ids": np.arange(2), "t": "a"}, {"ids": np.arange(3)}, None, {"t": "c"}],
    "blob": [b"ab", None, b"", bytearray(b"xyz")],
    "num": [1, 2.5, None, True],
    "flags": [True, False, True, None],
    "tens": [torch.arange(3.0), torch.ones(2, 2), None, torch.zeros(1)],
    "media": [[b"a", b"bc"], [], None, [b"d"]],
    "lists": [[{"a": 1}], [{"a": 2}, {"b": np.arange(2)}], None, []],
    "mixed": [np.arange(2), np.array(3.0), None, np.arange(6).reshape(2, 3)],
}
out["obj_in"] = describe(columns)
obj = call("obj_put", t.put, columns, type="dict", partition="objp", stage="o1")
if obj is not None:
    out["obj_handle"] = sos.export_dataproto_ref(obj)
    call("obj_get", t.get, obj, type="dict")
    call("obj_get_dp", t.get_dataproto, obj)
    call("obj_rows", t.get, obj, type="dict", rows=slice(1, 4, 2))
    call("obj_member_rows", t.get, obj, rows=sos.StructuredMemberSlice(0, -3, 4, 1))
    call("obj_idx", t.get, obj, non_tensor_fields=["names", "nested", "tens"], rows=[3, 0])
    call("obj_fields", t.get_dataproto, obj, non_tensor_fields=["info", "media"])
    call("obj_view", t.dataproto_manifest_view, obj)
    call("obj_import", t.get, sos.import_dataproto_ref(out["obj_handle"]), fields=["lists"])
    arr2 = np.empty(4, dtype=object)
    arr2[:] = columns["arr"]
    more = {"non_tensor_batch": {"tags": np.array(list("pqrs"), dtype=object), "arr2": arr2}}
    obj2 = call("obj_append", t.append_dataproto_fields, obj, more, stage="o1")
    if obj2 is not None:
        call("obj_get_appended", t.get_dataproto, obj2, non_tensor_fields=["tags", "arr2", "seq"])
        out["obj_objects"] = stored("pfx/objp/")
        call("obj_cleanup_append", t.cleanup_dataproto_append, obj, obj2)
    call("obj_cleanup", t.cleanup_dataproto, obj)
# FieldSchema codecs (no inference), and the auto fallbacks
schemas = {
    "m": sos.FieldSchema("msgpack_ragged"),
    "j": sos.FieldSchema("json_ragged"),
    "u": sos.FieldSchema("utf8_ragged"),
    "tr": sos.FieldSchema("typed_ragged", metadata={"dtype": "float32"}),
    "nd": sos.FieldSchema("ndarray", metadata={"dtype": "int32"}),
    "nd_auto": sos.FieldSchema("ndarray"),
    "auto": sos.FieldSchema("auto", nullable=False),
    "rtd": sos.FieldSchema("ragged_tensor_dict", metadata={"keys": ["a", "b"]}),
    "rt": sos.FieldSchema("ragged_tensor"),
    "by": sos.FieldSchema("bytes_ragged"),
}
schema_cols: dict[str, Any] = {
    "m": [{"a": [1, 2]}, None, "s"],
    "j": [{"a": 1.5}, [1, None], None],
    "u": ["x", None, "yz"],
    "tr": [[1, 2], [3], None],
    "nd": [1, None, 3],
    "nd_auto": [{"v": np.arange(2)}, {"v": np.arange(1)}, {"w": "z"}],
    "auto": np.array(["a", "b", "c"], dtype=object),
    "rtd": [{"a": torch.ones(2)}, None, {"a": torch.zeros(1), "b": torch.arange(3.0)}],
    "rt": [torch.ones(2, dtype=torch.int64), None, np.arange(3)],
    "by": [b"1", b"", None],
}
sd = call(
    "schema_put",
    t.put_dataproto,
    {"batch": {"x": torch.zeros(3)}, "non_tensor_batch": schema_cols},
    field_schemas=schemas,
    partition="schp",
)
if sd is not None:
    out["schema_handle"] = sos.export_dataproto_ref(sd)
    out["schema_objects"] = stored("pfx/schp/")
    call("schema_get", t.get_dataproto, sd)
    call("schema_rows", t.get, sd, rows=[2, 1])
    call("schema_cleanup", t.cleanup_dataproto, sd)
base = {"batch": {"x": torch.zeros(2)}}
for label, col, schema in [
    ("err_s_codec", ["a", "b"], sos.FieldSchema("zzz")),
    ("err_s_null", ["a", None], sos.FieldSchema("utf8_ragged", nullable=False)),
    ("err_s_auto_null", ["a", None], sos.FieldSchema("auto", nullable=False)),
    ("err_s_keys", [{"a": torch.ones(1), "c": torch.ones(1)}, None], schemas["rtd"]),
    ("err_s_key_none", [{"a": None}, None], schemas["rtd"]),
    ("err_s_dtype", [1, 2], sos.FieldSchema("ndarray", metadata={"dtype": "U3"})),
    ("err_s_msgpack", [np.int64(1), 2], sos.FieldSchema("msgpack_ragged")),
    ("err_s_bf16", [torch.ones(1, dtype=torch.bfloat16), None], sos.FieldSchema("ragged_tensor")),
    ("err_s_value", 5, sos.FieldSchema("utf8_ragged")),
]:
    call(
        label,
        t.put_dataproto,
        {**base, "non_tensor_batch": {"c": col}},
        field_schemas={"c": schema},
    )
for label, col in [
    ("err_obj_null", [None, None]),
    ("err_obj_mixed", [1, "a"]),
    ("err_obj_tuple", [{"a": (1, 2)}, {"a": (3,)}]),
    ("err_obj_objarr", [np.array(["a"], dtype=object), np.array(["b"], dtype=object)]),
]:
    call(label, t.put, {"x": ints[:2], "c": col}, type="dict")


def image(mode: str, size: tuple[int, int], seed: int) -> Any:
    """An image of ``mode`` with random pixels (any mode: its raw bytes are random)."""
    assert Image is not None
    nbytes = len(Image.new(mode, size).tobytes())
    return Image.frombytes(mode, size, np.random.default_rng(seed).bytes(nbytes))


def image_cases() -> None:
    """PIL images in object columns: ``media_bytes`` (all rows images) and
    ``media_list_ragged`` (lists of images and bytes), inferred and by FieldSchema, in
    many modes and odd sizes; whole reads, row slices, field selections; wrong types."""
    assert Image is not None
    import io

    pal = image("P", (5, 3), 3)
    pal.putpalette([(i * 37) % 256 for i in range(48)])
    png_buf = io.BytesIO()
    image("RGB", (4, 4), 4).save(png_buf, "PNG")
    png = Image.open(io.BytesIO(png_buf.getvalue()))  # lazy, format "PNG"
    ro = Image.frombuffer("L", (3, 2), b"abcdef", "raw", "L", 0, 1)  # readonly
    cols: dict[str, Any] = {
        "x": ints[:4],
        "rgb": [image("RGB", (7, 5), 1), None, image("RGBA", (1, 1), 2), image("L", (13, 3), 5)],
        "modes": [pal, image("I;16", (3, 3), 6), image("F", (2, 2), 7), image("1", (9, 2), 8)],
        "more": [png, ro, image("CMYK", (2, 3), 9), image("I", (2, 1), 10)],
        "odd": [
            Image.new("RGB", (0, 0)),
            image("LA", (1, 7), 11),
            None,
            image("YCbCr", (3, 1), 12),
        ],
        "mlist": [[image("RGB", (2, 2), 13), b"raw"], [], None, [pal, bytearray(b"x"), ro]],
        "empties": [[], [], None, []],
        "pics": [{"p": image("L", (2, 2), 14), "t": "a"}, {"p": pal}, None, {"t": "c"}],
    }
    out["img_in"] = describe(cols)
    img = call("img_put", t.put, cols, type="dict", partition="imgp", stage="i1")
    if img is not None:
        out["img_handle"] = sos.export_dataproto_ref(img)
        out["img_objects"] = stored("pfx/imgp/")
        call("img_get", t.get, img, type="dict")
        call("img_rows", t.get, img, type="dict", rows=slice(1, 4))
        call("img_fields", t.get_dataproto, img, non_tensor_fields=["mlist", "modes"])
        call("img_member_rows", t.get, img, rows=sos.StructuredMemberSlice(0, 1, 3, 1))
        call("img_cleanup", t.cleanup_dataproto, img)
    schemas = {
        "mb": sos.FieldSchema("media_bytes"),
        "ml": sos.FieldSchema("media_list_ragged"),
        "by": sos.FieldSchema("bytes_ragged"),
    }
    schema_cols = {
        "mb": [image("RGB", (3, 2), 15), b"raw", None],
        "ml": [(image("L", (1, 1), 16),), None, [b"a", np.arange(2, dtype=np.uint8)]],
        "by": [image("RGB", (2, 1), 17), None, b"z"],
    }
    out["img_schema_in"] = describe(schema_cols)
    sd = call(
        "img_schema_put",
        t.put_dataproto,
        {"batch": {"x": torch.zeros(3)}, "non_tensor_batch": schema_cols},
        field_schemas=schemas,
        partition="imgs",
    )
    if sd is not None:
        out["img_schema_handle"] = sos.export_dataproto_ref(sd)
        out["img_schema_objects"] = stored("pfx/imgs/")
        call("img_schema_get", t.get_dataproto, sd)
        call("img_schema_cleanup", t.cleanup_dataproto, sd)
    base = {"batch": {"x": torch.zeros(2)}}
    one = image("RGB", (2, 2), 18)
    for label, col, schema in [
        ("err_img_str", ["abc", None], sos.FieldSchema("media_bytes")),
        ("img_int", [3, None], sos.FieldSchema("media_bytes")),
        ("err_img_list_int", [5, None], sos.FieldSchema("media_list_ragged")),
        ("err_img_list_str", ["ab", None], sos.FieldSchema("media_list_ragged")),
        ("img_list_int_item", [[one, 3], None], sos.FieldSchema("media_list_ragged")),
    ]:
        r = call(
            label,
            t.put_dataproto,
            {**base, "non_tensor_batch": {"c": col}},
            field_schemas={"c": schema},
            partition="imge",
        )
        if r is not None:
            call(label + "_get", t.get_dataproto, r)
            call(label + "_cleanup", t.cleanup_dataproto, r)
    for label, col in [
        ("err_img_int", [one, 5]),
        ("err_img_str_mix", [one, "a"]),
        ("err_img_list_mix", [[one, 3], [b"a"]]),
        ("err_img_arr", [one, np.zeros((2, 2), np.uint8)]),
    ]:
        r = call(label, t.put, {"x": ints[:2], "c": col}, type="dict", partition="imge")
        if r is not None:
            call(label + "_get", t.get, r, type="dict")
            call(label + "_cleanup", t.cleanup_dataproto, r)


out["pil"] = Image is not None
if Image is not None:
    image_cases()


def inferred(values: list[Any]) -> Any:
    leaves: list[Any] = []
    nodes: list[Any] = []
    sos.infer_structure("root", values, leaves, nodes)
    return {
        "leaves": [
            [leaf.path, describe(leaf.values), leaf.decision.accepted, leaf.decision.codec]
            + [leaf.decision.reason, leaf.decision.normalized_type, leaf.decision.metadata]
            for leaf in leaves
        ],
        "nodes": [[n.path, n.node_type, n.children, n.lengths, n.row_mask] for n in nodes],
    }


rows_in = [{"a.b": 1, "c": [{"d": "x"}, None]}, None, {"c": [], "e": b"z"}, {"a.b": 2.5}]
call("infer", inferred, rows_in)
call("infer_flat", inferred, [[1, 2], [3.5]])
call("infer_deep", inferred, [{"a": [[[1]]]}])
call("infer_missing", repr, sos.MISSING)
too_deep: Any = "leaf"
for _ in range(40):
    too_deep = {"k": too_deep}
call("err_infer_depth", inferred, [too_deep])
out["left"] = sorted(k for k in written if store.is_exist(k) == 1)
keys = sorted(written)
objects = {}
for key in keys:
    data = store.get(key)
    if key.endswith("/manifest") or key.endswith("/meta"):
        objects[key] = bytes(data).decode()
    elif data:
        objects[key] = sha(data)
groups = {k: v for k, v in sorted(store.groups.items()) if v}
# the image cases' keys apart (compared only where both sides have Pillow)
image_key = ("pfx/imgp/", "pfx/imgs/", "pfx/imge/")
out["objects"] = {k: v for k, v in objects.items() if not k.startswith(image_key)}
out["groups"] = {k: v for k, v in groups.items() if not k.startswith(image_key)}
out["img_all_objects"] = {k: v for k, v in objects.items() if k.startswith(image_key)}
out["img_all_groups"] = {k: v for k, v in groups.items() if k.startswith(image_key)}
if master is not None:
    # the whole store: tensor members go through its put_tensor / get_tensor, as the
    # published module does on a store that has them
    whole = sos.MooncakeBundleTransfer(full, key_prefix="whole")
    r4 = call("whole_put", whole.put_object, {"t": tensor, "h": half, "arr": arr})
    if r4 is not None:
        out["whole_specs"] = {n: sorted(p) for n, p in r4.manifest["buffers"].items()}
        out["whole_t"] = sha(full.get(r4.manifest["buffers"]["t"]["key"]))
    call("whole_get", whole.get_object, r4)
    full.close()
    master.shutdown()
sys.stdout.write(json.dumps(out, sort_keys=True, default=str) + "\n")
