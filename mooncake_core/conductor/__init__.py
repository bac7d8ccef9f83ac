"""The conductor: KV-cache-aware scheduling with early rejection, and its simulator.

Public API:

- :class:`Conductor` / :class:`ConductorConfig` / :class:`Decision`: per-request
  placement (``decide``) plus state updates (``prefill_done``, ``decode_done``, KV events).
- :class:`CostProfile` / :class:`CostModel` / :func:`fit_profile`: the cost model.
- :func:`simulate` / :data:`DEFAULT_CLUSTER`: discrete-event trace replay.
- :class:`Request` / :func:`load_trace`: Mooncake-format traces.
- :data:`POLICIES`: ``random``, ``least-load``, ``local-cache``, ``global-cache``.
"""

from __future__ import annotations

from mooncake_core.conductor.cache import BlockIndex
from mooncake_core.conductor.costmodel import (
    DEFAULT_PROFILE,
    CostModel,
    CostProfile,
    fit_profile,
    load_profile,
)
from mooncake_core.conductor.policy import POLICIES, Policy, make_policy
from mooncake_core.conductor.scheduler import Conductor, ConductorConfig, Decision
from mooncake_core.conductor.simulator import DEFAULT_CLUSTER, SimResult, simulate
from mooncake_core.conductor.trace import Request, load_trace

__all__ = [
    "BlockIndex",
    "Conductor",
    "ConductorConfig",
    "CostModel",
    "CostProfile",
    "DEFAULT_CLUSTER",
    "DEFAULT_PROFILE",
    "Decision",
    "POLICIES",
    "Policy",
    "Request",
    "SimResult",
    "fit_profile",
    "load_profile",
    "load_trace",
    "make_policy",
    "simulate",
]
