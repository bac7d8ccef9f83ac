"""``mooncake-core master`` with the published ``mooncake_master`` command line.

Parse tests for every spelling and unit (gflags syntax, flagfiles, ``--config_path``,
``--fromenv``), refusals as one line with exit status 2, ``--version``, and a real master
started with a published-style command line (HTTP metadata on its own port, lease in
milliseconds) serving a client written for the published API through our compat layer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tests_support import free_port

from mooncake_core.cli import master
from mooncake_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> tuple[master.Published, bool]:
    parser = argparse.ArgumentParser(prog="mooncake-core master")
    master.add_arguments(parser)
    return master.published_from_args(parser.parse_args(list(argv)))


def mc(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MOONCAKE_LOG_LEVEL="WARNING")
    return subprocess.run(
        [sys.executable, "-m", "mooncake_core", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_gflags_spellings_of_one_value() -> None:
    for argv in (
        ["--rpc_port=50100"],
        ["--rpc_port", "50100"],
        ["-rpc_port=50100"],
        ["-rpc_port", "50100"],
        ["-port", "50100"],
        ["--rpc_port=0", "-port=50100"],  # published: rpc_port 0 means "use --port"
    ):
        pub, published = parse(*argv)
        assert pub.rpc_port == 50100, argv
        assert published
    pub, published = parse()
    assert pub.rpc_port is None and not published


def test_booleans() -> None:
    for argv, want in (
        (["--enable_http_metadata_server"], True),
        (["-enable_http_metadata_server"], True),
        (["--enable_http_metadata_server=true"], True),
        (["--enable_http_metadata_server=1"], True),
        (["--enable_http_metadata_server", "yes"], True),
        (["--enable_http_metadata_server=false"], False),
        (["--noenable_http_metadata_server"], False),
        (["-noenable_http_metadata_server"], False),
        (["--enable_http_metadata_server", "--noenable_http_metadata_server"], False),
        (["--noenable_http_metadata_server", "--enable_http_metadata_server"], True),
    ):
        assert parse(*argv)[0].metadata is want, argv
    with pytest.raises(ConfigError, match="--enable_http_metadata_server"):
        parse("--enable_http_metadata_server=maybe")


def test_units_and_values() -> None:
    for raw, seconds in (("5000", 5.0), ("5s", 5.0), ("250ms", 0.25), ("2m", 120.0), ("1h", 3600)):
        pub, _ = parse(f"--default_kv_lease_ttl={raw}")
        assert pub.store["lease_ttl_s"] == pytest.approx(seconds), raw
    pub, _ = parse(
        "--eviction_high_watermark_ratio=0.8",
        "--eviction_ratio",
        "0.1",
        "--client_ttl=20",
        "--put_start_discard_timeout_sec=45",
        "--allocation_strategy=free_ratio_first",
        "--metrics_port=9100",
        "--metrics_host=127.0.0.1",
        "--rpc_address=127.0.0.1",
        "--http_metadata_server_host=127.0.0.1",
        "--http_metadata_server_port=8181",
        "--cluster_id=c1",
    )
    assert pub.store == {
        "eviction_high_watermark": 0.8,
        "eviction_ratio": 0.1,
        "client_ttl_s": 20.0,
        "put_timeout_s": 45.0,
        "placement": "free-ratio-first",
    }
    assert (pub.http_port, pub.http_host, pub.host) == (9100, "127.0.0.1", "127.0.0.1")
    assert (pub.metadata_host, pub.metadata_port, pub.cluster_id) == ("127.0.0.1", 8181, "c1")
    assert parse()[0].metadata_port == 8080  # as published
    for bad, flag in (
        (["--default_kv_lease_ttl=soon"], "--default_kv_lease_ttl"),
        (["--rpc_port=x"], "--rpc_port"),
        (["--client_ttl=1.5"], "--client_ttl"),
        (["--put_start_discard_timeout_sec=-1"], "--put_start_discard_timeout_sec"),
        (["--eviction_ratio=lots"], "--eviction_ratio"),
        (["--allocation_strategy=cxl"], "--allocation_strategy"),
    ):
        with pytest.raises(ConfigError, match=flag):
            parse(*bad)


def test_ha_endpoints_are_a_semicolon_list() -> None:
    pub, _ = parse("--enable_ha", "--etcd_endpoints=127.0.0.1:2379;127.0.0.1:2380")
    assert pub.ha_url == "etcd://127.0.0.1:2379,127.0.0.1:2380"
    pub, _ = parse("--enable_ha=true", "--ha_backend_connstring=etcd://10.0.0.1:2379")
    assert pub.ha_url == "etcd://10.0.0.1:2379"
    assert parse("--etcd_endpoints=127.0.0.1:2379")[0].ha_url is None
    with pytest.raises(ConfigError, match="--enable_ha"):
        parse("--enable_ha")
    with pytest.raises(ConfigError, match="--ha_backend_type=redis"):
        parse("--enable_ha", "--ha_backend_type=redis", "--etcd_endpoints=a:1")


def test_flags_we_lack_refused_at_other_values_and_tuning_flags_warned() -> None:
    with pytest.raises(ConfigError, match=r"--enable_cxl=true: not supported"):
        parse("--enable_cxl")
    parse("--enable_cxl=false")  # the published default: nothing to refuse
    pub, _ = parse("--rpc_thread_num=8", "--logtostderr", "--max_threads=16")
    assert len(pub.warnings) == 2  # max_threads is at its default
    assert pub.warnings[0].startswith("--rpc_thread_num: accepted for compatibility, no effect")


def test_flagfile_config_path_and_fromenv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inner = tmp_path / "inner.flags"
    inner.write_text("--eviction_ratio=0.2\n")
    flags = tmp_path / "master.flags"
    flags.write_text(
        f"# comment\n--rpc_port=50200\n\n-noenable_ha\n--enable_http_metadata_server\n"
        f"--flagfile={inner}\n"
    )
    pub, _ = parse(f"--flagfile={flags}", "--rpc_port=50201")  # later on the line wins
    assert (pub.rpc_port, pub.metadata, pub.store["eviction_ratio"]) == (50201, True, 0.2)
    bad = tmp_path / "bad.flags"
    bad.write_text("--no_such_flag=1\n")
    with pytest.raises(ConfigError, match="no_such_flag"):
        parse(f"--flagfile={bad}")

    conf = tmp_path / "master.json"
    conf.write_text(
        json.dumps(
            {
                "rpc_port": 50300,
                "default_kv_lease_ttl": 5000,
                "eviction_ratio": 0.1,
                "client_live_ttl_sec": 60,
                "enable_http_metadata_server": True,
                "rpc_thread_num": 4,
            }
        )
    )
    pub, _ = parse(f"--config_path={conf}", "--eviction_ratio=0.3")  # flags over the file
    assert pub.rpc_port == 50300 and pub.metadata
    assert pub.store["lease_ttl_s"] == 5.0 and pub.store["client_ttl_s"] == 60.0
    assert pub.store["eviction_ratio"] == 0.3
    conf.write_text(json.dumps({"rpc_prot": 1}))
    with pytest.raises(ConfigError, match="rpc_prot: no such master flag"):
        parse(f"--config_path={conf}")

    monkeypatch.setenv("FLAGS_rpc_port", "50400")
    assert parse("--fromenv=rpc_port")[0].rpc_port == 50400
    assert parse("--tryfromenv=metrics_port")[0].http_port is None
    with pytest.raises(ConfigError, match="FLAGS_metrics_port"):
        parse("--fromenv=metrics_port")


def test_unsupported_flag_is_one_line_exit_2(tmp_path: Path) -> None:
    r = mc("master", "--rpc_port=1", "--enable_offload")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "--enable_offload=true" in lines[0] and "not supported" in lines[0]
    r = mc("master", f"--flagfile={tmp_path / 'missing'}")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--flagfile" in r.stderr


def test_help_lists_the_published_flags() -> None:
    for flag in ("--help", "-help", "--helpfull"):
        r = mc("master", flag)
        assert r.returncode == 0, r.stderr
        assert "--rpc_port" in r.stdout and "--http_metadata_server_port" in r.stdout
        assert "--rpc-port" in r.stdout  # ours stay


def test_version() -> None:
    for flag in ("--version", "-version"):
        r = mc("master", flag)
        assert r.returncode == 0, r.stderr
        assert "mooncake-core" in r.stdout
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from mooncake_core.cli.master import published_main as m; "
            "raise SystemExit(m(['-version']))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0 and "mooncake_master" in r.stdout, r.stderr


def _wait_ready(path: Path, proc: subprocess.Popen[str]) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if path.exists():
            return dict(json.loads(path.read_text()))
        if proc.poll() is not None:
            raise AssertionError(f"master exited {proc.returncode}: {proc.stderr.read()}")  # type: ignore[union-attr]
        time.sleep(0.05)
    raise AssertionError("master did not start")


@pytest.mark.slow
def test_published_command_line_serves_a_published_client(tmp_path: Path) -> None:
    rpc, metrics, meta = free_port(), free_port(), free_port()
    ready = tmp_path / "ready.json"
    cmd = [
        sys.executable,
        "-c",
        "import sys; from mooncake_core.cli.master import published_main as m; "
        "raise SystemExit(m(sys.argv[1:]))",
        f"--rpc_port={rpc}",
        "--rpc_address=127.0.0.1",
        "-metrics_port",
        str(metrics),
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={meta}",
        "--default_kv_lease_ttl=5000",
        "--eviction_high_watermark_ratio=0.95",
        "--eviction_ratio=0.05",
        "--rpc_thread_num=4",
        "--ready-file",
        str(ready),
    ]
    env = dict(os.environ, MOONCAKE_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        info = _wait_ready(ready, proc)
        assert (info["rpc_port"], info["http_port"], info["metadata_port"]) == (rpc, metrics, meta)
        from mooncake_core.compat.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(
            "127.0.0.1",
            f"http://127.0.0.1:{meta}/metadata",
            16 << 20,
            16 << 20,
            "tcp",
            "",
            f"127.0.0.1:{rpc}",
        )
        assert rc == 0
        try:
            payload = os.urandom(100_000)
            assert store.put("published/key", payload) == 0
            assert store.get("published/key") == payload
            assert store.is_exist("published/key") == 1
        finally:
            store.close()
        import urllib.error
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as exc:  # metadata is not on the metrics port
            urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metadata?key=x", timeout=5)
        assert exc.value.code == 404
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert proc.returncode == 0
    assert "--rpc_thread_num: accepted for compatibility" in (
        proc.stderr.read() if proc.stderr else ""
    )


@pytest.mark.slow
def test_mooncake_master_console_script_package(tmp_path: Path) -> None:
    """extras/mooncake-master installs a ``mooncake_master`` script that runs ours."""
    import tomllib

    meta = tomllib.loads((ROOT / "extras" / "mooncake-master" / "pyproject.toml").read_text())
    assert meta["project"]["scripts"] == {
        "mooncake_master": "mooncake_core.cli.master:published_main"
    }
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "mooncake_master" not in core["project"]["scripts"]  # never by surprise
    assert core["project"]["optional-dependencies"]["mooncake-master"] == ["mooncake-core-master"]
    import shutil

    src = tmp_path / "src"  # build a copy: pip builds in the tree it is given
    shutil.copytree(ROOT / "extras" / "mooncake-master", src)
    target = tmp_path / "site"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr
    script = target / "bin" / "mooncake_master"
    r = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert "mooncake-core" in r.stdout
    r = subprocess.run(
        [str(script), "--enable_offload"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "--enable_offload=true: not supported" in r.stderr


@pytest.mark.slow
@pytest.mark.etcd
def test_published_ha_command_line_leads_through_etcd(etcd_url: str, tmp_path: Path) -> None:
    import urllib.request
    import uuid

    endpoint = etcd_url[len("etcd://") :]
    rpc, metrics = free_port(), free_port()
    ready = tmp_path / "ready.json"
    cmd = [
        sys.executable,
        "-m",
        "mooncake_core",
        "master",
        "--enable_ha",
        f"--etcd_endpoints={endpoint};127.0.0.1:1",  # a semicolon list; the first one answers
        f"--cluster_id=flags-{uuid.uuid4().hex[:8]}",
        "--rpc_address=127.0.0.1",
        f"--rpc_port={rpc}",
        f"--metrics_port={metrics}",
        "--ready-file",
        str(ready),
    ]
    env = dict(os.environ, MOONCAKE_LOG_LEVEL="WARNING")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        _wait_ready(ready, proc)
        deadline = time.monotonic() + 20
        role: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/role", timeout=5) as r:
                role = json.loads(r.read())
            if role["role"] == "leader":
                break
            time.sleep(0.1)
        assert role["role"] == "leader" and role["leader"] == f"127.0.0.1:{rpc}"
    finally:
        proc.terminate()
        proc.wait(timeout=15)
