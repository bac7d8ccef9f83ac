"""pytest plugin registered through the ``pytest11`` entry point.

It adds the markers the suites use; the abstract test classes live beside it.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: a check inherited from mooncake-conformance")
