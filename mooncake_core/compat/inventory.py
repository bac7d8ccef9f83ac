"""The published ``mooncake`` package's public surface, and what we deliberately leave out.

:func:`surface` lists, for a module name, its public names: classes with their public
members, functions, constants and enum members. The same function lists the published
wheel (run as a script in its venv, ``python inventory.py mooncake``: this module
imports only the standard library so that it runs there) and ours (after
:func:`mooncake_core.compat.install`), so both sides are described by the same rules.
``tests/integration/test_compat_inventory.py`` compares them: every published name must
be provided by us or listed in :data:`NOT_PROVIDED` with the reason, and nothing listed
there may be provided (so the list stays honest). docs/compat.md mirrors the table.

Names: ``"mooncake.store"`` (a whole module), ``"mooncake.store:EngramStore"`` (a
module-level name), ``"mooncake.*store:MooncakeDistributedStore*.pub_tensor"`` (a class
member). A key may hold :mod:`fnmatch` wildcards (``*_session_*``).
"""

from __future__ import annotations
import __future__

import ast
import fnmatch
import importlib
import importlib.util
import inspect
import json
import logging
import pkgutil
import re
import sys
import typing
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "DOCUMENTED",
    "NOT_PROVIDED",
    "Surface",
    "is_exempt",
    "LISTED_FROM_SOURCE",
    "surface_from_source",
    "parameters",
    "published_modules",
    "signatures",
    "surface",
]

#: A module's public names: ``{name: None}`` for functions and constants,
#: ``{name: [members]}`` for classes.
Surface = dict[str, "list[str] | None"]

_CUDA = "needs CUDA / torch.distributed GPU kernels; the non-CUDA wheel cannot run it either"
_SSD = "remote SSD provisioning over SSH (paramiko, SPDK targets): an operator tool, out of scope"
_NOF = "NVMe-over-Fabrics segments: needs NoF hardware and the published master's NoF RPCs"
_CUDA_T = "CUDA tensors; the non-CUDA wheel refuses them too"
_CLI = "the published command-line tools; ours is `mooncake-core` (docs/store.md)"
_VLLM = (
    "the wheel's vendored (older vLLM) connector has it; mooncake.mooncake_connector_v1"
    " re-exports the installed vLLM's built-in MooncakeConnector, which has none"
    " (it pairs prefill and decode by transfer_id through a bootstrap server; docs/compat.md)"
)

#: Published names we do not provide, with the reason (mirrored in docs/compat.md).
NOT_PROVIDED: dict[str, str] = {
    # whole modules
    "mooncake.ep": _CUDA,
    "mooncake.mooncake_ep_buffer": _CUDA,
    "mooncake.mooncake_elastic_buffer": _CUDA,
    "mooncake.shared_segment": _CUDA,
    "mooncake.mooncake_ssd_register": _SSD,
    "mooncake.mooncake_ssd_unregister": _SSD,
    "mooncake.spdk_tgt_create": _SSD,
    # mooncake.mooncake_connector_v1: the wheel's side-channel wire types and env constants
    "mooncake.mooncake_connector_v1:MooncakeAgentMetadata": _VLLM,
    "mooncake.mooncake_connector_v1:RecvReqMeta": _VLLM,
    "mooncake.mooncake_connector_v1:TRANS_*": _VLLM,
    "mooncake.mooncake_connector_v1:VLLM_MOONCAKE_*": _VLLM,
    "mooncake.mooncake_connector_v1:MooncakeConnectorWorker.group_kv_pull": _VLLM,
    "mooncake._fast_copy": "a private C helper of the wheel",
    # mooncake.engine
    "mooncake.engine:InnerTransferEngine": "the C++ engine type; get_engine() returns ours",
    "mooncake.engine:SharedSegment": _CUDA,
    # mooncake.store: types
    "mooncake.store:MooncakeDistributedNoFRegister": _NOF,
    # mooncake.store: MooncakeDistributedStore members
    "mooncake.*store*:MooncakeDistributedStore*.init_all": "crashes (SIGSEGV) in the"
    " published 0.3.13 wheel before connecting anywhere, with or without a master and etcd at"
    " its defaults: there is no published behaviour to follow; use setup()",
    "mooncake.*store*:MooncakeDistributedStore*.*_cuda": _CUDA_T,
}

#: Published modules whose surface neither import nor source shows here, with their public
#: names as the Mooncake design documents give them: ``mooncake.pg`` only re-exports a
#: compiled ``mooncake.pg_<torch version>`` that the non-CUDA wheel does not ship. The
#: inventory test adds these to the wheel's listing, so a name we lack fails it.
DOCUMENTED: dict[str, Surface] = {
    "mooncake.pg": {
        "MooncakeBackendOptions": [
            "active_ranks",
            "auto_deactivate_on_failure",
            "auto_sync_on_failure",
            "is_extension",
            "max_group_size",
        ],
        **dict.fromkeys(
            [
                "activate_ranks",
                "deactivate_ranks",
                "get_active_ranks",
                "get_num_synced_ranks",
                "get_peer_state",
                "join_group",
                "recover_ranks",
                "set_device_filter",
                "set_host_ip",
                "set_transfer_engine",
                "sync_after_failure",
            ]
        ),
    },
}

