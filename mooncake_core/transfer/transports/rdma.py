"""RDMA transport through pyverbs (Debian's ``python3-pyverbs``): RC queue pairs, memory
registration, one-sided RDMA READ/WRITE.

It is used only when an RDMA device exists on both ends. Detection looks for
``/sys/class/infiniband`` devices and an importable pyverbs (Debian installs it for the
system Python; its ``dist-packages`` folder is added to ``sys.path`` when needed). On a
machine without devices (such as our CI, whose kernel has no InfiniBand/rxe support) the
transport logs that once and reports itself unavailable, and the engine uses TCP. The
verbs code below is real, but on our machines it is exercised only up to device
detection.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from mooncake_core.errors import InvalidRequest, PeerUnreachable, TransferTimeout, TransportError
from mooncake_core.plugins import TransportInfo, hookimpl
from mooncake_core.transfer.protocol import Op, Status
from mooncake_core.transfer.transports.base import Transport
from mooncake_core.transfer.types import READ, PeerInfo, TransportHost, WorkItem

__all__ = ["RDMATransport", "detect_devices", "rdma_available", "request_queue_pair"]

logger = logging.getLogger(__name__)
_logged = False
_DEBIAN_DIST = "/usr/lib/python3/dist-packages"


def detect_devices(sysfs: str = "/sys/class/infiniband") -> list[str]:
    """Names of RDMA devices the kernel exposes (empty when there is no RDMA support)."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(sysfs, "*")))


def _import_pyverbs() -> Any:
    try:
        import pyverbs.device

        return pyverbs
    except ImportError:
        pass
    if os.path.isdir(os.path.join(_DEBIAN_DIST, "pyverbs")) and _DEBIAN_DIST not in sys.path:
        sys.path.append(_DEBIAN_DIST)
        try:
            import pyverbs.device

            return pyverbs
        except ImportError:
            return None
    return None


def rdma_available(device_filter: str = "") -> tuple[bool, str]:
    """Whether RDMA can be used here, and why not."""
    devices = detect_devices()
    if device_filter:
        wanted = {d.strip() for d in device_filter.split(",") if d.strip()}
        devices = [d for d in devices if d in wanted]
    if not devices:
        return (
            False,
            "no RDMA device (no /sys/class/infiniband entries; "
            "kernel without InfiniBand/rxe support?)",
        )
    if _import_pyverbs() is None:
        return False, "pyverbs is not importable (apt-get install python3-pyverbs)"
    return True, ",".join(devices)


def request_queue_pair(
    host: TransportHost, peer: PeerInfo, info: dict[str, Any], deadline: float
) -> dict[str, Any]:
    """Client side of the RDMA queue-pair exchange, over the engine's control channel.

    Sends our queue pair ``info`` to ``peer`` and returns the peer's.

    Raises:
        TransportError: the peer refused (no RDMA device there, bad request).
    """
    status, body = host.control(peer, Op.RDMA_CONNECT, deadline, payload=json.dumps(info).encode())
    if status != Status.OK:
        raise TransportError(
            f"peer {peer.name!r} refused the RDMA connection: {body.decode(errors='replace')}"
        )
    answer: dict[str, Any] = json.loads(body)
    return answer


class _Endpoint:
    """One RC queue pair to one peer, with its completion queue."""

    def __init__(self, ctx: Any, pd: Any, port: int, gid_index: int) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self.cq = CQ(ctx, 1024)
        cap = QPCap(max_send_wr=512, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        attr = QPAttr(port_num=port)
        attr.qp_access_flags = (
            e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE
        )
        self.qp = QP(pd, init, attr)
        self.port = port
        self.gid_index = gid_index
        port_attr = ctx.query_port(port)
        self.lid = port_attr.lid
        self.gid = str(ctx.query_gid(port, gid_index))
        self.psn = int.from_bytes(os.urandom(3), "little")
        self.lock = threading.Lock()

    def info(self) -> dict[str, Any]:
        return {"qpn": self.qp.qp_num, "lid": self.lid, "gid": self.gid, "psn": self.psn}

    def connect(self, remote: dict[str, Any]) -> None:
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self.port)
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = int(remote["qpn"])
        attr.rq_psn = int(remote["psn"])
        attr.sq_psn = self.psn
        attr.max_dest_rd_atomic = 16
        attr.max_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = GlobalRoute(dgid=GID(remote["gid"]), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=int(remote["lid"]))
        self.qp.to_rts(attr)


