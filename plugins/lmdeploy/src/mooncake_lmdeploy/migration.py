"""LMDeploy PD migration backend on mooncake-core's transfer engine.

LMDeploy (0.18.0) moves a request's KV cache from the prefill engine to the decode engine
through a *migration backend*: a class in the mmengine registry
``lmdeploy.pytorch.disagg.backend.backend.MIGRATION_BACKENDS``, looked up by the name of
``--migration-backend`` (an enum: ``DLSlime`` or ``Mooncake``). LMDeploy's cache engine
(``CacheEngine.p2p_initialize`` / ``p2p_connect`` / ``migrate``) calls, per decode or
prefill rank and per peer engine:

1. ``p2p_initialize(DistServeInitRequest)``: a link to the peer engine is created;
2. ``register_memory_region(DistServeRegisterMRMessage)``: once per KV pool
   (``mr_key`` = pool index, ``addr`` = the pool tensor's ``data_ptr()``);
3. ``endpoint_info(remote_engine_id, protocol)``: a JSON-able dict the proxy hands to the
   peer;
4. ``p2p_connect(remote_engine_id, DistServeKVTransferEndpointInfo)``: the peer's dict;
5. ``await p2p_migrate(MigrationAssignment)`` on the decode side: byte segments
   (``source_offset`` local, ``target_offset`` remote, per pool) that the decode engine
   *pulls* from the prefill engine.

The cache engine also reads ``links[remote_engine_id].remote_engine_config``.

:class:`MooncakeCoreMigrationBackend` implements that on :class:`TransferEngine`: one engine
per process (shared by all links), the pools registered as engine memory, and each
assignment one batch of reads (adjacent segments merged). The transport is the engine's
choice: shared memory (cross-memory attach) on the same host, RDMA where both ends have a
device and ``protocol`` allows it, TCP otherwise. The endpoint dict keeps the published
backend's keys (``session_id``, ``mr_info``) and adds ``"engine": "mooncake-core"``;
connecting to a peer without it fails with one clear line.

A migration never hangs: the batch runs under a deadline
(``MOONCAKE_LMDEPLOY_MIGRATION_TIMEOUT_S``, else ``transfer.timeout_s``); on a failure or
timeout the backend waits until no transfer of that batch still touches the decode
blocks (so LMDeploy may reuse them) and raises :class:`MigrationError` naming the peer,
the block bytes and the cause. (Upstream's backend with ``LMDEPLOY_USE_ASYNC_MIGRATION``
awaits a future nobody completes.)

Registration under LMDeploy's name ``Mooncake``: :func:`register` (see
:mod:`mooncake_lmdeploy.autoload` for how it runs in every LMDeploy process).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mooncake_core.config import MooncakeConfig, env_str, load_config
from mooncake_core.errors import ConfigError, MooncakeError, TransferTimeout
from mooncake_core.transfer import TransferEngine, TransferRequest

__all__ = [
    "BACKEND_NAME",
    "ENGINE_TAG",
    "MigrationError",
    "MooncakeCoreMigrationBackend",
    "coalesce",
    "migration_deadline_s",
    "register",
    "registered",
]

# a child of LMDeploy's own logger: our lines appear in its log, at its --log-level
logger = logging.getLogger("lmdeploy.mooncake_lmdeploy")

#: LMDeploy's ``MigrationBackend`` member whose registry entry we take over.
BACKEND_NAME = "Mooncake"
#: marks our endpoint dicts (published backends do not carry it)
ENGINE_TAG = "mooncake-core"
TIMEOUT_ENV = "MOONCAKE_LMDEPLOY_MIGRATION_TIMEOUT_S"
#: after the engine's deadline, how long we wait for the batch to wind down
_GRACE_S = 5.0


class MigrationError(RuntimeError):
    """A KV migration failed or timed out.

    ``blocks_safe`` (default True): no transfer of it touches the decode blocks any more,
    so LMDeploy may give them to another request (:mod:`mooncake_lmdeploy.per_request`
    then fails just this request). False only when the transfer engine overran the
    deadline and its reads may still land."""

    def __init__(self, message: str, *, blocks_safe: bool = True) -> None:
        super().__init__(message)
        self.blocks_safe = blocks_safe

    def __reduce__(self) -> tuple[Any, ...]:  # Ray and multiprocessing pickle it
        return (_rebuild_error, (str(self), self.blocks_safe))


def _rebuild_error(message: str, blocks_safe: bool) -> MigrationError:
    return MigrationError(message, blocks_safe=blocks_safe)


def migration_deadline_s() -> float:
    """The longest one migration of this process's backend can run before it has ended
    for sure: the deadline (``MOONCAKE_LMDEPLOY_MIGRATION_TIMEOUT_S``, else
    ``transfer.timeout_s``) plus the wind-down grace."""
    raw = env_str(TIMEOUT_ENV)
    base = float(raw) if raw else float(load_config().transfer.timeout_s)
    return max(base, 0.0) + _GRACE_S


@dataclass
class _Link:
    """One peer engine, as LMDeploy's cache engine sees it (``links[remote_engine_id]``)."""

    local_engine_id: str
    remote_engine_id: str
    local_engine_config: Any
    remote_engine_config: Any
    rank: int
    protocol: Any
    local_regions: dict[int, tuple[int, int]] = field(default_factory=dict)  # mr_key -> addr, len
    remote_session: str = ""
    remote_regions: dict[int, tuple[int, int]] = field(default_factory=dict)


