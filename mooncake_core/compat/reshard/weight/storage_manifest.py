"""Weights persisted in the store: :class:`StoredFragment` (a tensor box at a byte range
of a payload object) and :class:`WeightManifest` (a group's tensors and fragments, its
canonical JSON and digest), with the published JSON schema and checks."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from math import prod
from typing import Any

from mooncake_core.compat.reshard.contracts import (
    ResourceId,
    ResourceKind,
    RevisionId,
    StoredFragmentId,
    TensorId,
)
from mooncake_core.compat.reshard.weight.placement import axis_wire
from mooncake_core.compat.reshard.weight.serde import _list, _read_axis
from mooncake_core.compat.reshard.weight.types import (
    TensorDescriptor,
    _aliases,
    check_int,
    check_ints,
    check_text,
    check_u64,
    require_manifest_items,
    validate_fragment_geometry,
)

__all__ = [
    "StoredFragment",
    "StoredManifestIdentity",
    "WeightManifest",
    "validate_weight_manifest_snapshot",
]

_MANIFEST_FIELDS = frozenset(
    {
        "resource_kind",
        "namespace",
        "resource_id",
        "revision",
        "weight_generation",
        "group_id",
        "manifest_key",
        "tensors",
        "fragments",
        "created_at",
    }
)
_TENSOR_FIELDS = frozenset(
    {
        "tensor_id",
        "global_shape",
        "dtype",
        "itemsize",
        "layer_id",
        "expert_id",
        "layout_fingerprint",
        "shard_dims",
        "parallel_axes",
    }
)
_FRAGMENT_FIELDS = frozenset(
    {
        "fragment_id",
        "tensor_id",
        "global_offset",
        "local_shape",
        "object_key",
        "object_offset",
        "nbytes",
        "aliases",
    }
)


@dataclass(frozen=True)
class StoredManifestIdentity:
    """Where a committed manifest is, and the sha256 of its canonical JSON."""

    namespace: str
    resource_id: ResourceId
    revision: RevisionId
    weight_generation: int
    group_id: str
    manifest_key: str
    content_sha256: str

    def __post_init__(self) -> None:
        for name in (
            "namespace",
            "resource_id",
            "revision",
            "group_id",
            "manifest_key",
            "content_sha256",
        ):
            check_text(getattr(self, name), name)
        check_u64(self.weight_generation, "weight_generation")
        digest = self.content_sha256
        if len(digest) != 64 or not set(digest) <= set("0123456789abcdef"):
            raise ValueError("content_sha256 must be a SHA-256 hex digest")


@dataclass(frozen=True)
class StoredFragment:
    """A box of one tensor stored at ``object_offset`` .. ``+ nbytes`` of an object."""

    fragment_id: StoredFragmentId
    tensor_id: TensorId
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    object_key: str
    object_offset: int
    nbytes: int
    aliases: tuple[TensorId, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "global_offset", check_ints(self.global_offset, "global_offset", minimum=0)
        )
        object.__setattr__(
            self, "local_shape", check_ints(self.local_shape, "local_shape", minimum=1)
        )
        for name in ("fragment_id", "tensor_id", "object_key"):
            check_text(getattr(self, name), name)
        check_int(self.object_offset, "object_offset", minimum=0)
        check_int(self.nbytes, "nbytes", minimum=1)
        group = _aliases(self.aliases)
        object.__setattr__(self, "aliases", group)
        if group and len(group) < 2:
            raise ValueError("alias group must contain at least two tensor IDs")
        if group and self.tensor_id not in group:
            raise ValueError("alias group must contain the fragment tensor_id")


def _obj(value: object, label: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or any(type(k) is not str for k in value):
        raise ValueError(f"{label} must be a JSON object")
    return dict(value)


def _exact(value: object, fields: frozenset[str], label: str) -> dict[str, Any]:
    obj = _obj(value, label)
    if frozenset(obj) != fields:
        raise ValueError(f"{label} schema fields do not match contract")
    return obj


def _maybe(value: object, label: str) -> int | None:
    return None if value is None else check_int(value, label, minimum=0)


def _read_tensor(value: object, index: int) -> TensorDescriptor:
    t = _exact(value, _TENSOR_FIELDS, "tensor descriptor")
    axes = tuple(
        _read_axis(a, i)
        for i, a in enumerate(_list(t["parallel_axes"], f"stored tensor parallel_axes {index}"))
    )
    tensor_id = TensorId(check_text(t["tensor_id"], "stored tensor tensor_id"))
    shape = check_ints(t["global_shape"], "stored tensor global_shape", minimum=1)
    dtype = check_text(t["dtype"], "stored tensor dtype")
    itemsize = check_int(t["itemsize"], "stored tensor itemsize", minimum=1)
    layer_id = _maybe(t["layer_id"], "stored tensor layer_id")
    expert_id = _maybe(t["expert_id"], "stored tensor expert_id")
    fingerprint = check_text(t["layout_fingerprint"], "stored tensor layout_fingerprint")
    dims = check_ints(t["shard_dims"], "stored tensor shard_dims", minimum=0)
    return TensorDescriptor(
        tensor_id=tensor_id,
        global_shape=shape,
        dtype=dtype,
        itemsize=itemsize,
        layer_id=layer_id,
        expert_id=expert_id,
        layout_fingerprint=fingerprint,
        shard_dims=dims,
        parallel_axes=axes,
    )


def _read_fragment(value: object) -> StoredFragment:
    f = _exact(value, _FRAGMENT_FIELDS, "stored fragment")
    fid = StoredFragmentId(check_text(f["fragment_id"], "stored fragment fragment_id"))
    tensor_id = TensorId(check_text(f["tensor_id"], "stored fragment tensor_id"))
    offset = check_ints(f["global_offset"], "stored fragment global_offset", minimum=0)
    shape = check_ints(f["local_shape"], "stored fragment local_shape", minimum=1)
    key = check_text(f["object_key"], "stored fragment object_key")
    at = check_int(f["object_offset"], "stored fragment object_offset", minimum=0)
    nbytes = check_int(f["nbytes"], "stored fragment nbytes", minimum=1)
    aliases = tuple(
        TensorId(check_text(a, "stored fragment alias"))
        for a in _list(f["aliases"], "stored fragment aliases")
    )
    return StoredFragment(
        fragment_id=fid,
        tensor_id=tensor_id,
        global_offset=offset,
        local_shape=shape,
        object_key=key,
        object_offset=at,
        nbytes=nbytes,
        aliases=aliases,
    )


def _boxes_intersect(a: StoredFragment, b: StoredFragment) -> bool:
    pairs = zip(a.global_offset, a.local_shape, b.global_offset, b.local_shape, strict=False)
    for x, n, y, m in pairs:
        if not (x < y + m and y < x + n):
            return False
    if len({len(a.global_offset), len(a.local_shape), len(b.global_offset)}) > 1:
        raise ValueError("zip() arguments have different lengths")
    return True


def _any_overlap(frags: Sequence[StoredFragment]) -> bool:
    if len(frags) < 2:
        return False
    rank = len(frags[0].global_offset)
    axis = max(
        range(rank),
        key=lambda d: len(
            {(f.global_offset[d], f.global_offset[d] + f.local_shape[d]) for f in frags}
        ),
    )
    live: list[StoredFragment] = []
    for frag in sorted(frags, key=lambda f: f.global_offset[axis]):
        start = frag.global_offset[axis]
        live = [o for o in live if o.global_offset[axis] + o.local_shape[axis] > start]
        if any(_boxes_intersect(o, frag) for o in live):
            return True
        live.append(frag)
    return False


def _alias_key(t: TensorDescriptor) -> tuple[object, ...]:
    return (
        t.global_shape,
        t.dtype,
        t.itemsize,
        t.shard_dims,
        t.parallel_axes,
        t.layer_id,
        t.expert_id,
        t.layout_fingerprint,
    )


def _check(tensors: Sequence[TensorDescriptor], frags: Sequence[StoredFragment]) -> None:
    by_id: dict[TensorId, TensorDescriptor] = {}
    for tensor in tensors:
        if tensor.tensor_id in by_id:
            raise ValueError(f"duplicate tensor_id: {tensor.tensor_id}")
        by_id[tensor.tensor_id] = tensor
    seen: set[str] = set()
    for frag in frags:
        if frag.fragment_id in seen:
            raise ValueError(f"duplicate fragment_id: {frag.fragment_id}")
        seen.add(frag.fragment_id)
        if frag.tensor_id not in by_id:
            raise ValueError(f"unknown tensor_id: {frag.tensor_id}")
        validate_fragment_geometry(
            by_id[frag.tensor_id],
            fragment_id=frag.fragment_id,
            global_offset=frag.global_offset,
            local_shape=frag.local_shape,
            nbytes=frag.nbytes,
        )
    # aliases: each group at one box is complete and its tensors describe the same data
    groups: dict[tuple[tuple[TensorId, ...], tuple[object, ...]], list[StoredFragment]] = {}
    for frag in frags:
        if frag.aliases:
            unknown = sorted(set(frag.aliases) - set(by_id))
            if unknown:
                raise ValueError(f"stored alias references unknown tensor: {unknown[0]}")
            where = (frag.global_offset, frag.local_shape, frag.nbytes)
            groups.setdefault((frag.aliases, where), []).append(frag)
    for key, members in groups.items():
        ids = {f.tensor_id for f in members}
        if ids != set(key[0]):
            raise ValueError("stored alias group is incomplete for fragment geometry")
        if len({_alias_key(by_id[i]) for i in ids}) != 1:
            raise ValueError("stored alias tensor descriptors differ")
    # coverage: every tensor exactly once
    per_tensor: dict[TensorId, list[StoredFragment]] = {}
    boxes: set[tuple[object, ...]] = set()
    for frag in frags:
        box = (frag.tensor_id, frag.global_offset, frag.local_shape)
        if box in boxes:
            raise ValueError(f"duplicate fragment geometry: {frag.tensor_id}")
        boxes.add(box)
        per_tensor.setdefault(frag.tensor_id, []).append(frag)
    for tensor in tensors:
        held = per_tensor.get(tensor.tensor_id, [])
        volume = sum(prod(f.local_shape) for f in held)
        if volume != prod(tensor.global_shape) or _any_overlap(held):
            raise ValueError(f"tensor is not fully covered: {tensor.tensor_id}")
    # payload byte ranges do not overlap within an object
    per_object: dict[str, list[StoredFragment]] = {}
    for frag in frags:
        per_object.setdefault(frag.object_key, []).append(frag)
    for key_name, members in per_object.items():
        ordered = sorted(members, key=lambda f: f.object_offset)
        for prev, cur in zip(ordered, ordered[1:], strict=False):
            if cur.object_offset < prev.object_offset + prev.nbytes:
                raise ValueError(
                    "stored fragment object ranges overlap: "
                    f"{prev.fragment_id} and {cur.fragment_id} in {key_name}"
                )


@dataclass(frozen=True)
class WeightManifest:
    """The manifest of a stored weight group: ``manifest_key`` is
    ``{group_id}/manifest``, payload objects live under ``{group_id}/payload/``; every
    tensor is covered exactly once. ``manifest_digest`` is the sha256 of
    :meth:`to_json`."""

    namespace: str
    resource_id: ResourceId
    revision: RevisionId
    weight_generation: int
    group_id: str
    manifest_key: str
    tensors: tuple[TensorDescriptor, ...]
    fragments: tuple[StoredFragment, ...]
    created_at: str
    manifest_digest: str = field(init=False)

    @property
    def resource_kind(self) -> ResourceKind:
        """Always ``ResourceKind.MODEL_WEIGHT``."""
        return ResourceKind.MODEL_WEIGHT

    def __post_init__(self) -> None:
        for name in (
            "namespace",
            "resource_id",
            "revision",
            "group_id",
            "manifest_key",
            "created_at",
        ):
            check_text(getattr(self, name), name)
        tensors = require_manifest_items(self.tensors, "WeightManifest tensors", TensorDescriptor)
        object.__setattr__(self, "tensors", tensors)
        frags = require_manifest_items(self.fragments, "WeightManifest fragments", StoredFragment)
        object.__setattr__(self, "fragments", frags)
        check_u64(self.weight_generation, "weight_generation")
        if self.manifest_key != f"{self.group_id}/manifest":
            raise ValueError("manifest_key does not belong to manifest group")
        if any(not f.object_key.startswith(f"{self.group_id}/payload/") for f in frags):
            raise ValueError("payload object_key does not belong to manifest group")
        _check(tensors, frags)
        digest = hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()
        object.__setattr__(self, "manifest_digest", digest)

    @property
    def manifest_identity(self) -> StoredManifestIdentity:
        """The manifest's location and content digest."""
        return StoredManifestIdentity(
            namespace=self.namespace,
            resource_id=self.resource_id,
            revision=self.revision,
            weight_generation=self.weight_generation,
            group_id=self.group_id,
            manifest_key=self.manifest_key,
            content_sha256=self.manifest_digest,
        )

    def to_json(self) -> str:
        """The canonical JSON (sorted keys, compact, UTF-8 text unescaped)."""
        doc = {
            "resource_kind": self.resource_kind.value,
            "namespace": self.namespace,
            "resource_id": self.resource_id,
            "revision": self.revision,
            "weight_generation": self.weight_generation,
            "group_id": self.group_id,
            "manifest_key": self.manifest_key,
            "tensors": [
                {
                    "tensor_id": t.tensor_id,
                    "global_shape": t.global_shape,
                    "dtype": t.dtype,
                    "itemsize": t.itemsize,
                    "layer_id": t.layer_id,
                    "expert_id": t.expert_id,
                    "layout_fingerprint": t.layout_fingerprint,
                    "shard_dims": t.shard_dims,
                    "parallel_axes": [axis_wire(a) for a in t.parallel_axes],
                }
                for t in self.tensors
            ],
            "fragments": [asdict(f) for f in self.fragments],
            "created_at": self.created_at,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_json(cls, value: str | bytes | bytearray) -> WeightManifest:
        """Parse :meth:`to_json` output (duplicate keys and NaN refused)."""

        def no_constants(name: str) -> None:
            raise ValueError(f"non-finite JSON number is unsupported: {name}")

        def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for key, item in pairs:
                if key in out:
                    raise ValueError(f"duplicate JSON field: {key}")
                out[key] = item
            return out

        try:
            raw = json.loads(value, parse_constant=no_constants, object_pairs_hook=no_duplicates)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError("weight manifest is not valid JSON") from exc
        return cls.from_dict(_obj(raw, "weight manifest"))

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> WeightManifest:
        """Build from the decoded JSON object (exactly the published fields)."""
        doc = _exact(raw, _MANIFEST_FIELDS, "weight manifest")
        if doc["resource_kind"] != ResourceKind.MODEL_WEIGHT.value:
            raise ValueError("weight manifest resource_kind must be model_weight")
        tensors = tuple(
            _read_tensor(t, i)
            for i, t in enumerate(_list(doc["tensors"], "WeightManifest tensors"))
        )
        frags = tuple(
            _read_fragment(f) for f in _list(doc["fragments"], "WeightManifest fragments")
        )
        namespace = check_text(doc["namespace"], "namespace")
        resource_id = ResourceId(check_text(doc["resource_id"], "resource_id"))
        revision = RevisionId(check_text(doc["revision"], "revision"))
        generation = check_u64(doc["weight_generation"], "weight_generation")
        group_id = check_text(doc["group_id"], "group_id")
        manifest_key = check_text(doc["manifest_key"], "manifest_key")
        return cls(
            namespace=namespace,
            resource_id=resource_id,
            revision=revision,
            weight_generation=generation,
            group_id=group_id,
            manifest_key=manifest_key,
            tensors=tensors,
            fragments=frags,
            created_at=check_text(doc["created_at"], "created_at"),
        )


def validate_weight_manifest_snapshot(manifest: WeightManifest) -> WeightManifest:
    """Rebuild ``manifest`` from its fields (rechecking everything) before trusting it."""
    if not isinstance(manifest, WeightManifest):
        raise ValueError("weight manifest snapshot is invalid")
    try:
        return WeightManifest(
            namespace=manifest.namespace,
            resource_id=manifest.resource_id,
            revision=manifest.revision,
            weight_generation=manifest.weight_generation,
            group_id=manifest.group_id,
            manifest_key=manifest.manifest_key,
            tensors=manifest.tensors,
            fragments=manifest.fragments,
            created_at=manifest.created_at,
        )
    except (AttributeError, TypeError) as exc:
        raise ValueError("weight manifest snapshot is invalid") from exc
