"""Units of mooncake-lmdeploy that need no second process: segment merging, the import
hook, the backend's checks of what LMDeploy hands it (with LMDeploy's own messages)."""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from mooncake_lmdeploy import autoload
from mooncake_lmdeploy.migration import (
    MigrationError,
    MooncakeCoreMigrationBackend,
    coalesce,
)

from mooncake_core.config import load_config
from mooncake_core.errors import ConfigError


def test_coalesce_merges_only_runs_contiguous_on_both_sides() -> None:
    segs = [(200, 1200, 100), (0, 1000, 100), (100, 1100, 100), (300, 5000, 100), (400, 5200, 50)]
    assert coalesce(segs) == [(0, 1000, 300), (300, 5000, 100), (400, 5200, 50)]
    assert coalesce([]) == []


def test_autoload_runs_the_hook_after_the_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mc_lmd_probe.py").write_text("ORDER = ['module']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []

    def hook(mod: ModuleType) -> None:
        seen.append(mod.__name__)
        mod.ORDER.append("hook")

    monkeypatch.setitem(autoload.HOOKS, "mc_lmd_probe", hook)
    monkeypatch.delenv(autoload.AUTOLOAD_ENV, raising=False)
    assert autoload.install()
    try:
        import mc_lmd_probe

        assert seen == ["mc_lmd_probe"] and mc_lmd_probe.ORDER == ["module", "hook"]
    finally:
        sys.modules.pop("mc_lmd_probe", None)


def test_autoload_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(autoload.AUTOLOAD_ENV, "0")
    assert autoload.install() is False


def test_pth_file_calls_install() -> None:
    pth = Path(__file__).resolve().parents[2] / "src" / "mooncake_lmdeploy.pth"
    line = pth.read_text().strip()
    assert "\n" not in line and line.startswith("import ")
    assert 'autoload").autoload.install()' in line


def test_timeout_env_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    b = MooncakeCoreMigrationBackend(load_config())
    monkeypatch.setenv("MOONCAKE_LMDEPLOY_MIGRATION_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="MOONCAKE_LMDEPLOY_MIGRATION_TIMEOUT_S"):
        _ = b.timeout_s
    monkeypatch.setenv("MOONCAKE_LMDEPLOY_MIGRATION_TIMEOUT_S", "2.5")
    assert b.timeout_s == 2.5


@pytest.fixture
def lmdeploy_msgs() -> ModuleType:
    mod: ModuleType = pytest.importorskip(
        "lmdeploy.pytorch.disagg.conn.protocol", reason="lmdeploy is not installed"
    )
    return mod


def _init(backend: MooncakeCoreMigrationBackend, proto: ModuleType) -> None:
    cfg = {
        "tp_size": 1,
        "ep_size": 1,
        "dp_size": 1,
        "pp_size": None,
        "dp_rank": 0,
        "block_size": 16,
        "num_cpu_blocks": 0,
        "num_gpu_blocks": 4,
    }
    backend.p2p_initialize(
        proto.DistServeInitRequest(
            local_engine_id="d",
            local_engine_config=cfg,
            remote_engine_id="p",
            remote_engine_config=cfg,
            protocol=proto.MigrationProtocol.RDMA,
            rank=0,
        )
    )


def test_backend_refuses_what_it_cannot_serve(lmdeploy_msgs: ModuleType) -> None:
    from lmdeploy.pytorch.disagg.messages import (
        AssignmentInstruct,
        DistServeRegisterMRMessage,
        MigrationAssignment,
    )

    proto = lmdeploy_msgs
    b = MooncakeCoreMigrationBackend(load_config())
    pool = (ctypes.c_char * 4096)()  # kept alive for the registration
    addr = ctypes.addressof(pool)
    try:
        _init(b, proto)
        assert b.links["p"].remote_engine_config.num_gpu_blocks == 4  # read by CacheEngine
        b.register_memory_region(
            DistServeRegisterMRMessage(
                protocol=proto.MigrationProtocol.RDMA,
                remote_engine_id="p",
                mr_key=0,
                addr=addr,
                offset=0,
                length=len(pool),
            )
        )
        info = b.endpoint_info("p", proto.MigrationProtocol.RDMA)
        assert info["engine"] == "mooncake-core" and info["mr_info"]["0"]["addr"] == addr
        assign = MigrationAssignment(
            protocol=proto.MigrationProtocol.RDMA,
            remote_engine_id="p",
            batch=[AssignmentInstruct(mr_key=0, target_offset=0, source_offset=0, length=64)],
        )
        with pytest.raises(MigrationError, match="p2p_connect was not called"):
            b.plan(assign)
        published = {"session_id": "127.0.0.1:1", "mr_info": {"0": {"addr": 1, "length": 8}}}
        with pytest.raises(MigrationError, match="does not run the mooncake-core"):
            b.p2p_connect(
                "p",
                proto.DistServeKVTransferEndpointInfo(
                    protocol=proto.MigrationProtocol.RDMA, endpoint_info=json.dumps(published)
                ),
            )
        ours = dict(info, session_id="127.0.0.1:1")
        b.p2p_connect(
            "p",
            proto.DistServeKVTransferEndpointInfo(
                protocol=proto.MigrationProtocol.RDMA, endpoint_info=json.dumps(ours)
            ),
        )
        assert b.plan(assign)[1] == [(addr, addr, 64)]
        too_far = assign.model_copy(
            update={
                "batch": [
                    AssignmentInstruct(mr_key=0, target_offset=4090, source_offset=0, length=64)
                ]
            }
        )
        with pytest.raises(MigrationError, match="outside"):
            b.plan(too_far)
        with pytest.raises(MigrationError, match="no link to engine 'q'"):
            b.endpoint_info("q", proto.MigrationProtocol.RDMA)
    finally:
        b.close()


def test_engine_timeout_is_a_safe_failure_only_an_overrun_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The transfer engine's own TransferTimeout (a TimeoutError, as asyncio's is) is a
    timed-out migration whose blocks are free again (blocks_safe): it was once caught as an
    overrun of our outer deadline, which stops LMDeploy's decode loop. Only a batch still
    running after the grace is unsafe. The engine is a FAKE (a future we complete)."""
    import asyncio
    from concurrent.futures import Future
    from types import SimpleNamespace

    import mooncake_lmdeploy.migration as mig

    from mooncake_core.errors import PeerUnreachable, TransferTimeout

    monkeypatch.setattr(mig, "_GRACE_S", 0.05)
    outcomes: list[BaseException | None] = [
        TransferTimeout("transfer to peer 'p' timed out with 2 slice(s) outstanding"),
        PeerUnreachable("peer 'p' refused"),
        None,  # never finishes
    ]

    def submit(reqs: list[Any], timeout: float) -> Any:
        fut: Future[None] = Future()
        err = outcomes.pop(0)
        if err is not None:
            fut.set_exception(err)
        return SimpleNamespace(future=fut)

    b = MooncakeCoreMigrationBackend(load_config(), timeout_s=0.1)
    b._engine = SimpleNamespace(submit=submit)  # type: ignore[assignment]
    link = SimpleNamespace(remote_engine_id="p", remote_session="127.0.0.1:1")
    monkeypatch.setattr(b, "plan", lambda a: (link, [(0, 0, 64)]))
    errors = []
    for _ in range(3):
        with pytest.raises(MigrationError) as info:
            asyncio.run(b.p2p_migrate(object()))
        errors.append(info.value)
    assert errors[0].blocks_safe and "timed out after" in str(errors[0])
    assert errors[1].blocks_safe and "failed after" in str(errors[1])
    assert not errors[2].blocks_safe and "did not finish within" in str(errors[2])
    assert b.stats["failed"] == 3


def _executor(errors: list[BaseException | None]) -> Any:
    """LMDeploy's UniExecutor (its ``migrate``) over a FAKE cache engine (the real one needs
    a GPU here; the PD test runs the real one) whose ``migrate`` raises the next error."""
    from types import SimpleNamespace

    from lmdeploy.pytorch.engine.executor.uni_executor import UniExecutor

    async def migrate(batch: object) -> None:
        err = errors.pop(0)
        if err is not None:
            raise err

    ex = UniExecutor.__new__(UniExecutor)  # its __init__ builds a GPU model agent
    ex.model_agent = SimpleNamespace(cache_engine=SimpleNamespace(migrate=migrate))
    return ex


def _loop_with(executor: object) -> Any:
    """LMDeploy's real decode EngineLoop and Scheduler around ``executor``."""
    from mooncake_lmdeploy.loop_harness import decode_engine_loop

    class Conn:
        sent: list[int] = []

        async def zmq_send(self, remote_engine_id: str, remote_session_id: int) -> None:
            self.sent.append(remote_session_id)

    return decode_engine_loop(executor, Conn(), 12, 16, 1024, 16)


