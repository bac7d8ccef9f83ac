"""The proxy's start-up checks of its engine instances (``--prefill`` / ``--decode`` URLs).

Every URL must be a well-formed ``http(s)://host[:port][/path]``; then, unless the wait is
0 (instances that start later), the proxy waits a bounded time until each one answers
``GET /health`` or ``GET /v1/models``, saying which ones it still waits for.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Sequence

from mooncake_core.errors import ConfigError, ProxyError

__all__ = ["check_url", "probe", "wait_for_upstreams"]

logger = logging.getLogger(__name__)

_FIRST_LOG_S = 2.0  # the first "waiting for" lines come after this long (none for a quick start)
_LOG_EVERY_S = 5.0
_PATHS = ("/health", "/v1/models")


def check_url(url: str, option: str) -> str:
    """``url`` without a trailing slash, or a one-line :class:`ConfigError` naming it.

    Args:
        url: an instance base URL, e.g. ``http://127.0.0.1:8100``.
        option: the option it came from (``--prefill``), for the message.
    """
    example = "http://127.0.0.1:8100"
    bad = f"{option}: {url!r} is not an http(s) URL like {example}"
    text = url.strip()
    try:
        u = urllib.parse.urlsplit(text)
        port = u.port
    except ValueError:
        raise ConfigError(f"{bad} (bad port)") from None
    if u.scheme not in ("http", "https"):
        raise ConfigError(f"{bad} (scheme {u.scheme + '://' if u.scheme else 'missing'})")
    if not u.hostname:
        raise ConfigError(f"{bad} (no host)")
    if port == 0:
        raise ConfigError(f"{bad} (port 0)")
    if u.query or u.fragment:
        raise ConfigError(f"{bad} (a base URL has no ?query or #fragment)")
    return text.rstrip("/")


def _reason(exc: BaseException) -> str:
    """A short, one-line reason an instance did not answer."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return "connection refused"
        if isinstance(seen, asyncio.TimeoutError | TimeoutError):
            return "no answer"
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def probe(url: str, timeout_s: float) -> str | None:
    """None when ``url`` answers ``GET /health`` or ``GET /v1/models`` (any status below
    500), else why not (one line)."""
    import aiohttp

    why = "no answer"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for path in _PATHS:
            try:
                async with session.get(url + path) as resp:
                    if resp.status < 500:
                        return None
                    why = f"GET {path} answered HTTP {resp.status}"
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                return _reason(exc)
    return why


async def wait_for_upstreams(
    upstreams: Sequence[tuple[str, str]], wait_s: float, probe_timeout_s: float = 2.0
) -> None:
    """Wait until every ``(role, url)`` answers; at most ``wait_s`` seconds (0: do not wait).

    Raises:
        ProxyError: some still do not answer after ``wait_s`` (one line naming each, and why).
    """
    if wait_s <= 0 or not upstreams:
        return
    t0 = time.monotonic()
    next_log = t0 + _FIRST_LOG_S
    pending = list(upstreams)
    while True:
        left = max(0.2, min(probe_timeout_s, t0 + wait_s - time.monotonic()))
        whys = await asyncio.gather(*(probe(url, left) for _, url in pending))
        failed = [
            (role, url, why)
            for (role, url), why in zip(pending, whys, strict=True)
            if why is not None
        ]
        if not failed:
            if time.monotonic() - t0 >= _FIRST_LOG_S:
                logger.info("all engine instances answer (after %.0f s)", time.monotonic() - t0)
            return
        pending = [(role, url) for role, url, _ in failed]
        now = time.monotonic()
        if now - t0 >= wait_s:
            listing = "; ".join(f"{role} {url} ({why})" for role, url, why in failed)
            raise ProxyError(
                f"proxy: engine instances not reachable after {wait_s:g}s: {listing} "
                "(start them first, or pass --wait-upstreams 0 if they start later)"
            )
        if now >= next_log:
            for role, url, why in failed:
                logger.warning(
                    "waiting for the %s instance %s (%s) (%d s)", role, url, why, int(now - t0)
                )
            next_log = now + _LOG_EVERY_S
        await asyncio.sleep(min(0.5, max(0.0, t0 + wait_s - time.monotonic())))