def coalesce(segments: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge ``(local_addr, remote_addr, length)`` segments that continue each other on
    both sides (LMDeploy emits one per layer and block; neighbouring blocks merge)."""
    out: list[tuple[int, int, int]] = []
    for loc, rem, n in sorted(segments):
        if out:
            pl, pr, pn = out[-1]
            if pl + pn == loc and pr + pn == rem:
                out[-1] = (pl, pr, pn + n)
                continue
        out.append((loc, rem, n))
    return out


def _cuda_owner(addr: int, length: int) -> Any:
    """A CUDA uint8 tensor over ``[addr, addr+length)`` when that is device memory, else None.

    LMDeploy passes only ``data_ptr()``; device memory is recognised by the CUDA caching
    allocator's segments (LMDeploy's pools come from it)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    for seg in torch.cuda.memory_snapshot():  # type: ignore[no-untyped-call]
        base, size = int(seg["address"]), int(seg["total_size"])
        if base <= addr and addr + length <= base + size:
            device = int(seg.get("device", 0))

            class _Ptr:
                __cuda_array_interface__ = {
                    "shape": (length,),
                    "typestr": "|u1",
                    "data": (addr, False),
                    "version": 3,
                }

            return torch.as_tensor(_Ptr(), device=f"cuda:{device}")
    return None


