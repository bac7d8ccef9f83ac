"""``mooncake.reshard.weight.manifest``: the weight manifest contracts in one place."""

from mooncake_core.compat.reshard.weight.binding import (
    validate_runtime_binding,
    validate_runtime_bindings,
)
from mooncake_core.compat.reshard.weight.part import WeightPlacementPart
from mooncake_core.compat.reshard.weight.placement import WeightPlacementManifest
from mooncake_core.compat.reshard.weight.runtime import WeightRuntimeBindingManifest
from mooncake_core.compat.reshard.weight.topology import ParallelTopology, TopologyParticipant
from mooncake_core.compat.reshard.weight.types import (
    OwnershipAxis,
    ParallelRank,
    PlacementFragment,
    ReplicatedAxis,
    RuntimeBindingFragment,
    SplitAxis,
    TensorDescriptor,
)

__all__ = [
    "ParallelRank",
    "ParallelTopology",
    "PlacementFragment",
    "TopologyParticipant",
    "WeightPlacementManifest",
    "WeightPlacementPart",
    "RuntimeBindingFragment",
    "WeightRuntimeBindingManifest",
    "SplitAxis",
    "ReplicatedAxis",
    "OwnershipAxis",
    "TensorDescriptor",
    "validate_runtime_binding",
    "validate_runtime_bindings",
]
