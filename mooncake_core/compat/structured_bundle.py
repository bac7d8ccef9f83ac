"""Bundles over any :class:`BundleStore`: the published manifest layout, read and written.

A bundle is one metadata payload plus named buffers. Each payload is cut into chunks of at
most ``chunk_bytes``; a payload of one chunk is stored under its own key, more chunks under
``<key>/chunk/<i>``. The manifest, a compact JSON object, is stored last::

    <prefix>/<partition>/<hex uuid>/meta[/chunk/<i>]
    <prefix>/<partition>/<hex uuid>/buffer/<name>[/chunk/<i>]
    <prefix>/<partition>/<hex uuid>/manifest
      {"version":1,"layout":"bundle","object_id":"<partition>/<hex>",
       "meta":{"key":..,"bytes":N,"chunks":[{"key":..,"bytes":n},..]},
       "buffers":{"<name>":{...same, plus "metadata_bytes" / "format" / "kind"}}}

This is what the published ``mooncake.structured_object_store`` (0.3.13) writes, so either
side reads the other's bundles from the same store bytes. We move bytes with the store's
plain ``put`` / ``get`` (and ``put_tensor`` / ``get_tensor`` for tensor members when the
store has them, as published); the published module's buffer-pool and registered-memory
fast paths change how bytes travel, not what is stored.
"""

from __future__ import annotations

import copy
import ctypes
import json
import uuid
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from mooncake_core.compat import tensor_format
from mooncake_core.compat.structured_ranges import read_ranges_into
from mooncake_core.compat.structured_types import (
    MISSING_OBJECT_ERROR,
    STRUCTURED_FIELD_SPECS_KEY,
    BundleStore,
    BundleTransferPolicy,
    RawDestination,
    RemoteBundleRef,
    TensorObjectBuffer,
)

__all__ = [
    "BundleManifests",
    "TensorPayload",
    "cleanup_keys",
    "decode_json",
    "encode_json",
    "field_specs",
    "ndarray_target",
    "patched_header",
    "select_nested_rows",
]

BundleRefLike = RemoteBundleRef | Mapping[str, Any]


class TensorPayload:
    """A torch tensor member on its way into a bundle."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


# ---------------------------------------------------------------- small helpers
def encode_json(value: Mapping[str, Any], label: str) -> bytes:
    """Compact JSON (the published separators), UTF-8."""
    try:
        return json.dumps(value, separators=(",", ":")).encode("utf-8")
    except TypeError as error:
        raise TypeError(f"{label} must be JSON-serializable") from error


def decode_json(payload: bytes, label: str) -> dict[str, Any]:
    """A JSON object from ``payload``; ValueError when it is not an object."""
    value = json.loads(payload.decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"{label} must decode to a dict")
    return value


def chunk_bytes_ok(chunk_bytes: int) -> int:
    """``chunk_bytes`` if positive, else ValueError."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    return chunk_bytes


def key_prefix_ok(key_prefix: str) -> str:
    """The prefix without surrounding slashes; ValueError when empty or with control chars."""
    prefix = key_prefix.strip("/")
    if not prefix or any(ord(c) < 32 for c in prefix):
        raise ValueError("key_prefix must be a non-empty key prefix")
    return prefix


def key_segment_ok(value: Any, name: str) -> None:
    """ValueError unless ``value`` is a non-empty string without ``/`` or control chars."""
    if not isinstance(value, str) or not value or "/" in value or any(ord(c) < 32 for c in value):
        raise ValueError(f"invalid bundle {name}: {value!r}")


def bytes_view(value: Any, name: str) -> memoryview:
    """A flat byte view of a bytes-like ``value`` (copied when not contiguous)."""
    try:
        view = memoryview(value)
    except TypeError as error:
        raise TypeError(f"{name} must be bytes-like, got {type(value).__name__}") from error
    if not view.contiguous:
        view = memoryview(bytes(view))
    return view.cast("B")