logger = logging.getLogger(__name__)

_VLLM_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake."

# Values that are public by name but not API: loggers, ``from __future__`` flags,
# typing helpers.
_NOT_API = (ModuleType, logging.Logger, __future__._Feature, typing.TypeVar)
_FOREIGN_BASES = ("builtins", "enum", "abc", "typing", "pybind11_builtins")


def _class_members(cls: type) -> list[str]:
    enum_like = hasattr(cls, "__members__")
    out = []
    for name in dir(cls):
        if name.startswith("_") or (enum_like and name in ("name", "value")):
            continue
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        if owner is not None and owner.__module__ in _FOREIGN_BASES:
            continue
        out.append(name)
    return sorted(out)


def _is_ours(value: Any, package: str) -> bool:
    mod = getattr(value, "__module__", None)
    if not isinstance(mod, str):
        return True
    # the published extension modules report themselves as ``engine`` / ``store``;
    # mooncake.mooncake_connector_v1 re-exports vLLM's built-in Mooncake connector
    return mod.split(".")[0] in (package, "engine", "store", "mooncake_core") or mod.startswith(
        _VLLM_CONNECTOR
    )


def _from_import(mod: ModuleType, package: str) -> Surface:
    out: Surface = {}
    for name in dir(mod):
        if name.startswith("_"):
            continue
        value = getattr(mod, name)
        if isinstance(value, _NOT_API) or typing.get_origin(value) is not None:
            continue
        if inspect.isclass(value):
            if _is_ours(value, package):
                out[name] = _class_members(value)
        elif callable(value):
            if _is_ours(value, package) and not str(type(value)).startswith("<class 'typing."):
                out[name] = None
        else:
            out[name] = None
    return out


def _from_source(path: Path) -> Surface:
    """Public names from the source of a module that does not import here (no torch)."""
    out: Surface = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = None
        elif isinstance(node, ast.ClassDef):
            members: list[str] = []
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.append(item.name)
                elif isinstance(item, ast.Assign):
                    members += [t.id for t in item.targets if isinstance(t, ast.Name)]
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    if item.value is not None:
                        members.append(item.target.id)
            out[node.name] = sorted(m for m in set(members) if not m.startswith("_"))
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id.isupper():
                    out[t.id] = None
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id.isupper():
                out[node.target.id] = None
    return {k: v for k, v in out.items() if not k.startswith("_") or k == "_fast_copy"}


def _public_submodules(package: str) -> list[str]:
    """The public modules of subpackage ``package`` (``mooncake.reshard``), recursively;
    private ones (``_planner``) are implementation."""
    try:
        path = importlib.import_module(package).__path__
    except Exception:  # noqa: BLE001 - not importable here: listed as one module
        return []
    names = []
    for info in pkgutil.iter_modules(path):
        if not info.name.startswith("_"):
            names.append(f"{package}.{info.name}")
            names += _public_submodules(names[-1]) if info.ispkg else []
    return names


def published_modules(package: str = "mooncake") -> list[str]:
    """The package and every module in it (pkgutil over its directory), importable or not,
    and the public modules of its subpackages."""
    pkg = importlib.import_module(package)
    names = [package]
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("lib"):  # bundled shared libraries (libasio.so, ...)
            continue
        names.append(f"{package}.{info.name}")
        names += _public_submodules(names[-1]) if info.ispkg else []
    return sorted(names)


#: Our modules whose surface is read from source, not imported (importing costs seconds):
#: ``mooncake.X`` -> our file next to this one. mooncake.mooncake_connector_v1 re-exports
#: vLLM's connector; importing it imports vLLM (~16 s).
LISTED_FROM_SOURCE: dict[str, str] = {
    "mooncake.mooncake_connector_v1": "mooncake_connector_v1.py",
}


def _module_source(dotted: str) -> Path | None:
    """The source file of module ``dotted``, found without importing it or its parents."""
    top, _, rest = dotted.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        path = Path(base, *rest.split("."))
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _with_bases(src: Path, depth: int = 0) -> Surface:
    """:func:`_from_source` of ``src``, each class with the public members of its bases
    (found by source too: in the same file, or imported by ``from M import Base``)."""
    out = _from_source(src)
    tree = ast.parse(src.read_text())
    imported = {
        a.asname or a.name: (node.module, a.name)
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module and not node.level
        for a in node.names
    }
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or out.get(node.name) is None or depth > 4:
            continue
        members = set(out[node.name] or [])
        for base in node.bases:
            if not isinstance(base, ast.Name):
                continue
            if base.id in out and base.id != node.name:
                members |= set(out[base.id] or [])
            elif base.id in imported:
                where, name = imported[base.id]
                found = _module_source(where)
                if found is not None:
                    members |= set(_with_bases(found, depth + 1).get(name) or [])
        out[node.name] = sorted(members)
    return out


