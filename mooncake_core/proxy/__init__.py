"""OpenAI-compatible prefill/decode proxy (``mooncake-core proxy``).

Public API: :class:`ProxyServer` / :class:`ProxyConfig` (the aiohttp front), the policy
interface :class:`RoutingPolicy` with :class:`Instance`, :class:`Job`, :class:`Placement`,
and :func:`make_policy` / :data:`POLICIES`.
"""

from __future__ import annotations

from mooncake_core.proxy.policy import (
    POLICIES,
    GlobalCachePolicy,
    Instance,
    Job,
    LeastLoadPolicy,
    Placement,
    RequestRejected,
    RoundRobinPolicy,
    RoutingPolicy,
    make_policy,
)
from mooncake_core.proxy.server import ProxyConfig, ProxyServer, UpstreamError

__all__ = [
    "POLICIES",
    "GlobalCachePolicy",
    "Instance",
    "Job",
    "LeastLoadPolicy",
    "Placement",
    "ProxyConfig",
    "ProxyServer",
    "RequestRejected",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "UpstreamError",
    "make_policy",
]
