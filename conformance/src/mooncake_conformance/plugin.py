"""pytest plugin registered through the ``pytest11`` entry point.

It declares the markers the suites use and records, per adapter, the outcome of every
inherited check in a status file (:mod:`mooncake_conformance.status`) at the end of
the session. The abstract test classes live in :mod:`mooncake_conformance.adapter`.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from typing import Any

import pytest

from mooncake_conformance import status

logger = logging.getLogger(__name__)

_KEY = pytest.StashKey[dict[str, dict[str, Any]]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: a check inherited from mooncake-conformance")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.stash[_KEY] = {}


def _contract_check(item: pytest.Item) -> str | None:
    cls = getattr(item, "cls", None)
    if cls is None:
        return None
    from mooncake_conformance.adapter import AdapterContract
    from mooncake_conformance.migration import MigrationContract

    # a class may take the migration checks alone (AdapterContract includes them)
    if not issubclass(cls, MigrationContract):
        return None
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    return name if hasattr(AdapterContract, name) else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    check = _contract_check(item)
    if check is None:
        return
    props = dict(item.user_properties)
    adapter = props.get("mooncake_adapter")
    if not adapter:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if report.skipped:
            result = "skipped"
        elif report.passed:
            result = "passed"
        else:
            result = "failed"
        rec = item.config.stash[_KEY].setdefault(
            str(adapter),
            {
                "module": str(props.get("mooncake_adapter_package") or ""),
                "checks": {},
                "reasons": {},
            },
        )
        rec["checks"][check] = status.merge_outcome(rec["checks"].get(check), result)
        if result == "skipped" and isinstance(report.longrepr, tuple):
            rec["reasons"][check] = str(report.longrepr[2])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        return
    for adapter, rec in session.config.stash.get(_KEY, {}).items():
        try:
            path = status.write_status(adapter, rec["module"], rec["checks"], rec["reasons"])
        except OSError as exc:
            logger.warning("could not write the conformance status of %s: %s", adapter, exc)
            continue
        if path is not None:
            logger.info("conformance status of %s written to %s", adapter, path)
