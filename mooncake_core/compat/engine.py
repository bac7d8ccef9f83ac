"""``mooncake.engine`` drop-in: the published ``TransferEngine`` API on our engine.

Contract (names, argument order, defaults and return codes follow the published
``mooncake-transfer-engine`` wheel, 0.3.13; see docs/compat.md for the full table):

- Lifecycle: :meth:`TransferEngine.initialize`, :meth:`~TransferEngine.initialize_ext`,
  :meth:`~TransferEngine.get_rpc_port`. With ``metadata_server="P2PHANDSHAKE"`` a peer
  is named ``"host:port"`` where ``port`` is its ``get_rpc_port()``.
- Memory: ``register_memory`` / ``unregister_memory`` and their batch forms,
  ``allocate_managed_buffer`` / ``free_managed_buffer``, ``write_bytes_to_buffer`` /
  ``read_bytes_from_buffer``.
- Transfers: ``transfer_sync_{write,read}``, ``transfer_sync``,
  ``batch_transfer_sync_{write,read}``, ``batch_transfer_sync``,
  ``batch_transfer_async_{write,read}`` / ``batch_transfer_async`` (return a batch id,
  0 when the submission failed) with ``get_batch_transfer_status``, and
  ``transfer_submit_write`` with ``transfer_check_status``.
- Misc: ``get_local_topology``, ``get_first_buffer_address``, ``get_notifies``,
  ``send_probe``, ``get_engine``, ``get_engine_ptr``.

Every method returns ``0`` on success and a negative code on failure (codes below); it
never raises for a failed transfer. Errors are logged with the reason (our exception
message), since an int cannot carry it.

Thread-safety: methods may be called from several threads; batch ids are guarded by a
lock. Transfers run on the inner :class:`mooncake_core.transfer.TransferEngine`.

Upstream-only environment variables honoured here (the one table of them; everything
else is configured through our ``MOONCAKE_*`` variables):

=======================  ==========================================================
``MC_TRANSFER_TIMEOUT``  seconds before a transfer fails as timed out (-> ``transfer.timeout_s``;
                         default 30)
``MC_TCP_BIND_ADDRESS``  address the listener binds to (-> ``transfer.listen_host``)
``MC_METADATA_SERVER``   used when ``initialize`` is given an empty ``metadata_server``
=======================  ==========================================================
"""

from __future__ import annotations

import enum
import ipaddress
import json
import logging
import random
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from mooncake_core.compat.rpc import *  # noqa: F403 - the published RPC channel names
from mooncake_core.config import MooncakeConfig, env_str, environment, load_config
from mooncake_core.errors import MooncakeError, PeerUnreachable, SegmentError, SegmentOverlap
from mooncake_core.transfer import engine as _engine_mod
from mooncake_core.transfer.engine import Batch, TransferRequest
from mooncake_core.transfer.memory import host_view

__all__ = [
    "TransferEngine",
    "TransferOpcode",
    "TransferNotify",
    "Read",
    "Write",
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
    "SUPPORT_INTRA_NVLINK",
    "UPSTREAM_ENV",
    "upstream_transfer_overrides",
    "OK",
    "ERR_INVALID_ARGUMENT",
    "ERR_ADDRESS_NOT_REGISTERED",
    "ERR_ADDRESS_OVERLAPPED",
    "ERR_SOCKET",
]

logger = logging.getLogger(__name__)

# Return codes (the published engine's numbering for the cases we can tell apart).
OK = 0
ERR_INVALID_ARGUMENT = -1  # also: any failed transfer, as the published binding reports it
ERR_ADDRESS_NOT_REGISTERED = -3  # unregister_memory of an address that is not registered
ERR_ADDRESS_OVERLAPPED = -7  # register_memory overlapping a registered range
ERR_SOCKET = -102  # send_probe: the peer cannot be reached

# Build capabilities, as the published non-CUDA wheel reports them. (Our engine moves
# CUDA tensors through a host staging copy; that is not the same as GPUDirect.)
SUPPORT_CUDA = False
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False

