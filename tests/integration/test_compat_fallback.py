"""``import mooncake`` with no code change: extras/mooncake-compat's start-up hook.

The extra's ``mooncake_core_fallback.pth`` and module are copied into a directory that the
child process adds as a site directory (``site.addsitedir`` runs ``.pth`` files exactly as
for site-packages), so no pip install is needed here. A script written for the published
package, with no ``install()`` call, then runs on ours against a real master; a ``mooncake``
package found on the path first (standing in for the published wheel) wins.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import test_compat_store as harness

ROOT = Path(__file__).resolve().parents[2]
EXTRA = ROOT / "extras" / "mooncake-compat"

USER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from mooncake.store import MooncakeDistributedStore   # no install(), as published code reads
    s = MooncakeDistributedStore()
    rc = s.setup("127.0.0.1", sys.argv[2], 16 << 20, 16 << 20, "tcp", "", sys.argv[1])
    value = bytes(range(256)) * 1000
    out = {"setup": rc, "put": s.put("k", value), "same": s.get("k") == value,
           "module": type(s).__module__}
    s.close()
    print(json.dumps(out))
    """
)


def _site(tmp: Path) -> Path:
    site = tmp / "site"
    site.mkdir()
    for name in ("mooncake_core_fallback.pth", "mooncake_core_fallback.py"):
        shutil.copy(EXTRA / name, site / name)
    return site


def _run(code: str, *args: str, sites: list[Path], cwd: Path) -> str:
    boot = "import site, sys\n" + "".join(f"site.addsitedir({str(s)!r})\n" for s in sites)
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", boot + code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=cwd,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_published_style_script_runs_on_ours_without_install(tmp_path: Path) -> None:
    site = _site(tmp_path)
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    code = "import runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    with harness.our_master() as (master, metadata):
        got = json.loads(_run(code, str(script), master, metadata, sites=[site], cwd=tmp_path))
    assert got == {"setup": 0, "put": 0, "same": True, "module": "mooncake_core.compat.store"}


def test_a_mooncake_package_found_first_is_left_alone(tmp_path: Path) -> None:
    site = _site(tmp_path)
    probe = (
        "import mooncake_core.compat as c\n"
        "print(c._real_package_present(), end=' ')\n"
        "import mooncake\n"
        "print(getattr(mooncake, 'WHO', mooncake.__name__), c.installed(), mooncake.__spec__.name)"
    )
    # ours alone: the fallback is not taken for a published package, and serves `mooncake`
    assert _run(probe, sites=[site], cwd=tmp_path) == (
        "False mooncake_core.compat True mooncake_core.compat"
    )
    published = tmp_path / "published"
    (published / "mooncake").mkdir(parents=True)
    (published / "mooncake" / "__init__.py").write_text("WHO = 'published'\n")
    assert _run(probe, sites=[published, site], cwd=tmp_path) == "True published False mooncake"
