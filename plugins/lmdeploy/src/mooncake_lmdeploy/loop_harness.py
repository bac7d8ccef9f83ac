"""LMDeploy's real decode ``EngineLoop`` migrating into a CPU cache engine (for tests).

:class:`DecodeLoop` runs LMDeploy 0.18.0's own ``EngineLoop.migration_loop`` as an asyncio
task on a thread of its own, with LMDeploy's real ``Scheduler`` (block manager, sequence
states), ``RequestManager`` and ``UniExecutor.migrate``, over a real ``CacheEngine`` whose
pools are CPU tensors (:func:`mooncake_lmdeploy.testing.cpu_cache_engine`). Stand-ins,
because the real ones need a GPU model: the executor's model agent (only its
``cache_engine`` is read by ``UniExecutor.migrate``), the inputs maker (one method the
loop's constructor reads) and the engine connection, whose ``zmq_send`` (the "free your
blocks" message to the prefill engine) is recorded instead of sent.

Requests are added the way ``Engine._add_message`` adds a migration request (a session,
a sequence carrying LMDeploy's ``MigrationRequest``, a ``Response``) and the loop is woken
through ``migration_event``, as the engine does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

__all__ = ["DecodeLoop", "add_migrating_sequence", "decode_engine_loop"]


class _Conn:
    """Stand-in for ``EngineP2PConnection``: records ``zmq_send``."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []

    async def zmq_send(self, remote_engine_id: str, remote_session_id: int) -> None:
        self.sent.append((remote_engine_id, int(remote_session_id)))


class DecodeLoop:
    """See the module doc. ``eng``: the rank's CPU ``CacheEngine`` (already linked)."""

    def __init__(self, eng: Any, blocks: int, block_size: int = 16) -> None:
        self.eng = eng
        self.aloop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.aloop.run_forever, daemon=True)
        self.thread.start()
        self.loop: Any = None
        self.task: Any = None
        self.conn = _Conn()
        self._last_tables: dict[int, list[int]] = {}
        self._call(self._start(blocks, block_size))

    def _call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.aloop).result(timeout)

    async def _start(self, blocks: int, block_size: int) -> None:
        from lmdeploy.pytorch.engine.executor.uni_executor import UniExecutor

        executor = UniExecutor.__new__(UniExecutor)  # its __init__ builds a GPU model agent
        executor.model_agent = SimpleNamespace(cache_engine=self.eng)
        self.loop = decode_engine_loop(executor, self.conn, blocks, block_size)
        self.task = asyncio.get_running_loop().create_task(self.loop.migration_loop())

    def info(self) -> dict[str, Any]:
        """Whether the migration loop runs, free blocks, and what the prefill was told."""
        sched = self.loop.scheduler
        done = self.task.done()
        err = None
        if done and not self.task.cancelled() and self.task.exception() is not None:
            err = f"{type(self.task.exception()).__name__}: {self.task.exception()}"
        return {
            "loop_running": not done,
            "loop_error": err,
            "free_blocks": sched.block_manager.get_num_free_gpu_blocks(),
            "patched": bool(getattr(type(self.loop), "_mooncake_per_request_failures", False)),
            "told_prefill": [s for _, s in self.conn.sent],
        }

    def request(
        self,
        session_id: int,
        remote_engine_id: str,
        remote_block_ids: list[int],
        num_tokens: int,
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        """Add one migration request, wait until the loop has dealt with it, end its
        session (as ``EngineInstance`` does after the last answer); its outcome."""
        seq = self._call(self._add(session_id, remote_engine_id, remote_block_ids, num_tokens))
        from lmdeploy.pytorch.messages import MessageStatus

        deadline = time.monotonic() + timeout
        pending = (MessageStatus.MIGRATION_WAITING, MessageStatus.MIGRATION_READY)
        while seq.status in pending and not self.task.done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"session {session_id}: still {seq.status.name}")
            time.sleep(0.02)
        time.sleep(0.05)  # let the loop finish answering
        blocks = self._call(self._blocks(seq))
        out = {
            "status": seq.status.name,
            "response": seq.resp.type.name,
            "error": seq.resp.err_msg or "",
            "answered": seq.resp.event.is_set(),  # set by RequestManager.response
            "blocks_held": blocks,
            "decode_blocks": list(self._last_tables.get(session_id, [])),
            **self.info(),
        }
        self._call(self._end(session_id))
        out["free_after_end"] = self.loop.scheduler.block_manager.get_num_free_gpu_blocks()
        return out

    async def _add(
        self, session_id: int, remote_engine_id: str, remote_block_ids: list[int], n: int
    ) -> Any:
        seq = add_migrating_sequence(self.loop, session_id, remote_engine_id, remote_block_ids, n)
        self.loop.migration_event.set()
        return seq

    async def _blocks(self, seq: Any) -> int:
        if seq.num_blocks:
            table = self.loop.scheduler.get_block_tables([seq])[0]
            self._last_tables[seq.session_id] = [int(b) for b in table]
        return int(seq.num_blocks)

    async def _end(self, session_id: int) -> None:
        if self.loop.scheduler.get_session(session_id) is not None:
            self.loop.scheduler.end_session(session_id)

    def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.aloop.call_soon_threadsafe(self.task.cancel)
        self.aloop.call_soon_threadsafe(self.aloop.stop)
        self.thread.join(timeout=5)


