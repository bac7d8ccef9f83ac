"""``mooncake.fabric_allocator_utils``: the same calls against the published wheel and ours.

One script runs with the wheel's python (scratch venv from scripts/setup_mooncake_peer.sh;
that side is skipped with a reason when absent) and with ours after
``mooncake_core.compat.install()``; both print what the two helpers return, raise and log
(libc as the probed library: ``sysconf(0)`` is a value both sides must read alike), and
the answers must be equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mooncake_core.bench.published import peer

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    r"""
    import ctypes, ctypes.util, inspect, json, logging, os
    if os.environ.get("USE_MOONCAKE_CORE"):
        import mooncake_core.compat
        assert mooncake_core.compat.install()
    import mooncake
    from mooncake import fabric_allocator_utils as fau

    warned = []

    class Catch(logging.Handler):
        def emit(self, record):
            warned.append(record.levelname)

    logging.getLogger(fau.__name__).addHandler(Catch())
    r = {}
    r["params"] = [
        [[p.name, str(p.kind), repr(p.default)] for p in inspect.signature(f).parameters.values()]
        for f in (fau.get_mooncake_so_path, fau.probe_allocator_backend)
    ]
    package_dir = os.path.dirname(os.path.abspath(mooncake.__file__))
    found = fau.get_mooncake_so_path("cli_client.py", "unused")
    r["found"] = [os.path.dirname(found) == package_dir, os.path.basename(found)]
    r["found"].append(os.path.isfile(found))
    try:
        fau.get_mooncake_so_path("mc_no_such_lib.so", "build mooncake with fabric support")
        r["missing"] = None
    except ImportError as exc:
        r["missing"] = [type(exc).__name__, str(exc)]
    libc = ctypes.util.find_library("c")
    r["sysconf"] = fau.probe_allocator_backend(libc, "sysconf", ctypes.c_long, -1)
    r["sysconf_ok"] = r["sysconf"] == os.sysconf(0)
    r["abs"] = fau.probe_allocator_backend(libc, "abs", ctypes.c_int, -7)
    r["warnings_ok"] = len(warned)
    r["no_symbol"] = fau.probe_allocator_backend(libc, "mc_no_such_symbol", ctypes.c_int, "unsup")
    r["no_lib"] = fau.probe_allocator_backend("/nonexistent/libmc_x.so", "abs", ctypes.c_int, None)
    r["warnings"] = warned
    print(json.dumps(r))
    """
)


def _run(python: str, ours: bool) -> dict[str, Any]:
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    env.pop("USE_MOONCAKE_CORE", None)
    if ours:
        env.update(USE_MOONCAKE_CORE="1", PYTHONPATH=str(ROOT))
    p = subprocess.run(
        [python, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60, cwd="/"
    )
    assert p.returncode == 0, p.stderr[-2000:]
    out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def test_same_answers_as_the_published_module() -> None:
    ours = _run(sys.executable, ours=True)
    assert ours["found"] == [True, "cli_client.py", True]
    assert ours["missing"] == ["ImportError", "build mooncake with fabric support"]
    assert ours["sysconf_ok"] and ours["abs"] == 0 and ours["warnings_ok"] == 0
    assert ours["no_symbol"] == "unsup" and ours["no_lib"] is None
    assert ours["warnings"] == ["WARNING", "WARNING"]
    real = os.environ.get("MOONCAKE_PEER_PYTHON") or peer().default_peer_python()
    if real is None:
        pytest.skip("no scratch venv with the published wheel (scripts/setup_mooncake_peer.sh)")
    theirs = _run(str(real), ours=False)
    assert theirs == ours
