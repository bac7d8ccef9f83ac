"""Suite-wide collection rules; this root conftest applies to tests/, plugins/ and conformance/.

``make test`` runs the suite on pytest-xdist workers with ``--dist loadfile``: a test
module runs whole on one worker, so its fixtures (masters, etcd, engines) start once.
Modules that drive real inference engines (marked ``engine``) are scheduled as a single
unit, first: their servers are the heaviest processes of the suite, and two workers
starting them at once on a 2-core machine only slow each other down (and time out),
while the other worker runs the socket- and process-bound rest beside them.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

ENGINE_GROUP = "engines"
ENGINE_MARK = "pytest.mark.engine"


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@functools.cache
def _drives_engines(path: Path) -> bool:
    try:
        return ENGINE_MARK in path.read_text(encoding="utf-8")
    except OSError:
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Engine modules first (every worker collects the same order)."""
    engine = {_module_of(i.nodeid) for i in items if i.get_closest_marker("engine") is not None}
    items[:] = [i for i in items if _module_of(i.nodeid) in engine] + [
        i for i in items if _module_of(i.nodeid) not in engine
    ]


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, except that every engine module is one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class EngineGroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = _module_of(nodeid)
            return ENGINE_GROUP if _drives_engines(root / module) else module

    return EngineGroupScheduling(config, log)
