"""Plugin discovery through entry points, and the CLI listing."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mooncake_core import hookmarkers, plugins
from mooncake_core.errors import ConfigError, PluginError
from mooncake_core.plugins import TransportInfo, hookimpl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_manager() -> object:
    plugins.reset_plugin_manager()
    yield None
    plugins.reset_plugin_manager()


def test_builtins_are_discovered() -> None:
    tr = plugins.transports()
    assert {"tcp", "shm", "rdma"} <= set(tr)
    assert tr["shm"].priority < tr["rdma"].priority < tr["tcp"].priority
    md = plugins.metadata_backends()
    assert {"p2p", "http", "etcd"} <= set(md)
    assert "P2PHANDSHAKE" in md["p2p"].schemes


def test_adapters_register_through_entry_points() -> None:
    names = {a.name for a in plugins.adapters()}
    assert {"vllm", "sglang", "lmdeploy", "trtllm"} <= names


def test_entry_point_plugins_are_registered_under_their_names() -> None:
    pm = plugins.get_plugin_manager()
    # loaded from the installed distribution's entry points (not only the built-in fallback)
    assert pm.has_plugin("tcp") and pm.has_plugin("etcd") and pm.has_plugin("vllm")
    info = dict(pm.list_plugin_distinfo())
    assert any(getattr(d, "project_name", "") == "mooncake-core" for d in info.values())


def test_third_party_transport_and_duplicate_names() -> None:
    pm = plugins.get_plugin_manager()
    mod = types.ModuleType("loopy")

    @hookimpl
    def mooncake_transports() -> list[TransportInfo]:
        return [TransportInfo("loopy", lambda eng: None, 99, "a test transport")]

    mod.mooncake_transports = mooncake_transports  # type: ignore[attr-defined]
    pm.register(mod, name="loopy")
    assert "loopy" in plugins.transports()
    dup = types.ModuleType("dup")

    @hookimpl
    def mooncake_transports2() -> list[TransportInfo]:
        return [TransportInfo("tcp", lambda eng: None, 1)]

    dup.mooncake_transports = mooncake_transports2  # type: ignore[attr-defined]
    pm.register(dup, name="dup")
    with pytest.raises(PluginError, match="'tcp' is provided twice"):
        plugins.transports()


def test_unknown_hook_is_rejected_at_startup() -> None:
    pm = plugins.get_plugin_manager()
    bad = types.ModuleType("typo")

    @hookimpl
    def mooncake_transprots() -> list[TransportInfo]:
        return []

    bad.mooncake_transprots = mooncake_transprots  # type: ignore[attr-defined]
    pm.register(bad, name="typo")
    import pluggy

    with pytest.raises(pluggy.PluginValidationError):
        pm.check_pending()


def test_blocking_and_autoload_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("MOONCAKE_BLOCK_PLUGINS", "rdma")
    plugins.reset_plugin_manager()
    assert "rdma" not in plugins.transports()
    assert plugins.adapters() == []  # adapters only come from entry points


def test_cli_lists_plugins() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mooncake_core", "plugins"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for word in (
        "tcp",
        "shm",
        "rdma",
        "P2PHANDSHAKE",
        "etcd://",
        "vllm",
        "sglang",
        "lmdeploy",
        "trtllm",
    ):
        assert word in out.stdout


def test_blocking_and_autoload_read_through_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_DISABLE_PLUGIN_AUTOLOAD", "On")
    monkeypatch.setenv("MOONCAKE_BLOCK_PLUGINS", " rdma , ,shm")
    plugins.reset_plugin_manager()
    assert {"rdma", "shm"}.isdisjoint(plugins.transports()) and "tcp" in plugins.transports()
    assert plugins.adapters() == []
    monkeypatch.setenv("MOONCAKE_DISABLE_PLUGIN_AUTOLOAD", "perhaps")
    plugins.reset_plugin_manager()
    with pytest.raises(ConfigError, match="MOONCAKE_DISABLE_PLUGIN_AUTOLOAD"):
        plugins.get_plugin_manager()


def test_hook_markers_live_in_a_leaf_module_re_exported_by_plugins() -> None:
    assert plugins.hookimpl is hookmarkers.hookimpl
    assert plugins.hookspec is hookmarkers.hookspec
    assert plugins.PROJECT == hookmarkers.PROJECT == "mooncake"
    tree = ast.parse(Path(hookmarkers.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m.startswith("mooncake") for m in imported), imported


# the contracts of .importlinter that guard the plugin and transfer layers
LAYER_CONTRACTS = (
    "core-layers",
    "transfer-layers",
    "transports-layers",
    "engine-knows-no-concrete-transport",
)


def test_plugin_and_transfer_layers_are_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    args = [exe, "--no-cache", "--no-logo"] + [
        a for c in LAYER_CONTRACTS for a in ("--contract", c)
    ]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
