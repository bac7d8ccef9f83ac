"""Start-up warm-up of the store connector: the first hit must find everything set up.

A real master (in a thread) and the connector's real scheduler and worker halves; no
engine (the engine tests in ``test_vllm_store.py`` cover hits end to end). Speed is the
benchmark's business (``ttft_store_first_hit_ms`` in ``bench vllm``); these tests assert
that the connections, registrations and threads exist before the first request, which
was not so before (the scheduler connected at its first lookup, the worker started its
load threads at its first load).
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_helpers import HAVE_VLLM, connector_extra, vllm_config_stub

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed")


def test_scheduler_registers_with_the_master_before_any_request(master: Any) -> None:
    from mooncake_vllm.store_connector import _StoreScheduler

    sched = _StoreScheduler(vllm_config_stub("/m/warm"), connector_extra(master), "warm")
    try:
        assert sched.client is not None and sched.warm_up_s is not None
        assert sched.client.client_id in master.state.clients
    finally:
        sched.close()
    # warm_up=false keeps the old behaviour: nothing until the first lookup
    lazy = _StoreScheduler(
        vllm_config_stub("/m/warm"), connector_extra(master, warm_up=False), "lazy"
    )
    try:
        assert lazy.client is None
        assert lazy._lookup(["p0"]) == 0
        assert lazy.client is not None
    finally:
        lazy.close()


def test_worker_is_warm_after_registering_its_kv_cache(master: Any) -> None:
    import torch
    from mooncake_vllm.store_worker import _LOAD_THREADS, _StoreWorker

    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, 2, 32, 64) for i in range(2)}
    worker = _StoreWorker(
        vllm_config_stub("/m/warm"), connector_extra(master, segment_size="4MiB"), "warm", 0
    )
    try:
        worker.register_kv_caches(kv)
        assert worker.warm_up_s is not None
        client = worker.client
        assert client is not None and client.client_id in master.state.clients
        loaders = [t for t in threading.enumerate() if t.name.startswith("mc-vllm-load")]
        assert len(loaders) >= _LOAD_THREADS
        # the save thread runs at a lower priority than the forward (off the critical path)
        saver = next(t for t in threading.enumerate() if t.name.startswith("mc-vllm-save"))
        assert saver.native_id is not None
        base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert os.getpriority(os.PRIO_PROCESS, saver.native_id) == max(10, base)
        assert all(os.getpriority(os.PRIO_PROCESS, t.native_id or 0) == base for t in loaders)
        # the probe page is gone and never touched the KV cache
        assert client.batch_exists([f"mcv-warm-up/{client.client_id}"]) == [False]
        assert all(not t.any() for t in kv.values())
        # the warmed path serves a real page: put from layer 0 block 1, load into block 2
        kv["model.layers.0.self_attn.attn"][1].fill_(3.5)
        bb = worker.block_bytes
        base = kv["model.layers.0.self_attn.attn"].data_ptr()
        assert client.batch_put_from(["page"], [base + bb], [bb]) == [None]
        res = worker._save_pool_free_load(["page"], [base + 2 * bb]).result()
        assert res == [bb]
        assert torch.equal(
            kv["model.layers.0.self_attn.attn"][2], kv["model.layers.0.self_attn.attn"][1]
        )
    finally:
        worker.close()


def test_warm_up_without_a_master_is_not_fatal() -> None:
    from mooncake_vllm.store_connector import _StoreScheduler
    from mooncake_vllm.testing import free_port

    extra = {
        "mooncake": {"master_server_address": f"127.0.0.1:{free_port()}"},
        "lookup_timeout_s": 0.3,
    }
    sched = _StoreScheduler(vllm_config_stub("/m/warm"), extra, "nomaster")
    try:
        assert sched.client is None and sched.warm_up_s is None
        assert sched._lookup(["p0"]) == 0  # a miss, as before
    finally:
        sched.close()


def test_first_read_from_a_peer_does_not_populate_its_whole_segment() -> None:
    """A hit's first read from a holder maps the holder's whole segment. Mapping it with
    MAP_POPULATE made that read wait until every page of the segment (mostly never written)
    was allocated and mapped: 0.7-2 s of the first hit for a 735 MiB segment. Now only the
    pages read are faulted in, and the holder's unwritten memory stays unallocated."""
    import ctypes

    from mooncake_core.config import load_config
    from mooncake_core.transfer.memory import ManagedBuffer
    from mooncake_core.transfer.transports.shm import ShmTransport

    size = 64 << 20
    holder = ManagedBuffer(size)  # a holder's segment: a memfd, mostly unwritten
    holder.view[5 << 20 : (5 << 20) + 4] = b"page"
    t = ShmTransport(SimpleNamespace(config=load_config(), host_id="h", name="me"))
    peer: Any = SimpleNamespace(pid=os.getpid(), name="holder")
    region = {"memfd": holder.fd, "addr": holder.addr, "memfd_offset": 0, "length": size}
    try:
        base = t._map(peer, region)
        assert ctypes.string_at(base + (5 << 20), 4) == b"page"  # the bytes the holder wrote
        assert os.fstat(holder.fd).st_blocks * 512 < size // 8  # its other pages: not allocated
        assert t._map(peer, region) == base  # mapped once
    finally:
        t.close()
        holder.close()