class RDMATransport(Transport):
    """RDMA READ/WRITE over RC queue pairs (pyverbs)."""

    name = "rdma"

    def __init__(self, engine: TransportHost) -> None:
        super().__init__(engine)
        global _logged
        self.available, why = rdma_available(engine.config.device_name)
        self._ctx: Any = None
        self._pd: Any = None
        self._mrs: dict[int, Any] = {}
        self._eps: dict[str, _Endpoint] = {}
        self._lock = threading.Lock()
        if not self.available:
            if not _logged:
                logger.info("RDMA unavailable (%s); using TCP instead", why)
                _logged = True
            return
        try:
            from pyverbs.device import Context
            from pyverbs.pd import PD

            self.device = why.split(",")[0]
            self._ctx = Context(name=self.device)
            self._pd = PD(self._ctx)
            engine.segments.on_change.append(self._sync_mrs)
            self._sync_mrs()
            logger.info("RDMA transport on device %s", self.device)
        except Exception as exc:  # driver errors: fall back to TCP, once, loudly
            self.available = False
            logger.warning("RDMA device %s could not be opened (%s); using TCP instead", why, exc)

    # ------------------------------------------------------------------ memory registration
    def _sync_mrs(self) -> None:
        import pyverbs.enums as e
        from pyverbs.mr import MR

        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        with self._lock:
            live = {r.addr: r for r in self.engine.segments.regions() if r.kind == "host"}
            for addr in [a for a in self._mrs if a not in live]:
                self._mrs.pop(addr).close()
            for addr, r in live.items():
                if addr not in self._mrs:
                    self._mrs[addr] = MR(self._pd, r.length, access, address=addr)

    def describe(self) -> dict[str, Any]:
        """rkeys of our regions, published in the segment descriptor."""
        if not self.available:
            return {}
        with self._lock:
            return {
                "device": self.device,
                "rkeys": {str(a): mr.rkey for a, mr in self._mrs.items()},
            }

    def accept(self, remote: dict[str, Any]) -> dict[str, Any]:
        """Server side of the QP handshake (called by the listener's RDMA_CONNECT)."""
        if not self.available:
            raise TransportError("RDMA is not available on this engine")
        ep = _Endpoint(self._ctx, self._pd, 1, self.engine.config.transfer.gid_index)
        ep.connect(remote)
        with self._lock:
            self._eps[f"in:{remote.get('name', id(ep))}"] = ep
        return ep.info()

    # ------------------------------------------------------------------ data path
    def can_reach(self, peer: PeerInfo) -> bool:
        return self.available and bool(peer.desc.get("rdma"))

    def _endpoint(self, peer: PeerInfo, deadline: float) -> _Endpoint:
        with self._lock:
            ep = self._eps.get(peer.name)
        if ep is not None:
            return ep
        ep = _Endpoint(self._ctx, self._pd, 1, self.engine.config.transfer.gid_index)
        mine = {**ep.info(), "name": self.engine.name}
        remote = request_queue_pair(self.engine, peer, mine, deadline)
        ep.connect(remote)
        with self._lock:
            self._eps[peer.name] = ep
        return ep

    def execute(self, peer: PeerInfo, items: list[WorkItem], deadline: float) -> None:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        ep = self._endpoint(peer, deadline)
        rkeys: dict[str, int] = peer.desc["rdma"].get("rkeys", {})
        with ep.lock:
            posted = []
            for i, it in enumerate(items):
                if it.done or it.error is not None:
                    continue
                region = peer.find_region(it.remote_addr, it.length)
                local = self.engine.segments.find(it.local_addr, it.length)
                if region is None or str(region["addr"]) not in rkeys:
                    it.error = InvalidRequest(
                        f"peer {peer.name!r} has no RDMA-registered memory at 0x{it.remote_addr:x}"
                    )
                    continue
                mr = self._mrs[local.addr]
                sge = SGE(it.local_addr, it.length, mr.lkey)
                wr = SendWR(
                    wr_id=i,
                    opcode=e.IBV_WR_RDMA_READ if it.op == READ else e.IBV_WR_RDMA_WRITE,
                    num_sge=1,
                    sg=[sge],
                    send_flags=e.IBV_SEND_SIGNALED,
                )
                wr.set_wr_rdma(rkeys[str(region["addr"])], it.remote_addr)
                ep.qp.post_send(wr)
                posted.append(i)
            left = len(posted)
            while left:
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"RDMA transfer to {peer.name!r} timed out")
                n, wcs = ep.cq.poll(num_entries=min(left, 64))
                for wc in wcs[:n]:
                    if wc.status != e.IBV_WC_SUCCESS:
                        with self._lock:
                            self._eps.pop(peer.name, None)
                        raise PeerUnreachable(
                            f"RDMA work completion failed ({wc.status}) to {peer.name!r}"
                        )
                    items[wc.wr_id].done = True
                left -= n

    def close(self) -> None:
        with self._lock:
            eps = list(self._eps.values())
            self._eps.clear()
        for ep in eps:
            for obj in (ep.qp, ep.cq):
                try:
                    obj.close()
                except Exception:  # noqa: BLE001 - best-effort teardown
                    pass


def _describe_json(t: RDMATransport) -> str:  # pragma: no cover - debugging helper
    return json.dumps(t.describe())


@hookimpl
def mooncake_transports() -> list[TransportInfo]:
    return [
        TransportInfo(
            "rdma",
            RDMATransport,
            priority=20,
            description="RDMA via pyverbs (RC QPs, READ/WRITE); falls back to TCP without a device",
        )
    ]
