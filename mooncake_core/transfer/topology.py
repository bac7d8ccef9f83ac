"""Topology discovery: this host's identity, network interfaces, their addresses and NUMA
nodes.

Reads ``/sys/class/net`` (operstate, NUMA node of the backing PCI device, link speed)
and asks the kernel for each interface's IPv4 address. :func:`choose_interfaces` picks
the interfaces for a segment on a given NUMA node (same-node NICs first), which the
engine uses to stripe one peer's TCP connections over several interfaces.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
from dataclasses import asdict, dataclass

__all__ = [
    "host_identity",
    "Nic",
    "discover_nics",
    "interface_ipv4",
    "choose_interfaces",
    "resolve_interfaces",
    "topology_json",
]

SIOCGIFADDR = 0x8915


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
