"""Streaming client for ``mooncake-core bench vllm``: token arrival times and cached tokens.

:func:`stream` sends one streaming ``/v1/completions`` request and records when each text
chunk arrived (vLLM sends one chunk per generated token), so the bench gets both TTFT and
the time between tokens (TBT), plus ``usage.prompt_tokens_details.cached_tokens`` (prompt
tokens vLLM did not compute: its own prefix cache plus what a KV connector loaded; the
server needs ``--enable-prompt-tokens-details``), which tells a real hit from a recompute.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Stream", "stream", "percentile"]


@dataclass
class Stream:
    """One streamed request: ``sent`` (perf_counter), token arrival times, text, usage."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    text: str = ""
    cached_tokens: int | None = None
    prompt_tokens: int | None = None

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first token (to the end, if none came)."""
        return (self.arrivals[0] if self.arrivals else time.perf_counter()) - self.sent

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive tokens (TBT), after the first."""
        a = self.arrivals
        return [a[i + 1] - a[i] for i in range(len(a) - 1)]


def stream(url: str, body: dict[str, Any], timeout: float = 600.0) -> Stream:
    """POST a streaming completion to ``url``; raises on HTTP errors and in-stream errors."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    out = Stream(sent=time.perf_counter())
    parts: list[str] = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"stream error: {ev['error']}")
            got = False
            for c in ev.get("choices") or []:
                t = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if t:
                    got = True
                    parts.append(t)
            if got:
                out.arrivals.append(now)
            usage = ev.get("usage")
            if usage:
                out.prompt_tokens = usage.get("prompt_tokens")
                details = usage.get("prompt_tokens_details") or {}
                out.cached_tokens = details.get("cached_tokens")
    out.text = "".join(parts)
    return out


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by the nearest-rank method; 0.0 for no data."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]