class MooncakeCoreMigrationBackend:
    """LMDeploy ``MigrationBackendImpl`` on mooncake-core's transfer engine.

    Args:
        config: transfer-engine configuration (default: :func:`load_config`, i.e.
            ``MOONCAKE_CONFIG_PATH`` and ``MOONCAKE_*`` variables). The metadata server is
            always the P2P handshake: the endpoint dict carries the engine's address.
        timeout_s: deadline of one migration (default ``MOONCAKE_LMDEPLOY_MIGRATION_TIMEOUT_S``,
            else ``transfer.timeout_s``).

    LMDeploy builds it with no arguments (``MIGRATION_BACKENDS.module_dict[name]()``).
    """

    def __init__(self, config: MooncakeConfig | None = None, timeout_s: float | None = None):
        self.links: dict[str, _Link] = {}
        self._config = config
        self._timeout_s = timeout_s
        self._engine: TransferEngine | None = None
        self._lock = threading.Lock()
        self.stats = {"migrations": 0, "failed": 0, "bytes": 0, "requests": 0}

    # ------------------------------------------------------------------ engine
    @property
    def engine(self) -> TransferEngine:
        """This process's transfer engine (started on first use)."""
        with self._lock:
            if self._engine is None:
                cfg = self._config if self._config is not None else load_config()
                cfg = cfg.replace(metadata_server="P2PHANDSHAKE")
                self._engine = TransferEngine(cfg).start()
                logger.info(
                    "mooncake-lmdeploy: migration backend on transfer engine %s",
                    self._engine.name,
                )
            return self._engine

    @property
    def timeout_s(self) -> float:
        if self._timeout_s is not None:
            return self._timeout_s
        raw = env_str(TIMEOUT_ENV)
        if raw:
            try:
                value = float(raw)
            except ValueError:
                raise ConfigError(f"{TIMEOUT_ENV}={raw!r}: not a number of seconds") from None
            if value <= 0:
                raise ConfigError(f"{TIMEOUT_ENV}={raw!r}: must be positive")
            return value
        return float(self.engine.config.transfer.timeout_s)

    def close(self) -> None:
        """Stop the transfer engine (LMDeploy never calls this; for tests and benches)."""
        with self._lock:
            eng, self._engine = self._engine, None
        if eng is not None:
            eng.close()

    def _link(self, remote_engine_id: str) -> _Link:
        link = self.links.get(remote_engine_id)
        if link is None:
            raise MigrationError(
                f"no link to engine {remote_engine_id!r}: p2p_initialize was not called for it "
                f"(links: {', '.join(self.links) or 'none'})"
            )
        return link

    # ------------------------------------------------------------------ MigrationBackendImpl
    def p2p_initialize(self, init_request: Any) -> None:
        """Create the link to ``init_request.remote_engine_id`` (idempotent per peer)."""
        self.engine  # noqa: B018 (start the engine now: endpoint_info needs its address)
        self.links[init_request.remote_engine_id] = _Link(
            local_engine_id=init_request.local_engine_id,
            remote_engine_id=init_request.remote_engine_id,
            local_engine_config=init_request.local_engine_config,
            remote_engine_config=init_request.remote_engine_config,
            rank=int(init_request.rank or 0),
            protocol=init_request.protocol,
        )

    def register_memory_region(self, register_mr_request: Any) -> None:
        """Register one KV pool (``addr`` = its ``data_ptr()``) with the transfer engine."""
        r = register_mr_request
        link = self._link(r.remote_engine_id)
        addr, length = int(r.addr), int(r.length)
        if length <= 0:
            raise MigrationError(f"memory region {r.mr_key}: length must be positive, got {length}")
        eng = self.engine
        try:
            eng.segments.find(addr, length)
            known = True
        except MooncakeError:
            known = False
        if not known:  # the same pool is registered once per link; the engine needs it once
            owner = _cuda_owner(addr, length)
            if owner is not None:
                eng.register(owner, name=f"lmdeploy-pool{r.mr_key}-{addr:x}")
            else:
                eng.register_memory(addr, length, name=f"lmdeploy-pool{r.mr_key}-{addr:x}")
        link.local_regions[int(r.mr_key)] = (addr, length)

    def endpoint_info(self, remote_engine_id: str, protocol: Any) -> dict[str, Any]:
        """What the peer needs to reach our pools (the published keys plus ``engine``)."""
        link = self._link(remote_engine_id)
        return {
            "engine": ENGINE_TAG,
            "session_id": self.engine.name,
            "mr_info": {
                str(k): {"addr": a, "length": n, "offset": 0}
                for k, (a, n) in sorted(link.local_regions.items())
            },
        }

    def p2p_connect(self, remote_engine_id: str, conn_req: Any) -> None:
        """Record the peer's engine address and pools from its endpoint dict."""
        link = self._link(remote_engine_id)
        try:
            info = json.loads(conn_req.endpoint_info)
        except (TypeError, ValueError) as exc:
            raise MigrationError(
                f"engine {remote_engine_id!r}: endpoint info is not JSON: {exc}"
            ) from None
        if not isinstance(info, dict) or info.get("engine") != ENGINE_TAG:
            raise MigrationError(
                f"engine {remote_engine_id!r} does not run the mooncake-core migration backend "
                "(its endpoint info lacks engine='mooncake-core'); install mooncake-lmdeploy "
                "on both prefill and decode hosts"
            )
        try:
            link.remote_session = str(info["session_id"])
            link.remote_regions = {
                int(k): (int(v["addr"]), int(v["length"])) for k, v in info["mr_info"].items()
            }
        except (KeyError, TypeError, ValueError) as exc:
            raise MigrationError(
                f"engine {remote_engine_id!r}: malformed endpoint info ({exc!r})"
            ) from None
        logger.info(
            "mooncake-lmdeploy: linked %s -> %s at %s (%d pools)",
            link.local_engine_id,
            remote_engine_id,
            link.remote_session,
            len(link.remote_regions),
        )

    def plan(self, assignment: Any) -> tuple[_Link, list[tuple[int, int, int]]]:
        """``(link, [(local_addr, remote_addr, length), ...])`` of an assignment, merged;
        raises :class:`MigrationError` for offsets outside the registered pools."""
        link = self._link(assignment.remote_engine_id)
        if not link.remote_session:
            raise MigrationError(
                f"engine {link.remote_engine_id!r}: p2p_connect was not called for this link"
            )
        segs: list[tuple[int, int, int]] = []
        for i, task in enumerate(assignment.batch):
            key = int(task.mr_key)
            local = link.local_regions.get(key)
            remote = link.remote_regions.get(key)
            if local is None or remote is None:
                side = "local" if local is None else f"engine {link.remote_engine_id!r}'s"
                raise MigrationError(
                    f"assignment {i}: pool {key} is not registered on the {side} side"
                )
            n, so, to = int(task.length), int(task.source_offset), int(task.target_offset)
            if n <= 0 or so < 0 or to < 0 or so + n > local[1] or to + n > remote[1]:
                raise MigrationError(
                    f"assignment {i}: pool {key} source {so}+{n} / target {to}+{n} outside "
                    f"the pools ({local[1]} / {remote[1]} bytes)"
                )
            segs.append((local[0] + so, remote[0] + to, n))
        return link, coalesce(segs)

    async def p2p_migrate(self, assignment: Any, async_op: bool = False) -> None:
        """Pull the assignment's bytes from the prefill engine into our blocks.

        Awaits a batch of reads that runs on the engine's threads (the event loop stays
        free). Raises :class:`MigrationError` on failure or after the deadline."""
        link, segs = self.plan(assignment)
        if not segs:
            return
        eng = self.engine
        timeout = self.timeout_s
        total = sum(n for _, _, n in segs)
        reqs = [TransferRequest("read", link.remote_session, la, n, ra) for la, ra, n in segs]
        t0 = time.monotonic()
        try:
            batch = eng.submit(reqs, timeout=timeout)
        except MooncakeError as exc:
            self.stats["failed"] += 1
            raise MigrationError(
                f"migration from {link.remote_engine_id!r} ({total} bytes) refused: {exc}"
            ) from exc
        fut = asyncio.wrap_future(batch.future)
        # asyncio.wait, not wait_for: the engine's own TransferTimeout is a TimeoutError
        # too (as asyncio.TimeoutError is on 3.11), and catching it as ours reported an
        # ordinary timed-out batch (blocks safe) as an overrun (blocks unsafe), which stops
        # LMDeploy's decode loop instead of failing the one request
        done, _ = await asyncio.wait({fut}, timeout=timeout + _GRACE_S)
        if not done:
            self.stats["failed"] += 1
            logger.error(
                "mooncake-lmdeploy: the transfer engine overran a migration's deadline by "
                "%.1f s; its blocks may still be written",
                _GRACE_S,
            )
            raise MigrationError(
                f"migration from {link.remote_engine_id!r} ({total} bytes in {len(reqs)} "
                f"segments) did not finish within {timeout + _GRACE_S:.1f} s",
                blocks_safe=False,
            )
        try:
            fut.result()
        except MooncakeError as exc:
            self.stats["failed"] += 1
            what = "timed out" if isinstance(exc, TransferTimeout) else "failed"
            raise MigrationError(
                f"migration from {link.remote_engine_id!r} at {link.remote_session} "
                f"({total} bytes in {len(reqs)} segments) {what} after "
                f"{time.monotonic() - t0:.2f} s (deadline {timeout:g} s): {exc}"
            ) from exc
        self.stats["migrations"] += 1
        self.stats["requests"] += len(reqs)
        self.stats["bytes"] += total


