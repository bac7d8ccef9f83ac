"""Tenants: namespaces of one pool, with per-tenant byte quotas enforced at put.

A client given a tenant (``StoreClient(tenant="team-a")``) sees only its tenant's keys:
its RPC layer names every key ``team-a\\x00KEY`` on the wire (:func:`namespaced`), and the
calls that scan keys (``keys_by_regex``, ``remove_by_regex``, ``remove_all``) carry the
tenant so the master matches only that tenant's keys (against the key without the
prefix). Clients without a tenant are the default tenant ``""``: keys without a prefix. A
NUL in a key is refused except as this separator. (Tenants separate names and budgets;
they are not access control: the master authenticates no one.)

Quotas (master ``--tenant-quota NAME=SIZE`` or a JSON file ``{"NAME": "64MB", ...}``;
``"*"`` applies to every named tenant without an entry of its own): a tenant's bytes are
the sizes of its objects, finished or being written. A put that would take its tenant over
the quota first evicts the tenant's own least recently used objects (never another
tenant's; leases and pins respected as in global eviction); if that is not enough, or the
quota's policy is ``refuse`` (``NAME=SIZE:refuse``), the put fails with ``NoSpace`` naming
the tenant and its quota.

Per-tenant figures (objects, bytes, quota, evictions, refused puts) are in the master's
``/stats`` (``tenants``) and ``/tenants``.

Thread-safety: none; the master's event loop owns the state.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_core.config import format_size, parse_size
from mooncake_core.errors import ConfigError, NoSpace
from mooncake_core.store.eviction import candidates
from mooncake_core.store.protocol import METHOD_ARGS, InvalidArgument
from mooncake_core.store.state_core import Obj, StateCore, check_tenant_key

__all__ = [
    "SEP",
    "Quota",
    "TenantObjects",
    "TenantQuotas",
    "check_tenant",
    "check_tenant_key",
    "namespaced",
    "parse_quotas",
    "read_quota_file",
    "tenant_counts",
    "tenant_of",
    "user_key",
]

SEP = "\x00"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def check_tenant(name: str, what: str = "tenant") -> str:
    """A tenant name (1-64 of ``A-Z a-z 0-9 _ . -``; ``""`` is the default tenant)."""
    if name == "":
        return name
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidArgument(
            f"{what} {name!r}: use 1-64 letters, digits, '_', '.' or '-' (or '' for none)"
        )
    return name


def tenant_of(key: str) -> str:
    """The tenant of a key as the master stores it."""
    i = key.find(SEP)
    return key[:i] if i > 0 else ""


def user_key(key: str) -> str:
    """The key without its tenant prefix."""
    i = key.find(SEP)
    return key[i + 1 :] if i > 0 else key


# ---------------------------------------------------------------------- client side
def _plans() -> dict[str, tuple[int, int, int, tuple[Any, ...], int]]:
    """method -> (index of ``key``, of ``keys``, of ``tenant`` (-1: none), field defaults,
    number of fields)."""
    out = {}
    for method, st in METHOD_ARGS.items():
        fields = tuple(st.__struct_fields__)
        if method == "task_done":  # echoes a key the master sent: already namespaced
            continue
        k = fields.index("key") if "key" in fields else -1
        ks = fields.index("keys") if "keys" in fields else -1
        t = fields.index("tenant") if "tenant" in fields else -1
        if k >= 0 or ks >= 0 or t >= 0:
            out[method] = (k, ks, t, tuple(st.__struct_defaults__), len(fields))
    return out


_PLANS = _plans()


def namespaced(method: str, params: Any, tenant: str) -> Any:
    """``params`` of ``method`` with every key in ``tenant``'s namespace (and its tenant
    field set)."""
    plan = _PLANS.get(method)
    if plan is None or not isinstance(params, (tuple, list)):
        return params
    k, ks, t, defaults, nfields = plan
    out = list(params)
    prefix = tenant + SEP
    if 0 <= k < len(out) and isinstance(out[k], str):
        out[k] = prefix + out[k]
    if 0 <= ks < len(out) and isinstance(out[ks], (list, tuple)):
        out[ks] = [prefix + x if isinstance(x, str) else x for x in out[ks]]
    if t >= 0:
        first_default = nfields - len(defaults)
        while len(out) <= t:  # fill omitted optional fields with their defaults
            out.append(defaults[len(out) - first_default])
        out[t] = tenant
    return tuple(out)


# ---------------------------------------------------------------------- quotas
@dataclass(frozen=True)
class Quota:
    bytes: int
    refuse: bool = False  # True: refuse puts over quota; False: evict within the tenant first

    def __str__(self) -> str:
        return format_size(self.bytes) + (":refuse" if self.refuse else "")


def _quota(name: str, raw: Any, what: str) -> Quota:
    text = str(raw).strip()
    refuse = False
    for suffix, r in ((":refuse", True), (":evict", False)):
        if text.endswith(suffix):
            text, refuse = text[: -len(suffix)], r
    try:
        n = int(parse_size(text))
    except (ValueError, TypeError, ConfigError):
        raise ConfigError(
            f"{what}: quota {raw!r} of tenant {name!r} is not a size (e.g. 64MB, 1GB, "
            "or 64MB:refuse)"
        ) from None
    if n <= 0:
        raise ConfigError(f"{what}: quota of tenant {name!r} must be positive, got {raw!r}")
    return Quota(n, refuse)


def parse_quotas(
    items: Mapping[str, Any] | list[str], what: str = "--tenant-quota"
) -> dict[str, Quota]:
    """``{"NAME": "64MB"}`` or ``["NAME=64MB", "other=1GB:refuse"]`` -> quotas (``*``: any)."""
    pairs: list[tuple[str, Any]] = []
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        for item in items:
            name, eq, size = str(item).partition("=")
            if not eq:
                raise ConfigError(f"{what}: {item!r} is not NAME=SIZE (e.g. team-a=64MB)")
            pairs.append((name.strip(), size))
    out: dict[str, Quota] = {}
    for name, raw in pairs:
        if name != "*":
            try:
                check_tenant(name)
            except InvalidArgument as exc:
                raise ConfigError(f"{what}: {exc}") from None
            if not name:
                raise ConfigError(f"{what}: the default tenant has no quota (name a tenant)")
        out[name] = _quota(name, raw, what)
    return out


def read_quota_file(path: str) -> dict[str, Quota]:
    """Quotas from a JSON file ``{"NAME": "64MB", ...}``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--tenant-quotas {path}: cannot read a JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--tenant-quotas {path}: expected a JSON object of NAME: SIZE")
    return parse_quotas(data, f"--tenant-quotas {path}")


