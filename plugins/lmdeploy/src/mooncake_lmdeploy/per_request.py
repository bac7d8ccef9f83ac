"""A failed KV migration fails its request only, not LMDeploy's decode engine.

LMDeploy 0.18.0's decode engine migrates in ``EngineLoop.migration_loop``:
``_migration_loop_process_ready`` awaits ``executor.migrate`` for each ready request and
has no failure path, so any exception from a migration backend ends the loop task, and
``EngineLoop.wait_tasks`` then stops the whole engine: every other request dies with it.

:func:`patch_engine_loop` (run by :mod:`mooncake_lmdeploy.autoload` right after
``lmdeploy.pytorch.engine.engine_loop`` is imported) replaces that one method with a
version that migrates the ready requests one by one, exactly as upstream does, and when a
migration raises our :class:`~mooncake_lmdeploy.migration.MigrationError` fails that
request the way LMDeploy's engine ends a request it stops (``Engine._on_stop_session``):

1. the sequence is stopped (``seq.state.stop()``, so no scheduler queue holds it) and its
   decode blocks are given back (``seq.state.release_paging_resources()``, LMDeploy's own
   release: block manager, prefix-cache state);
2. the prefill engine gets the message it gets after a successful migration
   (``engine_conn.zmq_send``), so it frees that request's blocks too (best effort, bounded:
   a dead prefill engine cannot hold the loop);
3. the request's response is ``ResponseType.INTERNAL_ENGINE_ERROR`` with the error line
   (``response_reqs``, as LMDeploy answers failed requests), so ``EngineInstance`` yields
   the failure, the API server answers that request with an error, and ends the session.

The other requests of the batch get their outputs as before, and the loop goes on.

Only our ``MigrationError`` is handled so, because only ours promises that no transfer
still writes into the blocks when it is raised (see :mod:`mooncake_lmdeploy.migration`);
with other backends, or when our engine overran its deadline (``blocks_safe`` False), the
exception propagates as upstream (the engine stops rather than reuse blocks that may still
be written). With several ranks (the Ray executor gathers one migration per rank and
raises at the first failure) the blocks are released only after the migration deadline,
by which every rank's batch has ended.
"""

from __future__ import annotations

import asyncio
import logging
from types import ModuleType
from typing import Any

from mooncake_lmdeploy.migration import MigrationError, migration_deadline_s

__all__ = ["patch_engine_loop", "PATCHED"]

logger = logging.getLogger("lmdeploy.mooncake_lmdeploy")

#: attribute set on ``EngineLoop`` once patched
PATCHED = "_mooncake_per_request_failures"
_NOTIFY_S = 2.0  # at most this long to tell the prefill engine


def patch_engine_loop(module: ModuleType) -> bool:
    """Give ``module.EngineLoop`` (LMDeploy's ``engine_loop`` module) per-request migration
    failures. Idempotent; False when the class does not have the method we replace (another
    LMDeploy version): then nothing is changed."""
    cls = getattr(module, "EngineLoop", None)
    if cls is None or getattr(cls, PATCHED, False):
        return cls is not None
    migrate_one = getattr(cls, "_migration_loop_migrate", None)
    if migrate_one is None or not hasattr(cls, "_migration_loop_process_ready"):
        logger.warning(
            "mooncake-lmdeploy: this LMDeploy's EngineLoop has no _migration_loop_migrate; "
            "a failed migration will stop the decode engine"
        )
        return False

    async def _migration_loop_process_ready(self: Any, migration_ready: list[Any]) -> None:
        done = []
        for msg in migration_ready:
            try:
                await migrate_one(self, [msg])
            except MigrationError as exc:
                if not exc.blocks_safe:
                    raise
                await _fail(self, msg, exc)
                continue
            done.append(msg)
        if done:
            with self.scheduler.seqs_migration_activation(done):
                await self._migration_loop_get_outputs(done)
        self.has_runable_event.set()

    _migration_loop_process_ready.__doc__ = (
        "Process migration ready (mooncake-lmdeploy: a failed migration fails its request "
        "only; see mooncake_lmdeploy.per_request)."
    )
    cls._migration_loop_process_ready = _migration_loop_process_ready
    setattr(cls, PATCHED, True)
    return True


def _single_rank(executor: Any) -> bool:
    try:
        from lmdeploy.pytorch.engine.executor.uni_executor import UniExecutor
    except Exception:  # noqa: BLE001 - cannot tell: be safe, as with several ranks
        return False
    return isinstance(executor, UniExecutor)


async def _fail(self: Any, msg: Any, exc: MigrationError) -> None:
    """Fail one request whose migration raised ``exc`` (see module doc)."""
    req = msg.migration_request
    logger.error(
        "mooncake-lmdeploy: migration of session %s from %s failed; failing that request only: %s",
        msg.session_id,
        req.remote_engine_id,
        exc,
    )
    msg.state.stop()  # out of every scheduler queue; its blocks are still held
    if not _single_rank(self.executor):
        # another rank's batch may still write these blocks: wait out the deadline
        asyncio.get_running_loop().create_task(_release_later(self, msg, exc))
        return
    await _release_and_answer(self, msg, exc)


async def _release_later(self: Any, msg: Any, exc: MigrationError) -> None:
    try:
        await asyncio.sleep(migration_deadline_s())
    except Exception as err:  # noqa: BLE001 - a bad timeout setting: the default then
        logger.warning("mooncake-lmdeploy: %s; waiting 30 s", err)
        await asyncio.sleep(30.0)
    await _release_and_answer(self, msg, exc)


async def _release_and_answer(self: Any, msg: Any, exc: MigrationError) -> None:
    from lmdeploy.pytorch.engine.engine import ResponseType, response_reqs

    req = msg.migration_request
    if msg.num_blocks > 0:
        msg.state.release_paging_resources()
    try:
        await asyncio.wait_for(
            self.engine_conn.zmq_send(
                remote_engine_id=req.remote_engine_id, remote_session_id=req.remote_session_id
            ),
            _NOTIFY_S,
        )
    except Exception as err:  # noqa: BLE001 - the prefill engine may be the thing that died
        logger.warning(
            "mooncake-lmdeploy: could not tell %s to free session %s: %s",
            req.remote_engine_id,
            req.remote_session_id,
            err,
        )
    resp = getattr(msg, "resp", None)
    if resp is not None:
        resp.is_done = True
        response_reqs(
            self.req_manager,
            resp,
            ResponseType.INTERNAL_ENGINE_ERROR,
            err_msg=f"KV migration failed: {exc}",
        )
    self.has_runable_event.set()
