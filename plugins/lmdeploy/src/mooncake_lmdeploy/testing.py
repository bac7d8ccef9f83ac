"""LMDeploy's real cache engine with CPU KV pools, for tests and ``bench lmdeploy``.

LMDeploy's engine cannot run on CPU, but its cache engine's PD path can:
:func:`cpu_cache_engine` builds a real ``CacheEngine`` whose device pools come from
LMDeploy's own ``build_block_cache_plan(...).allocate(device="cpu")``. Only
``CacheEngine.__init__`` is skipped, because it allocates on ``cuda`` and creates CUDA
streams; :func:`cpu_cache_engine` sets the attributes that ``__init__`` sets and the PD
methods read (this is the one stand-in, for the GPU). ``p2p_initialize``, ``p2p_connect``,
``migrate`` (and so ``build_cache_pool_assignments``, ``describe_cache_pools``,
``validate_cache_pool_layouts``) and ``connector_kv_caches`` are LMDeploy's code.

``python -m mooncake_lmdeploy.testing`` is one engine rank in a process of its own,
driven by JSON lines on stdin (answers ``OK {json}`` / ``ERR message`` on stdout):

- ``setup`` {layers, blocks, block_size, kv_heads, head_dim, dtype, rank}: build the cache
  engine (``migration_backend=Mooncake``: whatever LMDeploy's registry holds);
- ``init`` {request}: ``CacheEngine.p2p_initialize(DistServeInitRequest)``, answers the
  ``DistServeKVTransferEndpointInfo``;
- ``connect`` {remote_engine_id, infos}: ``CacheEngine.p2p_connect``;
- ``fill`` {blocks, seed}: random bytes into those blocks of every pool;
  ``digest`` {blocks}: SHA-256 per block over all pools;
- ``migrate`` {batch}: ``await CacheEngine.migrate(MigrationExecutionBatch)``, answers
  seconds taken (or ``ERR`` with the backend's error);
- ``raw_serve`` / ``raw_read`` {port, nbytes}: the raw-socket reference of the bench
  (:mod:`mooncake_core.bench.rawtcp` over the first pool's memory);
- ``loop_start`` {blocks} / ``loop_info`` / ``loop_request`` {session_id, remote_engine_id, blocks,
  tokens}: LMDeploy's decode ``EngineLoop.migration_loop`` over this cache engine
  (:mod:`mooncake_lmdeploy.loop_harness`), and one migration request through it;
- ``corrupt_link`` {remote_engine_id, delta}: a corrupt descriptor of the peer's pools;
- ``modules``: the module ``mooncake.store`` resolves to; ``stats``: the backend's;
- ``exit``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from mooncake_core.transfer.procfs import all_threads_stopped

__all__ = [
    "cpu_cache_engine",
    "engine_config",
    "block_bytes",
    "RankProcess",
    "RankError",
    "RankPair",
    "link_pair",
    "main",
]

logger = logging.getLogger(__name__)


def cpu_cache_engine(
    *,
    layers: int = 4,
    blocks: int = 32,
    block_size: int = 16,
    kv_heads: int = 2,
    head_dim: int = 64,
    dtype: str = "bfloat16",
    rank: int = 0,
    tp_rank: int = 0,
    kv_transfer_config: Any = None,
) -> Any:
    """A real LMDeploy ``CacheEngine`` with its block pools on the CPU (see module doc)."""
    import torch
    from lmdeploy.pytorch.config import CacheConfig, ModelConfig
    from lmdeploy.pytorch.disagg.config import MigrationBackend
    from lmdeploy.pytorch.engine.cache_engine.engine import CacheEngine
    from lmdeploy.pytorch.engine.cache_engine.plan import build_block_cache_plan

    model_config = ModelConfig(
        hidden_size=kv_heads * head_dim * 2,
        num_layers=layers,
        num_attention_heads=kv_heads * 2,
        num_key_value_heads=kv_heads,
        bos_token_id=1,
        eos_token_id=[2],
        head_dim=head_dim,
        dtype=getattr(torch, dtype),
    )
    cache_config = CacheConfig(
        max_batches=4,
        block_size=block_size,
        num_cpu_blocks=0,
        num_gpu_blocks=blocks,
        migration_backend=MigrationBackend.Mooncake,
        kv_transfer_config=kv_transfer_config,
    )
    plan = build_block_cache_plan(model_config, cache_config, world_size=1)
    eng = CacheEngine.__new__(CacheEngine)  # __init__ needs CUDA (streams, cuda pools)
    eng.rank, eng.tp_rank, eng.cache_config = rank, tp_rank, cache_config
    eng.block_cache_plan = plan
    eng.gpu_allocation = plan.allocate(num_logical_blocks=blocks, device="cpu")
    eng.migration_backend_impl = None
    eng._pd_cache_pool_infos = None
    eng._remote_pd_cache_pool_infos = {}
    return eng


def engine_config(blocks: int, block_size: int = 16) -> dict[str, Any]:
    """A ``DistServeEngineConfig`` as a dict (tp 1, one DP rank)."""
    return {
        "tp_size": 1,
        "ep_size": 1,
        "dp_size": 1,
        "pp_size": None,
        "dp_rank": 0,
        "block_size": block_size,
        "num_cpu_blocks": 0,
        "num_gpu_blocks": blocks,
    }


def block_bytes(eng: Any, block: int) -> bytes:
    """Every pool's bytes of ``block`` (entry axis), pools in order."""
    out = []
    for pool in eng.gpu_allocation.pools:
        t = pool.tensor.select(pool.entry_axis, block).contiguous()
        out.append(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return b"".join(out)


class _Rank:
    def __init__(self) -> None:
        self.eng: Any = None
        self.raw_buf: Any = None
        # one event loop for every migrate, as in LMDeploy's engine (asyncio.run made a
        # loop and tore it down inside each timed call)
        self.aloop = asyncio.new_event_loop()
        self.loop: Any = None
        self.saved_regions: dict[str, dict[int, tuple[int, int]]] = {}

    def setup(self, m: dict[str, Any]) -> dict[str, Any]:
        from lmdeploy.pytorch.disagg.backend.backend import MIGRATION_BACKENDS

        self.eng = cpu_cache_engine(
            layers=m.get("layers", 4),
            blocks=m.get("blocks", 32),
            block_size=m.get("block_size", 16),
            kv_heads=m.get("kv_heads", 2),
            head_dim=m.get("head_dim", 64),
            dtype=m.get("dtype", "bfloat16"),
            rank=m.get("rank", 0),
        )
        cls = MIGRATION_BACKENDS.module_dict["Mooncake"]
        pools = [list(p.tensor.shape) for p in self.eng.gpu_allocation.pools]
        return {"backend": f"{cls.__module__}.{cls.__qualname__}", "pools": pools}

    def init(self, m: dict[str, Any]) -> dict[str, Any]:
        from lmdeploy.pytorch.disagg.conn.protocol import DistServeInitRequest

        req = DistServeInitRequest.model_validate(m["request"])
        info = self.eng.p2p_initialize(req)
        return {"info": info.model_dump(mode="json")}

    def connect(self, m: dict[str, Any]) -> dict[str, Any]:
        from lmdeploy.pytorch.disagg.conn.protocol import DistServeKVTransferEndpointInfo

        infos = [DistServeKVTransferEndpointInfo.model_validate(i) for i in m["infos"]]
        self.eng.p2p_connect(m["remote_engine_id"], infos)
        return {}

    def fill(self, m: dict[str, Any]) -> dict[str, Any]:
        import torch

        g = torch.Generator().manual_seed(int(m["seed"]))
        for pool in self.eng.gpu_allocation.pools:
            t = pool.tensor
            for b in m["blocks"]:
                row = t.select(pool.entry_axis, b)
                rnd = torch.randint(0, 256, row.shape, generator=g, dtype=torch.uint8)
                row.view(torch.uint8).copy_(rnd.view(row.view(torch.uint8).shape))
        return {}

    def zero(self, m: dict[str, Any]) -> dict[str, Any]:
        for pool in self.eng.gpu_allocation.pools:
            pool.tensor.zero_()
        return {}

    def digest(self, m: dict[str, Any]) -> dict[str, Any]:
        return {"sha": [hashlib.sha256(block_bytes(self.eng, b)).hexdigest() for b in m["blocks"]]}

    def migrate(self, m: dict[str, Any]) -> dict[str, Any]:
        from lmdeploy.pytorch.disagg.messages import MigrationExecutionBatch

        batch = MigrationExecutionBatch.model_validate(m["batch"])
        t0 = time.perf_counter()
        self.aloop.run_until_complete(self.eng.migrate(batch))
        return {"seconds": time.perf_counter() - t0}

    def loop_start(self, m: dict[str, Any]) -> dict[str, Any]:
        """Start LMDeploy's decode migration loop over this rank's cache engine
        (:class:`mooncake_lmdeploy.loop_harness.DecodeLoop`)."""
        from mooncake_lmdeploy.loop_harness import DecodeLoop

        if self.loop is not None:
            self.loop.close()
        self.loop = DecodeLoop(self.eng, int(m["blocks"]), int(m.get("block_size", 16)))
        out: dict[str, Any] = self.loop.info()
        return out

    def loop_info(self, m: dict[str, Any]) -> dict[str, Any]:
        """The decode loop's :meth:`~mooncake_lmdeploy.loop_harness.DecodeLoop.info`."""
        out: dict[str, Any] = self.loop.info()
        return out

    def corrupt_link(self, m: dict[str, Any]) -> dict[str, Any]:
        """Shift by ``delta`` the prefill pool addresses our backend keeps for a link (a
        corrupt memory descriptor: the prefill engine refuses the reads); 0 restores."""
        link = self.eng.migration_backend_impl.links[m["remote_engine_id"]]
        saved = self.saved_regions.setdefault(m["remote_engine_id"], dict(link.remote_regions))
        delta = int(m["delta"])
        link.remote_regions = {k: (a + delta, n) for k, (a, n) in saved.items()}
        return {}

    def loop_request(self, m: dict[str, Any]) -> dict[str, Any]:
        """One migration request through that loop; its outcome."""
        out: dict[str, Any] = self.loop.request(
            int(m["session_id"]), str(m["remote_engine_id"]), list(m["blocks"]), int(m["tokens"])
        )
        return out

    def modules(self, m: dict[str, Any]) -> dict[str, Any]:
        """Which ``mooncake.store`` LMDeploy's store connector would import here."""
        import lmdeploy.pytorch.kv_connector  # noqa: F401 (the autoload hook runs after it)
        import mooncake.store

        return {"mooncake.store": mooncake.store.__name__}

    def stats(self, m: dict[str, Any]) -> dict[str, Any]:
        impl = self.eng.migration_backend_impl
        return {"stats": dict(getattr(impl, "stats", {}))}

    def _pool_view(self) -> memoryview:
        t = self.eng.gpu_allocation.pools[0].tensor
        import ctypes

        n = t.numel() * t.element_size()
        return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")

    def raw_serve(self, m: dict[str, Any]) -> dict[str, Any]:
        from mooncake_core.bench.rawtcp import start_server

        return {"port": start_server(self._pool_view())}

    def raw_read(self, m: dict[str, Any]) -> dict[str, Any]:
        from mooncake_core.bench.rawtcp import RawClient

        n = int(m["nbytes"])
        mv = self._pool_view()[:n]
        c = RawClient(int(m["port"]))
        try:
            t0 = time.perf_counter()
            c.read(mv)
            return {"seconds": time.perf_counter() - t0}
        finally:
            c.close()


class RankError(RuntimeError):
    """A rank process answered ``ERR``."""


class RankProcess:
    """``python -m mooncake_lmdeploy.testing`` in a process of its own (one engine rank)."""

    def __init__(
        self, name: str, env: Mapping[str, str] | None = None, timeout: float = 180
    ) -> None:
        self.name = name
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mooncake_lmdeploy.testing"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self._expect("READY")

    def _expect(self, what: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RankError(f"rank {self.name} exited (code {self.proc.poll()}) before {what}")
        return line.strip()

    def call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        """Send one command; its answer, or :class:`RankError` with the rank's message."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self._expect(cmd)
        if line.startswith("OK "):
            out: dict[str, Any] = json.loads(line[3:])
            return out
        raise RankError(f"rank {self.name}: {cmd}: {line[4:] if line.startswith('ERR ') else line}")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGSTOP the rank and return once *every* thread of it is stopped.

        ``kill`` returns before the stop has happened: the kernel wakes one thread, and
        only when that thread runs does it stop the others. Until then the rest (the
        transfer engine's listener among them) keep serving, for tens of milliseconds on
        a loaded machine; a "stalled" peer would then still answer."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not all_threads_stopped(self.proc.pid):
            if self.proc.poll() is not None:
                raise RankError(f"rank {self.name} exited (code {self.proc.poll()}) while stopping")
            if time.monotonic() > deadline:
                raise RankError(f"rank {self.name}: not every thread stopped within {timeout} s")
            time.sleep(0.002)

    def resume(self) -> None:
        """SIGCONT the rank (after :meth:`stop`); harmless when it runs or has exited."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def link_pair(
    prefill: RankProcess,
    decode: RankProcess,
    *,
    blocks_p: int,
    blocks_d: int,
    block_size: int = 16,
    p_id: str = "http://127.0.0.1:23333",
    d_id: str = "http://127.0.0.1:23334",
) -> None:
    """Link two ranks the way LMDeploy's proxy does (``/distserve/p2p_initialize`` on both,
    then ``/distserve/p2p_connect`` on both with the other's endpoint info)."""
    from lmdeploy.pytorch.disagg.conn.protocol import MigrationProtocol

    cfg_p, cfg_d = engine_config(blocks_p, block_size), engine_config(blocks_d, block_size)

    def req(local: str, lcfg: dict[str, Any], remote: str, rcfg: dict[str, Any]) -> dict[str, Any]:
        return {
            "local_engine_id": local,
            "local_engine_config": lcfg,
            "remote_engine_id": remote,
            "remote_engine_config": rcfg,
            # what the proxy offers; our engine picks the transport itself
            "protocol": MigrationProtocol.RDMA.value,
            "rdma_config": {},
        }

    info_p = prefill.call("init", request=req(p_id, cfg_p, d_id, cfg_d))["info"]
    info_d = decode.call("init", request=req(d_id, cfg_d, p_id, cfg_p))["info"]
    prefill.call("connect", remote_engine_id=d_id, infos=[info_d])
    decode.call("connect", remote_engine_id=p_id, infos=[info_p])


class RankPair:
    """A linked prefill and decode :class:`RankProcess` as a conformance ``MigrationPair``
    (:mod:`mooncake_conformance.migration`): ``migrate`` is ``CacheEngine.migrate`` in the
    decode rank, ``request`` one request through LMDeploy's decode ``EngineLoop``
    (:mod:`mooncake_lmdeploy.loop_harness`, started on first use)."""

    def __init__(
        self,
        prefill: RankProcess,
        decode: RankProcess,
        *,
        prefill_blocks: int,
        decode_blocks: int,
        block_bytes: int,
        deadline_s: float,
        block_size: int = 16,
        p_id: str = "http://127.0.0.1:23333",
    ) -> None:
        self.p, self.d = prefill, decode
        self.prefill_blocks, self.decode_blocks = prefill_blocks, decode_blocks
        self.block_bytes, self.deadline_s = block_bytes, deadline_s
        self.block_size, self.p_id = block_size, p_id
        self._loop = False

    def _rank(self, side: str) -> RankProcess:
        if side not in ("prefill", "decode"):
            raise ValueError(f"side must be 'prefill' or 'decode', got {side!r}")
        return self.p if side == "prefill" else self.d

    def fill_prefill(self, seed: int) -> None:
        self.p.call("fill", blocks=list(range(self.prefill_blocks)), seed=seed)

    def zero_decode(self) -> None:
        self.d.call("zero")

    def digests(self, side: str, blocks: Sequence[int]) -> list[str]:
        out: list[str] = self._rank(side).call("digest", blocks=list(blocks))["sha"]
        return out

    def batch(self, pairs: Sequence[tuple[int, int]]) -> dict[str, Any]:
        """A ``MigrationExecutionBatch`` (as JSON) pulling ``pairs`` from the prefill."""
        from lmdeploy.pytorch.disagg.conn.protocol import MigrationProtocol

        return {
            "protocol": MigrationProtocol.RDMA.value,
            "requests": [[self.p_id, [[int(a), int(b)] for a, b in pairs]]],
        }

    def migrate(self, pairs: Sequence[tuple[int, int]]) -> None:
        self.d.call("migrate", batch=self.batch(pairs))

    def request(self, session_id: int, prefill_blocks: Sequence[int]) -> Any:
        from mooncake_conformance.migration import MigrationOutcome

        if not self._loop:
            self.d.call("loop_start", blocks=self.decode_blocks, block_size=self.block_size)
            self._loop = True
        free = int(self.d.call("loop_info")["free_blocks"])
        out = self.d.call(
            "loop_request",
            session_id=session_id,
            remote_engine_id=self.p_id,
            blocks=list(prefill_blocks),
            tokens=len(prefill_blocks) * self.block_size - self.block_size // 2,
        )
        ok = out["response"] == "SUCCESS" and out["loop_running"]
        return MigrationOutcome(
            ok=ok,
            error="" if ok else f"{out['response']}: {out['error'] or out['loop_error']}",
            # what the request holds once answered (LMDeploy's block table)
            decode_blocks=list(out["decode_blocks"]) if out["blocks_held"] else [],
            free_before=free,
            free_after=int(out["free_after_end"]),
        )

    @contextmanager
    def stalled_prefill(self) -> Iterator[None]:
        self.p.stop()
        try:
            yield
        finally:
            self.p.resume()


def main() -> int:
    """The rank loop (see the module doc)."""
    # answers go to the original stdout; everything else printed (LMDeploy's logger
    # writes to stdout) goes to stderr
    chan = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    rank = _Rank()

    def say(text: str) -> None:
        chan.write(text + "\n")
        chan.flush()

    say("READY")
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        msg = json.loads(line)
        cmd = msg.pop("cmd")
        if cmd == "exit":
            break
        try:
            out = getattr(rank, cmd)(msg)
        except Exception as exc:  # reported to the driver, which decides
            say("ERR " + f"{type(exc).__name__}: {exc}".replace("\n", " "))
            continue
        say("OK " + json.dumps(out))
    if rank.loop is not None:
        rank.loop.close()
    impl = getattr(rank.eng, "migration_backend_impl", None)
    if impl is not None and hasattr(impl, "close"):
        impl.close()
    rank.aloop.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
