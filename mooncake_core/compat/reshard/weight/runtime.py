"""Where one participant's fragments of a weight placement live right now."""

from __future__ import annotations

from dataclasses import dataclass

from mooncake_core.compat.reshard.contracts import (
    LeaseId,
    ParticipantId,
    PlacementId,
    ResourceId,
    ResourceKind,
    RevisionId,
    RuntimeBindingFragment,
    RuntimeInstanceId,
)
from mooncake_core.compat.reshard.weight.types import (
    check_text,
    check_u64,
    require_manifest_items,
    require_sha256_digest,
)

__all__ = ["WeightRuntimeBindingManifest"]

_TEXT = ("resource_id", "placement_id", "instance_id", "lease_id", "revision", "participant_id")


@dataclass(frozen=True)
class WeightRuntimeBindingManifest:
    """The runtime fragments (addresses) of one participant for one placement, fenced
    by the runtime instance, its generation and a lease. Fragments are kept sorted by
    placement fragment id; each placement fragment and runtime fragment id once."""

    resource_id: ResourceId
    placement_id: PlacementId
    placement_digest: str
    instance_id: RuntimeInstanceId
    generation: int
    lease_id: LeaseId
    revision: RevisionId
    participant_id: ParticipantId
    fragments: tuple[RuntimeBindingFragment, ...]

    @property
    def resource_kind(self) -> ResourceKind:
        """Always ``ResourceKind.MODEL_WEIGHT``."""
        return ResourceKind.MODEL_WEIGHT

    def __post_init__(self) -> None:
        for name in _TEXT:
            check_text(getattr(self, name), name)
        require_sha256_digest(self.placement_digest, "placement_digest")
        check_u64(self.generation, "generation")
        frags = require_manifest_items(
            self.fragments, "WeightRuntimeBindingManifest fragments", RuntimeBindingFragment
        )
        frags = tuple(sorted(frags, key=lambda f: f.placement_fragment_id))
        object.__setattr__(self, "fragments", frags)
        if len({f.placement_fragment_id for f in frags}) != len(frags):
            raise ValueError("duplicate placement fragment in runtime binding")
        if len({f.fragment_id for f in frags}) != len(frags):
            raise ValueError("duplicate runtime fragment_id in runtime binding")
