"""A complete weight placement: every participant's part, checked to cover every tensor,
with a canonical placement id and a digest of its canonical JSON."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mooncake_core.compat.reshard.contracts import (
    ParticipantId,
    PlacementId,
    PlacementSetId,
    ResourceId,
    ResourceKind,
    RevisionId,
    TensorId,
)
from mooncake_core.compat.reshard.weight.part import WeightPlacementPart
from mooncake_core.compat.reshard.weight.topology import ParallelTopology
from mooncake_core.compat.reshard.weight.types import (
    OwnershipAxis,
    ParallelRank,
    PlacementFragment,
    ReplicatedAxis,
    SplitAxis,
    TensorDescriptor,
    canonical_json_sha,
    check_text,
    check_u64,
    require_manifest_items,
)
from mooncake_core.compat.reshard.weight.validation import (
    _validate_complete_weight_placement,
    _validate_fragments,
)

__all__ = ["WeightPlacementManifest"]


def axis_wire(axis: object) -> dict[str, object]:
    """An axis as its wire / identity dict."""
    if isinstance(axis, SplitAxis):
        return {"semantics": "split", "kind": axis.kind, "dim": axis.dim}
    if isinstance(axis, ReplicatedAxis):
        return {"semantics": "replicated", "kind": axis.kind}
    if isinstance(axis, OwnershipAxis):
        return {"semantics": "ownership", "kind": axis.kind}
    raise ValueError("unsupported parallel axis value")


def _fragment_identity(frag: PlacementFragment) -> dict[str, object]:
    out: dict[str, object] = {
        "placement_fragment_id": frag.placement_fragment_id,
        "tensor_id": frag.tensor_id,
        "global_offset": frag.global_offset,
        "local_shape": frag.local_shape,
        "nbytes": frag.nbytes,
        "rank": asdict(frag.rank),
        "aliases": frag.aliases,
    }
    if frag.pipeline_stage_id is not None:  # absent unless set: older ids stay stable
        out["pipeline_stage_id"] = frag.pipeline_stage_id
    return out


def _placement_id(
    resource_id: str,
    revision: str,
    generation: int,
    set_id: str,
    topology: ParallelTopology,
    tensors: Sequence[TensorDescriptor],
    parts: Sequence[WeightPlacementPart],
) -> PlacementId:
    content = {
        "schema": "complete-weight-placement",
        "resource_id": resource_id,
        "revision": revision,
        "weight_generation": generation,
        "placement_set_id": set_id,
        "topology": {
            "tp_size": topology.tp_size,
            "pp_size": topology.pp_size,
            "ep_size": topology.ep_size,
            "dp_size": topology.dp_size,
            "topology_id": topology.topology_id,
            "participants": [asdict(p) for p in topology.participants],
        },
        "tensors": [
            {
                "tensor_id": t.tensor_id,
                "global_shape": t.global_shape,
                "dtype": t.dtype,
                "itemsize": t.itemsize,
                "shard_dims": t.shard_dims,
                "layout_fingerprint": t.layout_fingerprint,
                "parallel_axes": [axis_wire(a) for a in t.parallel_axes],
                "layer_id": t.layer_id,
                "expert_id": t.expert_id,
            }
            for t in tensors
        ],
        "parts": [
            {
                "participant_id": p.participant_id,
                "rank": asdict(p.rank),
                "fragments": [_fragment_identity(f) for f in p.fragments],
            }
            for p in parts
        ],
    }
    return PlacementId(f"sha256:{canonical_json_sha(content)}")


def _check_parts(
    parts: tuple[WeightPlacementPart, ...],
    topology: ParallelTopology,
    expect: dict[str, object],
) -> None:
    ids = [p.participant_id for p in parts]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate placement participant")
    members = {m.participant_id: m for m in topology.participants}
    missing = sorted(set(members) - set(ids))
    if missing:
        raise ValueError(f"missing topology participant: {missing[0]}")
    unknown = sorted(set(ids) - set(members))
    if unknown:
        raise ValueError(f"unknown topology participant: {unknown[0]}")
    for part in parts:
        for name, value in expect.items():
            if getattr(part, name) != value:
                raise ValueError(f"placement part {name} differs")
        if part.rank != members[part.participant_id].rank:
            raise ValueError("placement part rank differs from topology")


@dataclass(frozen=True, init=False)
class WeightPlacementManifest:
    """Every participant's part of one weight generation's placement. The parts are
    sorted by participant; ``tensors`` and ``fragments`` are their sorted unions;
    ``placement_id`` is derived from the content (a given one must match)."""

    resource_id: ResourceId
    placement_id: PlacementId
    revision: RevisionId
    weight_generation: int
    placement_set_id: PlacementSetId
    topology: ParallelTopology
    parts: tuple[WeightPlacementPart, ...]
    tensors: tuple[TensorDescriptor, ...]
    fragments: tuple[PlacementFragment, ...]
    _digest_cache: str | None = field(init=False, repr=False, compare=False)

    def __init__(
        self,
        *,
        resource_id: ResourceId,
        revision: RevisionId,
        weight_generation: int,
        placement_set_id: PlacementSetId,
        topology: ParallelTopology,
        parts: tuple[WeightPlacementPart, ...],
        placement_id: PlacementId | None = None,
    ) -> None:
        check_text(resource_id, "resource_id")
        check_text(revision, "revision")
        check_u64(weight_generation, "weight_generation")
        check_text(placement_set_id, "placement_set_id")
        if not isinstance(topology, ParallelTopology):
            raise ValueError("topology must be a ParallelTopology")
        if placement_id is not None:
            check_text(placement_id, "placement_id")
        items = require_manifest_items(parts, "WeightPlacementManifest parts", WeightPlacementPart)
        ordered = tuple(sorted(items, key=lambda p: p.participant_id))
        _check_parts(
            ordered,
            topology,
            {
                "resource_id": resource_id,
                "revision": revision,
                "weight_generation": weight_generation,
                "placement_set_id": placement_set_id,
                "topology_id": topology.topology_id,
            },
        )
        by_id: dict[TensorId, TensorDescriptor] = {}
        frags: list[PlacementFragment] = []
        for part in ordered:
            for tensor in part.tensors:
                if by_id.setdefault(tensor.tensor_id, tensor) != tensor:
                    raise ValueError(
                        f"placement part tensor descriptor mismatch: {tensor.tensor_id}"
                    )
            frags.extend(part.fragments)
        tensors = tuple(sorted(by_id.values(), key=lambda t: t.tensor_id))
        fragments = tuple(sorted(frags, key=lambda f: f.placement_fragment_id))
        _validate_fragments(tensors, fragments, require_complete_alias_groups=True)
        _validate_complete_weight_placement(tensors, fragments, topology=topology)
        canonical = _placement_id(
            resource_id,
            revision,
            weight_generation,
            placement_set_id,
            topology,
            tensors,
            ordered,
        )
        if placement_id is not None and placement_id != canonical:
            raise ValueError("placement_id does not match canonical logical content")
        for name, value in (
            ("resource_id", resource_id),
            ("placement_id", canonical),
            ("revision", revision),
            ("weight_generation", weight_generation),
            ("placement_set_id", placement_set_id),
            ("topology", topology),
            ("parts", ordered),
            ("tensors", tensors),
            ("fragments", fragments),
            ("_digest_cache", None),
        ):
            object.__setattr__(self, name, value)

    @property
    def resource_kind(self) -> ResourceKind:
        """Always ``ResourceKind.MODEL_WEIGHT``."""
        return ResourceKind.MODEL_WEIGHT

    @property
    def digest(self) -> str:
        """sha256 (hex) of :func:`~.serde.weight_placement_to_json` of this placement."""
        if self._digest_cache is None:
            text = canonical_placement_json(self)
            object.__setattr__(self, "_digest_cache", hashlib.sha256(text.encode()).hexdigest())
        assert self._digest_cache is not None
        return self._digest_cache

    @classmethod
    def from_fragments(
        cls,
        *,
        resource_id: ResourceId,
        revision: RevisionId,
        weight_generation: int,
        placement_set_id: PlacementSetId,
        topology: ParallelTopology,
        tensors: Sequence[TensorDescriptor],
        fragments: Sequence[PlacementFragment],
        placement_id: PlacementId | None = None,
    ) -> WeightPlacementManifest:
        """Build the parts from a flat list of fragments, by the participant whose rank
        each fragment carries."""
        tensor_items = require_manifest_items(tensors, "placement tensors", TensorDescriptor)
        frag_items = require_manifest_items(fragments, "placement fragments", PlacementFragment)
        by_id = {t.tensor_id: t for t in tensor_items}
        if len(by_id) != len(tensor_items):
            raise ValueError("duplicate tensor_id in placement tensors")
        used = {f.tensor_id for f in frag_items}
        unknown = sorted(used - set(by_id))
        if unknown:
            raise ValueError(f"unknown tensor_id: {unknown[0]}")
        idle = sorted(set(by_id) - used)
        if idle:
            raise ValueError(f"global placement contains an unreferenced tensor: {idle[0]}")
        member_of = {m.rank: m for m in topology.participants}
        held: dict[ParticipantId, list[PlacementFragment]] = {
            m.participant_id: [] for m in topology.participants
        }
        for frag in frag_items:
            member = member_of.get(frag.rank)
            if member is None:
                raise ValueError(
                    f"placement fragment rank has no topology participant: {frag.fragment_id}"
                )
            held[member.participant_id].append(frag)
        parts = []
        for member in topology.participants:
            local = tuple(held[member.participant_id])
            parts.append(
                WeightPlacementPart(
                    resource_id=resource_id,
                    revision=revision,
                    weight_generation=weight_generation,
                    placement_set_id=placement_set_id,
                    topology_id=topology.topology_id,
                    participant_id=member.participant_id,
                    rank=member.rank,
                    tensors=tuple(by_id[t] for t in sorted({f.tensor_id for f in local})),
                    fragments=local,
                )
            )
        return cls(
            resource_id=resource_id,
            revision=revision,
            weight_generation=weight_generation,
            placement_set_id=placement_set_id,
            topology=topology,
            parts=tuple(parts),
            placement_id=placement_id,
        )


def _rank(rank: ParallelRank) -> dict[str, int]:
    return {"dp": rank.dp, "tp": rank.tp, "pp": rank.pp, "ep": rank.ep}


def _fragment(frag: PlacementFragment) -> dict[str, Any]:
    out: dict[str, Any] = {
        "placement_fragment_id": frag.placement_fragment_id,
        "tensor_id": frag.tensor_id,
        "global_offset": list(frag.global_offset),
        "local_shape": list(frag.local_shape),
        "nbytes": frag.nbytes,
        "rank": _rank(frag.rank),
        "aliases": list(frag.aliases),
    }
    if frag.pipeline_stage_id is not None:
        out["pipeline_stage_id"] = frag.pipeline_stage_id
    return out


def canonical_placement_json(placement: WeightPlacementManifest) -> str:
    """The placement's canonical wire JSON (sorted keys, compact); its sha256 is the
    placement's ``digest``."""
    topo = placement.topology
    payload = {
        "resource_kind": placement.resource_kind.value,
        "resource_id": placement.resource_id,
        "revision": placement.revision,
        "weight_generation": placement.weight_generation,
        "placement_set_id": placement.placement_set_id,
        "placement_id": placement.placement_id,
        "topology": {
            "tp_size": topo.tp_size,
            "pp_size": topo.pp_size,
            "ep_size": topo.ep_size,
            "dp_size": topo.dp_size,
            "topology_id": topo.topology_id,
            "participants": [
                {"participant_id": p.participant_id, "rank": _rank(p.rank)}
                for p in topo.participants
            ],
        },
        "tensors": [
            {
                "tensor_id": t.tensor_id,
                "global_shape": list(t.global_shape),
                "dtype": t.dtype,
                "itemsize": t.itemsize,
                "shard_dims": list(t.shard_dims),
                "layout_fingerprint": t.layout_fingerprint,
                "parallel_axes": [axis_wire(a) for a in t.parallel_axes],
                "layer_id": t.layer_id,
                "expert_id": t.expert_id,
            }
            for t in placement.tensors
        ],
        "parts": [
            {
                "participant_id": part.participant_id,
                "rank": _rank(part.rank),
                "fragments": [_fragment(f) for f in part.fragments],
            }
            for part in placement.parts
        ],
    }
    return json.dumps(payload, sort_keys=True, separators=(",", ":"))
