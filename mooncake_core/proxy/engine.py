"""What the proxy needs from one inference engine, and where it gets it.

The proxy is an engine-agnostic OpenAI front: routing, the conductor, early rejection,
store lookups and the KV-event socket plumbing live in :mod:`mooncake_core.proxy`.
Everything that depends on one engine's formats comes from that engine's adapter through
the plugin hook ``mooncake_proxy_engine(name)`` as a :class:`ProxyEngine`:

- how a prefill/decode request is split (:meth:`ProxyEngine.prefill_body`,
  :meth:`ProxyEngine.handoff`, :meth:`ProxyEngine.decode_body`);
- how an instance tokenizes a prompt (:attr:`ProxyEngine.tokenize_path`,
  :meth:`ProxyEngine.tokenize_body`, :meth:`ProxyEngine.token_ids`);
- which model path an instance serves (:meth:`ProxyEngine.model_path`);
- its KV-cache events, decoded into the neutral :data:`KVEvent` types
  (:meth:`ProxyEngine.decode_kv_events`);
- how its store connector names KV pages (:meth:`ProxyEngine.store_keys`, a
  :class:`StoreKeys`).

:func:`proxy_engine` asks the installed adapters (``mooncake-core proxy --engine NAME``;
default :data:`DEFAULT_ENGINE`) and fails with one line when none serves the name.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from mooncake_core.errors import ConfigError

__all__ = [
    "DEFAULT_ENGINE",
    "AllBlocksCleared",
    "BlocksRemoved",
    "BlocksStored",
    "KVEvent",
    "ProxyEngine",
    "StoreKeys",
    "proxy_engine",
]

#: the engine ``mooncake-core proxy`` serves when ``--engine`` is not given
DEFAULT_ENGINE = "vllm"


@dataclass(frozen=True)
class BlocksStored:
    """An instance stored KV blocks.

    Attributes:
        block_hashes: the engine's hash of each block, in prompt order.
        parent_hash: the engine's hash of the block before the first one (None: prompt start).
        token_ids: the tokens of all the blocks, concatenated.
        block_size: tokens per block (None: the engine did not say).
    """

    block_hashes: tuple[Hashable, ...]
    parent_hash: Hashable | None
    token_ids: tuple[int, ...]
    block_size: int | None = None


@dataclass(frozen=True)
class BlocksRemoved:
    """An instance dropped the blocks with these engine hashes."""

    block_hashes: tuple[Hashable, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """An instance dropped every block it held."""


#: one KV-cache event, whatever engine sent it
KVEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


@runtime_checkable
class StoreKeys(Protocol):
    """How one deployment's store connector names KV pages (for ``--store-master``).

    A lookup turns a prompt's token ids into page ids (:meth:`lookup_pages`), those into
    the keys to ask the master about (:meth:`exists_keys`), and the master's
    ``batch_exists`` answer into the length of the leading run the connector would load
    (:meth:`held_pages`).
    """

    @property
    def seed(self) -> str:
        """What identifies the scheme (shown in ``/proxy/stats``)."""

    def rank_prefix(self, rank: int) -> str:
        """The start of every key of TP rank ``rank`` (for log lines)."""

    def lookup_pages(self, tokens: Sequence[int]) -> list[str]:
        """Ids of the pages of ``tokens`` a lookup asks about."""

    def exists_keys(self, pages: Sequence[str]) -> list[str]:
        """The keys whose existence decides whether ``pages`` are held."""

    def held_pages(self, exists: Sequence[bool]) -> int:
        """Leading pages held, from ``batch_exists`` over :meth:`exists_keys`."""


@runtime_checkable
class ProxyEngine(Protocol):
    """The engine-specific half of the proxy; adapters return one from ``mooncake_proxy_engine``.

    Methods get and return plain JSON-like values; none may block (they run on the
    proxy's event loop, except :meth:`decode_kv_events`, which runs on the listener thread).
    """

    #: engine name (``--engine``)
    name: str
    #: HTTP path of the instances' tokenizer endpoint (``POST``)
    tokenize_path: str
    #: the error after "prefill instance URL " when its answer has no hand-off (say how to fix it)
    missing_handoff: str

    def prefill_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request the prefill instance gets for the client's ``body`` (a new dict)."""

    def handoff(self, answer: Any) -> dict[str, Any] | None:
        """What the decode instance needs from the prefill ``answer`` (None: it gave none)."""

    def decode_body(self, body: dict[str, Any], handoff: dict[str, Any]) -> dict[str, Any]:
        """The request the decode instance gets: the client's ``body`` plus the hand-off."""

    def tokenize_body(self, body: dict[str, Any], chat: bool) -> dict[str, Any] | None:
        """The tokenizer request for ``body``, or None when it has no single text prompt."""

    def token_ids(self, answer: Any) -> list[int]:
        """Token ids in a tokenizer answer; raises ValueError, KeyError or TypeError if
        malformed."""

    def model_path(self, models: Any) -> str | None:
        """The model path in an instance's ``GET /v1/models`` answer (None: not there)."""

    def decode_kv_events(self, payload: bytes) -> list[KVEvent]:
        """The KV events in one published message; raises ValueError or TypeError if malformed."""

    def store_keys(self, model: str, dtype: str, block_tokens: int, tp_size: int) -> StoreKeys:
        """The store connector's page naming for this deployment; ValueError on bad values."""


def proxy_engine(name: str = DEFAULT_ENGINE) -> ProxyEngine:
    """The :class:`ProxyEngine` an installed adapter offers for ``name``.

    Raises:
        ConfigError: no installed adapter serves ``name`` (one line).
    """
    from mooncake_core import plugins

    found = plugins.get_plugin_manager().hook.mooncake_proxy_engine(name=name)
    if found is None:
        raise ConfigError(
            f"--engine {name!r}: no installed engine adapter serves it for the proxy "
            "(install that engine's adapter; `mooncake-core plugins` lists those found)"
        )
    engine: ProxyEngine = found
    return engine
