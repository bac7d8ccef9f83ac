"""Requests and Mooncake-format traces.

Contract:

- :class:`Request` is what the conductor schedules: prompt block hashes (prefix-chained:
  equal ids at equal positions mean the KV of that whole prefix is reusable), input and
  output lengths in tokens, and an arrival time in seconds.
- :func:`load_trace` reads the FAST'25 trace format, one JSON object per line with
  ``timestamp`` (ms since start), ``input_length``, ``output_length`` and ``hash_ids``
  (one id per 512-token block). A malformed line raises
  :class:`~mooncake_core.errors.TraceError` naming the file and line number; an empty
  trace is an error too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mooncake_core.errors import TraceError

__all__ = ["Request", "load_trace", "parse_trace_lines"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the conductor sees it.

    Attributes:
        rid: Request id (the 0-based line index for traces).
        arrival_s: Arrival time in seconds (already divided by any speedup).
        input_len: Prompt length in tokens (> 0).
        output_len: Tokens to generate (>= 1).
        blocks: Prefix-chained hashes of the prompt's KV blocks.
    """

    rid: int
    arrival_s: float
    input_len: int
    output_len: int
    blocks: tuple[int, ...]


def _int_field(obj: dict[str, object], key: str, where: str, minimum: int) -> int:
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or int(v) != v:
        raise TraceError(f"{where}: field {key!r} must be an integer, got {v!r}")
    if v < minimum:
        raise TraceError(f"{where}: field {key!r} must be >= {minimum}, got {v!r}")
    return int(v)


def parse_trace_lines(
    lines: Sequence[str], source: str = "<trace>", speedup: float = 1.0
) -> list[Request]:
    """Parse trace lines (see module docstring) into requests sorted by arrival.

    Args:
        lines: The JSONL lines; blank lines are skipped.
        source: File name used in error messages.
        speedup: Arrival times are divided by this (2.0 replays twice as fast).

    Raises:
        TraceError: a malformed line (with its number), or no request at all.
    """
    if not speedup > 0:
        raise TraceError(f"speedup must be > 0, got {speedup!r}")
    out: list[Request] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        ts = obj.get("timestamp")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts != ts or ts < 0:
            raise TraceError(f"{where}: field 'timestamp' must be a number of ms >= 0, got {ts!r}")
        n = _int_field(obj, "input_length", where, 1)
        m = _int_field(obj, "output_length", where, 0)
        hashes = obj.get("hash_ids")
        if not isinstance(hashes, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in hashes
        ):
            raise TraceError(f"{where}: field 'hash_ids' must be a list of integers")
        out.append(Request(len(out), float(ts) / 1000.0 / speedup, n, max(m, 1), tuple(hashes)))
    if not out:
        raise TraceError(f"{source}: the trace is empty (no request lines)")
    if any(out[i].arrival_s > out[i + 1].arrival_s for i in range(len(out) - 1)):
        out.sort(key=lambda r: r.arrival_s)
        out = [
            Request(i, r.arrival_s, r.input_len, r.output_len, r.blocks) for i, r in enumerate(out)
        ]
    return out


def load_trace(path: str | Path, speedup: float = 1.0, limit: int | None = None) -> list[Request]:
    """Read a Mooncake-format JSONL trace.

    Args:
        path: The trace file.
        speedup: Replay factor; arrival times are divided by it.
        limit: Keep only the first ``limit`` requests (``None``: all).

    Raises:
        TraceError: the file is missing/unreadable, a line is malformed, or it is empty.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise TraceError(f"trace {str(p)!r} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"trace {str(p)!r} is not readable: {exc}") from exc
    lines = text.splitlines()
    if limit is not None:
        if limit <= 0:
            raise TraceError(f"limit must be > 0, got {limit}")
        lines = lines[:limit]
    reqs = parse_trace_lines(lines, str(p), speedup)
    logger.debug("loaded %d requests from %s", len(reqs), p)
    return reqs