@pytest.mark.parametrize("batches", [0, 1])
def test_loads_in_groups_of_layers_land_in_the_right_blocks(master: Any, batches: int) -> None:
    """``load_batches``: 0 reads each layer in its own batch, 1 all layers in one; either way
    every layer's pages land in their blocks and the counters are written once per load."""
    import torch
    from mooncake_vllm.store_connector import PageJob, StoreMetadata, _StoreWorker

    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    kv = {n: torch.zeros(6, 2, 32, 16) for n in names}
    worker = _StoreWorker(
        vllm_config_stub("/m/warm"),
        connector_extra(master, segment_size="4MiB", load_batches=batches),
        "g",
        0,
    )
    try:
        worker.register_kv_caches(kv)
        bb = worker.block_bytes
        pages = [f"pg{batches}a", f"pg{batches}b"]
        for li, n in enumerate(names):  # source: blocks 0 and 1 hold layer- and page-unique values
            kv[n][0].fill_(li * 10 + 1)
            kv[n][1].fill_(li * 10 + 2)
            base = kv[n].data_ptr()
            keys = worker._keys(pages, li)
            assert worker.client.batch_put_from(keys, [base, base + bb], [bb, bb]) == [None] * 2
        before = worker.counters.snapshot().get("load_pages", 0)
        worker.start_load(StoreMetadata(loads=[PageJob("r", pages, [4, 3])]))
        assert len({id(j[0]) for js in worker._loading.values() for j in js}) == (
            1 if batches == 1 else len(names)
        )
        for n in names:
            worker.wait_for_layer_load(n)
        assert not worker._loading and not worker.load_errors()
        for n in names:
            assert torch.equal(kv[n][4], kv[n][0]) and torch.equal(kv[n][3], kv[n][1]), n
        assert worker.counters.snapshot()["load_pages"] == before + 2
    finally:
        worker.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_loads_on_spare_cpus_read_one_batch_per_spare_cpu_in_layer_order(master: Any) -> None:
    """With the forward bound to one core and one spare CPU for the I/O threads, a hit's
    layers are read one batch at a time in layer order (four at once on one CPU made the
    first layer, which the forward needs first, arrive with the fourth: bench vllm traces,
    docs/vllm.md); an unbound engine still reads four at once."""
    import torch
    from mooncake_vllm.store_connector import PageJob, StoreMetadata, _StoreWorker

    cpus = os.sched_getaffinity(0)
    engine_core = {min(cpus)}
    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    kv = {n: torch.zeros(6, 2, 32, 16) for n in names}
    seen: dict[str, Any] = {"order": [], "now": 0, "most": 0}
    lock = threading.Lock()

    def run() -> None:  # as vLLM's forward thread, bound to its core
        os.sched_setaffinity(0, engine_core)
        w = _StoreWorker(
            vllm_config_stub("/m/warm"),
            connector_extra(master, segment_size="4MiB", io_cpus="spare"),
            "o",
            0,
        )
        seen["w"] = w
        w.register_kv_caches(kv)
        bb = w.block_bytes
        for li, n in enumerate(names):
            kv[n][0].fill_(li + 1)
            keys = w._keys(["po"], li)
            assert w.client.batch_put_from(keys, [kv[n].data_ptr()], [bb]) == [None]
        read = w.client.batch_get_into

        def traced(keys: list[str], *a: Any) -> Any:
            with lock:
                seen["order"].append(keys[0].rsplit("/L", 1)[1])
                seen["now"] += 1
                seen["most"] = max(seen["most"], seen["now"])
            try:
                return read(keys, *a)
            finally:
                with lock:
                    seen["now"] -= 1

        w.client.batch_get_into = traced
        seen["streams"] = w._load_streams()
        w.start_load(StoreMetadata(loads=[PageJob("r", ["po"], [5])]))
        for n in names:
            w.wait_for_layer_load(n)
        seen["errors"] = w.load_errors()

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    w = seen["w"]
    try:
        spare = len(cpus - engine_core)
        assert seen["streams"] == min(4, spare) and not seen["errors"]
        if spare == 1:
            assert seen["most"] == 1 and seen["order"] == [str(i) for i in range(len(names))]
        for n in names:
            assert torch.equal(kv[n][5], kv[n][0]), n
        w._follow_binding()  # an engine bound to every CPU: the I/O threads share them
        assert w.io_cpus is None and w._load_streams() == 4
        w.io_cpus = w._engine_cpus = set(cpus)  # io_cpus "any" with the engine on every CPU
        assert w._load_streams() == 4
    finally:
        w.close()


