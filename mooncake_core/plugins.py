"""Plugin system: pluggy hookspecs and the entry-point groups that feed them.

Entry-point groups (each entry point names a module or object carrying ``@hookimpl``
functions):

- ``mooncake_core.transports``: transports (built-in: tcp, shm, rdma),
- ``mooncake_core.metadata``: metadata backends (built-in: p2p, http, etcd),
- ``mooncake_core.adapters``: engine adapters (mooncake-vllm, mooncake-sglang, ...).

Built-ins register through the same groups as third parties; when the package is run
from a source tree without installed metadata they are registered directly. Set
``MOONCAKE_DISABLE_PLUGIN_AUTOLOAD=1`` to load only the built-ins (tests), and
``MOONCAKE_BLOCK_PLUGINS=a,b`` to block plugins by entry-point name.

The markers ``hookimpl``/``hookspec`` live in the leaf :mod:`mooncake_core.hookmarkers`
(re-exported here). This module sits below metadata and transfer in the layering
(``.importlinter``): it must not import them, not even for type checking.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from mooncake_core.config import MooncakeConfig, env_flag, env_list
from mooncake_core.errors import PluginError
from mooncake_core.hookmarkers import PROJECT, hookimpl, hookspec

__all__ = [
    "PROJECT",
    "GROUPS",
    "hookimpl",
    "hookspec",
    "TransportInfo",
    "TransportFactory",
    "MetadataBackendInfo",
    "MetadataBackendFactory",
    "AdapterInfo",
    "get_plugin_manager",
    "reset_plugin_manager",
    "transports",
    "metadata_backends",
    "adapters",
]

logger = logging.getLogger(__name__)

GROUPS = ("mooncake_core.transports", "mooncake_core.metadata", "mooncake_core.adapters")

# The plugin layer sits below metadata and transfer, so it names what the factories build
# without importing them: a transport factory gets the engine's narrow host interface
# (``mooncake_core.transfer.types.TransportHost``) and returns a
# ``mooncake_core.transfer.transports.base.Transport``; a metadata factory returns a
# ``mooncake_core.metadata.base.MetadataBackend``.
TransportFactory = Callable[[Any], Any]
"""``factory(host) -> Transport``: builds one transport for one engine."""
MetadataBackendFactory = Callable[[str, MooncakeConfig], Any]
"""``factory(url, config) -> MetadataBackend``: opens the backend serving ``url``."""

_BUILTINS = {
    "mooncake_core.transports": {
        "tcp": "mooncake_core.transfer.transports.tcp",
        "shm": "mooncake_core.transfer.transports.shm",
        "rdma": "mooncake_core.transfer.transports.rdma",
    },
    "mooncake_core.metadata": {
        "p2p": "mooncake_core.metadata.p2p",
        "http": "mooncake_core.metadata.http",
        "etcd": "mooncake_core.metadata.etcd",
    },
}


@dataclass(frozen=True)
class TransportInfo:
    """A transport offered by a plugin.

    Attributes:
        name: protocol string (``"tcp"``, ``"shm"``, ``"rdma"``).
        factory: builds the transport for one engine: ``factory(host) -> Transport``, where
            ``host`` is the engine seen through ``transfer.types.TransportHost``.
        priority: lower is tried first when several transports can reach a peer.
        description: one line for ``mooncake-core plugins``.
    """

    name: str
    factory: TransportFactory
    priority: int
    description: str = ""


@dataclass(frozen=True)
class MetadataBackendInfo:
    """A metadata backend offered by a plugin.

    Attributes:
        name: short name (``"etcd"``).
        schemes: connection-string prefixes it serves (``("etcd://",)``); ``"P2PHANDSHAKE"``
            is the scheme of the handshake backend.
        factory: ``factory(url, config) -> MetadataBackend``.
        description: one line for ``mooncake-core plugins``.
    """

    name: str
    schemes: tuple[str, ...]
    factory: MetadataBackendFactory
    description: str = ""


@dataclass(frozen=True)
class AdapterInfo:
    """An engine adapter, as listed by ``mooncake-core plugins``."""

    name: str
    package: str
    engine: str
    engine_installed: bool
    conformance: str
    status: str = ""


class MooncakeHookSpecs:
    """Hook specifications. Every hook is prefixed ``mooncake_``."""

    # ---------------------------------------------------------------- transports
    @hookspec
    def mooncake_transports(self) -> list[TransportInfo]:  # type: ignore[empty-body]
        """Return the transports this plugin provides.

        :return: a list of :class:`TransportInfo`; every plugin is asked (broadcast).
        """

    # ---------------------------------------------------------------- metadata
    @hookspec
    def mooncake_metadata_backends(self) -> list[MetadataBackendInfo]:  # type: ignore[empty-body]
        """Return the metadata backends this plugin provides.

        :return: a list of :class:`MetadataBackendInfo`; every plugin is asked.
        """

    # ---------------------------------------------------------------- adapters
    @hookspec
    def mooncake_adapter_info(self) -> AdapterInfo:  # type: ignore[empty-body]
        """Describe an engine adapter for listings and conformance status.

        :return: one :class:`AdapterInfo`; every adapter is asked.
        """

    # ---------------------------------------------------------------- proxy
    @hookspec(firstresult=True)
    def mooncake_proxy_engine(self, name: str) -> Any:
        """Return what ``mooncake-core proxy --engine NAME`` needs from that engine, or None.

        The answer follows the ``ProxyEngine`` protocol of ``mooncake_core.proxy.engine``
        (how a PD request is split, tokenizer endpoint, KV-event decoding, store keys); it
        is typed ``Any`` here because this module sits below the proxy.

        :param name: engine name (``"vllm"``, ``"sglang"``, ...).
        :return: first non-None answer wins; later adapters are not asked.
        """


_pm: pluggy.PluginManager | None = None
_lock = threading.Lock()


def _blocked() -> set[str]:
    return set(env_list("MOONCAKE_BLOCK_PLUGINS"))


def get_plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, loading entry points on first use."""
    global _pm
    with _lock:
        if _pm is not None:
            return _pm
        pm = pluggy.PluginManager(PROJECT)
        pm.add_hookspecs(MooncakeHookSpecs)
        for name in _blocked():
            pm.set_blocked(name)
        if not env_flag("MOONCAKE_DISABLE_PLUGIN_AUTOLOAD"):
            for group in GROUPS:
                try:
                    pm.load_setuptools_entrypoints(group)
                except Exception as exc:  # a broken third-party plugin must be named
                    raise PluginError(
                        f"loading entry points of group {group!r} failed: {exc}"
                    ) from exc
        for table in _BUILTINS.values():
            for name, modpath in table.items():
                if pm.has_plugin(name) or pm.is_blocked(name):
                    continue
                pm.register(importlib.import_module(modpath), name=name)
        try:
            pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {exc.plugin!r} implements an unknown hook: {exc}") from exc
        _pm = pm
        return pm


def reset_plugin_manager() -> None:
    """Forget the plugin manager (tests that change environment variables)."""
    global _pm
    with _lock:
        _pm = None


def transports() -> dict[str, TransportInfo]:
    """Every transport discovered, by protocol name."""
    out: dict[str, TransportInfo] = {}
    for infos in get_plugin_manager().hook.mooncake_transports():
        for info in infos:
            if info.name in out:
                raise PluginError(f"transport {info.name!r} is provided twice")
            out[info.name] = info
    return out


def metadata_backends() -> dict[str, MetadataBackendInfo]:
    """Every metadata backend discovered, by name."""
    out: dict[str, MetadataBackendInfo] = {}
    for infos in get_plugin_manager().hook.mooncake_metadata_backends():
        for info in infos:
            if info.name in out:
                raise PluginError(f"metadata backend {info.name!r} is provided twice")
            out[info.name] = info
    return out


def adapters() -> list[AdapterInfo]:
    """Every engine adapter discovered."""
    return sorted(get_plugin_manager().hook.mooncake_adapter_info(), key=lambda a: a.name)
