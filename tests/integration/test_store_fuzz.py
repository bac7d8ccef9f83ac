"""Bad input: fuzzed RPC frames and invalid arguments get clear errors; the master stays up."""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from store_support import Agent, Master

from mooncake_core.errors import StoreError
from mooncake_core.store import InvalidArgument, StoreClient, UnknownClient
from mooncake_core.store.protocol import (
    METHOD_ARGS,
    BatchPutConfirmArgs,
    Code,
    PutConfirmArgs,
    ReplicaCfg,
    decode_params,
    decode_response,
    encode_request,
)
from mooncake_core.store.rpc import MasterRPC

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Master, Agent, Path]]:
    tmp = tmp_path_factory.mktemp("store-fuzz")
    m = Master(tmp)
    a = Agent(m.address, segment_size=16 << 20, log=tmp / "agent.log")
    try:
        yield m, a, tmp
    finally:
        a.stop()
        m.stop()


def _exchange(port: int, data: bytes) -> bytes:
    """Send raw bytes; return whatever comes back before the master closes or goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        s.settimeout(2)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def _frames(data: bytes) -> list[bytes]:
    out, pos = [], 0
    while pos + 4 <= len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        out.append(data[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return out


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=5), c, max_size=4),
    max_leaves=12,
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.binary(max_size=200))
def test_random_frames_close_only_that_connection(
    master: tuple[Master, Agent, Path], body: bytes
) -> None:
    m, _a, _ = master
    _exchange(m.rpc_port, struct.pack("<I", len(body)) + body)
    assert m.alive()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    method=st.sampled_from(sorted(METHOD_ARGS)) | st.text(max_size=12),
    params=_values,
    version=st.sampled_from([1, 1, 1, 2]),
)
def test_well_framed_requests_with_bad_params_get_error_answers(
    master: tuple[Master, Agent, Path], method: str, params: object, version: int
) -> None:
    m, _a, _ = master
    body = msgspec.msgpack.encode((version, 7, method, params))
    got = _frames(_exchange(m.rpc_port, struct.pack("<I", len(body)) + body))
    if (
        not got and method in ("put_confirm", "batch_put_confirm") and version == 1
    ):  # may go unanswered
        args = decode_params(method, msgspec.msgpack.encode(params))
        assert isinstance(args, (PutConfirmArgs, BatchPutConfirmArgs)) and args.reply is False
        assert m.alive()
        return
    assert len(got) == 1
    resp = decode_response(got[0])
    assert resp.id == 7
    if method in METHOD_ARGS and method not in ("ping", "stats"):
        assert resp.code != Code.INTERNAL, msgspec.msgpack.decode(resp.result)


def test_a_one_way_confirm_gets_no_answer_and_a_bad_one_changes_nothing(
    master: tuple[Master, Agent, Path],
) -> None:
    m, a, _ = master
    a.call("put", key="one-way", size=1000)
    body = msgspec.msgpack.encode((1, 9, "put_confirm", ["nobody", "one-way", 12345, True, False]))
    assert (
        _exchange(m.rpc_port, struct.pack("<I", len(body)) + body) == b""
    )  # no answer, the master logs it
    body = msgspec.msgpack.encode(
        (1, 10, "put_confirm", ["nobody", "one-way", 12345, False])
    )  # reply defaults on
    got = _frames(_exchange(m.rpc_port, struct.pack("<I", len(body)) + body))
    resp = decode_response(got[0])
    assert resp.id == 10 and resp.code == Code.INVALID and b"no early commit" in bytes(resp.result)
    assert a.call("get", key="one-way")[
        "match"
    ]  # a false confirm neither completes nor drops anything


def test_oversized_and_truncated_frames(master: tuple[Master, Agent, Path]) -> None:
    m, a, _ = master
    assert _exchange(m.rpc_port, struct.pack("<I", 0xFFFFFFFF) + b"x" * 100) == b""
    assert _exchange(m.rpc_port, struct.pack("<I", 1000) + b"short") == b""
    assert _exchange(m.rpc_port, b"\x01\x02") == b""
    # a garbage frame, then a good one on another connection: served
    good = encode_request(1, "ping", ())
    assert decode_response(_frames(_exchange(m.rpc_port, good))[0]).code == Code.OK
    a.call("put", key="after-fuzz", size=1000)
    assert a.call("get", key="after-fuzz")["match"]
    text = m.http("/metrics")[1]
    bad = re.search(r"^mooncake_master_bad_frames_total (\d+)", text, re.M)
    assert bad and int(bad.group(1)) > 0


def test_invalid_arguments_give_clear_errors(master: tuple[Master, Agent, Path]) -> None:
    m, a, _ = master
    with StoreClient(master=m.address, segment_size=4 << 20) as c:
        with pytest.raises(InvalidArgument, match="non-empty string"):
            c.put("", b"x")
        with pytest.raises(InvalidArgument, match="limit is 4096"):
            c.put("k" * 5000, b"x")
        with pytest.raises(InvalidArgument, match="limit is 4096"):
            c.get("k" * 5000)
        with pytest.raises(InvalidArgument, match="size must be positive"):
            c.put("empty", b"")
        with pytest.raises(InvalidArgument, match="larger than all mounted segments"):
            c.put_from("huge", bytearray(64 << 20))
        with pytest.raises(InvalidArgument, match="replica_num must be 1..16"):
            c.put("r0", b"x", replica_num=0)
        with pytest.raises(InvalidArgument, match="unknown placement"):
            c.put("p", b"x", strategy="nearest")
        with pytest.raises(InvalidArgument, match="preferred segment 'nope' is not mounted"):
            c.put("p", b"x", preferred_segment="nope")
        with pytest.raises(InvalidArgument, match="invalid regex"):
            c.remove_by_regex("([")
        with pytest.raises(InvalidArgument, match="buffer holds 10"):
            a.call("put", key="big", size=100, preferred_segment=a.segment)
            c.get_into("big", bytearray(10))
        with pytest.raises(StoreError, match="no object"):
            c.get("missing")
    rpc = MasterRPC(m.address)
    try:
        with pytest.raises(UnknownClient, match="unknown client id 'nope'"):
            rpc.call("put_start", ("nope", "k", 10, ReplicaCfg()))
        with pytest.raises(UnknownClient):
            rpc.call("mount", ("nope", "seg", "peer", 4096, 1 << 20, ""))
        with pytest.raises(InvalidArgument, match="bad parameters"):
            rpc.call("put_start", ("x", "k", "ten", ReplicaCfg()))
        with pytest.raises(InvalidArgument, match="unknown RPC method"):
            rpc.call("drop_tables", ())
        assert rpc.call("ping", ())["role"] == "leader"
    finally:
        rpc.close()
    assert a.call("get", key="big") == {"size": 100, "match": True}  # the other client carries on
    assert m.alive()
