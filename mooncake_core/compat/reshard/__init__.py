"""``mooncake.reshard``: resource-neutral contracts for reusing model runtime resources
(weights, KV cache) across placements, as the published 0.3.13 package defines them.

The package root exports the four manifest contracts; :mod:`.contracts` adds the
identity types, :class:`~.contracts.RuntimeBindingFragment` and
:func:`~.contracts.validate_resource_binding_identity`; :mod:`.weight` the model-weight
manifests. docs/compat.md says which published parts are left out.
"""

from mooncake_core.compat.reshard.contracts import (
    PlacementManifest,
    ResourceKind,
    ResourceManifest,
    RuntimeBindingManifest,
)

__all__ = ["PlacementManifest", "ResourceKind", "ResourceManifest", "RuntimeBindingManifest"]
