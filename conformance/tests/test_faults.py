"""The test-only fault plugins of :mod:`mooncake_conformance.faults` do what tests rely on.

- in this process: writes over the real ``shm`` and ``tcp`` transports deliver zeros while
  the switch is on, and the caller's bytes otherwise;
- in a child process: a generated ``dist-info`` on ``PYTHONPATH`` makes the child's plugin
  manager load the plugin through the ``mooncake_core.transports`` entry-point group.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from mooncake_conformance import faults

from mooncake_core.config import environment
from mooncake_core.plugins import get_plugin_manager, reset_plugin_manager
from mooncake_core.transfer import TransferEngine


@pytest.fixture
def corrupt() -> Iterator[faults.CorruptWrites]:
    reset_plugin_manager()
    plugin = faults.install_corrupt_writes()
    try:
        yield plugin
    finally:
        get_plugin_manager().unregister(plugin)
        reset_plugin_manager()


@pytest.mark.parametrize("hint", [None, "tcp"])
def test_writes_deliver_zeros_only_while_switched_on(
    corrupt: faults.CorruptWrites, hint: str | None
) -> None:
    with (
        TransferEngine(transfer={"timeout_s": 5}) as a,
        TransferEngine(transfer={"timeout_s": 5}) as b,
    ):
        src = bytearray(b"\x5a" * 4096)
        dst = bytearray(4096)
        a.register(src)
        region = b.register(dst)
        a.write(b.name, src, region.addr, transport=hint)
        assert dst == src and corrupt.corrupted == 0
        dst[:] = b"\x11" * 4096
        with corrupt.switched_on():
            a.write(b.name, src, region.addr, transport=hint)
        assert dst == bytearray(4096) and corrupt.corrupted > 0
        a.write(b.name, src, region.addr, transport=hint)  # switched off again
        assert dst == src


def test_child_loads_the_plugin_through_the_entry_point(tmp_path: Path) -> None:
    env = dict(environment(), **faults.corrupt_writes_env(tmp_path))
    env.pop("MOONCAKE_DISABLE_PLUGIN_AUTOLOAD", None)
    code = (
        "import json; from mooncake_core.plugins import transports; "
        "print(json.dumps({n: t.description for n, t in transports().items()}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    desc = json.loads(out.strip().splitlines()[-1])
    assert desc["tcp"].endswith("[test: writes corrupted]") and desc["shm"].endswith(
        "[test: writes corrupted]"
    )
    assert "[test" not in desc.get("rdma", "")
