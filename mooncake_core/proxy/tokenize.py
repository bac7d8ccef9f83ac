"""Token ids of text prompts for the proxy's cache-aware routing, from the instances' tokenizer.

KV events and store keys name blocks by token ids; a completion with a string prompt or a
chat request only has text. :class:`RemoteTokenizer` asks a prefill instance (vLLM:
``POST /tokenize``, the engine's own tokenizer and chat template) with the fields of the
request that change tokenization; which fields, which path and how the answer reads are
the engine's (:class:`~mooncake_core.proxy.engine.ProxyEngine`). Answers are cached (LRU,
bounded by tokens held), so a repeated prompt costs nothing.

Why the instance and not a tokenizer in the proxy: the instance's answer is exactly what
the engine computes (same tokenizer files, chat template, special tokens), the proxy
needs no model files or ``transformers``, and it costs one local HTTP round trip per new
prompt. When no instance answers, the caller falls back to character hashing (the
request is still served; only its prefix match is lost), with one warning per outage.

*Thread-safety*: none; call from the proxy's event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import aiohttp

from mooncake_core.proxy.engine import ProxyEngine, proxy_engine

__all__ = ["RemoteTokenizer"]

logger = logging.getLogger(__name__)


class RemoteTokenizer:
    """Tokenizes request bodies through the instances' tokenizer endpoint (see the module doc).

    Args:
        urls: instance base URLs, tried in turn (rotating the first one per call).
        timeout_s: per-call timeout.
        cache_tokens: cache capacity in tokens (4 bytes each).
        engine: what the instances run (request fields, endpoint, answer format); default:
            the default engine's adapter.
    """

    def __init__(
        self,
        urls: Sequence[str],
        timeout_s: float = 5.0,
        cache_tokens: int = 8 << 20,
        engine: ProxyEngine | None = None,
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        if not self.urls:
            raise ValueError("RemoteTokenizer needs at least one instance URL")
        self.engine = engine or proxy_engine()
        self._path = self.engine.tokenize_path
        self.timeout_s = timeout_s
        self.cache_tokens = cache_tokens
        self._cache: OrderedDict[bytes, array[int]] = OrderedDict()
        self._held = 0
        self._turn = 0
        self._down = False
        self.counters: dict[str, int] = {"calls": 0, "cache_hits": 0, "failures": 0, "rejected": 0}

    def _get(self, key: bytes) -> list[int] | None:
        ids = self._cache.get(key)
        if ids is None:
            return None
        self._cache.move_to_end(key)
        return ids.tolist()

    def _put(self, key: bytes, ids: list[int]) -> None:
        if len(ids) > self.cache_tokens:
            return
        arr = array("i", ids)
        self._cache[key] = arr
        self._held += len(arr)
        while self._held > self.cache_tokens:
            _, old = self._cache.popitem(last=False)
            self._held -= len(old)

    async def token_ids(
        self, session: aiohttp.ClientSession, body: dict[str, Any], chat: bool
    ) -> list[int] | None:
        """Token ids the engine would compute for ``body``'s prompt, or None (not a text prompt, or
        no answer)."""
        req = self.engine.tokenize_body(body, chat)
        if req is None:
            return None
        key = hashlib.blake2b(
            json.dumps(req, sort_keys=True, default=str).encode(), digest_size=16
        ).digest()
        hit = self._get(key)
        if hit is not None:
            self.counters["cache_hits"] += 1
            return hit
        n = len(self.urls)
        self._turn = (self._turn + 1) % n
        last: str = ""
        for i in range(n):
            url = self.urls[(self._turn + i) % n]
            try:
                async with session.post(
                    url + self._path, json=req, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
                ) as r:
                    raw = await r.read()
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = f"{url}: {exc!r}"
                continue
            if (
                400 <= status < 500
            ):  # this request cannot be tokenized (bad messages, unknown model, ...)
                self.counters["rejected"] += 1
                logger.debug("%s%s answered %d: %s", url, self._path, status, raw[:200])
                return None
            try:
                ids = [int(t) for t in self.engine.token_ids(json.loads(raw))]
            except (ValueError, KeyError, TypeError) as exc:
                last = f"{url}: answered {status} {exc!r}"
                continue
            self.counters["calls"] += 1
            if self._down:
                self._down = False
                logger.info("tokenizing text prompts through %s works again", self._path)
            self._put(key, ids)
            return ids
        self.counters["failures"] += 1
        if not self._down:
            self._down = True
            logger.warning(
                "no instance tokenized a text prompt (%s); routing text prompts by characters "
                "until one answers",
                last,
            )
        return None

    def stats(self) -> dict[str, int]:
        return {**self.counters, "cached_prompts": len(self._cache), "cached_tokens": self._held}
