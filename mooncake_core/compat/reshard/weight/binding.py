"""Checks that runtime bindings realise exactly a weight placement."""

from __future__ import annotations

from mooncake_core.compat.reshard.contracts import (
    RuntimeInstanceId,
    validate_resource_binding_identity,
)
from mooncake_core.compat.reshard.weight.placement import WeightPlacementManifest
from mooncake_core.compat.reshard.weight.runtime import WeightRuntimeBindingManifest
from mooncake_core.compat.reshard.weight.types import (
    canonical_strides_bytes,
    require_manifest_items,
)
from mooncake_core.compat.reshard.weight.validation import (
    _validate_runtime_binding_address_ranges,
)

__all__ = ["validate_runtime_binding", "validate_runtime_bindings"]


def validate_runtime_binding(
    placement: WeightPlacementManifest,
    binding: WeightRuntimeBindingManifest,
) -> None:
    """Raise ``ValueError`` unless ``binding`` covers exactly its participant's part of
    ``placement`` with dense views of the right size, shape and itemsize, and its views
    and allocations do not overlap."""
    if not isinstance(placement, WeightPlacementManifest):
        raise ValueError("placement must be a WeightPlacementManifest")
    if not isinstance(binding, WeightRuntimeBindingManifest):
        raise ValueError("binding must be a WeightRuntimeBindingManifest")
    validate_resource_binding_identity(placement, binding)
    if placement.revision != binding.revision:
        raise ValueError("placement and runtime binding revision differ")
    part = next((p for p in placement.parts if p.participant_id == binding.participant_id), None)
    if part is None:
        raise ValueError(f"unknown runtime binding participant: {binding.participant_id}")
    planned = {f.placement_fragment_id: f for f in part.fragments}
    bound = {f.placement_fragment_id: f for f in binding.fragments}
    tensors = {t.tensor_id: t for t in placement.tensors}
    unknown = sorted(bound.keys() - planned.keys())
    if unknown:
        raise ValueError(f"unknown placement fragment in runtime binding: {unknown[0]}")
    missing = sorted(planned.keys() - bound.keys())
    if missing:
        raise ValueError(f"missing placement fragment in runtime binding: {missing[0]}")
    for frag in part.fragments:
        view = bound[frag.placement_fragment_id]
        tensor = tensors[frag.tensor_id]
        if view.nbytes != frag.nbytes:
            what = "byte size"
        elif view.local_shape != frag.local_shape:
            what = "local_shape"
        elif view.itemsize != tensor.itemsize:
            what = "itemsize"
        elif view.strides_bytes != canonical_strides_bytes(frag.local_shape, tensor.itemsize):
            raise ValueError(
                "runtime binding stride does not describe a canonical contiguous view: "
                f"{frag.placement_fragment_id}"
            )
        else:
            continue
        raise ValueError(
            f"runtime binding {what} does not match placement: {frag.placement_fragment_id}"
        )
    _validate_runtime_binding_address_ranges(
        instance_id=binding.instance_id,
        tensors=placement.tensors,
        placements=part.fragments,
        bindings=binding.fragments,
    )


def _validate_runtime_binding_subset(
    placement: WeightPlacementManifest, bindings: object
) -> tuple[WeightRuntimeBindingManifest, ...]:
    items = require_manifest_items(bindings, "runtime bindings", WeightRuntimeBindingManifest)
    if len({b.participant_id for b in items}) != len(items):
        raise ValueError("duplicate runtime binding participant")
    for binding in items:
        validate_runtime_binding(placement, binding)
    parts = {p.participant_id: p for p in placement.parts}
    per_instance: dict[RuntimeInstanceId, list[WeightRuntimeBindingManifest]] = {}
    for binding in items:
        per_instance.setdefault(binding.instance_id, []).append(binding)
    for instance_id, group in per_instance.items():  # participants sharing a process
        _validate_runtime_binding_address_ranges(
            instance_id=instance_id,
            tensors=placement.tensors,
            placements=tuple(f for b in group for f in parts[b.participant_id].fragments),
            bindings=tuple(f for b in group for f in b.fragments),
        )
    return items


def validate_runtime_bindings(placement: WeightPlacementManifest, bindings: object) -> None:
    """:func:`validate_runtime_binding` for each, no two for one participant, none
    overlapping within one instance, and exactly one for each participant that holds
    fragments."""
    items = _validate_runtime_binding_subset(placement, bindings)
    want = {p.participant_id for p in placement.parts if p.fragments}
    have = {b.participant_id for b in items}
    missing = sorted(want - have)
    if missing:
        raise ValueError(f"missing runtime binding participant: {missing[0]}")
    unknown = sorted(have - want)
    if unknown:
        raise ValueError(f"unknown runtime binding participant: {unknown[0]}")