def _add(loop: Any, session_id: int) -> Any:
    from mooncake_lmdeploy.loop_harness import add_migrating_sequence

    return add_migrating_sequence(loop, session_id, "p", [0, 1], 20, remote_token_id=3)


def test_engine_loop_is_patched_and_a_failed_migration_fails_one_request() -> None:
    """The real EngineLoop (patched by the import hook): of two ready requests, the one whose
    migration raised MigrationError is stopped, its blocks freed, answered with LMDeploy's
    INTERNAL_ENGINE_ERROR; the other gets its output. Other errors, and ours when the blocks
    may still be written, propagate as upstream (the engine stops)."""
    pytest.importorskip("lmdeploy.pytorch.engine.engine_loop")
    import asyncio

    from lmdeploy.pytorch.engine.engine_loop import EngineLoop

    assert getattr(EngineLoop, "_mooncake_per_request_failures", False)

    async def run() -> None:
        loop = _loop_with(_executor([MigrationError("peer gone"), None]))
        sched = loop.scheduler
        a, b = _add(loop, 1), _add(loop, 2)
        ready = sched.schedule_migration()
        assert len(ready) == 2 and sched.block_manager.get_num_free_gpu_blocks() == 8
        await loop._migration_loop_process_ready(ready)
        assert a.status.name == "STOPPED" and a.num_blocks == 0 and a.resp.event.is_set()
        assert a.resp.type.name == "INTERNAL_ENGINE_ERROR" and "peer gone" in a.resp.err_msg
        assert b.status.name == "MIGRATION_DONE" and b.resp.type.name == "SUCCESS"
        assert sched.block_manager.get_num_free_gpu_blocks() == 10
        assert loop.engine_conn.sent == [1, 2]
        for err in (RuntimeError("not ours"), MigrationError("late", blocks_safe=False)):
            loop = _loop_with(_executor([err]))
            _add(loop, 3)
            with pytest.raises(type(err)):
                await loop._migration_loop_process_ready(loop.scheduler.schedule_migration())

    asyncio.run(run())
