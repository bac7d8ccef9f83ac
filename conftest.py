"""Suite-wide collection rules; this root conftest applies to tests/, plugins/ and conformance/.

``make test`` runs the suite on several pytest-xdist workers (``--dist loadgroup``). Each
test module is one group, so a module's fixtures (masters, etcd, engines) start once, on
one worker. Modules that drive real inference engines (marked ``engine``) form a single
group that runs first: their servers are the heaviest processes of the suite and two
workers starting them at the same time on a 2-core machine only slow each other down,
while the other worker runs the socket- and process-bound rest beside them.
"""

from __future__ import annotations

import pytest

ENGINE_GROUP = "engines"


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def module_of(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    engine_modules = {module_of(i) for i in items if i.get_closest_marker("engine") is not None}
    engine = [i for i in items if module_of(i) in engine_modules]
    rest = [i for i in items if module_of(i) not in engine_modules]
    items[:] = engine + rest
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        mod = module_of(item)
        item.add_marker(pytest.mark.xdist_group(ENGINE_GROUP if mod in engine_modules else mod))
