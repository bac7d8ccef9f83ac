"""``mooncake.store.bind_to_numa_node(node)``: run the calling thread on one NUMA node.

The published function (0.3.13, checked by running it) binds the calling thread to the
CPUs of ``node`` and prefers that node for its memory allocations, and returns None in
every case: a node that does not exist (negative, or past the last one) logs a warning and
changes nothing, except -1, which (libnuma's "all nodes") lets the thread run on every
node's CPUs again; a non-int raises ``TypeError``. Ours does the same with
the node's ``/sys/devices/system/node/node<N>/cpulist`` and ``sched_setaffinity`` on the
calling thread, plus ``set_mempolicy(MPOL_PREFERRED)`` through libc where the system call
number is known (x86-64, aarch64); without it the CPUs are still bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from pathlib import Path

__all__ = ["bind_to_numa_node", "node_cpus"]

logger = logging.getLogger("mooncake_core.compat.store")
_NODES = Path("/sys/devices/system/node")
_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
_MPOL_PREFERRED = 1


def _parse_list(text: str) -> set[int]:
    """``0-3,8,10-11`` as a set of ints."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def node_cpus(node: int) -> set[int] | None:
    """The CPUs of NUMA node ``node``, or None when there is no such node."""
    try:
        return _parse_list((_NODES / f"node{int(node)}" / "cpulist").read_text())
    except (OSError, ValueError):
        return None


def _valid_range() -> str:
    try:
        return (_NODES / "online").read_text().strip()
    except OSError:
        return "0-0"


def _prefer_memory(node: int) -> None:
    nr = _SET_MEMPOLICY.get(platform.machine())
    if nr is None:
        logger.debug("bind_to_numa_node: no set_mempolicy on %s", platform.machine())
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    bits = 64
    mask = (ctypes.c_ulong * (node // bits + 1))()
    mask[node // bits] = 1 << (node % bits)
    if libc.syscall(nr, _MPOL_PREFERRED, mask, ctypes.c_ulong(len(mask) * bits + 1)) != 0:
        logger.warning(
            "bind_to_numa_node: set_mempolicy failed for node %d: %s",
            node,
            os.strerror(ctypes.get_errno()),
        )


def bind_to_numa_node(node: int) -> None:
    """Bind the current thread and memory allocation preference to the specified NUMA node."""
    if not isinstance(node, int):
        raise TypeError(f"bind_to_numa_node(): node must be an int, got {type(node).__name__}")
    cpus = node_cpus(node) if node >= 0 else None
    if not cpus:
        logger.warning("Invalid NUMA node: %d. Valid range: %s", node, _valid_range())
        if node != -1:
            return
        # as published (libnuma's numa_run_on_node(-1)): run on every node's CPUs again
        cpus = set().union(*(node_cpus(n) or set() for n in _parse_list(_valid_range())))
        if cpus:
            os.sched_setaffinity(0, cpus)
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("bind_to_numa_node: cannot run on node %d's CPUs: %s", node, exc.strerror)
        return
    _prefer_memory(int(node))
