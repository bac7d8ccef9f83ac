"""The canonical JSON of a weight placement (the published wire schema, byte for byte).

:func:`weight_placement_to_json` writes sorted keys with no spaces; its sha256 is the
placement's ``digest``. :func:`weight_placement_from_json` accepts exactly that schema:
unknown or missing fields, duplicate keys, NaN / Infinity, bools for integers and the
like are refused with the published ``ValueError`` message, and the result is checked
as a :class:`WeightPlacementManifest` (so its ``placement_id`` must match the content).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, cast

from mooncake_core.compat.reshard.contracts import (
    ParticipantId,
    PlacementFragmentId,
    PlacementId,
    PlacementSetId,
    ResourceId,
    ResourceKind,
    RevisionId,
    TensorId,
    TopologyId,
)
from mooncake_core.compat.reshard.weight.part import WeightPlacementPart
from mooncake_core.compat.reshard.weight.placement import (
    WeightPlacementManifest,
    canonical_placement_json,
)
from mooncake_core.compat.reshard.weight.topology import ParallelTopology, TopologyParticipant
from mooncake_core.compat.reshard.weight.types import (
    AXIS_ORDER,
    OwnershipAxis,
    ParallelAxis,
    ParallelRank,
    PlacementFragment,
    ReplicatedAxis,
    SplitAxis,
    TensorDescriptor,
)

__all__ = ["weight_placement_from_json", "weight_placement_to_json"]

JsonScalar = None | bool | int | float | str
JsonValue = JsonScalar | list[Any] | dict[str, Any]
JsonObject = Mapping[str, JsonValue]

_TOP = {
    "resource_kind",
    "resource_id",
    "revision",
    "weight_generation",
    "placement_set_id",
    "placement_id",
    "topology",
    "tensors",
    "parts",
}
_TENSOR = {
    "tensor_id",
    "global_shape",
    "dtype",
    "itemsize",
    "shard_dims",
    "layout_fingerprint",
    "parallel_axes",
    "layer_id",
    "expert_id",
}
_FRAGMENT_OLD = {
    "placement_fragment_id",
    "tensor_id",
    "global_offset",
    "local_shape",
    "nbytes",
    "rank",
    "aliases",
}
_FRAGMENT = _FRAGMENT_OLD | {"pipeline_stage_id"}


# -- writing ------------------------------------------------------------------------


def weight_placement_to_json(placement: WeightPlacementManifest) -> str:
    """The placement's canonical JSON (sorted keys, compact)."""
    if not isinstance(placement, WeightPlacementManifest):
        raise ValueError("placement must be a WeightPlacementManifest")
    return canonical_placement_json(placement)


# -- reading ------------------------------------------------------------------------


def _obj(value: object, label: str) -> JsonObject:
    if not isinstance(value, Mapping) or any(type(k) is not str for k in value):
        raise ValueError(f"{label} must be a JSON object")
    return cast(JsonObject, value)


def _exact(value: object, fields: AbstractSet[str], label: str) -> JsonObject:
    obj = _obj(value, label)
    if set(obj) != set(fields):
        raise ValueError(f"{label} schema fields do not match contract")
    return obj


def _list(value: object, label: str) -> Sequence[Any]:
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise ValueError(f"{label} must be a sequence")
    return value


def _text(value: object, label: str) -> str:
    if type(value) is not str or not value:
        raise ValueError(f"{label} must be a non-empty string")
    return value


