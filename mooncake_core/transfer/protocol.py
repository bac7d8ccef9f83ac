"""Wire format of the transfer engine's TCP listener.

Every connection starts with the server's greeting (magic, version, flags, 16-byte
nonce). The client answers with a HELLO whose payload is HMAC-SHA256(secret, nonce)
(zeros when no secret is configured) plus a JSON blob describing itself. Until HELLO is
accepted no other operation is served.

Requests are a fixed 32-byte header, optionally followed by ``length`` payload bytes
(WRITE, HELLO, TENSOR, NOTIFY, READV). Responses are a fixed 24-byte header, optionally
followed by payload (READ, READV, DESC). Responses come back in request order, so a client
may pipeline several requests on one connection.

READV (version 2) reads several ranges in one request: ``aux`` ranges, the payload
``aux`` x ``RANGE`` (addr u64, length u64); the answer carries the ranges' bytes back to
back, or one error status for the whole request. A client sends it only to a peer whose
greeting says version 2 or later.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

__all__ = [
    "MAGIC",
    "VERSION",
    "GREETING",
    "REQ",
    "RESP",
    "Op",
    "Status",
    "MAX_CONTROL_PAYLOAD",
    "MAX_READV_BYTES",
    "MAX_READV_RANGES",
    "RANGE",
    "auth_digest",
]

MAGIC = 0x4D434B31  # "MCK1"
VERSION = 2  # 2: READV
# greeting: magic u32, version u16, flags u16 (bit0: secret required), nonce 16s
GREETING = struct.Struct("<IHH16s")
# request: magic u32, op u8, flags u8, pad u16, req_id u32, aux u32, addr u64, length u64
REQ = struct.Struct("<IBBHIIQQ")
# response: magic u32, status i32, req_id u32, pad u32, length u64
RESP = struct.Struct("<IiIIQ")
# one range of a READV request: addr u64, length u64
RANGE = struct.Struct("<QQ")
MAX_READV_RANGES = 1024  # IOV_MAX on Linux: one sendmsg/recvmsg_into per answer at most
MAX_READV_BYTES = 256 << 20  # one READV answers at most this many bytes

MAX_CONTROL_PAYLOAD = 16 << 20  # HELLO / TENSOR metadata / NOTIFY bodies above this are refused
FLAG_SECRET_REQUIRED = 1


class Op:
    HELLO = 1
    DESC = 2
    READ = 3
    WRITE = 4
    TENSOR = 5
    NOTIFY = 6
    PING = 7
    RDMA_CONNECT = 8  # queue-pair exchange (JSON both ways) for the RDMA transport
    READV = 9  # several ranges, one answer (version 2)


class Status:
    OK = 0
    BAD_REQUEST = -1
    OUT_OF_BOUNDS = -2
    AUTH_FAILED = -3
    NOT_AUTHENTICATED = -4
    INTERNAL = -5
    TOO_LARGE = -6


STATUS_TEXT = {
    Status.OK: "ok",
    Status.BAD_REQUEST: "bad request",
    Status.OUT_OF_BOUNDS: "address range outside registered memory",
    Status.AUTH_FAILED: "authentication failed (wrong or missing shared secret)",
    Status.NOT_AUTHENTICATED: "not authenticated",
    Status.INTERNAL: "internal error on the peer",
    Status.TOO_LARGE: "payload too large",
}


def auth_digest(secret: str, nonce: bytes) -> bytes:
    """HMAC-SHA256 of the server's nonce under the shared secret (32 zero bytes if none)."""
    if not secret:
        return bytes(32)
    return hmac.new(secret.encode(), nonce, hashlib.sha256).digest()
