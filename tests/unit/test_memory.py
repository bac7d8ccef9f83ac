"""Registered memory: segment table bounds, overlaps, buffer kinds; topology discovery."""

from __future__ import annotations

import numpy as np
import pytest

from mooncake_core.errors import InvalidRequest, SegmentError, SegmentOverlap
from mooncake_core.transfer import TransferEngine
from mooncake_core.transfer.memory import ManagedBuffer, Region, SegmentTable, buffer_address
from mooncake_core.transfer.topology import choose_interfaces, discover_nics, resolve_interfaces


def test_segment_table_bounds_and_overlaps() -> None:
    t = SegmentTable()
    t.add(Region(0x10000, 0x1000, "a"))
    t.add(Region(0x20000, 0x1000, "b"))
    assert t.find(0x10000, 0x1000).name == "a"
    assert t.find(0x20FFF, 1).name == "b"
    with pytest.raises(InvalidRequest, match="runs past the end"):
        t.find(0x10FFF, 2)
    with pytest.raises(InvalidRequest, match="not inside any registered memory"):
        t.find(0x18000, 1)
    with pytest.raises(InvalidRequest, match="length must be positive"):
        t.find(0x10000, 0)
    with pytest.raises(SegmentOverlap, match="overlaps registered region 'a'"):
        t.add(Region(0x10800, 0x1000, "c"))
    with pytest.raises(SegmentError, match="overlaps registered region 'b'"):
        t.add(Region(0x1F800, 0x1000, "c"))
    with pytest.raises(SegmentError, match="already registered"):
        t.add(Region(0x30000, 0x10, "a"))
    with pytest.raises(SegmentError, match="length must be positive"):
        t.add(Region(0x40000, 0, "z"))
    t.remove(0x10000)
    with pytest.raises(InvalidRequest):
        t.find(0x10000, 1)
    with pytest.raises(SegmentError, match="no registered memory starts at"):
        t.remove(0x10000)


def test_buffer_kinds() -> None:
    arr = np.zeros(100, dtype=np.float32)
    addr, n, kind = buffer_address(arr)
    assert (addr, n, kind) == (arr.ctypes.data, 400, "host")
    ba = bytearray(10)
    assert buffer_address(ba)[1] == 10
    with pytest.raises(SegmentError, match="read-only"):
        buffer_address(b"abc")
    assert buffer_address(b"abc", writable=False)[1] == 3
    with pytest.raises(SegmentError, match="C-contiguous"):
        buffer_address(np.zeros((10, 10))[:, ::2])
    with pytest.raises(SegmentError, match="cannot use int"):
        buffer_address(5)
    torch = pytest.importorskip("torch")
    t = torch.zeros(8, dtype=torch.float16)
    assert buffer_address(t) == (t.data_ptr(), 16, "host")
    with pytest.raises(SegmentError, match="contiguous"):
        buffer_address(torch.zeros(4, 4).t())


def test_engine_registration_api() -> None:
    with TransferEngine() as eng:
        arr = np.zeros(4096, dtype=np.uint8)
        r = eng.register(arr, name="kv")
        assert eng.describe()["buffers"][0]["name"] == "kv"
        with pytest.raises(SegmentError):
            eng.register(arr)  # overlaps
        eng.unregister(arr)
        eng.register_memory(r.addr, 4096)
        eng.unregister(r.addr)
        buf = eng.allocate(1 << 16)
        assert isinstance(buf, ManagedBuffer) and len(buf) == 1 << 16
        assert "memfd" in eng.describe()["buffers"][0]
        eng.free(buf)
        with pytest.raises(SegmentError, match="no engine-allocated buffer"):
            eng.free(buf.addr)
        with pytest.raises(SegmentError, match="length must be positive"):
            eng.allocate(0)


def test_topology_discovery() -> None:
    nics = discover_nics()
    lo = [n for n in nics if n.name == "lo"]
    assert lo and lo[0].ipv4 == "127.0.0.1"
    assert all(n.name != "lo" for n in choose_interfaces(nics)) or len(nics) == 1
    assert resolve_interfaces("lo, 127.0.0.1") == ["127.0.0.1", "127.0.0.1"]
    from mooncake_core.errors import ConfigError

    with pytest.raises(ConfigError, match="transfer.interfaces: interface 'nope0'"):
        resolve_interfaces("nope0")


def test_shared_transfer_types_keep_their_old_import_paths() -> None:
    from mooncake_core.transfer import PeerInfo, engine, topology, types
    from mooncake_core.transfer.transports import base, shm

    assert base.WorkItem is types.WorkItem and (base.READ, base.WRITE) == (types.READ, types.WRITE)
    assert engine.PeerInfo is PeerInfo is types.PeerInfo
    assert shm.host_identity is topology.host_identity
    assert topology.host_identity() == topology.host_identity() != ""
    peer = PeerInfo("h:1", [("h", 1)], {"buffers": [{"addr": 4096, "length": 100, "name": "a"}]})
    assert peer.find_region(4100, 96) is not None and peer.find_region(4100, 97) is None
    assert peer.region_named("a") is not None and peer.region_named("b") is None
