"""The master's RPC wire format: versioned msgpack frames over TCP.

Contract:

- A frame is a 4-byte little-endian length followed by that many bytes of msgpack.
  Frames larger than :data:`MAX_FRAME` are refused (the connection is closed).
- A request is ``[version, request_id, method, params]``; ``params`` is a msgpack
  array whose layout is the method's ``*Args`` struct below (array-like structs).
- A response is ``[request_id, code, result]``: ``code`` is :class:`Code`; on success
  ``result`` is the method's result, otherwise a one-line error message. The one
  exception: a well-formed ``put_confirm`` or ``batch_put_confirm`` with ``reply`` false
  gets no response.
- A frame that is not valid msgpack or not a request array closes that connection only;
  a well-formed request with invalid parameters gets a ``Code.INVALID`` answer.

:func:`raise_for` maps a non-OK code to the matching :mod:`mooncake_core.errors` class.
"""

from __future__ import annotations

import enum
import struct
from typing import Any, NamedTuple

import msgspec

from mooncake_core.errors import (
    LeaseExpired,
    MasterUnavailable,
    NoSpace,
    ObjectExists,
    ObjectNotFound,
    StoreError,
)

__all__ = [
    "VERSION",
    "MAX_FRAME",
    "MAX_KEY",
    "MAX_BATCH",
    "HEADER",
    "Code",
    "Request",
    "Response",
    "Slice",
    "SliceW",
    "Extent",
    "ReplicaCfg",
    "METHOD_ARGS",
    "encode_request",
    "encode_response",
    "decode_request",
    "decode_response",
    "raise_for",
    "error_for",
    "ObjectBusy",
    "UnknownClient",
    "NotLeader",
    "InvalidArgument",
    "RetryLater",
    "ReservationGone",
    "EarlyCommitsOff",
]

VERSION = 1
MAX_FRAME = 64 << 20
MAX_KEY = 4096
MAX_BATCH = 65536
HEADER = struct.Struct("<I")


