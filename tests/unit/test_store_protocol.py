"""The RPC wire format: envelopes, typed params, error-code mapping."""

from __future__ import annotations

import msgspec
import pytest

from mooncake_core.errors import LeaseExpired, NoSpace, ObjectExists, ObjectNotFound, StoreError
from mooncake_core.store import protocol as P


def test_request_round_trip_and_typed_params() -> None:
    frame = P.encode_request(5, "put_start", ("c", "key", 10, P.ReplicaCfg(replica_num=2)))
    (n,) = P.HEADER.unpack(frame[:4])
    assert n == len(frame) - 4
    req = P.decode_request(frame[4:])
    assert (req.v, req.id, req.method) == (P.VERSION, 5, "put_start")
    args = P.decode_params(req.method, req.params)
    assert isinstance(args, P.PutStartArgs) and args.cfg.replica_num == 2 and args.size == 10


def test_bad_params_are_invalid_argument() -> None:
    raw = msgspec.Raw(msgspec.msgpack.encode(["c", "k", "ten", []]))
    with pytest.raises(P.InvalidArgument, match="put_start: bad parameters"):
        P.decode_params("put_start", raw)
    with pytest.raises(P.InvalidArgument, match="unknown RPC method 'nope'"):
        P.decode_params("nope", raw)
    with pytest.raises(msgspec.DecodeError):
        P.decode_request(b"\xc1garbage")


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (P.Code.NOT_FOUND, ObjectNotFound),
        (P.Code.EXISTS, ObjectExists),
        (P.Code.NO_SPACE, NoSpace),
        (P.Code.LEASE_EXPIRED, LeaseExpired),
        (P.Code.BUSY, P.ObjectBusy),
        (P.Code.NOT_LEADER, P.NotLeader),
        (P.Code.INTERNAL, StoreError),
    ],
)
def test_codes_map_to_error_classes(code: P.Code, cls: type[Exception]) -> None:
    with pytest.raises(cls, match="msg"):
        P.raise_for(code, "msg")
    assert P.code_of(cls("x")) == code
    P.raise_for(P.Code.OK, "")