def decode_engine_loop(
    executor: Any,
    conn: Any,
    blocks: int,
    block_size: int = 16,
    max_session_len: int = 4096,
    max_request_output_len: int = 64,
) -> Any:
    """LMDeploy's real decode-role ``EngineLoop`` and ``Scheduler`` (Mooncake migration
    backend, ``blocks`` KV blocks) around ``executor``; ``conn`` stands in for the
    engine's P2P connection (``zmq_send``)."""
    from lmdeploy.pytorch.config import CacheConfig, SchedulerConfig
    from lmdeploy.pytorch.disagg.config import EngineRole, MigrationBackend
    from lmdeploy.pytorch.engine.engine_loop import EngineLoop, EngineLoopConfig
    from lmdeploy.pytorch.engine.request import RequestManager
    from lmdeploy.pytorch.messages import SequenceMeta
    from lmdeploy.pytorch.paging import Scheduler
    from lmdeploy.pytorch.strategies.ar.sequence import ARSequenceStrategy

    sched = Scheduler(
        SchedulerConfig(
            max_batches=4,
            max_session_len=max_session_len,
            max_request_output_len=max_request_output_len,
        ),
        CacheConfig(
            max_batches=4,
            block_size=block_size,
            num_cpu_blocks=0,
            num_gpu_blocks=blocks,
            migration_backend=MigrationBackend.Mooncake,
        ),
        seq_meta=SequenceMeta(block_size, strategy=ARSequenceStrategy()),
    )
    return EngineLoop(
        req_manager=RequestManager(),
        scheduler=sched,
        state_checkpoints=None,
        executor=executor,
        seq_strategy=None,
        inputs_maker=SimpleNamespace(has_pending_long_context_chunk=lambda: False),
        config=EngineLoopConfig(role=EngineRole.Decode),
        engine_conn=conn,
    )


def add_migrating_sequence(
    loop: Any,
    session_id: int,
    remote_engine_id: str,
    remote_block_ids: list[int],
    num_tokens: int,
    remote_token_id: int = 7,
) -> Any:
    """A session with one sequence waiting for migration from ``remote_block_ids``, as
    the engine adds it for a decode request (call on ``loop``'s event loop)."""
    from lmdeploy.messages import ResponseType
    from lmdeploy.pytorch.disagg.conn.protocol import MigrationProtocol, MigrationRequest
    from lmdeploy.pytorch.engine.request import Response
    from lmdeploy.pytorch.messages import SamplingParam

    sched = loop.scheduler
    sched.add_session(session_id)
    sess = sched.get_session(session_id)
    req = MigrationRequest(
        protocol=MigrationProtocol.RDMA,
        remote_engine_id=remote_engine_id,
        remote_session_id=session_id,
        remote_token_id=remote_token_id,
        remote_block_ids=list(remote_block_ids),
    )
    sess.add_sequence(
        list(range(1, num_tokens + 1)), sampling_param=SamplingParam(), migration_request=req
    )
    seq = next(iter(sess.sequences.values()))
    # as RequestManager makes it: the type until the engine answers
    seq.resp = Response(
        type=ResponseType.INTERNAL_ENGINE_ERROR,
        sender_id=0,
        event=asyncio.Event(),
        data=None,
        err_msg=None,
    )
    return seq
