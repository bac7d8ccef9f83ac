"""Elastic expert parallelism for MoE layers that keeps serving when ranks fail.

Public API: :class:`ElasticEP` (dispatch/combine/forward, start/join/rebalance),
:class:`EPConfig`, placement (:class:`Placement`, :func:`balanced_placement`,
:func:`repair_placement`), routing (:func:`route`), expert weight sources
(:class:`ExpertWeightSource`, :class:`LiveReplicaSource`, :class:`StoreWeightSource`) and
the tiny reference expert (:class:`ExpertBank`, :func:`reference_moe`). See docs/ep.md.
"""

from __future__ import annotations

from mooncake_core.ep.config import EPConfig
from mooncake_core.ep.engine import DispatchHandle, ElasticEP
from mooncake_core.ep.experts import ExpertBank, make_expert_weights, reference_moe, run_expert
from mooncake_core.ep.membership import AliveInfo, MembershipStoreLost, View, plan_view
from mooncake_core.ep.placement import (
    Placement,
    balanced_placement,
    repair_placement,
    seat_imbalance,
)
from mooncake_core.ep.routing import Policy, ReplicaTable, Route, route, validate_routing
from mooncake_core.ep.weights import (
    STORE,
    ExpertWeightSource,
    FetchContext,
    LiveReplicaSource,
    StoreClientProtocol,
    StoreWeightSource,
    Transfer,
)

__all__ = [
    "STORE",
    "AliveInfo",
    "DispatchHandle",
    "ElasticEP",
    "EPConfig",
    "ExpertBank",
    "ExpertWeightSource",
    "FetchContext",
    "LiveReplicaSource",
    "MembershipStoreLost",
    "Placement",
    "Policy",
    "ReplicaTable",
    "Route",
    "StoreClientProtocol",
    "StoreWeightSource",
    "Transfer",
    "View",
    "balanced_placement",
    "make_expert_weights",
    "plan_view",
    "reference_moe",
    "repair_placement",
    "route",
    "run_expert",
    "seat_imbalance",
    "validate_routing",
]