class TenantObjects(dict[str, Obj]):
    """The master's object table, counting bytes and objects per tenant as it changes.

    Only used while quotas are configured (:attr:`TenantQuotas.tenant_quotas`): the counts
    cost every put and removal a Python call, so a master without quotas keeps a plain
    ``dict`` and counts by walking it when asked (``/tenants``, ``/stats``)."""

    def __init__(self, objects: Mapping[str, Obj] | None = None) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.count: dict[str, int] = {}
        for k, o in (objects or {}).items():
            self[k] = o

    def _add(self, key: str, o: Obj, sign: int) -> None:
        t = tenant_of(key)
        self.bytes[t] = self.bytes.get(t, 0) + sign * o.size
        self.count[t] = self.count.get(t, 0) + sign

    def __setitem__(self, key: str, o: Obj) -> None:
        old = dict.get(self, key)
        if old is not None:
            self._add(key, old, -1)
        dict.__setitem__(self, key, o)
        self._add(key, o, 1)

    def __delitem__(self, key: str) -> None:
        old = dict.pop(self, key)
        self._add(key, old, -1)

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            old = dict.pop(self, key)
            self._add(key, old, -1)
            return old
        if default:
            return default[0]
        raise KeyError(key)


def tenant_counts(objects: Mapping[str, Obj]) -> tuple[dict[str, int], dict[str, int]]:
    """``(bytes, objects)`` per tenant: kept by a :class:`TenantObjects`, else one walk."""
    if isinstance(objects, TenantObjects):
        return objects.bytes, objects.count
    nbytes: dict[str, int] = {}
    count: dict[str, int] = {}
    for k, o in objects.items():
        t = tenant_of(k) if SEP in k else ""
        nbytes[t] = nbytes.get(t, 0) + o.size
        count[t] = count.get(t, 0) + 1
    return nbytes, count