def surface_from_source(module: str) -> Surface | str:
    """Ours of a :data:`LISTED_FROM_SOURCE` module without importing it: the names its
    ``__all__`` lists, from its own source or, for the names it re-exports, from the source
    of the module its ``BUILTIN_MODULE`` names (classes with their bases' members). A
    listed name found in neither is left out (so the comparison reports it missing)."""
    ours = Path(__file__).with_name(LISTED_FROM_SOURCE[module])
    tree = ast.parse(ours.read_text())
    consts: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                consts[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    builtin = consts.get("BUILTIN_MODULE")
    src = _module_source(builtin) if isinstance(builtin, str) else None
    if src is None:
        return f"ModuleNotFoundError: no source of {builtin!r} (the module {module} re-exports)"
    own, theirs = _from_source(ours), _with_bases(src)
    return {
        n: own[n] if n in own else theirs[n] for n in consts["__all__"] if n in own or n in theirs
    }


def surface(module: str) -> Surface | str:
    """The public names of ``module``, or a one-line reason why it cannot be listed."""
    package = module.split(".")[0]
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        pkg = sys.modules.get(package)
        base = Path(next(iter(getattr(pkg, "__path__", [])), "")) if pkg else None
        src = base / (module.split(".", 1)[1] + ".py") if base and "." in module else None
        if src is not None and src.is_file():
            return _from_source(src)
        return f"{type(exc).__name__}: {exc}"
    return _from_import(mod, package)


_DOC_SIG = re.compile(r"^[A-Za-z_]\w*\((.*)\)\s*->")


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[(<{"
        depth -= ch in "])>}"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [p for p in [*parts, cur.strip()] if p]


def parameters(fn: Any) -> list[tuple[str, bool]] | None:
    """The parameters of ``fn`` (without ``self``) as ``(name, has_default)``, ``*args`` and
    ``**kw`` named so; from :func:`inspect.signature`, or
    from the first docstring line pybind11 writes (``name(self: T, a: int, b: str = '')``);
    None when neither can be read (overloaded pybind11 functions)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        first = (getattr(fn, "__doc__", None) or "").strip().splitlines()[:1]
        match = _DOC_SIG.match(first[0]) if first else None
        if match is None:
            return None
        out = []
        for part in _split_top(match.group(1)):
            name = part.split(":")[0].split("=")[0].strip()
            if name != "self":
                out.append((name, " = " in part))
        return out
    kinds = inspect.Parameter
    res = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        prefix = (
            "*" if p.kind is kinds.VAR_POSITIONAL else "**" if p.kind is kinds.VAR_KEYWORD else ""
        )
        res.append((prefix + p.name, p.default is not inspect.Parameter.empty))
    return res


def signatures(module: str) -> dict[str, Any]:
    """``{"Name": params, "Class.member": params}`` for the callables of ``module``."""
    package = module.split(".")[0]
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - not importable here: no signatures to compare
        return {}
    out: dict[str, Any] = {}
    for name, members in _from_import(mod, package).items():
        obj = getattr(mod, name)
        if members is None:
            if callable(obj) and not inspect.isclass(obj):
                out[name] = parameters(obj)
            continue
        for member in members:
            attr = inspect.getattr_static(obj, member, None)
            if isinstance(attr, (staticmethod, classmethod)):
                attr = attr.__func__
            if callable(attr) and not inspect.isclass(attr):
                out[f"{name}.{member}"] = parameters(attr)
    return out


def is_exempt(key: str) -> str | None:
    """The reason ``key`` (``module``, ``module:Name`` or ``module:Class.member``) is not
    provided, or None. A whole module or class listed covers what is inside it."""
    mod, _, rest = key.partition(":")
    probes = [mod]
    if rest:
        probes.append(f"{mod}:{rest.split('.')[0]}")
        if "." in rest:
            probes.append(key)
    for probe in probes:
        for pattern, reason in NOT_PROVIDED.items():
            if fnmatch.fnmatchcase(probe, pattern):
                return reason
    return None


def main(argv: list[str]) -> int:
    """``python inventory.py [--signatures] PACKAGE``: print ``{module: surface}`` (or
    ``{module: signatures}``) as JSON."""
    sigs = "--signatures" in argv
    args = [a for a in argv if a != "--signatures"]
    package = args[0] if args else "mooncake"
    lister = signatures if sigs else surface
    out = {m: lister(m) for m in published_modules(package)}
    sys.stdout.write(json.dumps(out, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    # run as a script: keep our sibling modules (engine.py, store.py) off the path
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
    raise SystemExit(main(sys.argv[1:]))
