"""``mooncake-core bench conductor --live``: the conductor in the proxy against real engines.

A slice of the conversation trace is replayed through ``mooncake-core proxy`` in front of
real engine instances that share the KV store, once with ``--policy global-cache`` and
once with ``--policy least-load``, in the same run and from cold caches each time. The
core does what is engine-neutral (this module):

- :func:`live_slice` cuts and scales the trace for a small machine: multi-turn
  conversations of a window of the trace, in trace order, until ``requests``; each trace
  block id (512 tokens in the trace) becomes ``block_tokens`` token ids derived from the
  id alone, so requests that share leading hash ids share exactly those token prefixes;
  prompts keep at most ``max_blocks`` leading blocks and end with a short tail of their
  own (the trace's partial last block); arrival times are compressed linearly so the slice
  spans ``duration_s``.
- the figures: per policy the mean, p50 and p99 TTFT as the client sees it through the
  proxy, the engines' own prefix-cache hit rate and the store hit rate (both as shares of
  the prompt tokens the prefill instances were asked to compute), and
  ``live_mean_ttft_ratio_global_vs_least`` (target <= 0.8).
- ``--local-baseline`` adds phases of a third label, :data:`LOCAL_BASELINE`
  (``least-load-local``: the proxy's ``least-load`` with ``--store-loads off``, so the
  instances load nothing from the store and only their own prefix cache helps, as the
  simulator's least-load), run in the same rounds, and the extra reference
  ``live_mean_ttft_ratio_global_vs_least_local`` beside (not instead of) the figure above.

Starting engines is an adapter's business: an installed engine adapter provides the
runner as the entry point ``bench.conductor-live-ENGINE`` of the group
``mooncake_core.cli`` (so ``mooncake-core bench conductor-live-ENGINE`` runs it too); its
module defines :data:`RUNNER_FUNCTION` ``(requests, settings) -> dict[policy,
PhaseResult]``. Without one, ``--live`` stops with one line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from mooncake_core.conductor.trace import Request, load_trace

__all__ = [
    "LiveRequest",
    "LiveSettings",
    "PhaseResult",
    "RUNNER_FUNCTION",
    "ENTRY_PREFIX",
    "LOCAL_BASELINE",
    "live_slice",
    "ideal_hit_rate",
    "block_token_ids",
    "find_runner",
    "add_live_arguments",
    "summarize",
    "routing_summary",
    "merge_phases",
    "phase_order",
    "turn_split",
    "request_tag",
    "run_live",
]

GROUP = "mooncake_core.cli"  # the entry-point group of mooncake-core's extensions
ENTRY_PREFIX = "bench.conductor-live-"  # + engine name
RUNNER_FUNCTION = "run_conductor_live"
POLICIES = ("global-cache", "least-load")
#: the ``--local-baseline`` phases: least-load with the store's loads off (local cache only)
LOCAL_BASELINE = "least-load-local"


@dataclass(frozen=True)
class LiveRequest:
    """One scaled request: what the client sends and when.

    Attributes:
        rid: line index of the request in the trace.
        arrival_s: send time after the phase starts (compressed).
        prompt: token ids.
        max_tokens: tokens to generate.
        blocks: trace blocks the prompt kept (each ``block_tokens`` long).
        conversation: the conversation key (the trace's second hash id).
    """

    rid: int
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int
    blocks: tuple[int, ...]
    conversation: int


@dataclass(frozen=True)
class LiveSettings:
    """What the runner gets besides the requests.

    Attributes:
        block_tokens: the engines' KV block size, equal to the tokens per trace block.
        max_prompt_tokens: the longest prompt of the slice (for the engines' context size).
        workdir: model, logs and counters go here.
        quick: the short variant (a smaller model where the runner has one).
        policies: the proxy policy of each phase, in the order the phases run (a policy
            may come more than once: :func:`phase_order`; the runner merges its phases with
            :func:`merge_phases`); :data:`LOCAL_BASELINE` is ``least-load`` with the proxy's
            ``--store-loads off``.
        cores: CPU ids for the instances (one per prefill instance).
        store_holdings: how ``global-cache`` learns what the store holds: ``"events"`` (the
            master's KV events, ``--store-events``: nothing asked per request) or ``"lookup"``
            (one ``batch_exists`` per request, ``--store-master``).
        log: progress lines.
    """

    block_tokens: int
    max_prompt_tokens: int
    workdir: Path
    quick: bool = False
    policies: tuple[str, ...] = POLICIES
    cores: tuple[int, ...] = (0, 1)
    store_holdings: str = "events"
    log: Callable[[str], None] = print


@dataclass
class PhaseResult:
    """What one phase measured (filled in by the runner).

    Attributes:
        ttft_s: per answered request, seconds to the first token through the proxy.
        errors: requests that failed.
        prompt_tokens: prompt tokens the prefill instances were asked for (their
            prefix-cache queries).
        prefix_hit_tokens: of those, found in the engines' own prefix cache.
        store_hit_tokens: of those, loaded from the store by the store connector.
        routed: prefill instance -> requests it served.
        wall_s: the phase's wall time.
        notes: anything else worth printing (name -> value).
        decisions: the proxy's decision records of the phase (``GET /proxy/decisions``; the
            client sends :func:`request_tag` as each request's ``user`` field).
        tagged_ttft: ``(request_tag, TTFT)`` per answered request (first turns of a
            conversation and later turns are told apart with it).
    """

    ttft_s: list[float] = field(default_factory=list)
    errors: int = 0
    prompt_tokens: float = 0.0
    prefix_hit_tokens: float = 0.0
    store_hit_tokens: float = 0.0
    routed: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    tagged_ttft: list[tuple[str, float]] = field(default_factory=list)


def request_tag(r: LiveRequest) -> str:
    """The ``user`` field a runner sends with ``r`` (names it in the proxy's decision log)."""
    return f"trace-{r.rid}"


def routing_summary(
    requests: Sequence[LiveRequest], decisions: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """How a phase was routed, from the proxy's decision records (any policy).

    Walking each phase's records (``phase`` key, default 0) in the proxy's order, every
    instance is taken to hold every prefix it prefilled before in that phase (no eviction).
    ``prefix_available``: requests for which some instance held at least 2 leading blocks
    (the trace's first block is a system prompt every conversation shares);
    ``prefix_followed``: of those, routed to an instance with the longest.
    ``prefill_leg_mean_s`` / ``proxy_ttft_mean_s``: the prefill leg and the first byte as the
    proxy timed them. With ``global-cache`` records also
    ``events_confirmed``: of the requests whose chosen instance the policy's index credited
    with at least 2 blocks, those the engine's own KV events credited too (0 while the
    events and the proxy name blocks differently).
    """
    by_tag = {request_tag(r): r for r in requests}
    recs = sorted(
        (d for d in decisions if d.get("tag") in by_tag and d.get("prefill") is not None),
        key=lambda d: (int(d.get("phase", 0)), int(d.get("rid", 0))),
    )
    held: dict[int, set[tuple[int, ...]]] = {}
    phase = None
    available = followed = credited = confirmed = 0
    legs: list[float] = []
    ttfts: list[float] = []
    for d in recs:
        if d.get("phase", 0) != phase:
            phase, held = d.get("phase", 0), {}
        r = by_tag[d["tag"]]
        i = int(d["prefill"])
        match: dict[int, int] = {}
        for j, prefixes in held.items():
            k = 0
            while k < len(r.blocks) and tuple(r.blocks[: k + 1]) in prefixes:
                k += 1
            match[j] = k
        best = max(match.values(), default=0)
        if best >= 2:
            available += 1
            followed += int(match.get(i, 0) == best)
        held.setdefault(i, set()).update(tuple(r.blocks[:k]) for k in range(1, len(r.blocks) + 1))
        if isinstance(d.get("prefill_s"), (int, float)):
            legs.append(float(d["prefill_s"]))
        if isinstance(d.get("ttft_s"), (int, float)):
            ttfts.append(float(d["ttft_s"]))
        local, events = d.get("local"), d.get("events")
        if isinstance(local, list) and isinstance(events, list) and i < len(local):
            if local[i] >= 2:
                credited += 1
                confirmed += int(i < len(events) and events[i] >= 2)
    out: dict[str, Any] = {
        "routing_records": len(recs),
        "prefix_available": available,
        "prefix_followed": followed,
        "prefill_leg_mean_s": round(statistics.fmean(legs), 4) if legs else None,
        "proxy_ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else None,
    }
    if credited:
        out["events_confirmed"] = round(confirmed / credited, 3)
    return out


def merge_phases(phases: Sequence[PhaseResult]) -> PhaseResult:
    """One policy's phases as one result (TTFTs, tokens, routing and records pooled)."""
    out = PhaseResult()
    for p in phases:
        out.ttft_s += p.ttft_s
        out.errors += p.errors
        out.prompt_tokens += p.prompt_tokens
        out.prefix_hit_tokens += p.prefix_hit_tokens
        out.store_hit_tokens += p.store_hit_tokens
        for url, n in p.routed.items():
            out.routed[url] = out.routed.get(url, 0) + n
        out.wall_s += p.wall_s
        for k, v in p.notes.items():
            out.notes[k] = out.notes.get(k, 0) + v if isinstance(v, (int, float)) else v
        out.decisions += p.decisions
        out.tagged_ttft += p.tagged_ttft
    return out


def turn_split(
    requests: Sequence[LiveRequest], tagged: Sequence[tuple[str, float]]
) -> dict[str, Any]:
    """Mean TTFT of the conversations' first turns (nothing to reuse: routing cannot help
    them) and of their later turns (a prefix to reuse), from ``(tag, TTFT)`` pairs."""
    seen: set[int] = set()
    first: set[str] = set()
    for r in requests:
        if r.conversation not in seen:
            seen.add(r.conversation)
            first.add(request_tag(r))
    a = [t for tag, t in tagged if tag in first]
    b = [t for tag, t in tagged if tag not in first]
    return {
        "first_turns_mean_ttft_s": round(statistics.fmean(a), 4) if a else None,
        "later_turns_mean_ttft_s": round(statistics.fmean(b), 4) if b else None,
        "first_turns_ttft_sum_s": round(sum(a), 4),
    }


def phase_order(order: Sequence[str], rounds: int) -> tuple[str, ...]:
    """The phases of ``rounds`` rounds: ``order``, then reversed, and so on (A B B A ...), so a
    load that drifts during the run weighs on both policies alike."""
    out: list[str] = []
    for k in range(rounds):
        out += list(order) if k % 2 == 0 else list(reversed(order))
    return tuple(out)


def block_token_ids(block: int, block_tokens: int, vocab: int = 400) -> list[int]:
    """The token ids standing for trace block ``block`` (ids 3 .. vocab+2, from the id alone)."""
    rng = random.Random(block * 2_654_435_761 + 97)
    return [3 + rng.randrange(vocab) for _ in range(block_tokens)]


def ideal_hit_rate(blocks: Sequence[Sequence[int]]) -> float:
    """Share of blocks whose whole prefix an earlier request already had (infinite cache)."""
    prefixes: dict[tuple[int, int], int] = {}  # (prefix id, block) -> id of the longer prefix
    total = hit = 0
    for bs in blocks:
        prev = -1
        for b in bs:
            total += 1
            key = (prev, b)
            if key in prefixes:
                hit += 1
            else:
                prefixes[key] = len(prefixes)
            prev = prefixes[key]
    return hit / total if total else 0.0


def live_slice(
    trace: Sequence[Request],
    *,
    requests: int,
    block_tokens: int,
    max_blocks: int,
    duration_s: float,
    window: int = 3000,
    start: int = 0,
    tail_tokens: int | None = None,
    max_tokens: int = 2,
    max_turns: int = 6,
) -> list[LiveRequest]:
    """Cut and scale a slice of ``trace`` (see the module docstring).

    Conversations are keyed by their second hash id (the first is the trace's shared
    system prompt); those with at least two turns in ``trace[start:start+window]`` are
    taken in order of their first turn (at most ``max_turns`` turns each) until
    ``requests`` requests. Raises ValueError when the window has too few.
    """
    if requests < 2 or block_tokens < 1 or max_blocks < 1 or duration_s <= 0:
        raise ValueError(
            "live slice: requests >= 2, block_tokens >= 1, max_blocks >= 1 and duration > 0 "
            f"needed (got {requests}, {block_tokens}, {max_blocks}, {duration_s})"
        )
    part = list(trace[start : start + window])
    turns: dict[int, list[Request]] = {}
    for r in part:
        if len(r.blocks) >= 2:
            turns.setdefault(r.blocks[1], []).append(r)
    chosen: list[tuple[int, Request]] = []
    for key, rs in turns.items():  # dicts keep insertion order: by first turn
        room = requests - len(chosen)
        if len(rs) < 2 or room <= 0:
            continue
        # whole conversations (the last one cut to the room left, its first turns)
        chosen += [(key, r) for r in rs[: min(max_turns, room)]]
    if len(chosen) < requests:
        raise ValueError(
            f"live slice: the trace window [{start}, {start + window}) has only {len(chosen)} "
            f"requests in multi-turn conversations, {requests} asked"
        )
    chosen.sort(key=lambda kr: (kr[1].arrival_s, kr[1].rid))
    t0 = chosen[0][1].arrival_s
    span = max(chosen[-1][1].arrival_s - t0, 1e-9)
    tail = block_tokens // 2 if tail_tokens is None else tail_tokens
    cache: dict[int, list[int]] = {}
    out: list[LiveRequest] = []
    for key, r in chosen:
        kept = r.blocks[:max_blocks]
        ids: list[int] = []
        for b in kept:
            if b not in cache:
                cache[b] = block_token_ids(b, block_tokens)
            ids += cache[b]
        rng = random.Random(1_000_003 * (r.rid + 1))
        ids += [3 + rng.randrange(400) for _ in range(tail)]
        arrival = (r.arrival_s - t0) * duration_s / span
        out.append(LiveRequest(r.rid, round(arrival, 3), tuple(ids), max_tokens, kept, key))
    return out


def find_runner(engine: str | None = None) -> tuple[str, Callable[..., dict[str, PhaseResult]]]:
    """(engine, runner) from the installed adapters; ValueError (one line) when none fits."""
    found: dict[str, str] = {}
    for ep in entry_points(group=GROUP):
        if ep.name.startswith(ENTRY_PREFIX):
            found.setdefault(ep.name[len(ENTRY_PREFIX) :], ep.value.split(":", 1)[0].strip())
    if not found:
        raise ValueError(
            "bench conductor --live: no installed engine adapter provides a live runner "
            f"(entry point '{ENTRY_PREFIX}ENGINE' in group {GROUP!r}); install an engine adapter"
        )
    if engine is None:
        engine = sorted(found)[0]
    if engine not in found:
        raise ValueError(
            f"bench conductor --live: no live runner for engine {engine!r}; "
            f"installed: {', '.join(sorted(found))}"
        )
    mod = importlib.import_module(found[engine])
    fn = getattr(mod, RUNNER_FUNCTION, None)
    if not callable(fn):
        raise ValueError(
            f"bench conductor --live: {found[engine]} defines no {RUNNER_FUNCTION}(requests, "
            "settings)"
        )
    return engine, fn


def add_live_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("live run (--live): real engines behind mooncake-core proxy")
    g.add_argument("--live", action="store_true", help="replay a trace slice on real engines")
    g.add_argument("--quick", action="store_true", help="the short variant (about 2 minutes)")
    g.add_argument(
        "--engine", default=None, help="engine adapter to run (default: the installed one)"
    )
    g.add_argument("--requests", type=int, default=None, help="requests (default 60; quick 24)")
    g.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds the slice spans (default 90; quick 30)",
    )
    g.add_argument(
        "--block-tokens", type=int, default=32, help="tokens per trace block (default 32)"
    )
    g.add_argument(
        "--max-blocks",
        type=int,
        default=None,
        help="longest prompt in blocks (default 32; quick 16)",
    )
    g.add_argument("--window", type=int, default=3000, help="trace requests to pick from (3000)")
    g.add_argument("--start", type=int, default=0, help="first trace request of the window (0)")
    g.add_argument("--max-tokens", type=int, default=2, help="tokens generated per request (2)")
    g.add_argument(
        "--order",
        default=",".join(POLICIES),
        help="policies in the order their phases run (default global-cache,least-load; "
        f"with --local-baseline it may name {LOCAL_BASELINE}, else that comes last)",
    )
    g.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of phases: 2 runs A B B A, so a drifting machine load weighs on both "
        "policies alike (default 1)",
    )
    g.add_argument(
        "--local-baseline",
        action="store_true",
        help=f"also run phases of {LOCAL_BASELINE} (least-load, the proxy's --store-loads off: "
        "no store loads, only the instances' own prefix cache, as the simulator's least-load) "
        "and report live_mean_ttft_ratio_global_vs_least_local besides the usual figures",
    )
    g.add_argument("--cores", default="0,1", help="CPU ids of the prefill instances (default 0,1)")
    g.add_argument(
        "--store-holdings",
        choices=("events", "lookup"),
        default="events",
        help="global-cache learns the store's holdings from the master's KV events (default) "
        "or by one lookup RPC per request",
    )
    g.add_argument("--workdir", default=None, help="model, logs, counters (default: a temp dir)")


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    k = min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))
    return s[k]


def summarize(results: dict[str, PhaseResult]) -> dict[str, Any]:
    """The JSON figures of the phases (keys ``live_*``; ``-`` in policy names becomes ``_``)."""
    out: dict[str, Any] = {}
    for pol, r in results.items():
        k = pol.replace("-", "_")
        t = r.ttft_s
        out[f"live_mean_ttft_s_{k}"] = round(statistics.fmean(t), 4) if t else None
        out[f"live_p50_ttft_s_{k}"] = round(_pct(t, 0.5), 4) if t else None
        out[f"live_p99_ttft_s_{k}"] = round(_pct(t, 0.99), 4) if t else None
        q = r.prompt_tokens
        out[f"live_prefix_hit_rate_{k}"] = round(r.prefix_hit_tokens / q, 4) if q else 0.0
        out[f"live_store_hit_rate_{k}"] = round(r.store_hit_tokens / q, 4) if q else 0.0
        out[f"live_answered_{k}"] = len(t)
        out[f"live_errors_{k}"] = r.errors
        out[f"live_routed_{k}"] = dict(r.routed)
        out[f"live_wall_s_{k}"] = round(r.wall_s, 1)
        for name, v in r.notes.items():
            out[f"live_{name}_{k}"] = v
    g, least = out.get("live_mean_ttft_s_global_cache"), out.get("live_mean_ttft_s_least_load")
    out["live_mean_ttft_ratio_global_vs_least"] = round(g / least, 3) if g and least else None
    g50, l50 = out.get("live_p50_ttft_s_global_cache"), out.get("live_p50_ttft_s_least_load")
    out["live_p50_ttft_ratio_global_vs_least"] = round(g50 / l50, 3) if g50 and l50 else None
    gl = out.get("live_later_turns_mean_ttft_s_global_cache")
    ll = out.get("live_later_turns_mean_ttft_s_least_load")
    if gl and ll:  # the turns with a prefix to reuse: where the policies can differ
        out["live_later_turns_ttft_ratio_global_vs_least"] = round(gl / ll, 3)
    _ratios(out, "least_load_local", "least_local")
    lr = results.get("least-load")
    first = out.get("live_first_turns_ttft_sum_s_least_load")
    if lr is not None and lr.ttft_s and first is not None:
        # the mean ratio global-cache would reach were its later turns free and its first
        # turns as fast as least-load's: no routing can go below this on this slice
        out["live_mean_ttft_ratio_floor"] = round(first / sum(lr.ttft_s), 3)
    return out


def _ratios(out: dict[str, Any], key: str, name: str) -> None:
    """global-cache's mean, p50 and later-turns TTFT over those of policy key ``key`` as
    ``live_*_ratio_global_vs_{name}`` (nothing when that policy did not run)."""
    if f"live_mean_ttft_s_{key}" not in out:
        return
    for fig, label in (
        ("mean_ttft_s", "mean_ttft"),
        ("p50_ttft_s", "p50_ttft"),
        ("later_turns_mean_ttft_s", "later_turns_ttft"),
    ):
        g, b = out.get(f"live_{fig}_global_cache"), out.get(f"live_{fig}_{key}")
        if g and b:
            out[f"live_{label}_ratio_global_vs_{name}"] = round(g / b, 3)
        elif label != "later_turns_ttft":
            out[f"live_{label}_ratio_global_vs_{name}"] = None


def _table(results: dict[str, PhaseResult], fig: dict[str, Any]) -> None:
    print(
        f"\n{'policy':<16} {'answered':>8} {'err':>4} {'TTFT mean':>9} {'p50':>7} {'p99':>7} "
        f"{'prefix hit':>10} {'store hit':>9}  routed"
    )
    for pol, r in results.items():
        k = pol.replace("-", "_")

        def f(name: str, k: str = k) -> str:
            v = fig[f"live_{name}_{k}"]
            return "-" if v is None else f"{v:.3f}"

        print(
            f"{pol:<16} {len(r.ttft_s):>8} {r.errors:>4} {f('mean_ttft_s'):>9} "
            f"{f('p50_ttft_s'):>7} {f('p99_ttft_s'):>7} {f('prefix_hit_rate'):>10} "
            f"{f('store_hit_rate'):>9}  {sorted(r.routed.values())}"
        )
    for pol, r in results.items():
        n = r.notes
        if n.get("later_turns_mean_ttft_s") is not None:
            print(
                f"{pol:<16} TTFT mean of first turns {n['first_turns_mean_ttft_s']} s, "
                f"of later turns {n['later_turns_mean_ttft_s']} s"
            )
        if "prefix_available" in n:
            print(
                f"{pol:<16} routing: {n['prefix_followed']}/{n['prefix_available']} requests "
                "with a held prefix went to its longest holder; prefill leg mean "
                f"{n['prefill_leg_mean_s']} s"
                + (f"; events confirm {n['events_confirmed']}" if "events_confirmed" in n else "")
            )
    print(
        f"\nlive_mean_ttft_ratio_global_vs_least = {fig['live_mean_ttft_ratio_global_vs_least']}"
        " (target <= 0.8)"
    )
    if "live_mean_ttft_ratio_global_vs_least_local" in fig:
        print(
            "live_mean_ttft_ratio_global_vs_least_local = "
            f"{fig['live_mean_ttft_ratio_global_vs_least_local']} (reference: least-load with no "
            "store loads, only the instances' own prefix cache, as in the simulator)"
        )
    if fig.get("live_mean_ttft_ratio_floor") is not None:
        print(
            f"live_mean_ttft_ratio_floor = {fig['live_mean_ttft_ratio_floor']} (later turns free, "
            "first turns as least-load's: the lowest ratio routing can reach on this slice)"
        )


def run_live(args: argparse.Namespace, trace_path: Path) -> int:
    """``--live``: slice the trace, hand it to the adapter's runner, print the figures."""
    try:
        engine, runner = find_runner(args.engine)
    except ValueError as exc:
        print(f"mooncake-core: error: {exc}")
        return 2
    n = args.requests or (24 if args.quick else 60)
    duration = args.duration or (30.0 if args.quick else 90.0)
    max_blocks = args.max_blocks or (16 if args.quick else 32)
    policies = tuple(p.strip() for p in args.order.split(",") if p.strip())
    rounds = int(getattr(args, "rounds", 1) or 1)
    if rounds < 1:
        print(f"mooncake-core: error: --rounds must be >= 1, got {rounds}")
        return 2
    local = bool(getattr(args, "local_baseline", False))
    if sorted(p for p in policies if p != LOCAL_BASELINE) != sorted(POLICIES) or (
        policies.count(LOCAL_BASELINE) > int(local)
    ):
        also = f" (and {LOCAL_BASELINE} with --local-baseline)" if local else ""
        print(
            f"mooncake-core: error: --order must name {' and '.join(POLICIES)}{also}, "
            f"got {args.order!r}"
        )
        return 2
    if local and LOCAL_BASELINE not in policies:
        policies += (LOCAL_BASELINE,)
    try:
        cores = tuple(int(c) for c in args.cores.split(","))
        trace = load_trace(trace_path)
        reqs = live_slice(
            trace,
            requests=n,
            block_tokens=args.block_tokens,
            max_blocks=max_blocks,
            duration_s=duration,
            window=args.window,
            start=args.start,
            max_tokens=args.max_tokens,
        )
    except ValueError as exc:
        print(f"mooncake-core: error: {exc}")
        return 2
    import tempfile

    work = Path(args.workdir or tempfile.mkdtemp(prefix="mooncake-bench-conductor-live-"))
    work.mkdir(parents=True, exist_ok=True)
    settings = LiveSettings(
        block_tokens=args.block_tokens,
        max_prompt_tokens=max(len(r.prompt) for r in reqs),
        workdir=work,
        quick=args.quick,
        policies=phase_order(policies, rounds),
        cores=cores,
        store_holdings=str(getattr(args, "store_holdings", "events")),
        log=lambda m: print(f"[bench conductor --live] {m}", flush=True),
    )
    slice_hit = ideal_hit_rate([r.blocks for r in reqs])
    trace_hit = ideal_hit_rate([r.blocks for r in trace[args.start : args.start + args.window]])
    settings.log(
        f"{engine}: {len(reqs)} requests of {trace_path.name} (trace rows "
        f"{min(r.rid for r in reqs)}..{max(r.rid for r in reqs)}), prompts "
        f"{min(len(r.prompt) for r in reqs)}..{settings.max_prompt_tokens} tokens, "
        f"over {duration:.0f} s; ideal prefix hit rate {slice_hit:.3f} (window {trace_hit:.3f}); "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    load0 = os.getloadavg()[0]
    results = runner(reqs, settings)
    for pol, res in results.items():
        if res.decisions:
            (work / f"decisions-{pol}.json").write_text(json.dumps(res.decisions, indent=0))
            res.notes.update(routing_summary(reqs, res.decisions))
        if res.tagged_ttft:
            res.notes.update(turn_split(reqs, res.tagged_ttft))
    fig: dict[str, Any] = {
        "live_engine": engine,
        "live_requests": len(reqs),
        "live_duration_s": duration,
        "live_block_tokens": args.block_tokens,
        "live_max_prompt_tokens": settings.max_prompt_tokens,
        "live_slice_ideal_hit_rate": round(slice_hit, 4),
        "live_window_ideal_hit_rate": round(trace_hit, 4),
        "live_order": list(phase_order(policies, rounds)),
        "live_store_holdings": settings.store_holdings,
        "live_load_avg_start": round(load0, 2),
        "live_load_avg_end": round(os.getloadavg()[0], 2),
        **summarize(results),
    }
    _table(results, fig)
    if args.json:
        print(json.dumps(fig))
    return 0
