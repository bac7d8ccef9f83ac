"""The layout rules of docs/architecture.md that import-linter does not check.

- No module of ``mooncake_core`` is longer than 800 lines (split along its seams instead);
  nor is any module of the engine adapters' or the conformance suite's source packages
  (``plugins/*/src``, ``conformance/src``).
- ``mooncake_core`` names no engine adapter nor the conformance suite, not even in a comment
  or a docstring (import-linter checks the imports; this checks the text).
- Only ``mooncake_core/config.py`` reads the process environment.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "mooncake_core"
MAX_LINES = 800


def _modules() -> list[Path]:
    files = sorted(CORE.rglob("*.py"))
    assert files, f"no modules under {CORE}"
    return files


def test_no_core_module_is_over_800_lines() -> None:
    long = {
        str(p.relative_to(CORE)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them along their seams): {long}"


def _package_modules() -> list[Path]:
    """The source modules of the engine adapters and of the conformance suite."""
    files = sorted([*ROOT.glob("plugins/*/src/**/*.py"), *ROOT.glob("conformance/src/**/*.py")])
    assert files, f"no modules under {ROOT}/plugins/*/src or {ROOT}/conformance/src"
    return files


def test_no_adapter_or_conformance_module_is_over_800_lines() -> None:
    long = [
        f"{p.relative_to(ROOT)} ({n} lines)"
        for p in _package_modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"modules over {MAX_LINES} lines (split them along their seams): {long}"


def test_the_core_names_no_adapter() -> None:
    pattern = re.compile(r"mooncake_(vllm|sglang|lmdeploy|trtllm|conformance)")
    hits = [
        f"{p.relative_to(CORE)}:{i}"
        for p in _modules()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, f"the core names an adapter: {hits}"


def test_only_the_config_module_reads_the_environment() -> None:
    pattern = re.compile(r"os\.environ|os\.getenv|os\.putenv")
    hits = [
        f"{p.relative_to(CORE)}:{i}"
        for p in _modules()
        if p.name != "config.py" or p.parent != CORE
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, f"read the environment through mooncake_core.config instead: {hits}"
