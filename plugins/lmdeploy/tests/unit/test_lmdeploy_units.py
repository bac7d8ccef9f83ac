"""Units of mooncake-lmdeploy that need no second process: segment merging, the import
hook, the backend's checks of what LMDeploy hands it (with LMDeploy's own messages)."""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path
from types import ModuleType

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