def _impl_class() -> type:
    """Our backend as a subclass of LMDeploy's ``MigrationBackendImpl`` (built lazily)."""
    global _IMPL
    if _IMPL is None:
        from lmdeploy.pytorch.disagg.backend.base import MigrationBackendImpl

        _IMPL = type(
            "MooncakeCoreBackend",
            (MooncakeCoreMigrationBackend, MigrationBackendImpl),
            {"__module__": __name__, "__doc__": MooncakeCoreMigrationBackend.__doc__},
        )
    return _IMPL


_IMPL: type | None = None


def register(force: bool = True) -> type:
    """Put our backend into LMDeploy's ``MIGRATION_BACKENDS`` under ``Mooncake``.

    Imports ``lmdeploy.pytorch.disagg.backend`` (whose ``__init__`` registers LMDeploy's
    own backends first). Idempotent. Returns the registered class."""
    import lmdeploy.pytorch.disagg.backend  # noqa: F401 (its __init__ registers upstream's)
    from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS

    cls = _impl_class()
    if MIGRATION_BACKENDS.module_dict.get(BACKEND_NAME) is not cls:
        MIGRATION_BACKENDS.register_module(BACKEND_NAME, force=force, module=cls)
        logger.info(
            "mooncake-lmdeploy: --migration-backend %s now runs on mooncake-core", BACKEND_NAME
        )
    return cls


def registered() -> bool:
    """True when LMDeploy's ``Mooncake`` migration backend is ours."""
    from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS

    cls = MIGRATION_BACKENDS.module_dict.get(BACKEND_NAME)
    return isinstance(cls, type) and issubclass(cls, MooncakeCoreMigrationBackend)