#: Upstream env name -> (our config key, meaning). Documented in docs/compat.md.
UPSTREAM_ENV: Mapping[str, tuple[str, str]] = {
    "MC_TRANSFER_TIMEOUT": ("transfer.timeout_s", "transfer timeout in seconds (default 30)"),
    "MC_TCP_BIND_ADDRESS": ("transfer.listen_host", "address the transfer listener binds to"),
    "MC_METADATA_SERVER": (
        "metadata_server",
        "metadata server when initialize() gets an empty one",
    ),
    "MC_MIN_RPC_PORT": ("", "low end of the handshake port range (default 15000)"),
    "MC_MAX_RPC_PORT": ("", "high end of the handshake port range (default 17000)"),
    "MC_STORE_CLIENT_MIN_PORT": ("", "low end of the store client's port range (default 12300)"),
    "MC_STORE_CLIENT_MAX_PORT": ("", "high end of the store client's port range (default 14300)"),
}

# Published protocol strings -> ours. RDMA-family protocols go to our RDMA transport,
# which falls back to TCP when there is no device; the rest run on TCP/shared memory.
_PROTOCOLS = {
    "tcp": "tcp",
    "rdma": "rdma",
    "efa": "rdma",
    "barex": "rdma",
    "shm": "shm",
    "auto": "auto",
}
_HINTS = {"tcp": "tcp", "rdma": "rdma", "shm": "shm"}
_METADATA_TYPES = {
    "p2p": "P2PHANDSHAKE",
    "p2phandshake": "P2PHANDSHAKE",
    "etcd": "etcd://",
    "http": "http://",
    "redis": "redis://",
}


class TransferOpcode(enum.IntEnum):
    """Direction of a transfer (values as in the published binding)."""

    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """A (name, msg) notification delivered to the peer after a transfer."""

    __slots__ = ("name", "msg")

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransferNotify) and (self.name, self.msg) == (
            other.name,
            other.msg,
        )

    __hash__ = None  # type: ignore[assignment]


#: The published engine's P2P handshake ports come from this range (MC_MIN_RPC_PORT..
#: MC_MAX_RPC_PORT, default 15000..17000, both ends included), as observed on the wheel.
RPC_PORT_RANGE = (15000, 17000)


def port_range(
    environ: Mapping[str, str], low: str, high: str, default: tuple[int, int]
) -> tuple[int, int]:
    """The port range ``[$low, $high]`` as the published package reads it (observed on the
    wheel): each end in 1..65535 replaces its default on its own; a bad number, or a low end
    above the high end, leaves the whole default range (with a warning)."""
    ends = list(default)
    for i, name in enumerate((low, high)):
        raw = env_str(name, environ=environ)
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if not 0 < value <= 65535:
            logger.warning("%s=%r is not a port number; using %d-%d", name, raw, *default)
            return default
        ends[i] = value
    if ends[0] > ends[1]:
        logger.warning(
            "%s..%s is an empty range (%d > %d); using %d-%d", low, high, *ends, *default
        )
        return default
    return ends[0], ends[1]


def rpc_port_range(environ: Mapping[str, str]) -> tuple[int, int]:
    """Where the compat engine's P2P handshake port comes from (``MC_MIN_RPC_PORT`` /
    ``MC_MAX_RPC_PORT``, default :data:`RPC_PORT_RANGE`)."""
    return port_range(environ, "MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT", RPC_PORT_RANGE)


