"""OpenAI-compatible prefill/decode proxy (``mooncake-core proxy``).

Public API: :class:`ProxyServer` / :class:`ProxyConfig` (the aiohttp front), the policy
interface :class:`RoutingPolicy` with :class:`Instance`, :class:`Job`, :class:`Placement`,
and :func:`make_policy` / :data:`POLICIES`; :class:`StoreLookup` (which prompt pages the
store holds) and :class:`RemoteTokenizer` (token ids of text prompts) for ``global-cache``.
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
from mooncake_core.proxy.storelookup import StoreLookup
from mooncake_core.proxy.tokenize import RemoteTokenizer

__all__ = [
    "POLICIES",
    "GlobalCachePolicy",
    "Instance",
    "Job",
    "LeastLoadPolicy",
    "Placement",
    "ProxyConfig",
    "ProxyServer",
    "RemoteTokenizer",
    "RequestRejected",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "StoreLookup",
    "UpstreamError",
    "make_policy",
]