class TenantQuotas(StateCore):
    """The part of ``MasterState`` that admits puts under their tenant's quota.

    Zero cost until quotas are set: the object table is a plain ``dict`` and :meth:`_admit`
    returns at its first test. Setting :attr:`tenant_quotas` to a non-empty mapping turns the
    table into a :class:`TenantObjects` (one walk to count what is there); setting it empty
    turns it back."""

    tenant_counters: dict[str, dict[str, int]]
    _quotas: dict[str, Quota]

    @property
    def tenant_quotas(self) -> dict[str, Quota]:
        return self._quotas

    @tenant_quotas.setter
    def tenant_quotas(self, quotas: dict[str, Quota]) -> None:
        self._quotas = quotas
        counting = isinstance(self.objects, TenantObjects)
        if quotas and not counting:
            self.objects = TenantObjects(self.objects)
        elif not quotas and counting:
            self.objects = dict(self.objects)

    def _tenant_count(self, tenant: str, what: str, n: int = 1) -> None:
        c = self.tenant_counters.setdefault(tenant, {"evictions": 0, "refused": 0})
        c[what] += n

    def quota_of(self, tenant: str) -> Quota | None:
        if not tenant:
            return None
        q = self.tenant_quotas.get(tenant)
        return q if q is not None else self.tenant_quotas.get("*")

    def _admit(self, key: str, size: int, now: float) -> None:
        """Make room for ``size`` more bytes in ``key``'s tenant, or raise ``NoSpace``."""
        if not self._quotas:
            return
        t = tenant_of(key)
        q = self.quota_of(t)
        if q is None:
            return
        objs = self.objects
        if not isinstance(objs, TenantObjects):  # quotas set by hand, table not switched
            self.tenant_quotas = self._quotas
            objs = self.objects
            assert isinstance(objs, TenantObjects)
        used = int(objs.bytes.get(t, 0))
        if used + size <= q.bytes:
            return
        if size <= q.bytes and not q.refuse:
            for k in candidates(
                self.lru, self._get_obj, now, allow_soft=True, accept=lambda k, o: tenant_of(k) == t
            ):
                o = self.objects.get(k)
                if o is None:
                    continue
                self._drop_object(o)
                self._tenant_count(t, "evictions")
                self.counters["evictions"] += 1
                self.counters["evicted_bytes"] += o.size
                used = int(objs.bytes.get(t, 0))
                if used + size <= q.bytes:
                    return
        self._tenant_count(t, "refused")
        raise NoSpace(
            f"put {user_key(key)!r}: tenant {t!r} holds {format_size(used)} of its "
            f"{format_size(q.bytes)} quota and this object is {format_size(size)}"
            + (
                " (its quota refuses puts when full: remove objects or raise the quota)"
                if q.refuse
                else "; nothing more of the tenant can be evicted (leased or pinned)"
                if size <= q.bytes
                else ""
            )
        )

    def tenant_stats(self) -> dict[str, dict[str, Any]]:
        nbytes, count = tenant_counts(self.objects)
        names = set(count) | set(self.tenant_counters) | {t for t in self.tenant_quotas if t != "*"}
        out: dict[str, dict[str, Any]] = {}
        for t in sorted(names):
            q = self.quota_of(t)
            c = self.tenant_counters.get(t, {})
            out[t] = {
                "objects": int(count.get(t, 0)),
                "bytes": int(nbytes.get(t, 0)),
                "quota": q.bytes if q is not None else None,
                "on_full": None if q is None else ("refuse" if q.refuse else "evict"),
                "evictions": c.get("evictions", 0),
                "refused": c.get("refused", 0),
            }
        return out
