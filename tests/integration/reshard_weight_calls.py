"""The ``mooncake.reshard.weight`` and ``mooncake.reshard.geometry`` half of
``dataproto_reshard_calls.py`` (the same calls on the published package and on ours):
placements built, serialized, parsed back and refused; runtime bindings validated;
stored weight manifests; box geometry."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any


def weight_calls(call: Callable[..., Any], out: dict[str, Any]) -> None:
    import mooncake.reshard.geometry as geo
    import mooncake.reshard.weight as w
    from mooncake.reshard.weight.storage_manifest import (
        StoredManifestIdentity,
        validate_weight_manifest_snapshot,
    )

    rank0, rank1 = w.ParallelRank(tp=0), w.ParallelRank(tp=1)
    topo = w.ParallelTopology(
        tp_size=2,
        pp_size=1,
        ep_size=1,
        dp_size=1,
        participants=(
            w.TopologyParticipant("w1", rank1),
            w.TopologyParticipant("w0", rank0),
        ),
    )
    out["topology"] = [
        topo.topology_id,
        topo.world_size,
        [p.participant_id for p in topo.participants],
    ]
    split = w.TensorDescriptor("qkv", (8, 4), "float16", 2, (0,), "fp", (w.SplitAxis("tp", 0),), 0)
    norm = w.TensorDescriptor("norm", [4], "float32", 4, [], "fp", [w.ReplicatedAxis("tp")])
    embed = w.TensorDescriptor("embed", (6, 4), "bfloat16", 2, (), "fp", (w.ReplicatedAxis("tp"),))
    head = w.TensorDescriptor("lm_head", (6, 4), "bfloat16", 2, (), "fp", (w.ReplicatedAxis("tp"),))
    tensors = (split, norm, embed, head)
    frags = []
    for r in (rank0, rank1):
        frags.append(w.PlacementFragment("qkv", (4 * r.tp, 0), (4, 4), 32, r))
        frags.append(w.PlacementFragment("norm", (0,), (4,), 16, r, pipeline_stage_id=0))
        for name in ("embed", "lm_head"):
            frags.append(
                w.PlacementFragment(name, (0, 0), (6, 4), 48, r, aliases=("lm_head", "embed"))
            )
    out["fragment_ids"] = [f.placement_fragment_id for f in frags]
    ident = dict(resource_id="m", revision="r1", weight_generation=3, placement_set_id="s")
    pl = call("placement", w.WeightPlacementManifest.from_fragments, **ident, topology=topo,
              tensors=tensors, fragments=frags)  # fmt: skip
    if pl is None:
        return
    text = w.weight_placement_to_json(pl)
    out["placement_json"] = text
    out["placement_digest"] = [pl.digest, pl.placement_id, pl.resource_kind.value]
    back = call("from_json", w.weight_placement_from_json, text)
    out["round_trip_equal"] = back == pl
    doc = json.loads(text)

    def mutated(change: Callable[[dict[str, Any]], Any]) -> str:
        d = json.loads(text)
        change(d)
        return json.dumps(d)

    bad_json: list[tuple[str, Any]] = [
        ("j_not_json", "{"),
        ("j_not_str", 5),
        ("j_list", "[]"),
        ("j_nan", text[:-1] + ',"x":NaN}'),
        ("j_dup", text[:-1] + ',"revision":"r2"}'),
        ("j_extra", mutated(lambda d: d.update(extra=1))),
        ("j_kind", mutated(lambda d: d.update(resource_kind="kv_cache"))),
        ("j_gen_bool", mutated(lambda d: d.update(weight_generation=True))),
        ("j_pid", mutated(lambda d: d.update(placement_id="sha256:x"))),
        ("j_topo_id", mutated(lambda d: d["topology"].update(topology_id="t"))),
        ("j_topo_size", mutated(lambda d: d["topology"].update(tp_size=0))),
        (
            "j_axis_sem",
            mutated(lambda d: d["tensors"][0]["parallel_axes"].append({"semantics": "x"})),
        ),
        (
            "j_axis_split",
            mutated(
                lambda d: d["tensors"][0]["parallel_axes"].__setitem__(
                    0, {"semantics": "split", "kind": "dp", "dim": 0}
                )
            ),
        ),  # fmt: skip
        (
            "j_axis_kind",
            mutated(
                lambda d: d["tensors"][0]["parallel_axes"].__setitem__(
                    0, {"semantics": "replicated", "kind": "zz"}
                )
            ),
        ),  # fmt: skip
        ("j_frag_schema", mutated(lambda d: d["parts"][0]["fragments"][0].pop("nbytes"))),
        (
            "j_frag_legacy",
            mutated(
                lambda d: [
                    f.pop("pipeline_stage_id", None) for p in d["parts"] for f in p["fragments"]
                ]
            ),
        ),  # fmt: skip
        ("j_drop_frag", mutated(lambda d: d["parts"][1]["fragments"].pop(0))),
        ("j_unref", mutated(lambda d: d["tensors"].append(dict(d["tensors"][0], tensor_id="zz")))),
        ("j_rank", mutated(lambda d: d["parts"][0]["rank"].update(tp=-1))),
        ("j_part_fields", mutated(lambda d: d["parts"][0].update(x=1))),
        ("j_shape", mutated(lambda d: d["tensors"][0].update(global_shape="8"))),
        ("j_alias", mutated(lambda d: d["parts"][0]["fragments"][0]["aliases"].append(""))),
    ]
    for label, value in bad_json:
        call(label, w.weight_placement_from_json, value)
    out["doc_keys"] = sorted(doc)
    # constructor checks
    ctor_cases: list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]] = [
        ("e_rank", w.ParallelRank, (), {"tp": -1}),
        ("e_rank_bool", w.ParallelRank, (), {"dp": True}),
        ("e_split_dp", w.SplitAxis, ("dp", 0), {}),
        ("e_split_ep", w.SplitAxis, ("ep", 1), {}),
        ("e_axis_kind", w.ReplicatedAxis, ("zz",), {}),
        ("e_axis_empty", w.OwnershipAxis, ("",), {}),
        ("e_t_shape", w.TensorDescriptor, ("t", (), "f", 1, (), "fp", ()), {}),
        ("e_t_shape0", w.TensorDescriptor, ("t", (0,), "f", 1, (), "fp", ()), {}),
        ("e_t_dims", w.TensorDescriptor, ("t", (2, 2), "f", 1, (1, 0), "fp", ()), {}),
        ("e_t_dims_dup", w.TensorDescriptor, ("t", (2, 2), "f", 1, (0, 0), "fp", ()), {}),
        ("e_t_dims_range", w.TensorDescriptor, ("t", (2,), "f", 1, (1,), "fp", ()), {}),
        ("e_t_axes", w.TensorDescriptor, ("t", (2,), "f", 1, (), "fp", ("tp",)), {}),
        (
            "e_t_axes_dup",
            w.TensorDescriptor,
            ("t", (2,), "f", 1, (), "fp", (w.ReplicatedAxis("tp"), w.OwnershipAxis("tp"))),
            {},
        ),  # fmt: skip
        (
            "e_t_conflict",
            w.TensorDescriptor,
            ("t", (2,), "f", 1, (), "fp", (w.SplitAxis("tp", 0),)),
            {},
        ),
        (
            "e_t_expert",
            w.TensorDescriptor,
            ("t", (2,), "f", 1, (0,), "fp", (w.SplitAxis("ep", 0),)),
            {"expert_id": 1},
        ),  # fmt: skip
        ("e_t_fp", w.TensorDescriptor, ("t", (2,), "f", 1, (), "", ()), {}),
        (
            "t_sorted",
            w.TensorDescriptor,
            ("t", (2, 2), "f", 1, (0, 1), "fp", (w.SplitAxis("tp", 1), w.SplitAxis("ep", 0))),
            {},
        ),  # fmt: skip
        ("e_f_alias1", w.PlacementFragment, ("a", (0,), (1,), 1, rank0), {"aliases": ("a",)}),
        (
            "e_f_alias_self",
            w.PlacementFragment,
            ("a", (0,), (1,), 1, rank0),
            {"aliases": ("b", "c")},
        ),
        (
            "e_f_alias_dup",
            w.PlacementFragment,
            ("a", (0,), (1,), 1, rank0),
            {"aliases": ("a", "a")},
        ),
        ("e_f_rank", w.PlacementFragment, ("a", (0,), (1,), 1, "r"), {}),
        ("e_f_nbytes", w.PlacementFragment, ("a", (0,), (1,), 0, rank0), {}),
        ("e_f_offset", w.PlacementFragment, ("a", "0", (1,), 1, rank0), {}),
        (
            "f_given_id",
            w.PlacementFragment,
            ("a", [0], [1], 1, rank0),
            {"placement_fragment_id": "x"},
        ),
        (
            "e_topo_dup",
            w.ParallelTopology,
            (),
            dict(
                tp_size=2,
                pp_size=1,
                ep_size=1,
                dp_size=1,
                participants=(w.TopologyParticipant("a", rank0), w.TopologyParticipant("b", rank0)),
            ),
        ),  # fmt: skip
        (
            "e_topo_range",
            w.ParallelTopology,
            (),
            dict(
                tp_size=1,
                pp_size=1,
                ep_size=1,
                dp_size=1,
                participants=(w.TopologyParticipant("a", rank1),),
            ),
        ),  # fmt: skip
        (
            "e_topo_empty",
            w.ParallelTopology,
            (),
            dict(tp_size=1, pp_size=1, ep_size=1, dp_size=1, participants=()),
        ),  # fmt: skip
        (
            "e_topo_id",
            w.ParallelTopology,
            (),
            dict(
                tp_size=2,
                pp_size=1,
                ep_size=1,
                dp_size=1,
                participants=topo.participants,
                topology_id="sha256:0",
            ),
        ),  # fmt: skip
        (
            "topo_same_id",
            w.ParallelTopology,
            (),
            dict(
                tp_size=2,
                pp_size=1,
                ep_size=1,
                dp_size=1,
                participants=topo.participants,
                topology_id=topo.topology_id,
            ),
        ),  # fmt: skip
        ("e_participant", topo.participant, ("zz",), {}),
        (
            "e_pl_missing",
            w.WeightPlacementManifest.from_fragments,
            (),
            dict(ident, topology=topo, tensors=tensors, fragments=frags[1:]),
        ),  # fmt: skip
        (
            "e_pl_unref",
            w.WeightPlacementManifest.from_fragments,
            (),
            dict(ident, topology=topo, tensors=tensors, fragments=frags[:4]),
        ),  # fmt: skip
        (
            "e_pl_overlap",
            w.WeightPlacementManifest.from_fragments,
            (),
            dict(
                ident,
                topology=topo,
                tensors=tensors,
                fragments=[*frags, w.PlacementFragment("qkv", (2, 0), (4, 4), 32, rank0)],
            ),
        ),  # fmt: skip
        (
            "e_pl_geometry",
            w.WeightPlacementManifest.from_fragments,
            (),
            dict(
                ident,
                topology=topo,
                tensors=tensors,
                fragments=[*frags[1:], w.PlacementFragment("qkv", (0, 0), (4, 4), 30, rank0)],
            ),
        ),  # fmt: skip
        (
            "e_pl_alias",
            w.WeightPlacementManifest.from_fragments,
            (),
            dict(
                ident,
                topology=topo,
                tensors=tensors,
                fragments=[
                    f
                    if f.tensor_id != "lm_head"
                    else w.PlacementFragment("lm_head", (0, 0), (6, 4), 48, f.rank)
                    for f in frags
                ],
            ),
        ),  # fmt: skip
        (
            "e_pl_pid",
            w.WeightPlacementManifest,
            (),
            dict(ident, topology=topo, parts=pl.parts, placement_id="x"),
        ),  # fmt: skip
        (
            "pl_parts",
            w.WeightPlacementManifest,
            (),
            dict(ident, topology=topo, parts=pl.parts[::-1]),
        ),
        (
            "e_pl_parts",
            w.WeightPlacementManifest,
            (),
            dict(ident, topology=topo, parts=pl.parts[:1]),
        ),
        (
            "e_pl_gen",
            w.WeightPlacementManifest,
            (),
            dict(ident, weight_generation=4, topology=topo, parts=pl.parts),
        ),  # fmt: skip
        ("e_pl_topo", w.WeightPlacementManifest, (), dict(ident, topology="t", parts=pl.parts)),
        ("e_to_json", w.weight_placement_to_json, ("x",), {}),
    ]
    for label, fn, args, kw in ctor_cases:
        call(label, fn, *args, **kw)
    out["pl_parts_same"] = out.get("pl_parts") == out.get("placement")
    # runtime bindings: participant w0's views in one allocation, the aliases sharing one
    by_id = {f.tensor_id: f for f in pl.parts[0].fragments}
    itemsizes = {t.tensor_id: t.itemsize for t in tensors}

    def view(tid: str, address: int, **change: Any) -> Any:
        f, size = by_id[tid], itemsizes[tid]
        strides = (size * f.local_shape[1], size) if len(f.local_shape) == 2 else (size,)
        args: dict[str, Any] = {
            "placement_fragment_id": f.placement_fragment_id,
            "fragment_id": f"rt-{tid}",
            "address": address,
            "nbytes": f.nbytes,
            "worker_id": "w0",
            "endpoint": "e",
            "device": "cpu",
            "itemsize": size,
            "local_shape": f.local_shape,
            "strides_bytes": strides,
            "storage_address": 4096,
            "storage_nbytes": 4096,
            "storage_offset_bytes": address - 4096,
        }
        args.update(change)
        return w.RuntimeBindingFragment(**args)

    views = [view("qkv", 4096), view("norm", 4160), view("embed", 4224), view("lm_head", 4224)]

    def binding(items: Any, **change: Any) -> Any:
        args = dict(resource_id="m", placement_id=pl.placement_id, placement_digest=pl.digest,
                    instance_id="i", generation=1, lease_id="l", revision="r1",
                    participant_id="w0", fragments=tuple(items))  # fmt: skip
        args.update(change)
        return w.WeightRuntimeBindingManifest(**args)

    b0 = call("binding", binding, views)
    call("bind_ok", w.validate_runtime_binding, pl, b0)
    call("e_bind_all", w.validate_runtime_bindings, pl, [b0])
    call("e_bind_dup", w.validate_runtime_bindings, pl, [b0, b0])
    call("e_bind_digest", binding, views, placement_digest="ab")
    call("e_bind_views", binding, [views[0], views[0]])
    call("e_bind_rev", w.validate_runtime_binding, pl, binding(views, revision="r2"))
    call("e_bind_pid", w.validate_runtime_binding, pl, binding(views, placement_id="p"))
    call("e_bind_who", w.validate_runtime_binding, pl, binding(views, participant_id="w9"))
    call("e_bind_missing", w.validate_runtime_binding, pl, binding(views[1:]))
    call("e_bind_overlap", w.validate_runtime_binding, pl,
         binding([view("qkv", 4096), view("norm", 4100), *views[2:]]))  # fmt: skip
    call("e_bind_alloc", w.validate_runtime_binding, pl,
         binding([*views[:3], view("lm_head", 4224, storage_address=4200, storage_nbytes=4096,
                                   storage_offset_bytes=24)]))  # fmt: skip
    call("e_bind_stride", w.validate_runtime_binding, pl,
         binding([view("qkv", 4096, strides_bytes=(8, 4), nbytes=32), *views[1:]]))  # fmt: skip
    call("e_bind_type", w.validate_runtime_binding, pl, "b")
    # stored weight manifests
    sfrags = [
        w.StoredFragment("s0", "qkv", (0, 0), (8, 4), "g/payload/0", 0, 64),
        w.StoredFragment("s1", "norm", (0,), (4,), "g/payload/0", 64, 16),
        w.StoredFragment("s2", "embed", (0, 0), (6, 4), "g/payload/1", 0, 48, ("lm_head", "embed")),
        w.StoredFragment(
            "s3", "lm_head", (0, 0), (6, 4), "g/payload/1", 48, 48, ("embed", "lm_head")
        ),
    ]
    wm_args = dict(namespace="ns", resource_id="m", revision="r1", weight_generation=3,
                   group_id="g", manifest_key="g/manifest", tensors=tensors,
                   fragments=tuple(sfrags), created_at="2026-12-02T00:00:00Zé")  # fmt: skip
    wm = call("weight_manifest", w.WeightManifest, **wm_args)
    if wm is not None:
        out["wm_json"] = wm.to_json()
        out["wm_digest"] = wm.manifest_digest
        call("wm_identity", lambda: wm.manifest_identity)
        call("wm_round_trip", lambda: w.WeightManifest.from_json(wm.to_json().encode()) == wm)
        call("wm_snapshot", lambda: validate_weight_manifest_snapshot(wm) == wm)
        wdoc = json.loads(wm.to_json())
        json_cases: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
            ("wm_e_extra", lambda d: d.update(x=1)),
            ("wm_e_kind", lambda d: d.update(resource_kind="kv")),
            ("wm_e_tensor", lambda d: d["tensors"][0].update(itemsize=0)),
            ("wm_e_tfields", lambda d: d["tensors"][0].pop("dtype")),
            ("wm_e_frag", lambda d: d["fragments"][0].update(object_offset=-1)),
            ("wm_e_alias", lambda d: d["fragments"][2].update(aliases=["embed", 5])),
            ("wm_e_gen", lambda d: d.update(weight_generation=-1)),
            ("wm_e_axes", lambda d: d["tensors"][0].update(parallel_axes="x")),
        ]
        for label, edit in json_cases:
            d = json.loads(json.dumps(wdoc))
            edit(d)
            call(label, w.WeightManifest.from_dict, d)
        call("wm_e_json", w.WeightManifest.from_json, "{]")
        call("wm_e_dup", w.WeightManifest.from_json, '{"a":1,"a":2}')
    manifest_cases: list[tuple[str, dict[str, Any]]] = [
        ("wm_e_key", {"manifest_key": "h/manifest"}),
        ("wm_e_payload", {"group_id": "h", "manifest_key": "h/manifest"}),
        ("wm_e_cover", {"fragments": tuple(sfrags[1:])}),
        (
            "wm_e_range",
            {
                "fragments": (
                    sfrags[0],
                    sfrags[1],
                    sfrags[2],
                    w.StoredFragment(
                        "s3", "lm_head", (0, 0), (6, 4), "g/payload/1", 40, 48, ("embed", "lm_head")
                    ),
                )
            },
        ),  # fmt: skip
        (
            "wm_e_alias_part",
            {
                "fragments": (
                    *sfrags[:3],
                    w.StoredFragment("s3", "lm_head", (0, 0), (6, 4), "g/payload/1", 48, 48),
                )
            },
        ),  # fmt: skip
        ("wm_e_items", {"tensors": ("t",)}),
    ]
    for label, change in manifest_cases:
        call(label, w.WeightManifest, **{**wm_args, **change})
    if wm is not None:
        planner_calls(call, out, pl, wm)
    call("e_identity", StoredManifestIdentity, "n", "m", "r", 1, "g", "g/manifest", "AB" * 32)
    call("e_snapshot", validate_weight_manifest_snapshot, "x")
    # geometry
    box = SimpleNamespace(global_offset=(0, 0), local_shape=(2, 2))
    region = [SimpleNamespace(overlap_offset=(0, 0), overlap_shape=(1, 2)),
              SimpleNamespace(overlap_offset=(1, 0), overlap_shape=(1, 2))]  # fmt: skip
    geometry_cases: list[tuple[str, Any, tuple[Any, ...]]] = [
        ("g_contains", geo.box_contains, ((0, 0), (4, 4), (1, 1), (3, 3))),
        ("g_contains_no", geo.box_contains, ((0, 0), (4, 4), (1, 1), (4, 3))),
        ("g_contains_rank", geo.box_contains, ((0, 0), (4, 4), (1,), (3,))),
        ("g_contains_rank_no", geo.box_contains, ((0, 0), (4, 4), (5,), (3,))),
        ("g_ov1", geo.boxes_overlap, ([((0,), (2,)), ((2,), (2,)), ((1,), (1,))],)),
        ("g_ov1_no", geo.boxes_overlap, ([((0,), (2,)), ((2,), (2,))],)),
        ("g_ov2", geo.boxes_overlap, ([((0, 0), (2, 2)), ((1, 1), (2, 2))],)),
        ("g_ov2_no", geo.boxes_overlap, ([((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 4))],)),
        ("g_ov3", geo.boxes_overlap, ([((0, 0, 0), (2, 2, 2)), ((1, 1, 1), (1, 1, 1))],)),
        ("g_ov3_no", geo.boxes_overlap, ([((0, 0, 0), (2, 2, 2)), ((0, 0, 2), (2, 2, 2))],)),
        (
            "g_cover",
            geo.boxes_exactly_cover,
            ((0, 0), (2, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2))]),
        ),
        ("g_cover_gap", geo.boxes_exactly_cover, ((0, 0), (2, 4), [((0, 0), (2, 2))])),
        ("g_cover_empty", geo.boxes_exactly_cover, ((0,), (2,), [])),
        ("g_regions", geo.regions_exactly_cover, (box, region)),
    ]
    for label, fn, args in geometry_cases:
        call(label, fn, *args)


def plan_summary(plan: Any) -> dict[str, Any]:
    """What a LogicalTransferPlan says: regions, executors, routes, totals."""

    def executors(side: str) -> list[Any]:
        items = plan.source_executors if side == "source" else plan.target_executors
        return [
            [e.participant_id, e.rank.tp, list(e.placement_fragment_ids),
             list(plan.operation_indices_for_executor(e, side))]
            for e in items
        ]  # fmt: skip

    return {
        "ops": [
            [
                o.tensor_id,
                o.source.fragment_id,
                o.target.fragment_id,
                o.overlap_offset,
                o.overlap_shape,
                o.source_base_offset,
                o.target_base_offset,
                o.inner_bytes,
                o.outer_loop_counts,
                o.source_strides,
                o.target_strides,
            ]
            for o in plan.operations
        ],  # fmt: skip
        "source_executors": executors("source"),
        "target_executors": executors("target"),
        "routes": [
            [
                r.source_pp,
                r.source_pipeline_stage_id,
                r.target_pp,
                r.target_pipeline_stage_id,
                r.operation_indices,
            ]
            for r in plan.pipeline_routes
        ],  # fmt: skip
        "total_bytes": plan.total_bytes,
        "ids": [plan.source_placement_id, plan.target_placement_id],
        "identity": None
        if plan.source_manifest_identity is None
        else plan.source_manifest_identity.content_sha256,
    }


def planner_calls(call: Callable[..., Any], out: dict[str, Any], pl: Any, wm: Any) -> None:
    """Plans between the script's tp=2 placement, a tp=1 one and the stored manifest."""
    import dataclasses
    import pickle

    import mooncake.reshard.weight as w

    one = w.ParallelRank()
    topo1 = w.ParallelTopology(
        tp_size=1, pp_size=1, ep_size=1, dp_size=1, participants=(w.TopologyParticipant("t0", one),)
    )
    frags = []
    for t in pl.tensors:
        group = ("embed", "lm_head") if t.tensor_id in ("embed", "lm_head") else ()
        nbytes = t.itemsize
        for n in t.global_shape:
            nbytes *= n
        frags.append(
            w.PlacementFragment(t.tensor_id, (0,) * len(t.global_shape), t.global_shape, nbytes,
                                one, aliases=group)
        )  # fmt: skip
    ident = dict(resource_id="m", revision="r1", weight_generation=3, placement_set_id="s1")
    tgt = w.WeightPlacementManifest.from_fragments(
        **ident, topology=topo1, tensors=pl.tensors, fragments=frags
    )

    def summarize(label: str, fn: Any, *args: Any, **kw: Any) -> Any:
        plan = call(label, lambda: plan_summary(fn(*args, **kw)))
        return plan

    summarize("plan_2_to_1", w.plan_placement_transfer, pl, tgt)
    summarize("plan_1_to_2", w.plan_placement_transfer, tgt, pl)
    summarize("plan_local_w1", w.plan_placement_transfer_to_local_target, tgt, pl, "w1")
    summarize("plan_local_default", w.plan_placement_transfer_to_local_target, pl, tgt)
    summarize("plan_stored", w.plan_stored_transfer_to_target_placement, wm, pl)
    call("e_plan_local_multi", w.plan_placement_transfer_to_local_target, tgt, pl)
    call("e_plan_local_who", w.plan_placement_transfer_to_local_target, tgt, pl, "zz")
    call("e_plan_limit", w.plan_placement_transfer, tgt, pl,
         planning_limits=w.PlanningLimits(max_transfer_regions=3))  # fmt: skip
    call("e_plan_segments", w.plan_placement_transfer, tgt, pl,
         planning_limits=w.PlanningLimits(max_total_lowered_segments=2))  # fmt: skip
    call("e_limits", w.PlanningLimits, 0)
    call("e_plan_type", w.plan_placement_transfer, "x", pl)
    other = w.WeightPlacementManifest.from_fragments(
        **dict(ident, revision="r2"), topology=topo1, tensors=pl.tensors, fragments=frags
    )
    call("e_plan_revision", w.plan_placement_transfer, pl, other)
    changed = [dataclasses.replace(t, layout_fingerprint="fp2") if t.tensor_id == "norm" else t
               for t in pl.tensors]  # fmt: skip
    relaid = w.WeightPlacementManifest.from_fragments(
        **ident, topology=topo1, tensors=changed, fragments=frags
    )
    call("e_plan_layout", w.plan_placement_transfer, pl, relaid)
    # a tensor split on its last dimension: strided regions
    r0, r1 = w.ParallelRank(tp=0), w.ParallelRank(tp=1)
    topo2 = w.ParallelTopology(tp_size=2, pp_size=1, ep_size=1, dp_size=1,
                               participants=(w.TopologyParticipant("a", r0),
                                             w.TopologyParticipant("b", r1)))  # fmt: skip
    col = w.TensorDescriptor("col", (4, 6), "float32", 4, (1,), "fp", (w.SplitAxis("tp", 1),))
    split = w.WeightPlacementManifest.from_fragments(
        **ident, topology=topo2, tensors=(col,),
        fragments=(w.PlacementFragment("col", (0, 0), (4, 3), 48, r0),
                   w.PlacementFragment("col", (0, 3), (4, 3), 48, r1)))  # fmt: skip
    whole = w.WeightPlacementManifest.from_fragments(
        **ident, topology=topo1, tensors=(col,),
        fragments=(w.PlacementFragment("col", (0, 0), (4, 6), 96, one),))  # fmt: skip
    plan = call("plan_strided_raw", lambda: plan_summary(w.plan_placement_transfer(whole, split)))
    if plan is None:
        return
    real = w.plan_placement_transfer(whole, split)
    region = real.operations[1]
    call("segments", lambda: list(region.iter_segments(max_segments=4)))
    call("e_segments", lambda: list(region.iter_segments(max_segments=3)))
    call("e_segments_arg", lambda: list(region.iter_segments(max_segments=0)))
    call("region_props", lambda: [region.segment_count, region.total_bytes, region.nbytes,
                                  region.repeat, region.source_offset, region.target_offset,
                                  region.source_stride, region.target_stride])  # fmt: skip
    call("pickled_equal", lambda: pickle.loads(pickle.dumps(real)) == real)
    region_cases: list[tuple[str, dict[str, Any]]] = [
        ("e_region_base", {"source_base_offset": 4}),
        ("e_region_inner", {"inner_bytes": 0}),
        (
            "e_region_canon",
            {
                "inner_bytes": 6,
                "outer_loop_counts": (8,),
                "source_strides": (12,),
                "target_strides": (6,),
            },
        ),  # fmt: skip
        ("e_region_box", {"overlap_shape": (4, 4)}),
        ("e_region_ints", {"overlap_offset": "00"}),
        ("e_region_rank", {"overlap_offset": (0,)}),
        ("e_region_neg", {"target_strides": (-1,)}),
        ("e_region_counts", {"outer_loop_counts": (4, 1)}),
    ]
    for label, change in region_cases:
        call(label, dataclasses.replace, region, **change)
    call("e_executor", real.operation_indices_for_executor, real.target_executors[0], "source")
    call("e_side", real.operation_indices_for_executor, real.target_executors[0], "middle")
    call("e_route", w.PipelineRouteGroup, None, None, 0, None, (1, 1))
    call("e_exec_plan", w.PlacementExecutorPlan, "p", "a", r0, ())
