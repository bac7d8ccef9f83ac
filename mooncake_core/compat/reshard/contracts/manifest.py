"""What every reusable-resource manifest exposes (structural protocols), and the check
that a runtime binding belongs to a placement."""

from __future__ import annotations

from enum import Enum
from typing import Protocol

from mooncake_core.compat.reshard.contracts.ids import (
    LeaseId,
    PlacementId,
    ResourceId,
    RuntimeInstanceId,
)

__all__ = [
    "PlacementManifest",
    "ResourceKind",
    "ResourceManifest",
    "RuntimeBindingManifest",
    "StoredResourceManifest",
    "validate_resource_binding_identity",
]


class ResourceKind(str, Enum):
    """Which kind of resource a manifest describes (its wire value is the string)."""

    MODEL_WEIGHT = "model_weight"
    KV_CACHE = "kv_cache"


class ResourceManifest(Protocol):
    """A typed resource with a stable id."""

    @property
    def resource_id(self) -> ResourceId:
        """The resource's stable id."""
        ...

    @property
    def resource_kind(self) -> ResourceKind:
        """Which kind of resource this is."""
        ...


class PlacementManifest(ResourceManifest, Protocol):
    """A logical placement of a resource (no addresses), attested by a digest."""

    @property
    def placement_id(self) -> PlacementId:
        """The placement's stable id."""
        ...

    @property
    def digest(self) -> str:
        """Digest of the serialized placement."""
        ...


class RuntimeBindingManifest(ResourceManifest, Protocol):
    """Where one placement lives in a running instance, fenced by generation and lease."""

    @property
    def placement_id(self) -> PlacementId:
        """The placement this binding realises."""
        ...

    @property
    def placement_digest(self) -> str:
        """Digest of that placement."""
        ...

    @property
    def instance_id(self) -> RuntimeInstanceId:
        """The runtime instance holding the memory."""
        ...

    @property
    def generation(self) -> int:
        """The instance's generation (a restart fences old bindings)."""
        ...

    @property
    def lease_id(self) -> LeaseId:
        """The lease that keeps the memory valid."""
        ...


class StoredResourceManifest(ResourceManifest, Protocol):
    """Metadata of a resource persisted in the store."""

    namespace: str
    group_id: str
    manifest_key: str
    created_at: str


def validate_resource_binding_identity(
    placement: PlacementManifest,
    binding: RuntimeBindingManifest,
) -> None:
    """Raise ``ValueError`` unless ``binding`` is for exactly this ``placement`` (kind,
    resource id, placement id and digest)."""
    checks = (
        ("resource_kind", "resource_kind", "placement and runtime binding resource_kind differ"),
        ("resource_id", "resource_id", "placement and runtime binding resource_id differ"),
        ("placement_id", "placement_id", "placement_id and runtime binding placement_id differ"),
        (
            "digest",
            "placement_digest",
            "placement digest and runtime binding placement digest differ",
        ),
    )
    for ours, theirs, message in checks:
        if getattr(placement, ours) != getattr(binding, theirs):
            raise ValueError(message)
