"""Topology discovery: this host's identity, network interfaces, their addresses and NUMA
nodes.

Reads ``/sys/class/net`` (operstate, NUMA node of the backing PCI device, link speed)
and asks the kernel for each interface's IPv4 address. :func:`choose_interfaces` picks
the interfaces for a segment on a given NUMA node (same-node NICs first), which the
engine uses to stripe one peer's TCP connections over several interfaces.

:func:`plan_listen` decides where the engine listens: from ``transfer.listen_host`` when
it is set, else from ``local_hostname`` (an IP literal of this host, or a name resolving
to one), loopback otherwise; it says when other hosts could not reach the result.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import os
import socket
import struct
from dataclasses import asdict, dataclass, field

__all__ = [
    "host_identity",
    "Nic",
    "discover_nics",
    "interface_ipv4",
    "choose_interfaces",
    "resolve_interfaces",
    "topology_json",
    "is_local_address",
    "ListenPlan",
    "plan_listen",
    "DEFAULT_LISTEN_HOST",
]

logger = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915
DEFAULT_LISTEN_HOST = "127.0.0.1"  # ``transfer.listen_host`` when nobody set it
_ANY = ("0.0.0.0", "::", "")


def host_identity() -> str:
    """Identity of 'this host' as seen by shared memory: boot id plus namespaces."""
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("no-boot-id")
    for ns in ("net", "pid", "mnt"):
        try:
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
        except OSError:
            parts.append("-")
    return "/".join(parts)


@dataclass(frozen=True)
class Nic:
    name: str
    ipv4: str | None
    numa_node: int
    speed_mbps: int
    up: bool
    virtual: bool


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def interface_ipv4(name: str) -> str | None:
    """IPv4 address of interface ``name`` (None if it has none)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(res[20:24])
    except OSError:
        return None
    finally:
        s.close()


def discover_nics(sysfs: str = "/sys/class/net") -> list[Nic]:
    """Every network interface with its IPv4 address, NUMA node (-1 unknown) and speed."""
    out = []
    try:
        names = sorted(os.listdir(sysfs))
    except OSError:
        return []
    for name in names:
        base = os.path.join(sysfs, name)
        numa = _read(os.path.join(base, "device", "numa_node"), "-1")
        speed = _read(os.path.join(base, "speed"), "-1")
        oper = _read(os.path.join(base, "operstate"), "unknown")
        out.append(
            Nic(
                name=name,
                ipv4=interface_ipv4(name),
                numa_node=int(numa) if numa.lstrip("-").isdigit() else -1,
                speed_mbps=int(speed) if speed.lstrip("-").isdigit() else -1,
                up=oper in ("up", "unknown") or name == "lo",
                virtual=not os.path.exists(os.path.join(base, "device")),
            )
        )
    return out


def choose_interfaces(nics: list[Nic], numa_node: int = -1) -> list[Nic]:
    """Usable NICs for a segment on ``numa_node``: same-node first, then the rest."""
    usable = [n for n in nics if n.up and n.ipv4 and n.name != "lo"]
    if not usable:
        usable = [n for n in nics if n.ipv4]
    same = [n for n in usable if numa_node >= 0 and n.numa_node == numa_node]
    return same + [n for n in usable if n not in same]


def resolve_interfaces(spec: str) -> list[str]:
    """Turn ``"eth0,10.0.0.2"`` (names or IPv4 addresses) into IPv4 addresses."""
    from mooncake_core.errors import ConfigError

    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        try:
            socket.inet_aton(item)
            out.append(item)
            continue
        except OSError:
            pass
        ip = interface_ipv4(item)
        if ip is None:
            raise ConfigError(
                f"transfer.interfaces: interface {item!r} does not exist or has no IPv4 address"
            )
        out.append(ip)
    return out


