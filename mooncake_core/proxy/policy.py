"""Instance choice for the PD proxy: a small policy interface and its implementations.

Contract: the proxy builds one policy over its prefill and decode :class:`Instance`
lists, then per request calls :meth:`RoutingPolicy.choose` once, :meth:`prefill_done`
after the prefill answered, and :meth:`finished` when the request ended (also on
errors). Policies may read and must not change the instances' counters (the proxy
updates them).

Policies (``--policy``): ``least-load`` (default), ``round-robin``, ``global-cache``
(the KV-cache-aware :class:`~mooncake_core.conductor.Conductor`). New ones go into
:data:`POLICIES` as ``"module:factory"``; they are imported on first use. Least-load and
global-cache are the conductor's rules (:mod:`mooncake_core.conductor.policy`, their one
definition) applied to the live instances; what is engine-specific (KV-event format,
store key scheme, model listing) comes from the :class:`~mooncake_core.proxy.engine.ProxyEngine`.

Thread-safety: none; the proxy calls from its event loop.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mooncake_core.conductor import policy as conductor_policy
from mooncake_core.conductor.policy import least_loaded, prefix_blocks
from mooncake_core.errors import ConfigError, ProxyError
from mooncake_core.proxy.engine import ProxyEngine

__all__ = [
    "Instance",
    "Job",
    "Placement",
    "RoutingPolicy",
    "LeastLoadPolicy",
    "RoundRobinPolicy",
    "GlobalCachePolicy",
    "HOLDER_MARGIN",
    "RequestRejected",
    "POLICIES",
    "make_policy",
    "prefix_blocks",
]

logger = logging.getLogger(__name__)

#: global-cache: share by which another option must be predicted faster than the holder of the
#: longest local prefix to take a request from it (see ``GlobalCachePolicy(holder_margin=)``)
HOLDER_MARGIN = 0.5


@dataclass
class Instance:
    """One upstream engine server and its live load, as the proxy sees it.

    Attributes:
        url: base URL (``http://127.0.0.1:8100``).
        role: ``"prefill"`` or ``"decode"``.
        index: position in its role's list.
        in_flight: requests sent and not yet answered in full.
        tokens_in_flight: estimated prompt tokens of those requests.
        served: requests answered.
        errors: requests that failed upstream.
    """

    url: str
    role: str
    index: int
    in_flight: int = 0
    tokens_in_flight: int = 0
    served: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "in_flight": self.in_flight,
            "tokens_in_flight": self.tokens_in_flight,
            "served": self.served,
            "errors": self.errors,
        }


@dataclass
class Job:
    """What a policy knows about one request.

    Attributes:
        rid: proxy-local request number.
        prompt_tokens: prompt length (exact for token ids, also for text the proxy tokenized;
            else estimated).
        prompt_key: the prompt's token ids (given, or from the instances' ``/tokenize`` when the
            policy asks for them), else its text; for cache-aware policies.
        max_tokens: tokens to generate.
        store_blocks: leading blocks of the prompt the shared store holds (``None``: not looked up).
        instance_blocks: per prefill instance, leading blocks in its own store segment (from the
            store's events; ``None``: not known).
        log: the request's decision record (``GET /proxy/decisions``): the proxy puts the load
            it saw and the timings in, a policy adds why it chose (e.g. matched blocks).
    """

    rid: int
    prompt_tokens: int
    prompt_key: Sequence[int] | str
    max_tokens: int = 16
    arrival: float = field(default_factory=time.monotonic)
    store_blocks: int | None = None
    instance_blocks: list[int] | None = None
    log: dict[str, Any] = field(default_factory=dict)


@dataclass
class Placement:
    """A policy's answer: where the request's prefill and decode run.

    ``headers`` go onto the answer to the client (e.g. why the policy chose so).
    """

    prefill: Instance
    decode: Instance
    detail: Any = None
    headers: dict[str, str] = field(default_factory=dict)


class RoutingPolicy(ABC):
    """Chooses a prefill and a decode instance per request.

    Args:
        prefill: prefill instances (at least one).
        decode: decode instances (at least one).
    """

    name = "abstract"
    #: True: the proxy tokenizes text prompts (instances' ``/tokenize``) before :meth:`prepare`.
    wants_token_ids = False

    def __init__(self, prefill: Sequence[Instance], decode: Sequence[Instance]) -> None:
        if not prefill or not decode:
            raise ConfigError("the proxy needs at least one --prefill and one --decode URL")
        self.prefill = list(prefill)
        self.decode = list(decode)
        #: the engine the instances run; the proxy sets it before :meth:`start`
        self.engine: ProxyEngine | None = None

    async def prepare(self, job: Job) -> None:
        """Gather what :meth:`choose` needs that takes I/O (called just before it; must not
        raise)."""
        return None

    @abstractmethod
    def choose(self, job: Job) -> Placement:
        """Return where ``job`` runs. Called once per request; must not block."""

    def prefill_done(self, job: Job, placement: Placement) -> None:
        """The prefill instance answered (its KV is now held there)."""
        return None

    def finished(self, job: Job, placement: Placement, ok: bool) -> None:
        """The request ended (``ok`` False on upstream errors)."""
        return None

    async def start(self) -> None:
        """The proxy is listening (called on its event loop): start background work."""
        return None

    def close(self) -> None:
        """The proxy is stopping."""
        return None

    def stats(self) -> dict[str, Any]:
        """Policy counters for ``GET /proxy/stats``."""
        return {}


class RoundRobinPolicy(RoutingPolicy):
    """Cycle through the instances of each role."""

    name = "round-robin"

    def __init__(self, prefill: Sequence[Instance], decode: Sequence[Instance]) -> None:
        super().__init__(prefill, decode)
        self._p = itertools.cycle(self.prefill)
        self._d = itertools.cycle(self.decode)

    def choose(self, job: Job) -> Placement:
        return Placement(next(self._p), next(self._d))


class LeastLoadPolicy(RoutingPolicy):
    """Prefill: fewest prompt tokens in flight; decode: fewest requests in flight.

    The conductor's least-load rule (:func:`~mooncake_core.conductor.policy.least_loaded`)
    over the live counters; ties go round-robin, so an idle cluster spreads requests evenly.
    """

    name = conductor_policy.LeastLoadPolicy.name

    def __init__(self, prefill: Sequence[Instance], decode: Sequence[Instance]) -> None:
        super().__init__(prefill, decode)
        self._turn = {"prefill": 0, "decode": 0}

    def _pick(self, pool: list[Instance], key: Callable[[Instance], tuple[int, int]]) -> Instance:
        role = pool[0].role
        self._turn[role] = turn = self._turn.get(role, 0) + 1
        return pool[least_loaded([key(i) for i in pool], turn)]

    def choose(self, job: Job) -> Placement:
        p = self._pick(self.prefill, lambda i: (i.tokens_in_flight, i.in_flight))
        d = self._pick(self.decode, lambda i: (i.in_flight, i.tokens_in_flight))
        return Placement(p, d)


class RequestRejected(ProxyError):
    """Early rejection: the predicted TTFT or TBT misses the SLO (the proxy answers 429)."""


class GlobalCachePolicy(RoutingPolicy):
    """The conductor's KV-cache-aware choice (``global-cache``), fed by the proxy.

    Prompt blocks are hashed by :func:`~mooncake_core.conductor.policy.prefix_blocks` (over token
    ids: given ones, or text prompts tokenized by the instances' ``/tokenize``); after a prefill
    the instance is recorded as holding them, so later requests sharing the prefix go where it lies
    (unless the predicted TTFT says another instance is better). The TTFT is predicted in real
    seconds: queues are the prefills each instance has in flight and the cost profile is scaled
    by each instance's measured speed (:class:`~mooncake_core.proxy.livequeue.LiveQueues`), so a
    busy holder of the prefix loses to an idle instance once the wait outweighs the prefix
    (which the other may then load from the store). With ``reject`` the
    conductor's early rejection is on: :meth:`choose` raises :class:`RequestRejected`.

    Args:
        block_tokens: tokens per hashed block (the engines' KV block size).
        reject: early rejection on/off.
        slo_ttft_s / slo_tbt_s: the latency targets early rejection protects.
        profile: cost-model profile (a JSON file from ``mooncake-core conductor fit``);
            default: the shipped profile with ``block_tokens`` blocks.
        kv_events: one ZMQ endpoint per prefill instance (``tcp://127.0.0.1:PORT``) that
            the proxy binds and the instance's KV-event publisher connects to; the
            instances' stored/removed blocks then update the conductor's view, including
            prefixes computed for requests this proxy did not route.
        tokenize: tokenize text prompts through the instances (default on); off: text
            prompts are hashed by characters (they then never match KV events or the store).
        store_master: store master address (``HOST:PORT``): before each decision, one
            ``batch_exists`` asks which leading pages of the prompt the engine's store
            connector saved; the conductor counts them as fetchable from the store, and
            fetches only from there (instances read each other's KV only through the store).
        store_dtype / store_model / store_tp: the key scheme of the instances' store
            connector: their dtype (required with ``store_master``), model path (default:
            the ``root`` in the first prefill instance's ``/v1/models``) and TP size.
        store_timeout_s: longest a store lookup may take; slower or failed ones count as
            "nothing stored" (one warning, then lookups pause for 10 s).
        store_events: instead of ``store_master``, the master's KV-event endpoint
            (:mod:`mooncake_core.proxy.store_events`): the pool's holdings come from its events,
            with no RPC per request.
        store_holders: with ``store_events``, the segment name of each prefill instance's store
            client: pages held in an instance's segment count as cached on that instance.
        live_queues: predict waits from the prefills in flight and each instance's measured
            speed (default); False: from the conductor's own queue model in profile seconds
            (the simulator's; for comparison).
        holder_margin: the instance holding the longest local prefix keeps the request unless
            another option is predicted faster by more than this share (default
            :data:`HOLDER_MARGIN`; 0: plain minimum). The measured speeds are estimates: between
            like instances they differ by tens of percent from noise, more than a prefix of a
            few blocks saves, and without a margin that noise sent requests away from an idle
            holder (``test_kv_events_reveal_prefixes_the_proxy_did_not_route`` failed in CI).
    """

    name = conductor_policy.GlobalCachePolicy.name

    def __init__(
        self,
        prefill: Sequence[Instance],
        decode: Sequence[Instance],
        block_tokens: int = 32,
        reject: bool = False,
        slo_ttft_s: float | None = None,
        slo_tbt_s: float | None = None,
        profile: str | None = None,
        kv_events: Sequence[str] | None = None,
        tokenize: bool = True,
        store_master: str | None = None,
        store_dtype: str | None = None,
        store_model: str | None = None,
        store_tp: int = 1,
        store_timeout_s: float = 0.5,
        store_events: str | None = None,
        store_holders: Sequence[str] | None = None,
        live_queues: bool = True,
        holder_margin: float = HOLDER_MARGIN,
    ) -> None:
        super().__init__(prefill, decode)
        if kv_events and len(kv_events) != len(self.prefill):
            raise ConfigError(
                f"give one KV-event endpoint per prefill instance: {len(kv_events)} for "
                f"{len(self.prefill)} instances"
            )
        self.kv_event_endpoints = list(kv_events or [])
        self.kv_listener: Any = None
        self.wants_token_ids = bool(tokenize)
        import dataclasses

        from mooncake_core.conductor import (
            DEFAULT_PROFILE,
            Conductor,
            ConductorConfig,
            load_profile,
        )
        from mooncake_core.conductor.scheduler import DEFAULT_SLO_TBT_S, DEFAULT_SLO_TTFT_S

        prof = (
            load_profile(profile)
            if profile
            else dataclasses.replace(DEFAULT_PROFILE, block_tokens=block_tokens)
        )
        self.block_tokens = prof.block_tokens
        self.store: Any = None
        if store_events and store_master:
            raise ConfigError("give --store-master or --store-events, not both")
        if store_holders and len(store_holders) != len(self.prefill):
            raise ConfigError(
                f"give one store holder per prefill instance: {len(store_holders)} for "
                f"{len(self.prefill)} instances"
            )
        if store_events:
            from mooncake_core.proxy.store_events import StoreEvents

            self.store = StoreEvents(
                store_events,
                self.block_tokens,
                store_dtype or "",
                store_tp,
                holders=list(store_holders or ()),
            )
            self._store_model = store_model
        elif store_master:
            from mooncake_core.proxy.storelookup import StoreLookup

            self.store = StoreLookup(
                store_master,
                self.block_tokens,
                store_dtype or "",
                store_tp,
                None,
                timeout_s=store_timeout_s,
            )
            self._store_model = store_model
        self._model_retry_at = 0.0
        self.conductor = Conductor(
            ConductorConfig(
                n_prefill=len(self.prefill),
                n_decode=len(self.decode),
                policy="global-cache",
                reject=reject,
                slo_ttft_s=DEFAULT_SLO_TTFT_S if slo_ttft_s is None else slo_ttft_s,
                slo_tbt_s=DEFAULT_SLO_TBT_S if slo_tbt_s is None else slo_tbt_s,
                store_blocks=None if self.store is not None else 0,
                # instances read each other's KV only through the store: no store, no fetch
                fetch_sources="store",
                holder_margin=holder_margin,
            ),
            prof,
        )
        from mooncake_core.conductor.cache import BlockIndex
        from mooncake_core.proxy.livequeue import LiveQueues

        self.live = LiveQueues(len(self.prefill))
        self.live_queues = live_queues
        #: blocks each instance holds by its own KV events alone (the decision log's ``events``)
        self.event_index = BlockIndex(len(self.prefill), None, 0)
        self.counters = {
            "store_blocks_seen": 0,
            "fetch_from_store": 0,
            "fetched_blocks": 0,
            "char_hashed_prompts": 0,
            "event_blocks_stored": 0,
            "event_blocks_removed": 0,
        }
        self._t0 = time.monotonic()

    def _now(self) -> float:
        return time.monotonic() - self._t0

    async def _ensure_scheme(self) -> bool:
        """The store key scheme needs the model path; ask an instance (at most every 10 s)."""
        if self.store.scheme is not None:
            return True
        if self.store.engine is None:
            self.store.engine = self._engine()
        if self._store_model:
            self.store.set_model(self._store_model)
            return True
        if time.monotonic() < self._model_retry_at:
            return False
        from mooncake_core.proxy.storelookup import model_root

        self._model_retry_at = time.monotonic() + 10.0
        root = await model_root([i.url for i in self.prefill], self.store.engine)
        if root is None:
            logger.warning(
                "no prefill instance listed its model (GET /v1/models); store lookups start "
                "once one does (or pass --store-model)"
            )
            return False
        self.store.set_model(root)
        return True

    async def prepare(self, job: Job) -> None:
        if isinstance(job.prompt_key, str):
            self.counters["char_hashed_prompts"] += 1
            return
        if self.store is None or not await self._ensure_scheme():
            return
        job.store_blocks = await self.store.aheld_pages(job.prompt_key)
        if hasattr(self.store, "held_by"):
            job.instance_blocks = self.store.held_by(job.prompt_key)

    def choose(self, job: Job) -> Placement:
        from mooncake_core.conductor import Request

        blocks = prefix_blocks(job.prompt_key, self.block_tokens)
        req = Request(
            rid=job.rid,
            arrival_s=self._now(),
            input_len=max(1, job.prompt_tokens),
            output_len=max(1, job.max_tokens),
            blocks=blocks,
        )
        # The store's holdings of this prompt are known exactly now: put them in the index for
        # this decision only (the next request asks the store again, so nothing goes stale).
        held = list(blocks[: job.store_blocks or 0])
        if held:
            self.conductor.store_put(held)
            self.counters["store_blocks_seen"] += len(held)
        # pages in an instance's own segment (store events): cached there, for this decision only
        local: list[tuple[int, list[int]]] = []
        for i, n in enumerate(job.instance_blocks or ()):
            new = [b for b in blocks[:n] if not self.conductor.index.holds(i, b)]
            if new:
                self.conductor.kv_stored(i, new)
                local.append((i, new))
        live = self.live_queues
        speed = self.live.speed() if live else np.ones(len(self.prefill))
        try:
            d = self.conductor.decide(
                req,
                now=req.arrival_s,
                wait_s=self.live.wait_s(req.arrival_s) if live else None,
                speed=speed if live else None,
            )
        finally:
            if held:
                self.conductor.store_removed(held)
            for i, new in local:
                self.conductor.kv_removed(i, new)
        if d.rejected:
            raise RequestRejected(
                f"rejected early: {d.reason} "
                f"(predicted TTFT {d.ttft_s:.2f} s, TBT {d.tbt_s * 1e3:.0f} ms)"
            )
        dec = d.decode if 0 <= d.decode < len(self.decode) else 0
        if d.fetch_blocks and d.fetch_source == len(self.prefill):
            source = "store"
            self.counters["fetch_from_store"] += 1
        elif d.fetch_blocks and 0 <= d.fetch_source < len(self.prefill):
            source = self.prefill[d.fetch_source].url
        else:
            source = "none"
        self.counters["fetched_blocks"] += d.fetch_blocks
        k = float(speed[d.prefill])
        self.live.started(d.prefill, job.rid, (d.prefill_s + d.transfer_s) / k, req.arrival_s)
        self._explain(job, blocks)
        info = (
            f"cached_blocks={d.cached_blocks}; fetch_blocks={d.fetch_blocks}; "
            f"fetch_source={source}; "
            f"store_blocks={'-' if job.store_blocks is None else job.store_blocks}; "
            f"predicted_ttft_ms={d.ttft_s * 1e3:.1f}"
        )
        logger.debug("request %d -> prefill %s: %s", job.rid, self.prefill[d.prefill].url, info)
        return Placement(
            self.prefill[d.prefill],
            self.decode[dec],
            detail=(d, blocks),
            headers={"X-Mooncake-Decision": info},
        )

    def _explain(self, job: Job, blocks: Sequence[int]) -> None:
        """Why the last decision went where it did, into the request's decision record."""
        v = self.conductor.last_view
        if v is None:
            return
        ev, _ = self.event_index.match(blocks)
        job.log.update(
            blocks=len(blocks),
            local=[int(x) for x in v.local_blocks],
            events=[int(x) for x in ev[: len(self.prefill)]],
            store=job.store_blocks,
            wait_s=[round(float(x), 4) for x in v.wait_s],
            speed=[round(float(x), 2) for x in self.live.speed()],
            predicted_s=[round(float(x), 4) for x in np.minimum(v.ttft_local_s, v.ttft_fetch_s)],
        )

    def _kv_stored(self, instance: int, blocks: list[int]) -> None:
        self.conductor.kv_stored(instance, blocks)
        self.event_index.insert(instance, blocks)
        self.counters["event_blocks_stored"] += len(blocks)

    def _kv_removed(self, instance: int, blocks: list[int]) -> None:
        self.conductor.kv_removed(instance, blocks)
        self.event_index.remove(instance, blocks)
        self.counters["event_blocks_removed"] += len(blocks)

    async def start(self) -> None:
        if self.kv_event_endpoints and self.kv_listener is None:
            from mooncake_core.proxy.kvevents import KVEventListener

            engine = self._engine()
            self.kv_listener = KVEventListener(
                self.kv_event_endpoints,
                self.block_tokens,
                self._kv_stored,
                self._kv_removed,
                asyncio.get_running_loop(),
                engine.decode_kv_events,
            )
            logger.info(
                "listening for %s KV events on %s", engine.name, ", ".join(self.kv_event_endpoints)
            )
        if self.store is not None:
            if await asyncio.get_running_loop().run_in_executor(None, self.store.probe):
                logger.info(
                    "store master %s answers; counting its KV pages as fetchable", self.store.master
                )
            await self._ensure_scheme()

    def _engine(self) -> ProxyEngine:
        if self.engine is None:
            from mooncake_core.proxy.engine import proxy_engine

            self.engine = proxy_engine()
        return self.engine

    def close(self) -> None:
        if self.kv_listener is not None:
            self.kv_listener.close()
            self.kv_listener = None
        if self.store is not None:
            self.store.close()

    def prefill_done(self, job: Job, placement: Placement) -> None:
        d, blocks = placement.detail
        now = self._now()
        self.live.answered(d.prefill, job.rid, now)
        self.conductor.prefill_done(d, blocks, now)

    def finished(self, job: Job, placement: Placement, ok: bool) -> None:
        d, _ = placement.detail
        self.live.dropped(d.prefill, job.rid)  # a prefill that failed: no answer to measure
        self.conductor.decode_done(job.rid, self._now())

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "decisions": self.conductor.decisions,
            "rejections": self.conductor.rejections,
            "kept_by_margin": getattr(self.conductor.policy, "kept_by_margin", 0),
            **self.counters,
        }
        if self.kv_listener is not None:
            out["kv_events"] = self.kv_listener.events
        if self.store is not None:
            out["store"] = self.store.stats()
        out["speed"] = [round(float(x), 3) for x in self.live.speed()]
        return out


# name -> "module:factory"; factories take (prefill, decode)
POLICIES: dict[str, str] = {
    "least-load": "mooncake_core.proxy.policy:LeastLoadPolicy",
    "round-robin": "mooncake_core.proxy.policy:RoundRobinPolicy",
    "global-cache": "mooncake_core.proxy.policy:GlobalCachePolicy",
}


def make_policy(
    name: str, prefill: Sequence[Instance], decode: Sequence[Instance], **options: Any
) -> RoutingPolicy:
    """Build the policy called ``name`` with ``options``; bad names or options raise
    :class:`ConfigError`."""
    target = POLICIES.get(name)
    if target is None:
        raise ConfigError(
            f"unknown proxy policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        )
    mod, _, attr = target.partition(":")
    factory = getattr(importlib.import_module(mod), attr)
    try:
        policy = factory(prefill, decode, **options)
    except TypeError as exc:
        raise ConfigError(
            f"policy {name!r} does not take options {sorted(options)}: {exc}"
        ) from None
    if not isinstance(policy, RoutingPolicy):
        raise ConfigError(f"policy {name!r} ({target}) did not build a RoutingPolicy")
    return policy
