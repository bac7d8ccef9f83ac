"""The opt-in ``mooncake_client`` console script (extras/mooncake-client, issue 16).

Its flag checks and ``--version`` run in this process; that it really runs our
standalone client is shown by test_compat_dummy_client.py, whose restarted service is
started through it. One test lists the published wheel's own ``mooncake_client --help``
(skipped without the scratch venv) and fails for any flag we neither take nor refuse by
name.
"""

from __future__ import annotations

import os
import re
import subprocess
from importlib import import_module
from pathlib import Path

import pytest
import tomllib

from mooncake_core.cli.standalone_client import (
    FLAGS,
    NOT_TAKEN,
    VERSION,
    published_main,
    unsupported_flags,
)

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / ".scratch" / "mooncake-venv" / "bin" / "mooncake_client"


def test_version_names_the_script(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--version", "-version"):
        assert published_main(["--port=1", flag]) == 0
        out = capsys.readouterr().out
        assert out.strip() == VERSION and out.startswith("mooncake_client (mooncake-core ")


def test_published_spellings_accepted() -> None:
    argv = [
        "--port=50052",
        "-host",
        "0.0.0.0",
        "--master_server_address",
        "127.0.0.1:50051",
        "--metadata_server=http://127.0.0.1:8080/metadata",
        "--global_segment_size",
        "4 GB",
        "--local_buffer_size=0",
        "--protocol",
        "tcp",
        "--device_names",
        "",
        "--tenant_id=default",
        "--threads",
        "4",
        "--noenable_offload",
        "--enable_http_server=false",
        "--v=1",
        "--logtostderr",
        "--log-level",
        "INFO",
        "--ready-file",
        "ready.json",
    ]
    assert unsupported_flags(argv) == []


def test_unsupported_flags_one_line_naming_each(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--vmodule=x=2", "--port", "1", "--bogus", "--nosymbolize_stacktrace", "-flagfile", "f"]
    assert [n for n, _ in unsupported_flags(argv)] == [
        "vmodule",
        "bogus",
        "symbolize_stacktrace",
        "flagfile",
    ]
    assert published_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mooncake_client: not supported")
    for name in ("--vmodule (a glog", "--bogus (not a published", "--flagfile (give"):
        assert name in err


def test_console_script_package_is_opt_in() -> None:
    meta = tomllib.loads((ROOT / "extras" / "mooncake-client" / "pyproject.toml").read_text())
    (target,) = meta["project"]["scripts"].values()
    assert list(meta["project"]["scripts"]) == ["mooncake_client"]
    module, _, func = target.partition(":")
    assert getattr(import_module(module), func) is published_main
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "mooncake_client" not in core["project"]["scripts"]  # never by surprise
    assert core["project"]["optional-dependencies"]["mooncake-client"] == ["mooncake-core-client"]


def test_every_published_flag_known() -> None:
    if not PUBLISHED.exists():
        pytest.skip("no scratch venv with the published wheel (scripts/setup_mooncake_peer.sh)")
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    r = subprocess.run(
        [str(PUBLISHED), "--helpfull"], capture_output=True, text=True, env=env, timeout=30
    )
    published = set(re.findall(r"^\s+-(\w+) \(", r.stdout + r.stderr, re.MULTILINE))
    assert len(published) > 40, r.stdout[-500:]
    ours = {f.name for f in FLAGS} | set(NOT_TAKEN) | {"help", "helpfull", "helpshort"}
    ours |= {"helppackage"}
    assert sorted(published - ours) == []
