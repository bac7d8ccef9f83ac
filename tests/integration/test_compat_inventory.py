"""Every public name of the published ``mooncake`` wheel is ours, or listed as left out.

The published side is listed by running ``mooncake_core/compat/inventory.py`` in the
scratch venv (scripts/setup_mooncake_peer.sh; skipped with a reason when absent): pkgutil
over the package directory, then per module its classes with their public members,
functions, constants and enum members. Our side is listed by the same function after
``mooncake_core.compat.install(force=True)``, except ``mooncake.mooncake_connector_v1``,
which re-exports vLLM's connector: its names are read from vLLM's source
(``inventory.surface_from_source``), sparing a vLLM import (~16 s). A published name
neither provided nor in ``inventory.NOT_PROVIDED`` fails, and so does a listed name that
we do provide.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mooncake_core.bench.published import peer
from mooncake_core.compat import inventory

ROOT = Path(__file__).resolve().parents[2]
INVENTORY = ROOT / "mooncake_core" / "compat" / "inventory.py"

OURS = textwrap.dedent(
    """
    import json, sys
    import mooncake_core.compat
    from mooncake_core.compat import inventory
    assert mooncake_core.compat.install(force=True)
    sigs = "--signatures" in sys.argv
    def lister(m):
        if m in inventory.LISTED_FROM_SOURCE and not sigs:  # read, not imported (vLLM: ~16 s)
            return inventory.surface_from_source(m)
        return (inventory.signatures if sigs else inventory.surface)(m)
    print(json.dumps({m: lister(m) for m in json.loads(sys.argv[1])}))
    """
)


def _published(*flags: str) -> dict[str, Any]:
    real = os.environ.get("MOONCAKE_PEER_PYTHON") or peer().default_peer_python()
    if real is None:
        pytest.skip(
            "no scratch venv with the published wheel; run scripts/setup_mooncake_peer.sh "
            "(or set MOONCAKE_PEER_PYTHON)"
        )
    env = dict(peer().mooncake_env(), GLOG_minloglevel="2")
    out = subprocess.run(
        [real, str(INVENTORY), *flags, "mooncake"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return data


def _ours(modules: list[str], *flags: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", OURS, json.dumps(modules), *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return data


def compare(theirs: dict[str, Any], ours: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(published names we lack and do not list, listed names we provide)."""
    missing: list[str] = []
    dishonest: list[str] = []

    def check(key: str, provided: bool) -> None:
        exempt = inventory.is_exempt(key)
        if provided and exempt is not None and _listed_exactly(key):
            dishonest.append(key)
        elif not provided and exempt is None:
            missing.append(key)

    for mod, names in sorted(theirs.items()):
        mine = ours.get(mod)
        check(mod, isinstance(mine, dict))
        if not isinstance(mine, dict) or not isinstance(names, dict):
            continue
        for name, members in sorted(names.items()):
            check(f"{mod}:{name}", name in mine)
            if name not in mine or members is None:
                continue
            have = set(mine[name] or [])
            for member in members:
                check(f"{mod}:{name}.{member}", member in have)
    return missing, dishonest


