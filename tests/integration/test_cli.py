"""The command line: demo, metadata server, bench --json contract, error lines."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from tests_support import free_port  # type: ignore[import-not-found]

pytestmark = pytest.mark.timeout(180)


def mc(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mooncake_core", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_moves_and_verifies_tensors() -> None:
    out = mc("demo", "--layers", "4", "--blocks", "8")
    assert out.returncode == 0, out.stderr
    assert "all transfers verified byte for byte" in out.stdout
    assert out.stdout.count(" yes") == 5


def test_metadata_server_cli() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake_core", "metadata-server", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}/metadata?key=mooncake/rpc_meta/x"
        end = time.monotonic() + 20
        while True:
            try:
                req = urllib.request.Request(url, data=b'{"rpc_port": 1}', method="PUT")
                urllib.request.urlopen(req, timeout=2).read()
                break
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)
        assert json.loads(urllib.request.urlopen(url, timeout=2).read()) == {"rpc_port": 1}
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metadata?key=nope", timeout=2)
        assert ei.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metadata", timeout=2)
        assert ei.value.code == 400
    finally:
        proc.terminate()
        proc.wait(10)


def test_bad_config_is_one_clear_line(tmp_path: object) -> None:
    import os

    env = dict(os.environ, MOONCAKE_TRANSFER_SLICE_SIZE="tiny")
    out = subprocess.run(
        [sys.executable, "-m", "mooncake_core", "demo"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip().splitlines()[-1]
        == "mooncake-core: error: transfer.slice_size: cannot parse size 'tiny' "
        "(use e.g. 4GB, 512MiB, 1048576)"
    )


@pytest.mark.slow
def test_bench_transfer_quick_json_contract() -> None:
    out = mc("bench", "transfer", "--quick", "--json", timeout=170)
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "tcp_write_gbps_16m",
        "tcp_read_gbps_16m",
        "raw_tcp_gbps",
        "shm_write_gbps_16m",
        "shm_read_gbps_16m",
        "memcpy_gbps",
        "lat64k_p50_us",
        "lat64k_p99_us",
    ):
        assert isinstance(last[key], (int, float)) and last[key] > 0, key


def test_adapter_commands_are_listed_and_unknown_ones_are_one_line() -> None:
    from mooncake_core.cli import extensions

    out = mc("--help")
    assert out.returncode == 0
    for name in extensions.commands():
        assert name in out.stdout  # e.g. pd-demo from the vLLM adapter's entry point
    bench = mc("bench", "--help")
    for name in ("transfer", "store", *extensions.benches()):
        assert name in bench.stdout
    for args in (("no-such-command",), ("bench", "no-such-bench")):
        bad = mc(*args)
        lines = bad.stderr.strip().splitlines()
        assert (
            bad.returncode == 2 and len(lines) == 1 and lines[0].startswith("mooncake-core: error:")
        ), bad.stderr
        assert args[-1] in lines[0]


def test_log_level_after_the_command_and_from_the_config() -> None:
    import os

    out = mc("plugins", "--json", "--log-level", "DEBUG")
    assert out.returncode == 0, out.stderr
    env = dict(os.environ, MOONCAKE_LOG_LEVEL="loud")
    out = subprocess.run(
        [sys.executable, "-m", "mooncake_core", "plugins"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2 and "log.level" in out.stderr
