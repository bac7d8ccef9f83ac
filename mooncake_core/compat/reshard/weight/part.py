"""One participant's share of a weight placement (no addresses)."""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_core.compat.reshard.contracts import (
    ParticipantId,
    PlacementSetId,
    ResourceId,
    RevisionId,
    TopologyId,
)
from mooncake_core.compat.reshard.weight.types import (
    ParallelRank,
    PlacementFragment,
    TensorDescriptor,
    check_text,
    check_u64,
    require_manifest_items,
)
from mooncake_core.compat.reshard.weight.validation import _validate_fragments

__all__ = ["WeightPlacementPart"]


@dataclass(frozen=True)
class WeightPlacementPart:
    """The tensors and fragments one participant holds; every tensor listed must have
    a fragment here, every fragment carries the part's rank. Tensors are kept sorted by
    id and fragments by fragment id."""

    resource_id: ResourceId
    revision: RevisionId
    weight_generation: int
    placement_set_id: PlacementSetId
    topology_id: TopologyId
    participant_id: ParticipantId
    rank: ParallelRank
    tensors: tuple[TensorDescriptor, ...]
    fragments: tuple[PlacementFragment, ...]

    def __post_init__(self) -> None:
        for name in ("resource_id", "revision", "placement_set_id", "topology_id"):
            check_text(getattr(self, name), name)
        check_text(self.participant_id, "participant_id")
        check_u64(self.weight_generation, "weight_generation")
        if not isinstance(self.rank, ParallelRank):
            raise ValueError("placement part rank must be a ParallelRank")
        tensors = require_manifest_items(
            self.tensors, "WeightPlacementPart tensors", TensorDescriptor
        )
        frags = require_manifest_items(
            self.fragments, "WeightPlacementPart fragments", PlacementFragment
        )
        if any(f.rank != self.rank for f in frags):
            raise ValueError("placement part fragment rank differs from part rank")
        idle = sorted({t.tensor_id for t in tensors} - {f.tensor_id for f in frags})
        if idle:
            raise ValueError(f"placement part contains an unreferenced tensor: {idle[0]}")
        object.__setattr__(self, "tensors", tuple(sorted(tensors, key=lambda t: t.tensor_id)))
        object.__setattr__(
            self, "fragments", tuple(sorted(frags, key=lambda f: f.placement_fragment_id))
        )
        _validate_fragments(self.tensors, self.fragments)
