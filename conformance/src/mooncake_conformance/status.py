"""Conformance status files: what the suite last found for each adapter.

When checks inherited from :class:`~mooncake_conformance.adapter.AdapterContract` run,
the pytest plugin writes ``<dir>/<adapter>.json`` with one outcome per check (a check
with parameters passes only if every parameter passed). ``<dir>`` is
``$MOONCAKE_CONFORMANCE_DIR``, else ``$XDG_CACHE_HOME/mooncake-core/conformance``, else
``~/.cache/mooncake-core/conformance``; ``MOONCAKE_CONFORMANCE_DIR=off`` disables writing.

The file records a digest of the adapter package's sources; :func:`describe` (what
``mooncake-core plugins`` shows through each adapter's ``mooncake_adapter_info``) calls
a result *stale* once the sources changed, and *incomplete* when some checks never ran.
Runs that only cover some checks merge with the last run of the same sources (a skip
does not replace a recorded pass or failure).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mooncake_core.config import env_str, environment

__all__ = [
    "status_dir",
    "source_digest",
    "contract_checks",
    "merge_outcome",
    "write_status",
    "read_status",
    "describe",
    "SUITE_VERSION",
]

SUITE_VERSION = "0.2.0"  # 0.2.0: the PD migration checks
_RANK = {"failed": 3, "passed": 2, "skipped": 1}


def status_dir() -> Path | None:
    """Where status files live, or None when disabled."""
    env = environment().get("MOONCAKE_CONFORMANCE_DIR")  # set but blank also disables
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else Path(env)
    base = env_str("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mooncake-core" / "conformance"


def source_digest(module: str) -> str:
    """sha256 over the ``.py`` files of an importable package (without importing it)."""
    if not module:
        return ""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return ""
    if spec is None:
        return ""
    roots = list(spec.submodule_search_locations or [])
    files = (
        sorted(p for r in roots for p in Path(r).rglob("*.py"))
        if roots
        else ([Path(spec.origin)] if spec.origin else [])
    )
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def contract_checks() -> list[str]:
    """Names of every check an adapter inherits."""
    from mooncake_conformance.adapter import AdapterContract

    return sorted(n for n in dir(AdapterContract) if n.startswith("test_"))


def merge_outcome(old: str | None, new: str) -> str:
    """Outcome of a check from its parameters' outcomes: any failure wins, then passes."""
    if old is None:
        return new
    return old if _RANK.get(old, 0) >= _RANK.get(new, 0) else new


def _path(adapter: str) -> Path | None:
    d = status_dir()
    return None if d is None else d / f"{adapter}.json"


def read_status(adapter: str) -> dict[str, Any] | None:
    p = _path(adapter)
    if p is None or not p.exists():
        return None
    try:
        data: dict[str, Any] = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return data


def write_status(
    adapter: str, module: str, checks: Mapping[str, str], reasons: Mapping[str, str]
) -> Path | None:
    """Record ``checks`` (name -> passed/failed/skipped) for ``adapter``; merges with an
    earlier run of the same sources and suite version."""
    p = _path(adapter)
    if p is None:
        return None
    digest = source_digest(module)
    old = read_status(adapter)
    merged: dict[str, str] = {}
    old_reasons: dict[str, str] = {}
    if old and old.get("source_digest") == digest and old.get("suite_version") == SUITE_VERSION:
        merged.update(old.get("checks", {}))
        old_reasons = dict(old.get("skip_reasons", {}))
    for name, outcome in checks.items():
        # a skip says nothing new: it never hides what a run of the same sources found
        # (an adapter may run a check in one module and skip it in another)
        if outcome != "skipped" or merged.get(name) not in ("passed", "failed"):
            merged[name] = outcome
    old_reasons.update(reasons)
    data = {
        "adapter": adapter,
        "module": module,
        "source_digest": digest,
        "suite_version": SUITE_VERSION,
        "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "checks": dict(sorted(merged.items())),
        "skip_reasons": {k: v for k, v in old_reasons.items() if merged.get(k) == "skipped"},
    }
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, p)
    return p


def describe(adapter: str, module: str = "") -> str:
    """One line for ``mooncake-core plugins``: the last conformance result, honestly qualified."""
    data = read_status(adapter)
    if data is None:
        return "not run (run the adapter's tests with mooncake-conformance installed)"
    checks: dict[str, str] = data.get("checks", {})
    known = contract_checks()
    ran = [c for c in known if c in checks]
    failed = [c for c in ran if checks[c] == "failed"]
    passed = [c for c in ran if checks[c] == "passed"]
    skipped = [c for c in ran if checks[c] == "skipped"]
    day = str(data.get("when", ""))[:10]
    if failed:
        text = (
            f"FAILED {len(failed)} of {len(known)} checks "
            f"({', '.join(failed[:3])}{', ...' if len(failed) > 3 else ''})"
        )
    elif len(ran) < len(known):
        text = (
            f"incomplete: {len(passed)} of {len(known)} checks passed, "
            f"{len(known) - len(ran)} not run"
        )
    else:
        text = f"passed {len(passed)} of {len(known)} checks"
    if skipped:
        text += f", {len(skipped)} skipped"
    text += f" (suite {data.get('suite_version', '?')}, {day})"
    if data.get("suite_version") != SUITE_VERSION:
        text += "; suite changed since"
    if module and data.get("source_digest") and source_digest(module) != data.get("source_digest"):
        text += "; stale: adapter changed since"
    return text
