"""``AdapterContract``: the checks every engine adapter inherits.

No ``Test`` prefix, so it only runs through a subclass that also mixes in the
adapter's fixtures (see :mod:`mooncake_conformance.fixtures`)::

    class TestSGLang(AdapterContract, SGLangFixtures):
        pass

Checks, by theme (all against a real master and memory node on loopback):

- layout: every layout the engine offers round-trips byte for byte, for every TP
  rank, through a second adapter instance too, and lands in the store objects the
  adapter documents (``expected_objects``);
- keys: deterministic, prefix-chained, stable across processes and restarts, and
  disjoint across models and ranks (checked on keys and on data);
- hits: full hit, partial hit, miss, and only the contiguous prefix counts;
- concurrency: several engine processes save and load overlapping prefixes;
- faults: the master or the memory node goes away mid-operation: misses or failures,
  never wrong data or exceptions, and recovery when it returns;
- bad input from the engine side: clear errors, and the adapter keeps working;
- PD migration between two engine processes, when the adapter has a migration backend
  (:class:`~mooncake_conformance.migration.MigrationContract`).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence

import pytest

from mooncake_conformance.fixtures import MakeHarness, SpawnWorker
from mooncake_conformance.harness import EngineHarness, HarnessSpec, KVLayout
from mooncake_conformance.migration import MigrationContract
from mooncake_conformance.scenarios import (
    ChurnStats,
    churn,
    expected_pages,
    fill_pages,
    make_tokens,
    verify_loaded,
)
from mooncake_conformance.store import StoreCluster

__all__ = ["AdapterContract", "CLEAR_ERRORS"]

PAGES = 4

try:
    from mooncake_core.errors import MooncakeError

    CLEAR_ERRORS: tuple[type[BaseException], ...] = (
        ValueError,
        IndexError,
        KeyError,
        MooncakeError,
    )
except ImportError:  # pragma: no cover - mooncake-core is a dependency
    CLEAR_ERRORS = (ValueError, IndexError, KeyError)


def _tokens(rng: random.Random, h: EngineHarness, pages: int = PAGES) -> list[int]:
    return make_tokens(rng, pages * h.page_size)


def _assert_clear_error(fn: Callable[[], object], what: str) -> None:
    try:
        fn()
    except CLEAR_ERRORS as exc:
        assert len(str(exc)) >= 15, (
            f"{what}: {type(exc).__name__}({str(exc)!r}) is too terse to act on"
        )
        return
    except Exception as exc:
        pytest.fail(
            f"{what}: raised {type(exc).__name__}: {exc}; expected ValueError, IndexError, "
            "KeyError or a MooncakeError naming the problem"
        )
    pytest.fail(f"{what}: was accepted silently; expected a clear error")


def _roundtrip(
    h: EngineHarness, tokens: Sequence[int], src: Sequence[int], dst: Sequence[int]
) -> None:
    """Save from ``src``, load into ``dst``, compare byte for byte."""
    n = len(src)
    want = expected_pages(h, tokens, n, h.num_slots - 1)
    fill_pages(h, tokens, src)
    assert h.save(tokens, src) == n, (
        f"{h.spec.layout.label} rank {h.spec.rank}: save reported a short prefix"
    )
    assert h.lookup(tokens) == n, (
        f"{h.spec.layout.label} rank {h.spec.rank}: saved pages are not all hits"
    )
    for s in dst:
        h.fill(s, 0x5EED)
    got = h.load(tokens, dst)
    assert got == n, f"{h.spec.layout.label} rank {h.spec.rank}: load reported {got} of {n} pages"
    bad = verify_loaded(h, dst, want, got)
    assert not bad, (
        f"{h.spec.layout.label} rank {h.spec.rank}: pages {bad} differ after the round trip"
    )


class AdapterContract(MigrationContract):
    """Checks every adapter must pass (mix in the adapter's ``AdapterFixtures`` subclass)."""

    # ================================================================== layout
    def test_layout_roundtrip_byte_for_byte(
        self, kv_layout: KVLayout, make_harness: MakeHarness, rng: random.Random
    ) -> None:
        """Every TP rank saves its pages and reads them back exactly, also via a new instance."""
        ranks = [make_harness(kv_layout, rank=r) for r in range(kv_layout.tp_size)]
        tokens = _tokens(rng, ranks[0])
        src, dst = list(range(PAGES)), list(range(PAGES, 2 * PAGES))
        for h in sorted(ranks, key=lambda x: not x.is_writer):  # the writer first, as engines do
            _roundtrip(h, tokens, src, dst)
        if kv_layout.tp_size > 1:
            reads = [h.read(src[0]) for h in ranks]
            if kv_layout.mla:
                assert all(r == reads[0] for r in reads), (
                    "MLA ranks must hold the same replicated page"
                )
            else:
                assert len(set(reads)) == len(reads), (
                    "harness bug: TP shards of one page must differ"
                )
        again = make_harness(kv_layout, rank=kv_layout.tp_size - 1)
        want = expected_pages(again, tokens, PAGES, again.num_slots - 1)
        assert again.lookup(tokens) == PAGES, (
            "a second adapter instance does not see the saved pages"
        )
        got = again.load(tokens, dst)
        assert got == PAGES and not verify_loaded(again, dst, want, got), (
            f"{kv_layout.label}: a second adapter instance read different bytes"
        )

    def test_layout_maps_onto_store_objects(
        self,
        kv_layout: KVLayout,
        make_harness: MakeHarness,
        store_cluster: StoreCluster,
        rng: random.Random,
    ) -> None:
        """The objects in the store hold exactly the bytes the adapter's layout says."""
        ranks = [make_harness(kv_layout, rank=r) for r in range(kv_layout.tp_size)]
        tokens = _tokens(rng, ranks[0])
        slots = list(range(PAGES))
        raw = store_cluster.client()
        key_sets = []
        for h in sorted(ranks, key=lambda x: not x.is_writer):
            fill_pages(h, tokens, slots)
            expected = h.expected_objects(tokens, slots)
            if expected is None:
                pytest.skip(
                    "the adapter's store object format is opaque (expected_objects returned None)"
                )
            assert h.save(tokens, slots) == PAGES
            keys = [k for page in h.page_keys(tokens) for k in page]
            key_sets.append(set(keys))
            assert set(expected) == set(keys), "expected_objects and page_keys disagree on the keys"
            for key, data in expected.items():
                stored = raw.get(key)
                assert len(stored) == len(data), (
                    f"{key}: store holds {len(stored)} bytes, layout says {len(data)}"
                )
                assert stored == data, (
                    f"{kv_layout.label} rank {h.spec.rank}: object {key} differs from the layout"
                )
        if kv_layout.tp_size > 1:
            if kv_layout.mla:
                assert all(s == key_sets[0] for s in key_sets), (
                    "MLA ranks must share one copy (same keys)"
                )
            else:
                assert not set.intersection(*key_sets), "TP ranks' shards must use different keys"

    # ================================================================== keys
    def test_keys_are_deterministic_and_prefix_chained(
        self, make_harness: MakeHarness, rng: random.Random
    ) -> None:
        a, b = make_harness(), make_harness()
        tokens = _tokens(rng, a)
        keys = a.page_keys(tokens)
        assert len(keys) == PAGES and all(keys), "one non-empty key list per full page"
        assert keys == b.page_keys(tokens), "two instances give different keys for the same tokens"
        assert a.page_keys(tokens + tokens[: a.page_size - 1]) == keys, (
            "a partial page must not get a key"
        )
        assert a.page_keys(tokens[: 2 * a.page_size]) == keys[:2], (
            "keys of a prefix must be a prefix of the keys"
        )
        changed = list(tokens)
        changed[0] ^= 1
        other = a.page_keys(changed)
        assert all(set(x).isdisjoint(y) for x, y in zip(other, keys, strict=True)), (
            "a page's key must depend on every token before it (hash chain)"
        )
        flat = [k for page in keys for k in page]
        assert len(set(flat)) == len(flat), "keys of different pages collide"

    def test_keys_differ_across_models_and_ranks(
        self, base_layout: KVLayout, make_harness: MakeHarness, rng: random.Random
    ) -> None:
        """Keys are disjoint across models (and MHA ranks); data saved under one never shows
        under another."""
        a = make_harness(model="conformance/model-a")
        b = make_harness(model="conformance/model-b")
        tokens = _tokens(rng, a)
        ka = {k for p in a.page_keys(tokens) for k in p}
        kb = {k for p in b.page_keys(tokens) for k in p}
        assert ka.isdisjoint(kb), "two models share store keys"
        src, dst = list(range(PAGES)), list(range(PAGES, 2 * PAGES))
        _roundtrip(a, tokens, src, dst)
        assert b.lookup(tokens) == 0, "model B hits on pages only model A saved"
        _roundtrip(b, tokens, src, dst)
        _roundtrip(a, tokens, src, dst)  # A still reads A's bytes, not B's
        layout = base_layout.replace(tp_size=2, mla=False)
        r0, r1 = make_harness(layout, rank=0), make_harness(layout, rank=1)
        k0 = {k for p in r0.page_keys(tokens) for k in p}
        k1 = {k for p in r1.page_keys(tokens) for k in p}
        assert k0.isdisjoint(k1), "two TP ranks share store keys"
        _roundtrip(r0, tokens, src, dst)
        assert r1.lookup(tokens) == 0, "rank 1 hits on pages only rank 0 saved"

    @pytest.mark.slow
    @pytest.mark.timeout(240)
    def test_keys_stable_across_processes_and_restarts(
        self,
        make_spec: Callable[..., HarnessSpec],
        make_harness: MakeHarness,
        spawn_worker: SpawnWorker,
        rng: random.Random,
    ) -> None:
        """A process saves and exits; a new process computes the same keys and reads the same
        bytes."""
        spec = make_spec()
        here = make_harness()
        tokens = _tokens(rng, here)
        first = spawn_worker(spec)
        keys = first.call("keys", tokens=tokens)
        assert keys == here.page_keys(tokens), "keys differ between processes"
        first.call("fill_pages", tokens=tokens, slots=list(range(PAGES)))
        assert first.call("save", tokens=tokens, slots=list(range(PAGES))) == PAGES
        first.close()  # the engine restarts: its adapter instance and memory are gone
        second = spawn_worker(spec)
        assert second.call("keys", tokens=tokens) == keys, "keys changed across a restart"
        assert second.call("lookup", tokens=tokens) == PAGES, (
            "a restarted engine does not find its pages"
        )
        dst = list(range(PAGES, 2 * PAGES))
        assert second.call("load", tokens=tokens, slots=dst) == PAGES
        assert second.call("read_digests", slots=dst) == second.call(
            "expected_digests", tokens=tokens, n=PAGES
        ), "a restarted engine read different bytes"

    # ================================================================== hits
    def test_hits_full_partial_and_miss(
        self, make_harness: MakeHarness, rng: random.Random
    ) -> None:
        h = make_harness()
        tokens = _tokens(rng, h, PAGES + 2)
        saved = tokens[: PAGES * h.page_size]
        src = list(range(PAGES))
        fill_pages(h, saved, src)
        assert h.lookup(saved) == 0, "miss before anything was saved"
        assert h.save(saved, src) == PAGES
        assert h.lookup(saved) == PAGES, "full hit"
        assert h.lookup(saved + [7] * (h.page_size // 2)) == PAGES, (
            "a trailing partial page changes nothing"
        )
        assert h.lookup(tokens) == PAGES, "partial hit: only the saved prefix counts"
        assert h.lookup(tokens[: 2 * h.page_size]) == 2, "hit on a shorter prefix"
        other = list(tokens)
        other[0] ^= 1
        assert h.lookup(other) == 0, "a different first page is a miss"
        want = expected_pages(h, tokens, PAGES, h.num_slots - 1)
        dst = list(range(PAGES, 2 * PAGES + 2))
        got = h.load(tokens, dst)
        assert got == PAGES, f"loading {PAGES + 2} pages of which {PAGES} exist reported {got}"
        assert not verify_loaded(h, dst, want, got)

    def test_hits_count_only_the_contiguous_prefix(
        self, make_harness: MakeHarness, store_cluster: StoreCluster, rng: random.Random
    ) -> None:
        h = make_harness()
        tokens = _tokens(rng, h)
        src = list(range(PAGES))
        fill_pages(h, tokens, src)
        assert h.save(tokens, src) == PAGES
        hole = 1
        raw = store_cluster.client()
        for key in h.page_keys(tokens)[hole]:
            raw.remove(key, force=True)
        assert h.lookup(tokens) == hole, "pages after a missing page must not count as hits"
        dst = list(range(PAGES, 2 * PAGES))
        want = expected_pages(h, tokens, PAGES, h.num_slots - 1)
        got = h.load(tokens, dst)
        assert got == hole, f"load past a missing page reported {got} pages"
        assert not verify_loaded(h, dst, want, got)
        fill_pages(h, tokens, src)
        assert h.save(tokens, src) == PAGES, "saving again fills the hole"
        assert h.lookup(tokens) == PAGES

    # ================================================================== concurrency
    @pytest.mark.slow
    @pytest.mark.timeout(300)
    def test_concurrent_overlapping_prefixes(
        self,
        make_spec: Callable[..., HarnessSpec],
        make_harness: MakeHarness,
        spawn_worker: SpawnWorker,
        rng: random.Random,
    ) -> None:
        """Three engine processes save and load prefixes that share their first pages."""
        here = make_harness()
        shared = _tokens(rng, here, 2)
        workers = [spawn_worker(make_spec()) for _ in range(3)]
        for i, w in enumerate(workers):
            w.send("churn", shared=shared, seed=1000 + i, pages=PAGES, rounds=4)
        results = [w.result(timeout=240) for w in workers]
        for i, r in enumerate(results):
            assert r["wrong"] == 0, f"worker {i} read wrong bytes: {r['errors']}"
            assert r["exceptions"] == 0, f"worker {i}: {r['errors']}"
        # Under contention a round may legitimately miss (another process's put of a shared
        # page is still in flight). Once the others are quiet, every process must load.
        for i, w in enumerate(workers):
            w.send("churn", shared=shared, seed=2000 + i, pages=PAGES, rounds=1)
            r = w.result(timeout=120)
            assert r["wrong"] == 0 and r["exceptions"] == 0, f"worker {i}: {r['errors']}"
            assert r["loaded_pages"] > 0, (
                f"worker {i} cannot load its own pages after the churn: {r}"
            )
        want = expected_pages(here, shared, 2, here.num_slots - 1)
        assert here.lookup(shared) == 2
        got = here.load(shared, [0, 1])
        assert got == 2 and not verify_loaded(here, [0, 1], want, got), (
            "the shared prefix reads back wrong"
        )

    # ================================================================== faults
    @pytest.mark.slow
    @pytest.mark.timeout(240)
    def test_master_outage_never_wrong_data_and_recovers(
        self,
        supports_store_faults: bool,
        fresh_store_cluster: StoreCluster,
        make_harness: MakeHarness,
        call_budget_s: float,
        rng: random.Random,
    ) -> None:
        if not supports_store_faults:
            pytest.skip(
                "the adapter does not claim to survive store faults (supports_store_faults)"
            )
        cluster = fresh_store_cluster
        h = make_harness(cluster=cluster)
        tokens = _tokens(rng, h)
        src, dst = list(range(PAGES)), list(range(PAGES, 2 * PAGES))
        _roundtrip(h, tokens, src, dst)
        # Mid-operation: a second rank churns while the master dies and comes back.
        busy = make_harness(cluster=cluster)
        stop = threading.Event()
        st = ChurnStats()
        t = threading.Thread(
            target=churn, args=(busy, [], 7, 3), kwargs={"stop": stop, "stats": st}, daemon=True
        )
        t.start()
        time.sleep(1.0)
        cluster.stop_master(kill=True)
        want = expected_pages(h, tokens, PAGES, h.num_slots - 1)
        calls: list[tuple[str, Callable[[], int]]] = [
            ("lookup", lambda: h.lookup(tokens)),
            ("load", lambda: h.load(tokens, dst)),
            ("save", lambda: h.save(tokens, src)),
        ]
        for what, call in calls:
            t0 = time.monotonic()
            n = call()
            took = time.monotonic() - t0
            assert took <= call_budget_s, f"{what} blocked {took:.1f}s while the master was down"
            assert isinstance(n, int) and 0 <= n <= PAGES
            if what == "load":
                assert not verify_loaded(h, dst, want, n), (
                    "wrong bytes loaded while the master was down"
                )
        cluster.start_master()
        restarted = time.monotonic()
        deadline = restarted + 60
        while time.monotonic() < deadline and st.last_ok < restarted:
            time.sleep(0.5)
        stop.set()
        t.join(60)
        assert st.wrong == 0, f"wrong bytes read around the outage: {st.errors}"
        assert st.exceptions == 0, (
            f"the adapter raised instead of reporting a miss: {st.errors[:3]}"
        )
        assert st.last_ok >= restarted, "no full save+load succeeded after the master came back"
        fresh = _tokens(rng, h)
        _roundtrip(h, fresh, src, dst)

    @pytest.mark.slow
    @pytest.mark.timeout(240)
    def test_holder_loss_reports_miss_and_recovers(
        self,
        supports_store_faults: bool,
        fresh_store_cluster: StoreCluster,
        make_harness: MakeHarness,
        rng: random.Random,
    ) -> None:
        if not supports_store_faults:
            pytest.skip(
                "the adapter does not claim to survive store faults (supports_store_faults)"
            )
        cluster = fresh_store_cluster
        h = make_harness(cluster=cluster)
        tokens = _tokens(rng, h)
        src, dst = list(range(PAGES)), list(range(PAGES, 2 * PAGES))
        _roundtrip(h, tokens, src, dst)
        want = expected_pages(h, tokens, PAGES, h.num_slots - 1)
        cluster.stop_node(kill=True)  # the memory holding every page is gone
        for s in dst:
            h.fill(s, 0x5EED)
        got = h.load(tokens, dst)
        assert not verify_loaded(h, dst, want, got), "wrong bytes loaded after the holder died"
        cluster.start_node()
        deadline = time.monotonic() + 60
        fresh = _tokens(rng, h)
        fill_pages(h, fresh, src)
        want = expected_pages(h, fresh, PAGES, h.num_slots - 1)
        while time.monotonic() < deadline:
            if h.save(fresh, src) == PAGES:
                break
            time.sleep(0.5)
        got = h.load(fresh, dst)
        assert got == PAGES and not verify_loaded(h, dst, want, got), (
            "no recovery after the holder returned"
        )

    # ================================================================== bad input
    def test_bad_input_wrong_sizes(self, make_harness: MakeHarness, rng: random.Random) -> None:
        h = make_harness()
        tokens = _tokens(rng, h)
        _assert_clear_error(
            lambda: h.save(tokens, list(range(PAGES - 1))), "save with fewer slots than pages"
        )
        _assert_clear_error(
            lambda: h.load(tokens, list(range(PAGES - 1))), "load with fewer slots than pages"
        )
        _roundtrip(h, tokens, list(range(PAGES)), list(range(PAGES, 2 * PAGES)))  # still works

    def test_bad_input_unknown_slots(self, make_harness: MakeHarness, rng: random.Random) -> None:
        h = make_harness()
        tokens = _tokens(rng, h, 2)
        past = h.num_slots + 3
        _assert_clear_error(
            lambda: h.save(tokens, [0, past]), f"save from slot {past} of {h.num_slots}"
        )
        _assert_clear_error(
            lambda: h.load(tokens, [0, past]), f"load into slot {past} of {h.num_slots}"
        )
        _assert_clear_error(lambda: h.save(tokens, [0, -1]), "save from slot -1")
        _roundtrip(h, tokens, [0, 1], [2, 3])

    def test_bad_input_engine_specific(self, make_harness: MakeHarness, rng: random.Random) -> None:
        h = make_harness()
        cases = h.bad_inputs()
        if not cases:
            pytest.skip("the harness lists no engine-specific bad inputs")
        for what, fn in cases.items():
            _assert_clear_error(fn, what)
        _roundtrip(h, _tokens(rng, h, 2), [0, 1], [2, 3])