def signature_differences(theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Callables we provide whose parameters differ from the published ones: names
    (unless the published one is a positional-only ``argN``), order, and which have
    defaults. Skipped: published ones without a readable signature (overloaded pybind11
    functions) and ours that take only ``(*args, **kwargs)`` (they dispatch overloads)."""
    out: list[str] = []
    for mod, sigs in sorted(theirs.items()):
        mine = ours.get(mod) or {}
        for name, params in sorted(sigs.items()):
            have = mine.get(name)
            if params is None or have is None:
                continue
            if [p[0][:1] for p in have] == ["*", "*"]:
                continue
            same = len(params) == len(have) and all(
                (re.fullmatch(r"arg\d+", t[0]) or t[0] == o[0]) and t[1] == o[1]
                for t, o in zip(params, have, strict=True)
            )
            if not same:
                out.append(f"{mod}:{name}: published {params}, ours {have}")
    return out


def _listed_exactly(key: str) -> bool:
    """True if a NOT_PROVIDED key names ``key`` itself (not an enclosing module/class)."""
    import fnmatch

    return any(fnmatch.fnmatchcase(key, pattern) for pattern in inventory.NOT_PROVIDED)


@pytest.fixture(scope="module")
def surfaces() -> tuple[dict[str, Any], dict[str, Any]]:
    theirs = _published()
    for mod, names in inventory.DOCUMENTED.items():  # what the wheel's source does not show
        listed = theirs.get(mod)
        theirs[mod] = {**(listed if isinstance(listed, dict) else {}), **names}
    return theirs, _ours(sorted(theirs))


def test_the_documented_surfaces_are_provided() -> None:
    """Without the wheel: every name of :data:`inventory.DOCUMENTED` (``mooncake.pg``,
    which the wheel cannot import) is ours (listed in this process from the module
    ``install()`` maps it to)."""
    from mooncake_core.compat import LAZY_MODULES

    documented: dict[str, Any] = dict(inventory.DOCUMENTED)
    ours: dict[str, Any] = {m: inventory.surface(LAZY_MODULES[m]) for m in documented}
    assert compare(documented, ours)[0] == []
    del ours["mooncake.pg"]["set_host_ip"]  # the check can fail
    assert compare(documented, ours)[0] == ["mooncake.pg:set_host_ip"]


@pytest.mark.timeout(240)
def test_every_published_name_is_provided_or_listed_with_a_reason(
    surfaces: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    theirs, ours = surfaces
    assert "mooncake.store" in theirs and "MooncakeDistributedStore" in theirs["mooncake.store"]
    missing, dishonest = compare(theirs, ours)
    assert missing == [], "published names we neither provide nor list in NOT_PROVIDED"
    assert dishonest == [], "names listed in NOT_PROVIDED that we do provide"


@pytest.mark.timeout(240)
def test_every_not_provided_entry_matches_a_published_name(
    surfaces: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    theirs, _ = surfaces
    keys = set(theirs)
    for mod, names in theirs.items():
        for name, members in (names if isinstance(names, dict) else {}).items():
            keys.add(f"{mod}:{name}")
            keys.update(f"{mod}:{name}.{m}" for m in members or [])
    import fnmatch

    stale = [p for p in inventory.NOT_PROVIDED if not fnmatch.filter(keys, p)]
    assert stale == [], "NOT_PROVIDED entries that name nothing the wheel publishes"


@pytest.mark.timeout(240)
def test_what_we_provide_has_the_published_parameters() -> None:
    theirs = _published("--signatures")
    assert theirs["mooncake.store"]["MooncakeDistributedStore.put"] == [
        ["key", False],
        ["value", False],
        ["config", True],
    ]
    # modules the wheel cannot import here have no published signatures to compare; listing
    # ours would only cost their imports (mooncake.mooncake_connector_v1: vLLM, ~15 s)
    ours = _ours(sorted(m for m, sigs in theirs.items() if sigs), "--signatures")
    assert signature_differences(theirs, ours) == []


def test_the_signature_comparison_catches_a_renamed_or_defaulted_parameter() -> None:
    theirs = {"m": {"C.f": [["arg0", False], ["size", False]], "C.g": [["x", True]]}}
    ours = {"m": {"C.f": [["key", False], ["n", False]], "C.g": [["x", False]]}}
    assert len(signature_differences(theirs, ours)) == 2
    ours = {"m": {"C.f": [["key", False], ["size", False]], "C.g": [["x", True]]}}
    assert signature_differences(theirs, ours) == []


def test_the_vllm_connector_is_listed_from_vllm_source() -> None:
    """Ours of mooncake.mooncake_connector_v1 without importing vLLM: the names our module
    re-exports, with their members (inherited ones too) from vLLM's source files."""
    mod = "mooncake.mooncake_connector_v1"
    ours = inventory.surface_from_source(mod)
    assert isinstance(ours, dict), ours
    assert {"BUILTIN_MODULE", "MooncakeConnector", "zmq_ctx"} <= set(ours)
    connector = set(ours["MooncakeConnector"] or [])
    assert {"get_num_new_matched_tokens", "shutdown", "role"} <= connector  # own, inherited
    theirs = {mod: {"MooncakeConnector": ["start_load_kv", "brand_new"], "new_func": None}}
    assert compare(theirs, {mod: ours})[0] == [
        f"{mod}:MooncakeConnector.brand_new",
        f"{mod}:new_func",
    ]


def test_the_comparison_catches_a_missing_and_a_dishonest_name() -> None:
    theirs = {"mooncake.store": {"MooncakeDistributedStore": ["put", "brand_new", "init_all"]}}
    ours = {"mooncake.store": {"MooncakeDistributedStore": ["put", "init_all"]}}
    missing, dishonest = compare(theirs, ours)
    assert missing == ["mooncake.store:MooncakeDistributedStore.brand_new"]
    assert dishonest == ["mooncake.store:MooncakeDistributedStore.init_all"]


def test_docs_mirror_the_not_provided_table() -> None:
    text = (ROOT / "docs" / "compat.md").read_text()
    section = text.split("<!-- NOT_PROVIDED begin -->")[1].split("<!-- NOT_PROVIDED end -->")[0]
    rows = {k.replace("\\*", "*") for k in re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)}
    assert rows == set(inventory.NOT_PROVIDED)
