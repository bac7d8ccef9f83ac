"""Abstract conformance suites for mooncake-core engine adapters.

Adapters subclass :class:`AdapterContract` together with their own
:class:`AdapterFixtures` subclass and inherit every check; see docs/conformance.md.
"""

from __future__ import annotations

from mooncake_conformance.adapter import AdapterContract
from mooncake_conformance.fixtures import AdapterFixtures, adapter_fixtures
from mooncake_conformance.harness import EngineHarness, HarnessSpec, KVLayout, build_harness
from mooncake_conformance.migration import MigrationContract, MigrationOutcome, MigrationPair
from mooncake_conformance.status import describe
from mooncake_conformance.store import StoreCluster

__all__ = [
    "AdapterContract",
    "AdapterFixtures",
    "EngineHarness",
    "HarnessSpec",
    "KVLayout",
    "MigrationContract",
    "MigrationOutcome",
    "MigrationPair",
    "StoreCluster",
    "adapter_fixtures",
    "build_harness",
    "describe",
]
