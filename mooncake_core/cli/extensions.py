"""Commands that installed packages add to ``mooncake-core`` (entry-point group
``mooncake_core.cli``).

An engine adapter registers its demos and benchmarks here, so the core names no engine:

.. code-block:: toml

    [project.entry-points."mooncake_core.cli"]
    pd-demo = "my_adapter.pd_demo"          # mooncake-core pd-demo
    "bench.myengine" = "my_adapter.bench"   # mooncake-core bench myengine

An entry ``NAME`` is a top-level command: its module defines ``add_arguments(parser)``
and ``run(args) -> int`` (the contract of every ``mooncake-core`` command). An entry
``bench.NAME`` is a benchmark: its module defines ``main(argv) -> int`` (the contract of
``mooncake-core bench``). Modules are imported only when their command runs (or, for
the help text, when the listing is printed).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

__all__ = ["GROUP", "commands", "benches", "summary"]

GROUP = "mooncake_core.cli"
_BENCH = "bench."


def _entries() -> dict[str, str]:
    out: dict[str, str] = {}
    for ep in entry_points(group=GROUP):
        out.setdefault(ep.name, ep.value.split(":", 1)[0].strip())
    return out


def commands() -> dict[str, str]:
    """Top-level commands from installed packages: name -> module."""
    return {k: v for k, v in _entries().items() if not k.startswith(_BENCH)}


def benches() -> dict[str, str]:
    """Benchmarks from installed packages: name (without ``bench.``) -> module."""
    return {k[len(_BENCH) :]: v for k, v in _entries().items() if k.startswith(_BENCH)}


def summary(module: str) -> str:
    """The first line of ``module``'s docstring (for help listings); never raises."""
    try:
        doc = importlib.import_module(module).__doc__ or ""
    except Exception as exc:  # a broken adapter must not break the listing
        return f"(unavailable: {exc})"
    line = (doc.strip().splitlines()[0] if doc.strip() else "").replace("``", "")
    head, sep, rest = line.partition(": ")
    return rest if sep and head.startswith("mooncake-core ") else line
