"""``mooncake-core plugins``: list what the plugin system discovered.

For each engine adapter the listing leads with a one-word conformance verdict, read
from the adapter's own ``AdapterInfo.conformance`` text (the conformance suite's last
recorded result, see docs/conformance.md):

- ``PASS``: every check of the suite ran on the current adapter sources and none failed;
- ``FAIL``: some check failed in the last run;
- ``STALE``: it passed, but the adapter or the suite changed since (run the tests again);
- ``INCOMPLETE``: some checks never ran;
- ``NOT RUN``: no result recorded (or the suite is not installed).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from mooncake_core import plugins

__all__ = ["add_arguments", "run", "conformance_verdict", "VERDICTS"]

VERDICTS = ("PASS", "FAIL", "STALE", "INCOMPLETE", "NOT RUN")


def conformance_verdict(text: str) -> str:
    """One of :data:`VERDICTS` for an adapter's conformance text."""
    t = text.strip().lower()
    if t.startswith("failed"):
        return "FAIL"
    if t.startswith("incomplete"):
        return "INCOMPLETE"
    if t.startswith("passed"):
        return "STALE" if ("stale" in t or "suite changed" in t) else "PASS"
    return "NOT RUN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _adapter_json(a: Any) -> dict[str, Any]:
    d = dict(a.__dict__)
    d["conformance_verdict"] = conformance_verdict(a.conformance)
    d["passes_conformance"] = d["conformance_verdict"] == "PASS"
    return d


def run(args: argparse.Namespace) -> int:
    tr = plugins.transports()
    md = plugins.metadata_backends()
    ad = plugins.adapters()
    if args.json:
        print(
            json.dumps(
                {
                    "transports": {
                        k: {"priority": v.priority, "description": v.description}
                        for k, v in tr.items()
                    },
                    "metadata": {
                        k: {"schemes": list(v.schemes), "description": v.description}
                        for k, v in md.items()
                    },
                    "adapters": [_adapter_json(a) for a in ad],
                }
            )
        )
        return 0
    print("transports (group mooncake_core.transports):")
    for name, t in sorted(tr.items(), key=lambda kv: kv[1].priority):
        print(f"  {name:<6} priority {t.priority:<3} {t.description}")
    print("metadata backends (group mooncake_core.metadata):")
    for name, m in sorted(md.items()):
        print(f"  {name:<6} {', '.join(m.schemes):<28} {m.description}")
    print("adapters (group mooncake_core.adapters):")
    if not ad:
        print("  (none installed)")
        return 0
    print(f"  {'name':<9} {'conformance':<11} {'engine':<29} package")
    verdicts = []
    for a in ad:
        v = conformance_verdict(a.conformance)
        verdicts.append((a.name, v))
        engine = f"{a.engine} ({'installed' if a.engine_installed else 'not installed'})"
        print(f"  {a.name:<9} {v:<11} {engine:<29} {a.package}")
        print(f"  {'':<9} last run: {a.conformance}")
        if a.status:
            print(f"  {'':<9} what: {a.status}")
    passing = [n for n, v in verdicts if v == "PASS"]
    others = ", ".join(f"{n} {v}" for n, v in verdicts if v != "PASS")
    print(
        f"conformance suite: {len(passing)} of {len(verdicts)} adapters pass"
        + (f" (not passing: {others})" if others else "")
    )
    return 0