def check_status(status: Any, operation: str, key: str) -> None:
    """RuntimeError for a store status other than 0 / None."""
    if status not in (None, 0):
        raise RuntimeError(f"{operation} failed for {key}: {status}")


def policy_ok(
    policy: BundleTransferPolicy | None, max_inflight_put: int | None = None
) -> BundleTransferPolicy:
    """The policy in effect (``max_inflight_put`` overrides); ValueError for bad fields."""
    result = policy or BundleTransferPolicy()
    if max_inflight_put is not None:
        result = BundleTransferPolicy(max_inflight_put, result.put_mode, result.copy_mode)
    if result.max_inflight_put < 1:
        raise ValueError("max_inflight_put must be positive")
    if result.put_mode not in {"auto", "batch", "parallel"}:
        raise ValueError(f"unsupported put_mode: {result.put_mode}")
    if result.copy_mode not in {"auto", "zero_copy", "copy"}:
        raise ValueError(f"unsupported copy_mode: {result.copy_mode}")
    return result


# ---------------------------------------------------------------- write configs
_CONFIG_FIELDS = (
    "data_type",
    "group_ids",
    "nof_replica_num",
    "prefer_alloc_in_same_node",
    "preferred_nof_segments",
    "preferred_segment",
    "preferred_segments",
    "replica_num",
    "with_hard_pin",
    "with_soft_pin",
)
_ONE_GROUP = (
    "structured object store config.group_ids must contain exactly one logical group id;"
    " it is expanded across internal Mooncake keys"
)


def copy_config(config: Any) -> Any:
    """A shallow copy of a write config (field by field when it cannot be copied)."""
    try:
        return copy.copy(config)
    except TypeError:
        pass
    try:
        out = type(config)()
    except Exception as error:
        raise TypeError(
            "structured object store config must be copyable or default-constructible"
        ) from error
    for name in _CONFIG_FIELDS:
        if not hasattr(config, name):
            continue
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001 - an unreadable field is left at its default
            continue
        value = list(value) if isinstance(value, list) else value
        try:
            setattr(out, name, value)
        except Exception as error:
            raise TypeError(
                f"structured object store config field {name!r} is not writable"
            ) from error
    return out


def config_for_keys(config: Any, key_count: int) -> Any:
    """``config`` with its single logical group id repeated for ``key_count`` keys."""
    if config is None or key_count <= 0:
        return config
    group_ids = getattr(config, "group_ids", None)
    if group_ids is None:
        return config
    as_str = isinstance(group_ids, str)
    ids = [group_ids] if as_str else list(group_ids)
    if not ids:
        out = copy_config(config)
        out.group_ids = None
        return out
    if len(ids) != 1:
        raise ValueError(_ONE_GROUP)
    if key_count == 1 and not as_str:
        return config
    out = copy_config(config)
    out.group_ids = [ids[0]] * key_count
    return out


def config_with_group(config: Any, group_id: str, config_type: Any = None) -> Any:
    """A copy of ``config`` (or a new ``config_type()``) whose group is ``group_id``."""
    have = getattr(config_for_keys(config, 1), "group_ids", None)
    if have and have[0] and have[0] != group_id:
        raise ValueError("config.group_ids conflicts with the DataProto storage group")
    if config is None:
        out = (config_type or SimpleNamespace)()
    else:
        out = copy_config(config)
    out.group_ids = [group_id]
    return out


def _call(fn: Any, *args: Any, config: Any = None) -> Any:
    return fn(*args) if config is None else fn(*args, config=config)