def _int(value: object, label: str, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{label} must be an integer at least {minimum}")
    return value


def _maybe_int(value: object, label: str, minimum: int) -> int | None:
    return None if value is None else _int(value, label, minimum)


def _ints(value: object, label: str, minimum: int) -> tuple[int, ...]:
    return tuple(_int(v, label, minimum) for v in _list(value, label))


def _kind(value: object) -> Any:
    kind = _text(value, "parallel axis kind")
    if kind not in AXIS_ORDER:
        raise ValueError(f"unsupported parallel axis kind: {kind}")
    return kind


def _read_rank(value: object, label: str) -> ParallelRank:
    rank = _exact(value, {"dp", "tp", "pp", "ep"}, label)
    dp = _int(rank["dp"], "rank dp", 0)
    tp = _int(rank["tp"], "rank tp", 0)
    pp = _int(rank["pp"], "rank pp", 0)
    ep = _int(rank["ep"], "rank ep", 0)
    return ParallelRank(dp=dp, tp=tp, pp=pp, ep=ep)


def _read_topology(value: object) -> ParallelTopology:
    topo = _exact(
        value,
        {"tp_size", "pp_size", "ep_size", "dp_size", "topology_id", "participants"},
        "parallel topology",
    )
    members = []
    for i, item in enumerate(_list(topo["participants"], "parallel topology participants")):
        member = _exact(item, {"participant_id", "rank"}, f"parallel topology participant {i}")
        pid = ParticipantId(_text(member["participant_id"], "participant_id"))
        members.append(
            TopologyParticipant(
                participant_id=pid,
                rank=_read_rank(member["rank"], f"parallel topology rank {i}"),
            )
        )
    sizes = {k: _int(topo[k], k, 1) for k in ("tp_size", "pp_size", "ep_size", "dp_size")}
    return ParallelTopology(
        **sizes,
        participants=tuple(members),
        topology_id=TopologyId(_text(topo["topology_id"], "topology_id")),
    )


def _read_axis(value: object, index: int) -> ParallelAxis:
    label = f"placement tensor parallel axis {index}"
    semantics = _text(_obj(value, label).get("semantics"), "axis semantics")
    if semantics == "split":
        axis = _exact(value, {"semantics", "kind", "dim"}, label)
        kind = _kind(axis["kind"])
        if kind not in ("ep", "tp"):
            raise ValueError(f"{kind} cannot use split semantics")
        return SplitAxis(kind=kind, dim=_int(axis["dim"], "split axis dim", 0))
    if semantics in ("replicated", "ownership"):
        axis = _exact(value, {"semantics", "kind"}, label)
        cls = ReplicatedAxis if semantics == "replicated" else OwnershipAxis
        return cls(kind=_kind(axis["kind"]))
    raise ValueError(f"unsupported parallel axis semantics: {semantics}")


def _read_tensor(value: object, index: int) -> TensorDescriptor:
    t = _exact(value, _TENSOR, f"placement tensor {index}")
    tensor_id = TensorId(_text(t["tensor_id"], "tensor_id"))
    shape = _ints(t["global_shape"], "global_shape", 1)
    dtype = _text(t["dtype"], "dtype")
    itemsize = _int(t["itemsize"], "itemsize", 1)
    shard_dims = _ints(t["shard_dims"], "shard_dims", 0)
    fingerprint = _text(t["layout_fingerprint"], "layout_fingerprint")
    axes = tuple(
        _read_axis(a, i)
        for i, a in enumerate(_list(t["parallel_axes"], "placement tensor parallel_axes"))
    )
    return TensorDescriptor(
        tensor_id=tensor_id,
        global_shape=shape,
        dtype=dtype,
        itemsize=itemsize,
        shard_dims=shard_dims,
        layout_fingerprint=fingerprint,
        parallel_axes=axes,
        layer_id=_maybe_int(t["layer_id"], "layer_id", 0),
        expert_id=_maybe_int(t["expert_id"], "expert_id", 0),
    )


def _read_fragment(value: object, index: int) -> PlacementFragment:
    f = _obj(value, f"placement fragment {index}")
    if set(f) not in (_FRAGMENT, _FRAGMENT_OLD):
        raise ValueError(f"placement fragment {index} has an invalid schema")
    fid = PlacementFragmentId(_text(f["placement_fragment_id"], "placement_fragment_id"))
    tensor_id = TensorId(_text(f["tensor_id"], "tensor_id"))
    offset = _ints(f["global_offset"], "global_offset", 0)
    shape = _ints(f["local_shape"], "local_shape", 1)
    nbytes = _int(f["nbytes"], "nbytes", 1)
    rank = _read_rank(f["rank"], f"placement rank {index}")
    stage = _maybe_int(f.get("pipeline_stage_id"), "pipeline_stage_id", 0)
    aliases = tuple(TensorId(_text(a, "alias")) for a in _list(f["aliases"], "aliases"))
    return PlacementFragment(
        placement_fragment_id=fid,
        tensor_id=tensor_id,
        global_offset=offset,
        local_shape=shape,
        nbytes=nbytes,
        rank=rank,
        pipeline_stage_id=stage,
        aliases=aliases,
    )


def _load(text: str, label: str) -> JsonObject:
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
        raw = json.loads(text, parse_constant=no_constants, object_pairs_hook=no_duplicates)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{label} is not valid JSON") from exc
    return _obj(raw, label)


def weight_placement_from_json(value: str) -> WeightPlacementManifest:
    """Parse :func:`weight_placement_to_json` output back into a checked placement."""
    doc = _exact(_load(value, "placement manifest"), _TOP, "placement manifest")
    if _text(doc["resource_kind"], "resource_kind") != ResourceKind.MODEL_WEIGHT.value:
        raise ValueError("placement manifest resource_kind must be model_weight")
    resource_id = ResourceId(_text(doc["resource_id"], "resource_id"))
    revision = RevisionId(_text(doc["revision"], "revision"))
    generation = _int(doc["weight_generation"], "weight_generation", 0)
    set_id = PlacementSetId(_text(doc["placement_set_id"], "placement_set_id"))
    placement_id = PlacementId(_text(doc["placement_id"], "placement_id"))
    topology = _read_topology(doc["topology"])
    tensors = tuple(
        _read_tensor(t, i) for i, t in enumerate(_list(doc["tensors"], "placement tensors"))
    )
    by_id = {t.tensor_id: t for t in tensors}
    if len(by_id) != len(tensors):
        raise ValueError("duplicate tensor_id in placement JSON")
    parts = []
    used: set[TensorId] = set()
    for i, item in enumerate(_list(doc["parts"], "placement parts")):
        part = _exact(item, {"participant_id", "rank", "fragments"}, f"placement part {i}")
        pid = ParticipantId(_text(part["participant_id"], "participant_id"))
        rank = _read_rank(part["rank"], f"placement part rank {i}")
        frags = tuple(
            _read_fragment(f, j)
            for j, f in enumerate(_list(part["fragments"], "placement part fragments"))
        )
        local = {f.tensor_id for f in frags}
        used |= local
        unknown = sorted(local - set(by_id))
        if unknown:
            raise ValueError(f"unknown tensor_id in placement part: {unknown[0]}")
        parts.append(
            WeightPlacementPart(
                resource_id=resource_id,
                revision=revision,
                weight_generation=generation,
                placement_set_id=set_id,
                topology_id=topology.topology_id,
                participant_id=pid,
                rank=rank,
                tensors=tuple(by_id[t] for t in sorted(local)),
                fragments=frags,
            )
        )
    idle = sorted(set(by_id) - used)
    if idle:
        raise ValueError(f"placement JSON contains an unreferenced tensor: {idle[0]}")
    return WeightPlacementManifest(
        resource_id=resource_id,
        revision=revision,
        weight_generation=generation,
        placement_set_id=set_id,
        placement_id=placement_id,
        topology=topology,
        parts=tuple(parts),
    )
