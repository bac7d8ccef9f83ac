"""Discrete-event replay of a request trace through the conductor.

Contract:

- :func:`simulate` replays requests (see :mod:`.trace`) on a cluster described by a
  :class:`~mooncake_core.conductor.scheduler.ConductorConfig` and a cost profile, and
  returns a :class:`SimResult` whose :meth:`SimResult.metrics` has the reported numbers.
- Prefill instances run one prefill at a time, first come first served, for the time the
  cost model gives; the conductor's predictions are therefore exact for prefill, which is
  what a calibrated profile aims at. Each instance keeps its KV blocks in an LRU of
  ``cache_blocks`` blocks; blocks it evicts go to the shared store pool
  (``store_blocks``) when there is one. After a prefill the instance holds the whole
  prompt, including a prefix it fetched: that copy is the hot-spot replication (a prefix
  that many requests fetch ends up on every instance that keeps asking for it).
- Decode instances run continuous batching: every step takes
  ``a + b * batch + c * context_tokens`` seconds and all running requests advance one
  token. A request joins when its KV reservation (prompt + output tokens) fits in the
  instance's ``decode_kv_tokens``; otherwise it waits, which shows up in its TBT. Between
  membership changes the step time grows linearly with the generated tokens, so token
  progress is integrated in closed form instead of simulating each step.
- TTFT is arrival to prefill end (the first token comes from prefill); TBT is
  (last token - first token) / (output tokens - 1). A request meets its SLOs when it was
  accepted, TTFT <= ``slo_ttft_s`` and TBT <= ``slo_tbt_s``; goodput is such requests per
  second of the (replayed) trace duration. Hit rate is reused prefix blocks (local plus
  fetched) over all prompt blocks of accepted requests.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mooncake_core.conductor.costmodel import DEFAULT_PROFILE, CostProfile
from mooncake_core.conductor.scheduler import Conductor, ConductorConfig
from mooncake_core.conductor.trace import Request
from mooncake_core.errors import ConfigError

__all__ = ["DEFAULT_CLUSTER", "ClusterDefaults", "SimResult", "simulate"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterDefaults:
    """The default cluster for the conversation trace (see docs/conductor.md).

    Attributes:
        n_prefill: Prefill instances (8 x A800 nodes each).
        n_decode: Decode instances.
        cache_blocks: Host-memory KV capacity per prefill instance in 512-token blocks
            (3,200 x 160 MiB = 500 GiB of a node's DRAM).
        store_blocks: Extra shared store pool in blocks (0: the pool is the prefill
            instances' own memory, as in the paper's experiment).
    """

    n_prefill: int = 7
    n_decode: int = 4
    cache_blocks: int = 3200
    store_blocks: int = 0


DEFAULT_CLUSTER = ClusterDefaults()

_ARRIVE, _PREFILL_DONE, _DECODE_JOIN, _DECODE_STEP = 0, 1, 2, 3


class _DecodeInstance:
    """Continuous-batching decode instance with a closed-form token clock."""

    __slots__ = (
        "a",
        "b",
        "c",
        "cap",
        "v",
        "t",
        "n",
        "s",
        "used",
        "heap",
        "meta",
        "waiting",
        "version",
    )

    def __init__(self, a: float, b: float, c: float, cap: float) -> None:
        self.a, self.b, self.c, self.cap = a, b, c, cap
        self.v = 0.0  # tokens generated per running request since the instance started
        self.t = 0.0
        self.n = 0
        self.s = 0.0  # sum over running requests of (prompt tokens - v at join)
        self.used = 0.0
        self.heap: list[tuple[float, int]] = []
        self.meta: dict[int, tuple[float, float]] = {}
        self.waiting: deque[tuple[int, int, int]] = deque()
        self.version = 0

    def _step(self) -> float:
        return self.a + self.b * self.n + self.c * (self.s + self.n * self.v)

    def advance(self, t: float) -> None:
        dt = t - self.t
        if dt > 0 and self.n:
            alpha = self._step()
            beta = self.c * self.n
            self.v += 2 * dt / (alpha + math.sqrt(alpha * alpha + 2 * beta * dt))
        self.t = max(t, self.t)

    def time_to(self, v_target: float) -> float:
        dv = max(v_target - self.v, 0.0)
        return self._step() * dv + self.c * self.n * dv * dv / 2

    def _admit(self, rid: int, prompt: int, tokens: int) -> None:
        self.n += 1
        self.s += prompt - self.v
        heapq.heappush(self.heap, (self.v + tokens, rid))
        self.meta[rid] = (prompt - self.v, float(prompt + tokens))
        self.used += prompt + tokens

    def join(self, rid: int, prompt: int, tokens: int, t: float) -> None:
        self.advance(t)
        if self.n and (self.waiting or self.used + prompt + tokens > self.cap):
            self.waiting.append((rid, prompt, tokens))
        else:
            self._admit(rid, prompt, tokens)
        self.version += 1

    def finish(self, t: float) -> list[int]:
        self.advance(t)
        done: list[int] = []
        while self.heap and self.heap[0][0] <= self.v + 1e-6:
            _, rid = heapq.heappop(self.heap)
            rel, tok = self.meta.pop(rid)
            self.n -= 1
            self.s -= rel
            self.used -= tok
            done.append(rid)
        if not self.n:
            self.s = self.used = 0.0
        while self.waiting and (
            not self.n or self.used + self.waiting[0][1] + self.waiting[0][2] <= self.cap
        ):
            self._admit(*self.waiting.popleft())
        self.version += 1
        return done

    def next_finish(self) -> float | None:
        if not self.n:
            return None
        return self.t + self.time_to(self.heap[0][0])


@dataclass
class SimResult:
    """Raw outcome of one replay; :meth:`metrics` summarises it."""

    config: ConductorConfig
    speedup: float
    requests: int
    duration_s: float
    wall_s: float
    ttft_s: np.ndarray
    tbt_s: np.ndarray
    good: int
    rejected: int
    total_blocks: int
    reused_blocks: int
    fetched_blocks: int
    prefill_busy_s: float
    makespan_s: float
    evictions: int
    store_demotions: int
    arrivals_s: np.ndarray = field(repr=False)
    hit_frac: np.ndarray = field(repr=False)
    queue_len: np.ndarray = field(repr=False)

    def metrics(self) -> dict[str, Any]:
        """Return the reported numbers as a flat JSON-ready dict."""

        def pct(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q)) if len(a) else 0.0

        t, b = self.ttft_s, self.tbt_s
        accepted = self.requests - self.rejected
        return {
            "policy": self.config.policy,
            "reject": self.config.reject,
            "n_prefill": self.config.n_prefill,
            "n_decode": self.config.n_decode,
            "speedup": self.speedup,
            "requests": self.requests,
            "accepted": accepted,
            "rejected": self.rejected,
            "mean_ttft_s": float(t.mean()) if len(t) else 0.0,
            "p50_ttft_s": pct(t, 50),
            "p90_ttft_s": pct(t, 90),
            "p99_ttft_s": pct(t, 99),
            "mean_tbt_s": float(b.mean()) if len(b) else 0.0,
            "p50_tbt_s": pct(b, 50),
            "p90_tbt_s": pct(b, 90),
            "p99_tbt_s": pct(b, 99),
            "slo_ttft_s": self.config.slo_ttft_s,
            "slo_tbt_s": self.config.slo_tbt_s,
            "slo_attainment": self.good / self.requests,
            "goodput_rps": self.good / self.duration_s,
            "hit_rate": self.reused_blocks / self.total_blocks if self.total_blocks else 0.0,
            "fetched_blocks": self.fetched_blocks,
            "prefill_utilization": self.prefill_busy_s / (self.config.n_prefill * self.makespan_s)
            if self.makespan_s > 0
            else 0.0,
            "evictions": self.evictions,
            "store_demotions": self.store_demotions,
            "duration_s": self.duration_s,
            "wall_s": self.wall_s,
        }


def simulate(
    requests: Sequence[Request],
    config: ConductorConfig,
    profile: CostProfile = DEFAULT_PROFILE,
    speedup: float = 1.0,
) -> SimResult:
    """Replay ``requests`` (sorted by arrival) and return the outcome.

    Args:
        requests: The trace (arrival times already scaled by ``speedup``).
        config: Cluster and policy; ``cache_blocks=None`` means unbounded caches.
        profile: Cost-model profile used both to predict and to "execute".
        speedup: Only recorded in the result (scale arrivals when loading the trace).

    Raises:
        ConfigError: empty request list or invalid configuration.
    """
    if not requests:
        raise ConfigError("cannot simulate an empty trace")
    wall0 = time.perf_counter()
    cond = Conductor(config, profile)
    cost = cond.cost
    a, b, c = cost.decode_coeffs()
    decoders = [
        _DecodeInstance(a, b, c, float(profile.decode_kv_tokens)) for _ in range(config.n_decode)
    ]
    n = len(requests)
    ttft = np.full(n, np.nan)
    tbt = np.full(n, np.nan)
    first_tok = np.zeros(n)
    hit_frac = np.full(n, np.nan)
    queue_len = np.zeros(n)
    arrivals = np.array([r.arrival_s for r in requests])
    rid_to_idx = {r.rid: k for k, r in enumerate(requests)}
    total_blocks = reused = fetched = rejected = 0
    busy = 0.0
    heap: list[tuple[float, int, int, Any]] = []
    seq = 0
    ri = 0
    now = 0.0

    def push(t: float, kind: int, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, payload))

    def schedule_decode(j: int) -> None:
        dec = decoders[j]
        tn = dec.next_finish()
        if tn is not None:
            push(tn, _DECODE_STEP, (j, dec.version))

    while ri < n or heap:
        if ri < n and (not heap or requests[ri].arrival_s <= heap[0][0]):
            req = requests[ri]
            k = ri
            ri += 1
            now = req.arrival_s
            queue_len[k] = float(cond.queued.sum())
            d = cond.decide(req, now)
            if d.rejected:
                rejected += 1
                continue
            nb = len(req.blocks)
            total_blocks += nb
            reused += d.cached_blocks
            fetched += d.fetch_blocks
            hit_frac[k] = d.cached_blocks / nb if nb else 0.0
            busy += d.prefill_s
            push(d.prefill_end_s, _PREFILL_DONE, (k, d))
            continue
        now, _, kind, payload = heapq.heappop(heap)
        if kind == _PREFILL_DONE:
            k, d = payload
            req = requests[k]
            cond.prefill_done(d, req.blocks, now)
            ttft[k] = now - req.arrival_s
            first_tok[k] = now
            if d.decode >= 0:
                push(now + cost.handoff_s(req.input_len), _DECODE_JOIN, (k, d.decode))
        elif kind == _DECODE_JOIN:
            k, j = payload
            req = requests[k]
            decoders[j].join(req.rid, req.input_len, req.output_len - 1, now)
            schedule_decode(j)
        else:
            j, version = payload
            dec = decoders[j]
            if version != dec.version:
                continue
            for rid in dec.finish(now):
                k = rid_to_idx[rid]
                tbt[k] = (now - first_tok[k]) / (requests[k].output_len - 1)
                cond.decode_done(rid, now)
            schedule_decode(j)
    ok_t = ~np.isnan(ttft)
    good_mask = ok_t & (ttft <= config.slo_ttft_s) & (np.isnan(tbt) | (tbt <= config.slo_tbt_s))
    duration = float(arrivals[-1] - arrivals[0]) if n > 1 else 1.0
    res = SimResult(
        config=config,
        speedup=speedup,
        requests=n,
        duration_s=max(duration, 1e-9),
        wall_s=time.perf_counter() - wall0,
        ttft_s=ttft[ok_t],
        tbt_s=tbt[~np.isnan(tbt)],
        good=int(good_mask.sum()),
        rejected=rejected,
        total_blocks=total_blocks,
        reused_blocks=reused,
        fetched_blocks=fetched,
        prefill_busy_s=busy,
        makespan_s=max(now - float(arrivals[0]), 1e-9),
        evictions=cond.index.evictions,
        store_demotions=cond.index.demotions,
        arrivals_s=arrivals,
        hit_frac=hit_frac,
        queue_len=queue_len,
    )
    logger.info(
        "simulated %d requests (%s, reject %s) in %.2f s",
        n,
        config.policy,
        config.reject,
        res.wall_s,
    )
    return res