def cleanup_keys(store: BundleStore, keys: Sequence[str], strict: bool) -> None:
    """Remove ``keys`` (a missing key is fine); with ``strict`` a failure raises."""
    pending = list(dict.fromkeys(keys))
    batch_remove = getattr(store, "batch_remove", None)
    if callable(batch_remove) and pending:
        try:
            try:
                results = batch_remove(pending, True)
            except TypeError:
                results = batch_remove(pending)
            if len(results) != len(pending):
                raise RuntimeError(
                    f"batch_remove returned {len(results)} results for {len(pending)} keys"
                )
            pending = [
                k
                for k, s in zip(pending, results, strict=True)
                if s not in (None, 0, MISSING_OBJECT_ERROR)
            ]
            if not pending:
                return
        except Exception:
            if strict:
                raise
    errors = []
    for key in pending:
        try:
            status = store.remove(key, True)
        except KeyError:
            continue
        except Exception:
            if strict:
                raise
            continue
        if status not in (None, 0, MISSING_OBJECT_ERROR):
            errors.append((key, status))
    if errors and strict:
        raise RuntimeError(f"failed to remove {len(errors)} Mooncake keys: {errors[:3]}")


# ---------------------------------------------------------------- the manifest store
class BundleManifests:
    """Writes and reads bundles under ``key_prefix`` in ``store``."""

    def __init__(self, store: BundleStore, key_prefix: str, default_chunk_bytes: int) -> None:
        self.store = store
        self.prefix = key_prefix
        self.default_chunk_bytes = default_chunk_bytes

    # -- writing
    def _put_chunks(self, keys: Sequence[str], chunks: Sequence[memoryview], config: Any) -> None:
        written: list[str] = []
        try:
            for key, chunk in zip(keys, chunks, strict=True):
                check_status(
                    _call(self.store.put, key, chunk, config=config_for_keys(config, 1)), "put", key
                )
                written.append(key)
        except Exception:
            cleanup_keys(self.store, written, strict=False)
            raise

    def put_payload(
        self,
        key: str,
        view: memoryview,
        chunk_bytes: int,
        policy: BundleTransferPolicy,
        config: Any = None,
    ) -> tuple[dict[str, Any], list[str]]:
        """Store ``view`` under ``key`` in chunks; (its spec, the keys written)."""
        if len(view) == 0:
            return {"key": key, "bytes": 0, "chunks": []}, []
        if policy.copy_mode == "zero_copy":
            raise RuntimeError("zero-copy put requires tensor-object buffers")
        chunks = [view[i : i + chunk_bytes] for i in range(0, len(view), chunk_bytes)]
        keys = [key if len(chunks) == 1 else f"{key}/chunk/{i}" for i in range(len(chunks))]
        self._put_chunks(keys, chunks, config)
        spec = {
            "key": key,
            "bytes": len(view),
            "chunks": [{"key": k, "bytes": len(c)} for k, c in zip(keys, chunks, strict=True)],
        }
        return spec, keys

    def put_tensor_object(
        self, key: str, value: TensorObjectBuffer, config: Any
    ) -> tuple[dict[str, Any], list[str]]:
        """A member whose tensor object bytes lie in caller memory (``put_from``)."""
        cfg = config_for_keys(config, 1)
        put_tensor_from = getattr(self.store, "put_tensor_from", None)
        put_from = getattr(self.store, "put_from", None)
        if cfg is None and callable(put_tensor_from):
            status = put_tensor_from(key, value.ptr, value.size)
        elif callable(put_from):
            status = _call(put_from, key, value.ptr, value.size, config=cfg)
        else:
            raise RuntimeError("put_from is unavailable")
        check_status(status, "put_from", key)
        return {"key": key, "bytes": value.size, "chunks": [{"key": key, "bytes": value.size}]}, [
            key
        ]

    def put_tensor(
        self, key: str, value: TensorPayload, policy: BundleTransferPolicy, config: Any
    ) -> tuple[dict[str, Any], list[str]]:
        """A torch tensor member: ``put_tensor`` when the store has it, else the tensor object
        bytes (a 0-d tensor: ``torch.save`` bytes) as a payload."""
        tensor = value.tensor
        if policy.copy_mode == "zero_copy":
            raise ValueError(
                "zero-copy structured tensor fields require a BufferPool tensor-object buffer"
            )
        if policy.copy_mode != "copy":
            put = getattr(self.store, "put_tensor" if config is None else "pub_tensor", None)
            if callable(put):
                total = tensor_format.HEADER_SIZE + int(tensor.nbytes)
                check_status(
                    _call(put, key, tensor, config=config_for_keys(config, 1)), "put_tensor", key
                )
                spec = {
                    "key": key,
                    "kind": "tensor",
                    "bytes": total,
                    "dtype": str(tensor.dtype),
                    "shape": list(tensor.shape),
                    "chunks": [{"key": key, "bytes": total}],
                    "metadata_bytes": tensor_format.HEADER_SIZE,
                }
                return spec, [key]
        if tensor.dim() == 0:
            data = torch_save_bytes(tensor)
            spec, keys = self.put_payload(key, memoryview(data), len(data) or 1, policy, config)
            spec["format"] = "torch_save"
            return spec, keys
        data = tensor_format.pack(tensor)
        spec, keys = self.put_payload(key, memoryview(data), len(data) or 1, policy, config)
        spec["metadata_bytes"] = tensor_format.HEADER_SIZE
        return spec, keys

    def put_bundle(
        self,
        meta: Any,
        buffers: Mapping[str, Any],
        partition: str,
        chunk_bytes: int | None,
        policy: BundleTransferPolicy | None,
        max_inflight_put: int | None,
        config: Any = None,
    ) -> RemoteBundleRef:
        """Store ``meta`` and ``buffers`` (bytes-like, :class:`TensorPayload` or
        :class:`TensorObjectBuffer`), then the manifest; on failure remove what was written."""
        key_segment_ok(partition, "partition")
        meta_view = bytes_view(meta, "meta")
        size = chunk_bytes_ok(self.default_chunk_bytes if chunk_bytes is None else chunk_bytes)
        pol = policy_ok(policy, max_inflight_put)
        object_id = f"{partition}/{uuid.uuid4().hex}"
        base = f"{self.prefix}/{object_id}"
        written: list[str] = []
        specs: dict[str, Any] = {}
        try:
            meta_spec, keys = self.put_payload(f"{base}/meta", meta_view, size, pol, config)
            written += keys
            for name, value in buffers.items():
                key_segment_ok(name, "buffer name")
                key = f"{base}/buffer/{name}"
                if isinstance(value, TensorObjectBuffer):
                    spec, keys = self.put_tensor_object(key, value, config)
                elif isinstance(value, TensorPayload):
                    spec, keys = self.put_tensor(key, value, pol, config)
                else:
                    spec, keys = self.put_payload(key, bytes_view(value, name), size, pol, config)
                specs[name] = spec
                written += keys
            manifest = {
                "version": 1,
                "layout": "bundle",
                "object_id": object_id,
                "meta": meta_spec,
                "buffers": specs,
            }
            key = self._put_manifest(base, manifest, config)
            written.append(key)
        except Exception:
            cleanup_keys(self.store, written, strict=False)
            raise
        return RemoteBundleRef(manifest_key=key, manifest=manifest)

    def _put_manifest(self, base: str, manifest: Mapping[str, Any], config: Any) -> str:
        """Store a bundle's manifest JSON at ``{base}/manifest``; its key."""
        key = f"{base}/manifest"
        blob = encode_json(manifest, "bundle manifest")
        check_status(
            _call(self.store.put, key, blob, config=config_for_keys(config, 1)), "put", key
        )
        return key

    def put_merged_manifest(
        self,
        meta: bytes,
        buffers: Mapping[str, Any],
        *,
        partition: str,
        chunk_bytes: int | None,
        policy: BundleTransferPolicy | None,
        cleanup: Sequence[str] = (),
        config: Any = None,
    ) -> RemoteBundleRef:
        """A new manifest (and meta) over buffers already stored by other bundles."""
        key_segment_ok(partition, "partition")
        meta_view = bytes_view(meta, "meta")
        size = chunk_bytes_ok(self.default_chunk_bytes if chunk_bytes is None else chunk_bytes)
        pol = policy_ok(policy)
        object_id = f"{partition}/{uuid.uuid4().hex}"
        base = f"{self.prefix}/{object_id}"
        written: list[str] = []
        try:
            meta_spec, keys = self.put_payload(f"{base}/meta", meta_view, size, pol, config)
            written += keys
            cleanup_list = list(dict.fromkeys(cleanup))
            ids = {self.object_id_of(str(s["key"])) for s in buffers.values()}
            ids.update(self.object_id_of(k) for k in cleanup_list)
            manifest: dict[str, Any] = {
                "version": 1,
                "layout": "bundle",
                "object_id": object_id,
                "meta": meta_spec,
                "buffers": dict(buffers),
                "buffer_object_ids": sorted(i for i in ids if i),
            }
            if cleanup_list:
                manifest["cleanup_keys"] = cleanup_list
            self.validate(manifest)
            key = self._put_manifest(base, manifest, config)
            written.append(key)
        except Exception:
            cleanup_keys(self.store, written, strict=False)
            raise
        return RemoteBundleRef(manifest_key=key, manifest=manifest)

    # -- removing
    def remove_bundle(self, ref: BundleRefLike) -> None:
        """Remove a bundle's chunks and manifest; a bundle already gone is fine."""
        key = ref.manifest_key if isinstance(ref, RemoteBundleRef) else ref.get("manifest_key")
        embedded = ref.manifest if isinstance(ref, RemoteBundleRef) else ref.get("manifest")
        is_exist = getattr(self.store, "is_exist", None)
        if not embedded and isinstance(key, str) and callable(is_exist):
            status = is_exist(key)
            if status == 0:
                return
            if status != 1:
                raise RuntimeError(f"is_exist failed for {key}: {status}")
        try:
            manifest = self.resolve(ref)
        except Exception:
            if isinstance(key, str) and callable(is_exist) and is_exist(key) == 0:
                return
            raise
        keys = self.payload_keys_of(manifest)
        keys.extend(manifest.get("cleanup_keys", []))
        cleanup_keys(self.store, keys, strict=True)
        cleanup_keys(self.store, [self.manifest_key(ref, manifest)], strict=True)

    # -- reading
    def resolve(self, ref: BundleRefLike) -> dict[str, Any]:
        """The manifest of ``ref`` (read from the store unless embedded), validated."""
        manifest: Any
        if isinstance(ref, RemoteBundleRef):
            manifest = ref.manifest or decode_json(
                self.store.get(ref.manifest_key), "bundle manifest"
            )
        else:
            manifest = ref.get("manifest")
            if manifest is None:
                key = ref.get("manifest_key")
                if not isinstance(key, str):
                    raise ValueError("bundle ref must include manifest_key")
                manifest = decode_json(self.store.get(key), "bundle manifest")
        self.validate(manifest)
        return dict(manifest)

    def manifest_key(self, ref: BundleRefLike, manifest: Mapping[str, Any] | None = None) -> str:
        """The manifest key, checked against the manifest's object id."""
        manifest = self.resolve(ref) if manifest is None else manifest
        expected = f"{self.prefix}/{manifest['object_id']}/manifest"
        key = ref.manifest_key if isinstance(ref, RemoteBundleRef) else ref.get("manifest_key")
        if key is None:
            return expected
        if key != expected:
            raise ValueError("bundle manifest_key does not match manifest object_id")
        return str(key)

    def read_range_into(self, spec: Mapping[str, Any], dest: Any, offset: int, length: int) -> None:
        """Copy bytes ``[offset, offset+length)`` of a payload into the writable ``dest``."""
        self.read_ranges_into(spec, dest, [(offset, 0, length)])

    def read_ranges_into(
        self, spec: Mapping[str, Any], dest: Any, ranges: Sequence[tuple[int, int, int]]
    ) -> None:
        """Copy ``(offset in the payload, offset in dest, length)`` ranges of a payload into
        the writable ``dest``, moving only their bytes where the store reads ranges
        (:func:`structured_ranges.read_ranges_into`)."""
        read_ranges_into(self.store, spec["chunks"], dest, ranges)

    def read_payload(self, spec: Mapping[str, Any]) -> bytes:
        """A whole payload."""
        return self.read_range(spec, 0, int(spec["bytes"]))

    def read_range(self, spec: Mapping[str, Any], offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset+length)`` of a payload."""
        if length == 0:
            return b""
        out = bytearray(length)
        self.read_range_into(spec, out, offset, length)
        return bytes(out)

    def read_range_to_address(
        self, spec: Mapping[str, Any], ptr: int, offset: int, length: int
    ) -> None:
        """Bytes ``[offset, offset+length)`` of a payload copied to memory at ``ptr``."""
        if length:
            ctypes.memmove(ptr, self.read_range(spec, offset, length), length)

    # -- validation
    def object_id_of(self, key: str) -> str | None:
        """The ``<partition>/<hex>`` part of a key of this prefix, or None."""
        head = f"{self.prefix}/"
        if not key.startswith(head):
            return None
        rest = key[len(head) :]
        for tail in ("/manifest", "/meta"):
            if rest.endswith(tail):
                return rest[: -len(tail)]
        for marker in ("/meta/", "/buffer/"):
            at = rest.find(marker)
            if at > 0:
                return rest[:at]
        return None

    @staticmethod
    def payload_keys(spec: Mapping[str, Any]) -> list[str]:
        """The chunk keys of one payload."""
        return [c["key"] for c in spec["chunks"]]

    def payload_keys_of(self, manifest: Mapping[str, Any]) -> list[str]:
        """Every chunk key of a manifest (meta first)."""
        specs = [manifest["meta"], *manifest["buffers"].values()]
        return [c["key"] for spec in specs for c in spec["chunks"]]

    def validate(self, manifest: Mapping[str, Any]) -> None:
        """ValueError unless ``manifest`` is a bundle manifest whose keys stay inside it."""
        if manifest.get("version") != 1 or manifest.get("layout") != "bundle":
            raise ValueError("invalid bundle manifest")
        object_id = manifest.get("object_id")
        if not isinstance(object_id, str):
            raise ValueError("bundle manifest object_id must be a string")
        ids = manifest.get("buffer_object_ids", [object_id])
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ValueError("bundle manifest buffer_object_ids must be a list of strings")
        bases = [f"{self.prefix}/{i}" for i in ids]
        self._validate_spec(manifest.get("meta"), [f"{self.prefix}/{object_id}"])
        cleanup = manifest.get("cleanup_keys", [])
        if not isinstance(cleanup, list) or not all(
            isinstance(k, str) and any(k == f"{b}/manifest" or k.startswith(f"{b}/") for b in bases)
            for k in cleanup
        ):
            raise ValueError("bundle manifest cleanup_keys are outside the bundle namespace")
        buffers = manifest.get("buffers")
        if not isinstance(buffers, dict):
            raise ValueError("bundle manifest buffers must be a dict")
        for name, spec in buffers.items():
            key_segment_ok(name, "buffer name")
            self._validate_spec(spec, bases)

    @staticmethod
    def _validate_spec(spec: Any, bases: Sequence[str]) -> None:
        if not isinstance(spec, dict):
            raise ValueError("bundle payload spec must be a dict")
        key = spec.get("key")
        if not isinstance(key, str) or not any(key.startswith(f"{b}/") for b in bases):
            raise ValueError("bundle payload key is outside the bundle namespace")
        expected = int(spec.get("bytes", -1))
        if expected < 0:
            raise ValueError("bundle payload bytes must be non-negative")
        chunks = spec.get("chunks")
        if not isinstance(chunks, list) or (expected and not chunks):
            raise ValueError("bundle payload chunks are invalid")
        seen: set[str] = set()
        total = 0
        for chunk in chunks:
            if not isinstance(chunk, dict):
                raise ValueError("bundle chunk must be a dict")
            ckey, size = chunk.get("key"), int(chunk.get("bytes", -1))
            if not isinstance(ckey, str) or (ckey != key and not ckey.startswith(f"{key}/")):
                raise ValueError("bundle chunk key is outside the payload namespace")
            if ckey in seen:
                raise ValueError("bundle chunk keys must be unique")
            if size < 0:
                raise ValueError("bundle chunk bytes must be non-negative")
            seen.add(ckey)
            total += size
        if total != expected:
            raise ValueError(f"bundle payload chunks total {total} bytes, expected {expected}")


def torch_save_bytes(value: Any) -> bytes:
    """``torch.save`` of ``value`` as bytes."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def torch_load_bytes(payload: bytes) -> Any:
    """The object ``torch.save`` wrote (weights only)."""
    import io

    import torch

    return torch.load(io.BytesIO(payload), weights_only=True)