class Code(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    EXISTS = 2
    NO_SPACE = 3
    INVALID = 4
    BUSY = 5  # leased / pinned / being written
    UNKNOWN_CLIENT = 6
    NOT_LEADER = 7
    LEASE_EXPIRED = 8
    RETRY = 9  # e.g. a promotion from SSD is in progress
    UNSUPPORTED = 10
    INTERNAL = 11
    RESERVATION_GONE = 12  # a commit's reservation is unknown, expired or lacks the range
    EARLY_COMMITS_OFF = 13  # an early commit sent to a master that takes none (HA)


class ObjectBusy(StoreError):
    """The object is leased, pinned or still being written; retry later or force."""


class UnknownClient(StoreError):
    """The master does not know this client id (it expired or the leader changed)."""


class NotLeader(MasterUnavailable):
    """The contacted master is a standby; the message names the leader if known."""


class InvalidArgument(StoreError, ValueError):
    """An RPC argument is invalid (empty key, bad size, unknown segment, ...)."""


class RetryLater(StoreError):
    """The master is preparing the object (e.g. promoting it from SSD); retry shortly."""


class ReservationGone(InvalidArgument):
    """A commit named a reservation that is unknown, expired or reclaimed, or a range that is
    not a free part of it: the client puts that object in two phases instead."""


class EarlyCommitsOff(InvalidArgument):
    """The master takes no early commits (an HA master): commit after the write instead."""


_ERRORS: dict[int, type[StoreError]] = {
    Code.NOT_FOUND: ObjectNotFound,
    Code.EXISTS: ObjectExists,
    Code.NO_SPACE: NoSpace,
    Code.INVALID: InvalidArgument,
    Code.BUSY: ObjectBusy,
    Code.UNKNOWN_CLIENT: UnknownClient,
    Code.NOT_LEADER: NotLeader,
    Code.LEASE_EXPIRED: LeaseExpired,
    Code.RETRY: RetryLater,
    Code.UNSUPPORTED: InvalidArgument,
    Code.INTERNAL: StoreError,
    Code.RESERVATION_GONE: ReservationGone,
    Code.EARLY_COMMITS_OFF: EarlyCommitsOff,
}


def code_of(exc: BaseException) -> Code:
    """The wire code for a store exception (INTERNAL for anything else)."""
    for code, cls in _ERRORS.items():
        if type(exc) is cls:
            return Code(code)
    for code, cls in _ERRORS.items():
        if isinstance(exc, cls):
            return Code(code)
    return Code.INTERNAL


def raise_for(code: int, message: str) -> None:
    """Raise the error class for ``code`` (no-op for OK)."""
    if code == Code.OK:
        return
    cls = _ERRORS.get(code, StoreError)
    raise cls(message)


def error_for(code: int, message: str) -> StoreError:
    """The error ``raise_for`` would raise for a non-OK ``code`` (for per-key batch results)."""
    return _ERRORS.get(code, StoreError)(message)


# ---------------------------------------------------------------------- envelopes
class Request(msgspec.Struct, array_like=True, frozen=True):
    v: int
    id: int
    method: str
    params: msgspec.Raw


class Response(msgspec.Struct, array_like=True, frozen=True):
    id: int
    code: int
    result: msgspec.Raw


class Slice(msgspec.Struct, array_like=True, frozen=True):
    """One contiguous piece of a replica: ``length`` bytes at ``addr`` on ``peer``.

    ``segment`` is the master's segment name; ``peer`` is the holder's transfer-engine
    name; ``host`` is the holder's host identity (same host -> shared memory path).
    """

    segment: str
    peer: str
    addr: int
    length: int
    host: str = ""


class SliceW(NamedTuple):
    """A :class:`Slice` as the client keeps it: a plain tuple with names (cheap to build from
    the decoded wire list with ``SliceW._make``, compared equal to the same tuple)."""

    segment: str
    peer: str
    addr: int  # absolute address on ``peer``
    length: int
    host: str


class Extent(NamedTuple):
    """A lent extent as ``reserve`` describes it (the master sends it as a list)."""

    segment: str
    peer: str
    base: int  # the segment's base address on ``peer``
    offset: int  # of the extent inside the segment
    length: int
    host: str


class ReplicaCfg(msgspec.Struct, array_like=True, frozen=True):
    """Per-put placement options (``ReplicateConfig`` of the published API)."""

    replica_num: int = 1
    preferred_segment: str = ""
    hard_pin: bool = False
    soft_pin_ttl_s: float = 0.0
    strategy: str = ""  # "" = master default: random | free-ratio-first | local-first


# ---------------------------------------------------------------------- method params
class _A(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    pass


class RegisterClientArgs(_A):
    client_id: str
    host: str
    peer: str
    ssd: bool = False


class MountArgs(_A):
    client_id: str
    segment: str
    peer: str
    base: int
    size: int
    host: str = ""


class UnmountArgs(_A):
    client_id: str
    segment: str


class PollArgs(_A):
    client_id: str
    timeout_s: float


class TaskDoneArgs(_A):
    client_id: str
    kind: str  # "offload" | "promote"
    key: str
    token: int
    ok: bool
    detail: str = ""


class PutStartArgs(_A):
    client_id: str
    key: str
    size: int
    cfg: ReplicaCfg
    # segments this client could not write (a put placed again after a failed write): the
    # master places elsewhere and marks their holders suspect (state.MasterState.put_start)
    exclude: list[str] = []


class BatchPutStartArgs(_A):
    client_id: str
    keys: list[str]
    sizes: list[int]
    cfg: ReplicaCfg
    exclude: list[str] = []  # as in PutStartArgs


class PutEndArgs(_A):
    client_id: str
    key: str
    token: int


class ReserveArgs(_A):
    client_id: str
    size: int  # typical object size; 0 = only release
    cfg: ReplicaCfg
    release: list[int] = []
    # objects of about ``size`` the client is about to put (a batch): room for them if possible
    count: int = 0


class PutCommitArgs(_A):
    client_id: str
    key: str
    rid: int
    offset: int  # inside the reservation's segment
    size: int
    cfg: ReplicaCfg
    early: bool = False  # sent while the write is in flight: readers wait for put_confirm


class BatchPutCommitArgs(_A):
    client_id: str
    keys: list[str]
    rids: list[int]
    offsets: list[int]
    sizes: list[int]
    cfg: ReplicaCfg
    early: bool = False


class BatchPutConfirmArgs(_A):
    client_id: str
    keys: list[str]
    tokens: list[int]
    ok: list[bool]
    reply: bool = True


class PutConfirmArgs(_A):
    client_id: str
    key: str
    token: int
    ok: bool  # False: the write failed, drop the early commit
    reply: bool = True  # False: a one-way request (no answer is sent, errors are only logged)


class BatchPutEndArgs(_A):
    client_id: str
    keys: list[str]
    tokens: list[int]
    ok: list[bool]


class KeyArgs(_A):
    key: str


class KeysArgs(_A):
    keys: list[str]


class RemoveArgs(_A):
    key: str
    force: bool = False


class BatchRemoveArgs(_A):
    keys: list[str]
    force: bool = False


class RegexArgs(_A):
    pattern: str
    force: bool = False
    tenant: str = ""  # match only this tenant's keys (mooncake_core.store.tenants)


class RemoveAllArgs(_A):
    force: bool = False
    tenant: str = ""


class NoArgs(_A):
    pass


class ReplicaTaskArgs(_A):
    client_id: str
    kind: str  # "copy" | "move" (store/replica_tasks.py)
    key: str
    targets: list[str]
    source: str = ""


class TaskIdArgs(_A):
    task_id: str


class DropReplicasArgs(_A):
    client_id: str
    key: str
    segment: str


class DropDiskArgs(_A):
    client_id: str


METHOD_ARGS: dict[str, type[msgspec.Struct]] = {
    "register_client": RegisterClientArgs,
    "mount": MountArgs,
    "unmount": UnmountArgs,
    "poll": PollArgs,
    "task_done": TaskDoneArgs,
    "put_start": PutStartArgs,
    "batch_put_start": BatchPutStartArgs,
    "put_end": PutEndArgs,
    "put_revoke": PutEndArgs,
    "batch_put_end": BatchPutEndArgs,
    "reserve": ReserveArgs,
    "put_commit": PutCommitArgs,
    "put_confirm": PutConfirmArgs,
    "batch_put_commit": BatchPutCommitArgs,
    "batch_put_confirm": BatchPutConfirmArgs,
    "get_replica_list": KeyArgs,
    "batch_get_replica_list": KeysArgs,
    "exists": KeyArgs,
    "batch_exists": KeysArgs,
    "get_size": KeyArgs,
    "remove": RemoveArgs,
    "batch_remove": BatchRemoveArgs,
    "remove_by_regex": RegexArgs,
    "keys_by_regex": RegexArgs,
    "remove_all": RemoveAllArgs,
    "ping": NoArgs,
    "stats": NoArgs,
    "query_key": KeyArgs,
    "create_replica_task": ReplicaTaskArgs,
    "query_replica_task": TaskIdArgs,
    "drop_replicas": DropReplicasArgs,
    "drop_disk": DropDiskArgs,
}

_enc = msgspec.msgpack.Encoder()
_req_dec = msgspec.msgpack.Decoder(Request)
_resp_dec = msgspec.msgpack.Decoder(Response)
_arg_decs = {m: msgspec.msgpack.Decoder(t) for m, t in METHOD_ARGS.items()}


def encode_request(req_id: int, method: str, params: msgspec.Struct | tuple[Any, ...]) -> bytes:
    """A complete frame (length prefix included) for one request."""
    body = _enc.encode((VERSION, req_id, method, params))
    return HEADER.pack(len(body)) + body


def encode_response(req_id: int, code: int, result: Any) -> bytes:
    body = _enc.encode((req_id, code, result))
    return HEADER.pack(len(body)) + body


def decode_request(frame: bytes | bytearray | memoryview) -> Request:
    """Decode a request envelope; raises ``msgspec.DecodeError`` on a malformed frame."""
    return _req_dec.decode(frame)


def decode_params(method: str, raw: msgspec.Raw) -> msgspec.Struct:
    """Decode ``raw`` as the params of ``method``; raises InvalidArgument."""
    dec = _arg_decs.get(method)
    if dec is None:
        raise InvalidArgument(f"unknown RPC method {method!r}")
    try:
        out: msgspec.Struct = dec.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidArgument(f"{method}: bad parameters: {exc}") from None
    return out


def decode_response(frame: bytes | bytearray | memoryview) -> Response:
    return _resp_dec.decode(frame)


def decode_result(raw: msgspec.Raw, typ: Any = Any) -> Any:
    return msgspec.msgpack.decode(raw, type=typ)