def free_port(host: str, lo: int, hi: int) -> int:
    """A port in ``[lo, hi]`` that is free on ``host`` now (random tries; an ephemeral
    one when none of them is)."""
    addr = host if host not in ("", "localhost") else "127.0.0.1"
    for port in random.sample(range(lo, hi + 1), min(64, hi + 1 - lo)):
        with socket.socket() as sock:
            try:
                sock.bind((addr, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind((addr, 0))
        return int(sock.getsockname()[1])


def upstream_transfer_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``transfer`` config overrides from the upstream env variables in :data:`UPSTREAM_ENV`."""
    transfer: dict[str, Any] = {}
    raw = env_str("MC_TRANSFER_TIMEOUT", environ=environ)
    if raw:
        try:
            if float(raw) > 0:
                transfer["timeout_s"] = float(raw)
        except ValueError:
            logger.warning("ignoring MC_TRANSFER_TIMEOUT=%r: not a number of seconds", raw)
    bind = env_str("MC_TCP_BIND_ADDRESS", environ=environ)
    if bind:
        transfer["listen_host"] = bind
    return transfer


def _ip_literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


class TransferEngine:
    """The published ``mooncake.engine.TransferEngine``, implemented on our engine.

    Construct with no arguments, then call :meth:`initialize`. All methods return ints
    (0 / negative) unless the published API returns something else.
    """

    def __init__(self) -> None:
        self._eng: _engine_mod.TransferEngine | None = None
        self._batches: dict[int, Batch] = {}
        self._failed_ids: set[int] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> int:
        """Start the engine. ``metadata_server``: ``P2PHANDSHAKE``, ``http://h:p/metadata``,
        ``etcd://h:p`` or bare ``h:p`` (etcd). ``protocol="rdma"`` falls back to TCP when
        there is no RDMA device. Calling it again on a started engine returns 0."""
        if self._eng is not None:
            return OK
        try:
            cfg = self._config(local_hostname, metadata_server, protocol, device_name)
            eng = _engine_mod.TransferEngine(cfg)
            eng.start()
        except MooncakeError as exc:
            logger.error(
                "initialize(%r, %r, %r) failed: %s", local_hostname, metadata_server, protocol, exc
            )
            return ERR_INVALID_ARGUMENT
        except OSError as exc:
            logger.error("initialize(%r) cannot listen: %s", local_hostname, exc)
            return ERR_SOCKET
        self._eng = eng
        return OK

    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int:
        """Like :meth:`initialize` with an explicit metadata type (``etcd``, ``http``,
        ``redis``, ``p2p``): a bare ``metadata_server`` gets that type's scheme."""
        kind = metadata_type.strip().lower()
        target = metadata_server.strip()
        if kind in _METADATA_TYPES and "://" not in target:
            prefix = _METADATA_TYPES[kind]
            target = prefix if prefix == "P2PHANDSHAKE" else prefix + target
        return self.initialize(local_hostname, target, protocol, device_name)

    @staticmethod
    def _config(
        local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> MooncakeConfig:
        env = dict(environment())
        # The published engine does not read mooncake.json; a store-only key there must
        # not break initialize().
        env.pop("MOONCAKE_CONFIG_PATH", None)
        transfer = upstream_transfer_overrides(env)
        host = local_hostname.strip() or "127.0.0.1"
        bare = host.rpartition(":")[0] if host.rpartition(":")[2].isdigit() else host
        ip = _ip_literal(bare)
        if (
            "listen_host" not in transfer
            and "MOONCAKE_TRANSFER_LISTEN_HOST" not in env
            and ip is not None
            and not ipaddress.ip_address(ip).is_loopback
        ):
            transfer["listen_host"] = ip  # cross-host use: listen where we told peers to connect
        meta = (
            metadata_server.strip() or env_str("MC_METADATA_SERVER", environ=env) or "P2PHANDSHAKE"
        )
        proto = _PROTOCOLS.get(protocol.strip().lower())
        if proto is None:
            logger.warning("protocol %r is not available here; using tcp/shared memory", protocol)
            proto = "tcp"
        overrides: dict[str, Any] = {
            "local_hostname": host,
            "metadata_server": meta,
            "protocol": proto,
            "device_name": device_name,
        }
        if transfer:
            overrides["transfer"] = transfer
        cfg = load_config(environ=env, **overrides)
        if meta.upper() == "P2PHANDSHAKE" and bare == host and cfg.transfer.port == 0:
            # no port given: take one from the published engine's handshake port range
            overrides["local_hostname"] = f"{host}:{free_port(bare, *rpc_port_range(env))}"
            cfg = load_config(environ=env, **overrides)
        return cfg

    def _engine(self) -> _engine_mod.TransferEngine:
        if self._eng is None:
            raise SegmentError("the transfer engine is not initialized: call initialize() first")
        return self._eng

    def get_rpc_port(self) -> int:
        """The handshake/transfer port (``host:port`` is this engine's P2P name)."""
        return self._eng.port if self._eng is not None else 0

    def get_engine(self) -> _engine_mod.TransferEngine:
        """The inner :class:`mooncake_core.transfer.TransferEngine` (to share with our store)."""
        return self._engine()

    def get_engine_ptr(self) -> int:
        """An opaque integer identifying the inner engine (``id()``; not a C pointer)."""
        return id(self._eng) if self._eng is not None else 0

    def close(self) -> None:
        """Stop the engine (an extension: the published engine lives until the process exits)."""
        if self._eng is not None:
            self._eng.close()
            self._eng = None
        with self._lock:
            self._batches.clear()
            self._failed_ids.clear()

    # ------------------------------------------------------------------ memory
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Register ``[buffer_addr, buffer_addr+capacity)``; -7 if it overlaps a registered
        range."""
        try:
            loc = "cpu:0" if location in ("*", "") else location
            self._engine().register_memory(int(buffer_addr), int(capacity), location=loc)
        except SegmentOverlap as exc:
            logger.error("register_memory(0x%x, %d): %s", buffer_addr, capacity, exc)
            return ERR_ADDRESS_OVERLAPPED
        except MooncakeError as exc:
            logger.error("register_memory(0x%x, %d): %s", buffer_addr, capacity, exc)
            return ERR_INVALID_ARGUMENT
        return OK

    def unregister_memory(self, buffer_addr: int) -> int:
        """Withdraw memory registered at exactly ``buffer_addr``; -3 if none starts there."""
        try:
            self._engine().unregister(int(buffer_addr))
        except MooncakeError as exc:
            logger.error("unregister_memory(0x%x): %s", buffer_addr, exc)
            return ERR_ADDRESS_NOT_REGISTERED
        return OK

    def batch_register_memory(
        self, buffer_addresses: list[int], capacities: list[int], location: str = "*"
    ) -> int:
        """Register several ranges; on the first failure the ones already done are undone."""
        if len(buffer_addresses) != len(capacities):
            logger.error(
                "batch_register_memory: %d addresses but %d capacities",
                len(buffer_addresses),
                len(capacities),
            )
            return ERR_INVALID_ARGUMENT
        done: list[int] = []
        for addr, cap in zip(buffer_addresses, capacities, strict=True):
            rc = self.register_memory(addr, cap, location)
            if rc != OK:
                for a in done:
                    self.unregister_memory(a)
                return rc
            done.append(addr)
        return OK

    def batch_unregister_memory(self, buffer_addresses: list[int]) -> int:
        """Unregister several ranges; returns the first failure code (the rest still run)."""
        rc = OK
        for addr in buffer_addresses:
            r = self.unregister_memory(addr)
            rc = r if rc == OK else rc
        return rc

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocate registered memory (shared with same-host peers); returns its address, 0 on
        failure."""
        try:
            return int(self._engine().allocate(int(length)).addr)
        except MooncakeError as exc:
            logger.error("allocate_managed_buffer(%d): %s", length, exc)
            return 0

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Free memory from :meth:`allocate_managed_buffer` (``length`` is not needed)."""
        try:
            self._engine().free(int(buffer_addr))
        except MooncakeError as exc:
            logger.error("free_managed_buffer(0x%x, %d): %s", buffer_addr, length, exc)
            return ERR_INVALID_ARGUMENT
        return OK

    def _host_range(self, addr: int, length: int) -> memoryview:
        region = self._engine().segments.find(int(addr), int(length))
        if region.kind != "host":
            raise SegmentError(
                f"0x{addr:x} is {region.kind} memory; only host memory can be read or written here"
            )
        return host_view(int(addr), int(length))

    def write_bytes_to_buffer(self, dest_address: int, src: bytes | str, length: int) -> int:
        """Copy ``length`` bytes of ``src`` to registered memory at ``dest_address``.

        Unlike the published engine (a raw memcpy), the destination must lie inside
        registered memory, so a wrong address gives -1 instead of a crash.
        """
        data = src.encode() if isinstance(src, str) else bytes(src)
        if length < 0 or length > len(data):
            logger.error(
                "write_bytes_to_buffer: length %d out of range for %d source bytes",
                length,
                len(data),
            )
            return ERR_INVALID_ARGUMENT
        if length == 0:
            return OK
        try:
            self._host_range(dest_address, length)[:] = data[:length]
        except MooncakeError as exc:
            logger.error("write_bytes_to_buffer(0x%x, %d): %s", dest_address, length, exc)
            return ERR_INVALID_ARGUMENT
        return OK

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes of registered memory at ``source_address`` (b"" on a bad range)."""
        if length <= 0:
            return b""
        try:
            return bytes(self._host_range(source_address, length))
        except MooncakeError as exc:
            logger.error("read_bytes_from_buffer(0x%x, %d): %s", source_address, length, exc)
            return b""

    # ------------------------------------------------------------------ transfers
    @staticmethod
    def _requests(
        op: str,
        target: str,
        buffers: Sequence[int],
        peer_addrs: Sequence[int],
        lengths: Sequence[int],
        hint: str,
    ) -> list[TransferRequest] | None:
        if not (len(buffers) == len(peer_addrs) == len(lengths)) or not buffers:
            logger.error(
                "%s batch to %r: need equal, non-empty lists "
                "(got %d buffers, %d peer addresses, %d lengths)",
                op,
                target,
                len(buffers),
                len(peer_addrs),
                len(lengths),
            )
            return None
        if any(int(n) < 0 for n in lengths):
            logger.error("%s batch to %r: negative length in %s", op, target, list(lengths))
            return None
        transport = _HINTS.get(hint.strip().lower()) if hint else None
        return [
            TransferRequest(op, target, int(b), int(n), int(a), transport=transport)
            for b, a, n in zip(buffers, peer_addrs, lengths, strict=True)
            if int(n) > 0
        ]

    def _sync(
        self,
        op: str,
        target: str,
        buffers: Sequence[int],
        peer_addrs: Sequence[int],
        lengths: Sequence[int],
        hint: str,
        notify: TransferNotify | None = None,
    ) -> int:
        reqs = self._requests(op, target, buffers, peer_addrs, lengths, hint)
        if reqs is None:
            return ERR_INVALID_ARGUMENT
        try:
            eng = self._engine()
            if reqs:
                eng.transfer(reqs)
            if notify is not None:
                eng.notify(target, notify.name, notify.msg)
        except MooncakeError as exc:
            logger.error("%s of %d request(s) to %r failed: %s", op, len(reqs), target, exc)
            return ERR_INVALID_ARGUMENT
        return OK

    def _async(
        self,
        op: str,
        target: str,
        buffers: Sequence[int],
        peer_addrs: Sequence[int],
        lengths: Sequence[int],
        hint: str,
    ) -> int:
        reqs = self._requests(op, target, buffers, peer_addrs, lengths, hint)
        if reqs is None:
            return 0
        try:
            eng = self._engine()
            # As in the published engine, an unreachable peer fails the submission itself.
            eng.peer(target, deadline=None)
            if not reqs:  # only zero-length entries: an already-finished batch
                done = Batch([TransferRequest(op, target, 0, 0, 0)])
                done.statuses[0].state = "completed"
                done._finish()
                batch = done
            else:
                batch = eng.submit(reqs)
        except MooncakeError as exc:
            logger.error(
                "%s batch of %d request(s) to %r not submitted: %s", op, len(reqs), target, exc
            )
            return 0
        with self._lock:
            self._batches[batch.id] = batch
        return batch.id

    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Write ``length`` bytes at local ``buffer`` to ``peer_buffer_address`` on the peer;
        blocks."""
        return self._sync(
            "write", target_hostname, [buffer], [peer_buffer_address], [length], transport_hint
        )

    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Read ``length`` bytes at ``peer_buffer_address`` on the peer into local ``buffer``;
        blocks."""
        return self._sync(
            "read", target_hostname, [buffer], [peer_buffer_address], [length], transport_hint
        )

    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: TransferOpcode,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        """One blocking transfer in direction ``opcode``; then deliver ``notify`` to the peer."""
        return self._sync(
            _op(opcode),
            target_hostname,
            [buffer],
            [peer_buffer_address],
            [length],
            transport_hint,
            notify,
        )

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        return self._sync(
            "write", target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint
        )

    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        return self._sync(
            "read", target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint
        )

    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: TransferOpcode,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        return self._sync(
            _op(opcode),
            target_hostname,
            buffers,
            peer_buffer_addresses,
            lengths,
            transport_hint,
            notify,
        )

    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        """Start a batch of writes; returns its batch id (0 if it could not be submitted)."""
        return self._async(
            "write", target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint
        )

    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        """Start a batch of reads; returns its batch id (0 if it could not be submitted)."""
        return self._async(
            "read", target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint
        )

    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: TransferOpcode,
        transport_hint: str = "",
    ) -> int:
        return self._async(
            _op(opcode), target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint
        )

    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Start one write; poll it with :meth:`transfer_check_status`. Returns the batch id
        (0 on failure)."""
        return self._async(
            "write", target_hostname, [buffer], [peer_buffer_address], [length], transport_hint
        )

    def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
        """Wait for every batch in ``batch_ids``; 0 if all completed, -1 otherwise. Releases the
        ids."""
        with self._lock:
            batches = [self._batches.pop(int(b), None) for b in batch_ids]
        rc = OK
        for bid, batch in zip(batch_ids, batches, strict=True):
            if batch is None:
                logger.error("get_batch_transfer_status: unknown batch id %r", bid)
                rc = ERR_INVALID_ARGUMENT
                continue
            try:
                batch.wait()
            except MooncakeError as exc:
                logger.error("batch %d failed: %s", bid, exc)
                rc = ERR_INVALID_ARGUMENT
        return rc

    def transfer_check_status(self, batch_id: int) -> int:
        """Poll a batch: 1 done, 0 pending, -1 failed, -2 timed out. A final answer releases the id
        (an unknown or released id gives -1; the published engine would read freed memory)."""
        with self._lock:
            batch = self._batches.get(int(batch_id))
        if batch is None:
            return ERR_INVALID_ARGUMENT
        if not batch.done():
            return 0
        with self._lock:
            self._batches.pop(int(batch_id), None)
        states = [s.state for s in batch.statuses]
        if all(s == "completed" for s in states):
            return 1
        return -2 if "timeout" in states else -1

    # ------------------------------------------------------------- peers, topology, notifications
    def get_local_topology(self, device_name: str | None = None) -> str:
        """JSON ``{"cpu:<node>": [[preferred NICs], [other NICs]]}`` (the published shape);
        ``device_name`` (comma list) keeps only those NICs."""
        from mooncake_core.transfer.topology import topology_json

        matrix: dict[str, list[list[str]]] = json.loads(topology_json()).get("priority_matrix", {})
        if device_name:
            keep = {d.strip() for d in device_name.split(",") if d.strip()}
            matrix = {k: [[n for n in tier if n in keep] for tier in v] for k, v in matrix.items()}
        return json.dumps(matrix, indent=1)

    def get_first_buffer_address(self, segment_name: str) -> int:
        """Lowest registered address of segment ``segment_name`` (this engine's or a peer's);
        0 if none."""
        try:
            eng = self._engine()
            if segment_name == eng.name:
                regions = eng.segments.regions()
                return regions[0].addr if regions else 0
            peer = eng.peer(segment_name, refresh=True)
            return int(peer.regions[0]["addr"]) if peer.regions else 0
        except MooncakeError as exc:
            logger.error("get_first_buffer_address(%r): %s", segment_name, exc)
            return 0

    def get_notifies(self) -> list[TransferNotify]:
        """Notifications received since the last call (from peers'
        ``transfer_sync(..., notify)``)."""
        if self._eng is None:
            return []
        return [TransferNotify(n, m) for n, m in self._eng.get_notifies()]

    def send_probe(self, peer_server_name: str) -> int:
        """0 if ``peer_server_name`` answers, -102 if it cannot be reached."""
        try:
            eng = self._engine()
        except MooncakeError:
            return ERR_INVALID_ARGUMENT
        if eng.ping(peer_server_name):
            return OK
        logger.warning("send_probe: peer %r does not answer", peer_server_name)
        return ERR_SOCKET

    def warmup_efa_segment(self, segment_name: str) -> int:
        """EFA only in the published engine; here a handshake with the peer (0 / -102)."""
        try:
            self._engine().peer(segment_name)
        except PeerUnreachable:
            return ERR_SOCKET
        except MooncakeError:
            return ERR_INVALID_ARGUMENT
        return OK


# published alias: ``TransferEngine.TransferOpcode.Write``
TransferEngine.TransferOpcode = TransferOpcode  # type: ignore[attr-defined]


def _op(opcode: TransferOpcode | int) -> str:
    return "read" if int(opcode) == int(TransferOpcode.Read) else "write"