# ---------------------------------------------------------------- member helpers
def _torch_module() -> Any:
    import torch

    return torch


def field_specs(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The member specs of structured metadata."""
    specs = metadata.get(STRUCTURED_FIELD_SPECS_KEY, {})
    if not isinstance(specs, dict):
        raise ValueError("structured field specs must be a dict")
    return specs


def nbytes_of(shape: tuple[int, ...], dtype: np.dtype[Any]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize


def ndarray_target(
    name: str, dest: Any, dtype: np.dtype[Any], shape: tuple[int, ...]
) -> np.ndarray:
    if dest is None:
        return np.empty(shape, dtype=dtype)
    if isinstance(dest, RawDestination):
        n = nbytes_of(shape, dtype) if shape else int(np.prod(shape)) * dtype.itemsize
        if dest.size < n:
            raise ValueError(f"raw destination has {dest.size} bytes, expected at least {n}")
        raw = (ctypes.c_uint8 * n).from_address(dest.ptr)
        return np.ctypeslib.as_array(raw).view(dtype).reshape(shape)
    where = f"structured ndarray field {name} destination"
    if not isinstance(dest, np.ndarray):
        raise TypeError(f"{where} must be a numpy.ndarray or raw_destination")
    if dest.dtype != dtype:
        raise ValueError(f"{where} dtype mismatch: expected {dtype.str}, got {dest.dtype.str}")
    if tuple(dest.shape) != shape:
        raise ValueError(f"{where} shape mismatch: expected {shape}, got {tuple(dest.shape)}")
    if not dest.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{where} must be C-contiguous")
    if not dest.flags["WRITEABLE"]:
        raise ValueError(f"{where} must be writeable")
    return dest


def select_nested_rows(value: Any, indices: Sequence[int]) -> Any:
    """Rows ``indices`` of a jagged nested tensor, as a nested tensor."""
    torch = _torch_module()
    rows = value.unbind()
    chosen = [rows[int(i)] for i in indices]
    if chosen:
        out = torch.nested.as_nested_tensor(chosen, layout=value.layout)
    else:
        offsets = torch.zeros(1, dtype=value.offsets().dtype, device=value.offsets().device)
        out = torch.nested.nested_tensor_from_jagged(value.values()[:0], offsets=offsets)
    if hasattr(value, "_ragged_idx"):
        out._ragged_idx = value._ragged_idx
    return out


def patched_header(head: bytes, shape: Sequence[int], data_bytes: int) -> bytes:
    out = bytearray(head)
    ctypes.c_uint64.from_buffer(out, 32).value = int(data_bytes)
    for i, dim in enumerate(shape):
        ctypes.c_int64.from_buffer(out, 40 + i * 8).value = int(dim)
        ctypes.c_int64.from_buffer(out, 104 + i * 8).value = int(dim)
    return bytes(out)