def topology_json() -> str:
    """The discovered topology as JSON (``get_local_topology`` of the compat engine)."""
    nics = discover_nics()
    nodes = sorted({n.numa_node for n in nics if n.numa_node >= 0}) or [0]
    matrix = {
        f"cpu:{node}": [
            [n.name for n in choose_interfaces(nics, node) if n.numa_node == node],
            [n.name for n in choose_interfaces(nics, node) if n.numa_node != node],
        ]
        for node in nodes
    }
    return json.dumps({"nics": [asdict(n) for n in nics], "priority_matrix": matrix})


def _ip_literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


def _is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def is_local_address(ip: str) -> bool:
    """True when ``ip`` belongs to one of this host's (network namespace's) interfaces.

    Checked by binding a throw-away socket to it, which the kernel allows only for a
    local address (secondary addresses included).
    """
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def _resolve(name: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    out: list[str] = []
    for info in infos:
        ip = str(info[4][0])
        if ip not in out:
            out.append(ip)
    return out


@dataclass
class ListenPlan:
    """Where the transfer listener binds and what it tells peers.

    Attributes:
        listen: addresses to bind.
        advertise: addresses published for peers (``listen`` unless it is a wildcard).
        warnings: why other hosts may not reach this engine (logged by the engine).
    """

    listen: list[str]
    advertise: list[str]
    warnings: list[str] = field(default_factory=list)


def plan_listen(host: str, listen_host: str = DEFAULT_LISTEN_HOST) -> ListenPlan:
    """Decide the listen and advertised addresses for ``local_hostname``'s host part.

    ``listen_host`` other than the default (127.0.0.1) is used as given. With the default,
    the address comes from ``host``: an IP literal of this host, or a name that resolves to
    one; loopback stays the answer for loopback names, and for names that resolve to no
    address here (with a warning). An IP literal that is not this host's raises
    :class:`~mooncake_core.errors.ConfigError` (binding it would fail anyway).
    """
    from mooncake_core.errors import ConfigError

    warnings: list[str] = []
    ip = _ip_literal(host)
    if listen_host != DEFAULT_LISTEN_HOST:
        listen = [listen_host]
        if listen_host in _ANY:
            advertise = [host]
            if (ip is not None and _is_loopback(ip)) or host == "localhost":
                warnings.append(
                    f"transfer.listen_host {listen_host!r} listens on every interface but "
                    f"local_hostname {host!r} is a loopback address: peers on other hosts "
                    "cannot reach this engine (set local_hostname to this host's address)"
                )
        else:
            advertise = [listen_host]
        return ListenPlan(listen, advertise, warnings)
    if ip is not None:
        if ip in _ANY or ipaddress.ip_address(ip).is_unspecified:
            raise ConfigError(
                f"local_hostname: {host!r} is not an address peers can connect to; "
                "give this host's address (set transfer.listen_host to listen on all interfaces)"
            )
        if _is_loopback(ip):
            return ListenPlan([DEFAULT_LISTEN_HOST], [DEFAULT_LISTEN_HOST])
        if not is_local_address(ip):
            raise ConfigError(
                f"local_hostname: {host} is not an address of this host (no interface has it); "
                "use this host's address, or set transfer.listen_host (0.0.0.0 behind NAT)"
            )
        return ListenPlan([ip], [ip])
    if host == "localhost":
        return ListenPlan([DEFAULT_LISTEN_HOST], [DEFAULT_LISTEN_HOST])
    addrs = _resolve(host)
    local = [a for a in addrs if not _is_loopback(a) and is_local_address(a)]
    if local:
        return ListenPlan([local[0]], [local[0]])
    if addrs and all(_is_loopback(a) for a in addrs):
        why = f"resolves only to loopback ({', '.join(addrs)})"
    elif addrs:
        why = f"resolves to {', '.join(addrs)}, none of them an address of this host"
    else:
        why = "does not resolve"
    warnings.append(
        f"local_hostname {host!r} {why}: listening on {DEFAULT_LISTEN_HOST}, which peers on "
        "other hosts cannot reach (use this host's address or set transfer.listen_host)"
    )
    return ListenPlan([DEFAULT_LISTEN_HOST], [DEFAULT_LISTEN_HOST], warnings)
