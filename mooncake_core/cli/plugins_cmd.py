"""``mooncake-core plugins``: list what the plugin system discovered."""

from __future__ import annotations

import argparse
import json

from mooncake_core import plugins


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


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
                    "adapters": [a.__dict__ for a in ad],
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
    for a in ad:
        inst = "installed" if a.engine_installed else "not installed"
        print(
            f"  {a.name:<9} {a.package:<18} engine {a.engine} ({inst}); "
            f"conformance: {a.conformance}; {a.status}"
        )
    return 0
