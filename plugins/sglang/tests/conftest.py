"""SGLang tests: install the inert ``torchvision`` (``torchvision_stand_in.py``) before SGLang's
pools load.

Only when torchvision is absent (a CPU-only machine: PyPI's builds are CUDA ones), and
only once a test of this folder runs, so other folders' tests never see it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torchvision_stand_in  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _torchvision_stand_in() -> None:
    torchvision_stand_in.install()
