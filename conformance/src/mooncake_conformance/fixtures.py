"""Fixtures of the adapter suite (the fsspec ``AbstractFixtures`` pattern).

An adapter's test module defines one class per engine::

    class SGLangFixtures(AdapterFixtures):
        @pytest.fixture
        def adapter_name(self): return "sglang"
        ...

    class TestSGLang(AdapterContract, SGLangFixtures):
        pass

:func:`adapter_fixtures` builds such a class from plain values (the usual way).

*Must* override: ``adapter_name``, ``harness_factory``, ``kv_layout`` (give it
``params=`` with every layout the engine offers) and ``base_layout`` (the layout the
behavioural checks use). *May* override: ``adapter_package``, ``harness_options``,
``worker_env``, ``call_budget_s``, the capability flags ``supports_multiprocess`` and
``supports_store_faults`` (a False flag skips the checks that need it, with a reason),
and ``migration_pair`` (a :class:`~mooncake_conformance.migration.MigrationPair` for the
PD migration checks; by default they skip with ``no_migration_reason``).
Everything else is provided: a real store (master and memory node processes on loopback),
``make_harness`` for in-process engine ranks and ``spawn_worker`` for engine processes.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from mooncake_conformance.harness import EngineHarness, HarnessSpec, KVLayout, build_harness
from mooncake_conformance.store import StoreCluster
from mooncake_conformance.worker import Worker

__all__ = ["AdapterFixtures", "MakeHarness", "SpawnWorker", "adapter_fixtures"]

NO_MIGRATION = (
    "the adapter offers no migration pair (a PD backend moving KV blocks between two engine "
    "processes); override the migration_pair fixture to run the migration checks"
)

MakeHarness = Callable[..., EngineHarness]
SpawnWorker = Callable[[HarnessSpec], Worker]


class AdapterFixtures:
    """Fixtures an adapter overrides to describe itself, plus the ones the suite provides."""

    # ------------------------------------------------------------------ must override
    @pytest.fixture
    def adapter_name(self) -> str:
        """Entry-point name of the adapter (``"sglang"``); names its conformance status."""
        raise NotImplementedError("override the adapter_name fixture")

    @pytest.fixture
    def harness_factory(self) -> str:
        """``"module:function"`` building an :class:`EngineHarness` from a :class:`HarnessSpec`."""
        raise NotImplementedError("override the harness_factory fixture")

    @pytest.fixture
    def kv_layout(self) -> KVLayout:
        """Every layout the engine offers: override with ``@pytest.fixture(params=[...])``."""
        raise NotImplementedError("override the kv_layout fixture with params=[...layouts]")

    @pytest.fixture
    def base_layout(self) -> KVLayout:
        """The layout the behavioural checks (keys, hits, faults, concurrency) use."""
        raise NotImplementedError("override the base_layout fixture")

    # ------------------------------------------------------------------ may override
    @pytest.fixture
    def adapter_package(self) -> str:
        """Distribution or import name of the adapter, recorded in the status file."""
        return ""

    @pytest.fixture
    def harness_options(self) -> dict[str, Any]:
        """Adapter-specific options put into every :class:`HarnessSpec`."""
        return {}

    @pytest.fixture
    def worker_env(self) -> dict[str, str]:
        """Extra environment for engine worker processes."""
        return {}

    @pytest.fixture
    def call_budget_s(self) -> float:
        """Longest one adapter call may block while the store is down."""
        return 20.0

    # ------------------------------------------------------------------ capabilities
    @pytest.fixture
    def supports_multiprocess(self) -> bool:
        """Whether the harness can be built in a worker process."""
        return True

    @pytest.fixture
    def supports_store_faults(self) -> bool:
        """Whether the adapter is expected to survive the store going away."""
        return True

    @pytest.fixture
    def no_migration_reason(self) -> str:
        """Why the adapter offers no ``migration_pair`` (the migration checks skip with it)."""
        return NO_MIGRATION

    @pytest.fixture
    def migration_pair(self, no_migration_reason: str) -> Any:
        """Two linked engine ranks for the PD migration checks
        (:class:`~mooncake_conformance.migration.MigrationPair`); override to run them."""
        pytest.skip(no_migration_reason)

    # ------------------------------------------------------------------ provided
    @pytest.fixture(autouse=True)
    def _conformance_record(
        self, request: pytest.FixtureRequest, adapter_name: str, adapter_package: str
    ) -> None:
        request.node.user_properties.append(("mooncake_adapter", adapter_name))
        request.node.user_properties.append(("mooncake_adapter_package", adapter_package))

    @pytest.fixture(scope="class")
    @classmethod
    def store_cluster(cls) -> Iterator[StoreCluster]:
        """A real master and memory node, shared by the checks of one class."""
        with StoreCluster() as cluster:
            yield cluster

    @pytest.fixture
    def fresh_store_cluster(self) -> Iterator[StoreCluster]:
        """A store of its own, for checks that kill and restart parts of it."""
        with StoreCluster() as cluster:
            yield cluster

    @pytest.fixture
    def rng(self, request: pytest.FixtureRequest) -> random.Random:
        """Random numbers seeded by the test id: reproducible, distinct per check."""
        return random.Random(
            int.from_bytes(hashlib.sha256(request.node.nodeid.encode()).digest()[:8], "little")
        )

    @pytest.fixture
    def make_spec(
        self,
        harness_factory: str,
        harness_options: dict[str, Any],
        base_layout: KVLayout,
        store_cluster: StoreCluster,
    ) -> Callable[..., HarnessSpec]:
        """``make_spec(layout=None, cluster=None, model=..., rank=0, **options)``."""

        def make(
            layout: KVLayout | None = None,
            cluster: StoreCluster | None = None,
            model: str = "conformance/model-a",
            rank: int = 0,
            **options: Any,
        ) -> HarnessSpec:
            c = cluster if cluster is not None else store_cluster
            return HarnessSpec(
                factory=harness_factory,
                layout=layout or base_layout,
                master=c.master_address,
                model=model,
                rank=rank,
                options={**harness_options, **options},
            )

        return make

    @pytest.fixture
    def make_harness(self, make_spec: Callable[..., HarnessSpec]) -> Iterator[MakeHarness]:
        """Build in-process engine ranks (same arguments as ``make_spec``); closed after the
        check."""
        built: list[EngineHarness] = []

        def make(*args: Any, **kw: Any) -> EngineHarness:
            h = build_harness(make_spec(*args, **kw))
            built.append(h)
            return h

        yield make
        for h in reversed(built):
            h.close()

    @pytest.fixture
    def spawn_worker(
        self, supports_multiprocess: bool, worker_env: dict[str, str]
    ) -> Iterator[SpawnWorker]:
        """Start engine ranks in processes of their own; stopped after the check."""
        if not supports_multiprocess:
            pytest.skip(
                "this adapter's harness cannot run in a worker process (supports_multiprocess)"
            )
        started: list[Worker] = []

        def spawn(spec: HarnessSpec) -> Worker:
            w = Worker(spec, env=worker_env)
            started.append(w)
            return w

        yield spawn
        for w in started:
            w.close()


def adapter_fixtures(
    adapter_name: str,
    harness_factory: str,
    layouts: Sequence[KVLayout],
    *,
    adapter_package: str = "",
    harness_options: Mapping[str, Any] | None = None,
    worker_env: Callable[[], dict[str, str]] | None = None,
    call_budget_s: float = 20.0,
    supports_multiprocess: bool = True,
    supports_store_faults: bool = True,
    no_migration_reason: str = NO_MIGRATION,
) -> type[AdapterFixtures]:
    """An :class:`AdapterFixtures` subclass from plain values, so an adapter's test module
    needs no fixture boilerplate::

        SGLangFixtures = adapter_fixtures("sglang", "pkg.harness:make_harness", LAYOUTS)

        class TestSGLang(AdapterContract, SGLangFixtures):
            pass

    ``layouts[0]`` is the base layout the behavioural checks use; every layout is a
    parameter of the layout checks. ``worker_env`` is called per check (it may read the
    environment at that time). ``no_migration_reason``: why the migration checks skip
    (an adapter that runs them overrides ``migration_pair`` in its test class).
    """
    if not layouts:
        raise ValueError(f"adapter {adapter_name!r}: layouts is empty; give at least one")
    all_layouts = list(layouts)
    options = dict(harness_options or {})

    class _Fixtures(AdapterFixtures):
        @pytest.fixture
        def adapter_name(self) -> str:
            return adapter_name

        @pytest.fixture
        def adapter_package(self) -> str:
            return adapter_package

        @pytest.fixture
        def harness_factory(self) -> str:
            return harness_factory

        @pytest.fixture(params=all_layouts, ids=[lay.label for lay in all_layouts])
        def kv_layout(self, request: pytest.FixtureRequest) -> KVLayout:
            return request.param  # type: ignore[no-any-return]

        @pytest.fixture
        def base_layout(self) -> KVLayout:
            return all_layouts[0]

        @pytest.fixture
        def harness_options(self) -> dict[str, Any]:
            return dict(options)

        @pytest.fixture
        def worker_env(self) -> dict[str, str]:
            return worker_env() if worker_env is not None else {}

        @pytest.fixture
        def call_budget_s(self) -> float:
            return call_budget_s

        @pytest.fixture
        def supports_multiprocess(self) -> bool:
            return supports_multiprocess

        @pytest.fixture
        def supports_store_faults(self) -> bool:
            return supports_store_faults

        @pytest.fixture
        def no_migration_reason(self) -> str:
            return no_migration_reason

    _Fixtures.__name__ = _Fixtures.__qualname__ = f"{adapter_name.title()}Fixtures"
    return _Fixtures
