"""OpenAI-compatible prefill/decode proxy (``mooncake-core proxy``), for any engine.

Public API: :class:`ProxyServer` / :class:`ProxyConfig` (the aiohttp front), the policy
interface :class:`RoutingPolicy` with :class:`Instance`, :class:`Job`, :class:`Placement`,
and :func:`make_policy` / :data:`POLICIES`; :class:`StoreLookup` (which prompt pages the
store holds) and :class:`RemoteTokenizer` (token ids of text prompts) for ``global-cache``;
:class:`ProxyEngine` (what an engine adapter provides, through the plugin hook
``mooncake_proxy_engine``) and :func:`proxy_engine` (find the one for ``--engine``).

Modules: ``server`` (HTTP front), ``policy`` (routing), ``engine`` (the engine contract
and neutral KV events), ``kvevents`` (ZMQ listener), ``storelookup``, ``tokenize``.
"""

from __future__ import annotations

from mooncake_core.proxy.engine import DEFAULT_ENGINE, ProxyEngine, StoreKeys, proxy_engine
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
    "DEFAULT_ENGINE",
    "POLICIES",
    "GlobalCachePolicy",
    "Instance",
    "Job",
    "LeastLoadPolicy",
    "Placement",
    "ProxyConfig",
    "ProxyEngine",
    "ProxyServer",
    "RemoteTokenizer",
    "RequestRejected",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "StoreKeys",
    "StoreLookup",
    "UpstreamError",
    "make_policy",
    "proxy_engine",
]
