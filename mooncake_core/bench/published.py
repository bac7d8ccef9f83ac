"""Where the comparisons with the PUBLISHED Mooncake live: ``benchmarks/published/`` of a checkout.

Those scripts run in a scratch venv with the published wheel
(``scripts/setup_mooncake_peer.sh``), so they are not part of the runtime package.
``mooncake-core bench transfer|store --compare-mooncake PYTHON`` (and engine adapters'
benchmarks) find them here, by path relative to the source tree; an installed package
without the checkout gets one clear :class:`~mooncake_core.errors.ConfigError`.

- :func:`published_dir`: the folder; :func:`script`: one file in it.
- :func:`peer`: the driver module ``benchmarks/published/mooncake_peer.py``
  (``run_mooncake_transfer_bench``, ``run_mooncake_store_bench``, ``mooncake_env``, ...),
  loaded once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from mooncake_core.errors import ConfigError

__all__ = ["published_dir", "script", "peer", "load"]

#: ``<repo>/benchmarks/published`` seen from ``<repo>/mooncake_core/bench``
_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "published"


def published_dir() -> Path:
    """``benchmarks/published`` of the source checkout this package runs from."""
    if not _DIR.is_dir():
        raise ConfigError(
            f"the published-Mooncake comparisons live in a source checkout ({_DIR} is missing); "
            "run from the mooncake-core repository"
        )
    return _DIR


def script(name: str) -> Path:
    """The path of ``benchmarks/published/<name>`` (:class:`ConfigError` when absent)."""
    path = published_dir() / name
    if not path.is_file():
        raise ConfigError(f"{path} is missing from the checkout")
    return path


def load(name: str) -> ModuleType:
    """Import ``benchmarks/published/<name>.py`` by path, once (module
    ``mooncake_published_<name>``)."""
    modname = f"mooncake_published_{name.lstrip('_')}"
    mod = sys.modules.get(modname)
    if mod is not None:
        return mod
    spec = importlib.util.spec_from_file_location(modname, script(f"{name}.py"))
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load {name}.py from {_DIR}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(modname, None)
        raise
    return mod


def peer() -> ModuleType:
    """``benchmarks/published/mooncake_peer.py``: runs the published wheel's processes."""
    return load("mooncake_peer")
