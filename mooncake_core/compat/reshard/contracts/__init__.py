"""``mooncake.reshard.contracts``: ids, manifest protocols and runtime fragments shared
by every resource kind."""

from mooncake_core.compat.reshard.contracts.fragments import RuntimeBindingFragment
from mooncake_core.compat.reshard.contracts.ids import (
    LeaseId,
    ParticipantId,
    PlacementFragmentId,
    PlacementId,
    PlacementSetId,
    ResourceId,
    RevisionId,
    RuntimeFragmentId,
    RuntimeInstanceId,
    StoredFragmentId,
    TensorId,
    TopologyId,
)
from mooncake_core.compat.reshard.contracts.manifest import (
    PlacementManifest,
    ResourceKind,
    ResourceManifest,
    RuntimeBindingManifest,
    StoredResourceManifest,
    validate_resource_binding_identity,
)

__all__ = [
    "LeaseId",
    "ParticipantId",
    "PlacementFragmentId",
    "PlacementId",
    "PlacementManifest",
    "PlacementSetId",
    "ResourceId",
    "ResourceKind",
    "ResourceManifest",
    "RevisionId",
    "RuntimeBindingManifest",
    "RuntimeBindingFragment",
    "RuntimeFragmentId",
    "RuntimeInstanceId",
    "StoredFragmentId",
    "TensorId",
    "TopologyId",
    "StoredResourceManifest",
    "validate_resource_binding_identity",
]