def test_bad_load_options_are_one_clear_error() -> None:
    from mooncake_vllm.store_connector import _StoreWorker

    with pytest.raises(ValueError, match="load_batches must be >= 0"):
        _StoreWorker(vllm_config_stub("/m/warm"), {"load_batches": -1}, "bad", 0)
    with pytest.raises(ValueError, match="io_cpus must be 'spare', 'any' or 'engine'"):
        _StoreWorker(vllm_config_stub("/m/warm"), {"io_cpus": "sometimes"}, "bad", 0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_io_threads_may_leave_the_engine_cores(master: Any) -> None:
    """vLLM binds its main thread to its compute cores, and threads it starts inherit that.
    ``io_cpus: spare`` (the default) moves the connector's load threads and the store
    client's threads to the other CPUs, ``any`` lets them run anywhere, ``engine`` keeps them
    on the engine's cores."""
    import torch
    from mooncake_vllm.store_connector import _StoreWorker

    cpus = os.sched_getaffinity(0)
    engine_core = {min(cpus)}
    want = {"engine": engine_core, "any": cpus, "spare": cpus - engine_core}

    def start(how: str | None, out: list[Any]) -> None:  # as vLLM's bound main thread would
        os.sched_setaffinity(0, engine_core)
        kv = {"model.layers.0.self_attn.attn": torch.zeros(4, 2, 32, 16)}
        opts = {} if how is None else {"io_cpus": how}
        w = _StoreWorker(
            vllm_config_stub("/m/warm"),
            connector_extra(master, segment_size="4MiB", **opts),
            str(how),
            0,
        )
        out.append(w)
        w.register_kv_caches(kv)

    for how in ("engine", "any", "spare", None):
        made: list[Any] = []
        t = threading.Thread(target=start, args=(how, made))
        t.start()
        t.join(60)
        w = made[0]
        try:
            assert w.client is not None and w.warm_up_s is not None
            threads = [*w._load_pool._threads, *w._save_pool._threads, w.client._poller]
            assert len(threads) > 2
            for th in threads:
                got = os.sched_getaffinity(th.native_id)
                assert got == want[how or "spare"], (how, th.name, got)
        finally:
            w.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_io_threads_follow_a_binding_made_after_start(master: Any) -> None:
    """An operator's ``taskset -a`` after start-up moves every thread onto the engine's core,
    the connector's too; the next load moves the I/O threads back off it (``spare``)."""
    import torch
    from mooncake_vllm.store_connector import _StoreWorker

    cpus = os.sched_getaffinity(0)
    engine_core = {min(cpus)}
    seen: dict[str, Any] = {}

    def run() -> None:  # unbound at start-up, as vLLM's in-process engine is
        os.sched_setaffinity(0, cpus)
        kv = {"model.layers.0.self_attn.attn": torch.zeros(4, 2, 32, 16)}
        w = _StoreWorker(
            vllm_config_stub("/m/warm"), connector_extra(master, segment_size="4MiB"), "late", 0
        )
        seen["w"] = w
        w.register_kv_caches(kv)
        threads = [*w._load_pool._threads, *w._save_pool._threads, w.client._poller]
        seen["before"] = [os.sched_getaffinity(t.native_id) for t in threads]
        for t in [threading.current_thread(), *threads]:  # taskset -a -p <core> <pid>
            os.sched_setaffinity(t.native_id, engine_core)
        w._follow_binding()
        seen["after"] = [os.sched_getaffinity(t.native_id) for t in threads]

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    try:
        assert seen["before"] and all(c == cpus for c in seen["before"])
        assert all(c == cpus - engine_core for c in seen["after"]), seen["after"]
    finally:
        seen["w"].close()
