"""SGLang's built-in ``--hicache-storage-backend mooncake`` on mooncake_core.compat.

The same conformance checks, run through SGLang's own ``MooncakeStore`` class (built by
``StorageBackendFactory.create_backend("mooncake", ...)``) with ``mooncake.store``
provided by ``mooncake_core.compat`` (as the ``sglang.srt.plugins`` hook installs it).
Upstream refuses MHA with ``layer_first``, so that layout is not offered here.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang is not installed (scripts/setup.sh)"
)

from mooncake_conformance import AdapterContract, AdapterFixtures, KVLayout  # noqa: E402

BASE = KVLayout("page_first", num_layers=4, page_size=16, num_kv_heads=4, head_dim=32, num_slots=24)
LAYOUTS = [
    BASE,
    BASE.replace(name="page_first_direct"),
    BASE.replace(tp_size=2),
    BASE.replace(mla=True, tp_size=2),
]


class BuiltinMooncakeFixtures(AdapterFixtures):
    @pytest.fixture
    def adapter_name(self) -> str:
        return "sglang-builtin-mooncake"

    @pytest.fixture
    def adapter_package(self) -> str:
        return "mooncake_core.compat"

    @pytest.fixture
    def harness_factory(self) -> str:
        return "mooncake_sglang.testing.harness:make_harness"

    @pytest.fixture(params=LAYOUTS, ids=[lay.label for lay in LAYOUTS])
    def kv_layout(self, request: pytest.FixtureRequest) -> KVLayout:
        return request.param  # type: ignore[no-any-return]

    @pytest.fixture
    def base_layout(self) -> KVLayout:
        return BASE

    @pytest.fixture
    def harness_options(self) -> dict[str, Any]:
        return {"backend": "builtin"}

    @pytest.fixture
    def supports_store_faults(self) -> bool:
        # compat's MooncakeDistributedStore waits up to 15 s per call for a master, so
        # upstream's save (exists + put) blocks 30 s per batch during an outage.
        return False

    @pytest.fixture
    def supports_multiprocess(self) -> bool:
        # the multi-process checks run for our own backend; here they would only add
        # another ~60 s of SGLang imports on a 2-core machine
        return False


class TestSGLangBuiltinMooncake(AdapterContract, BuiltinMooncakeFixtures):
    """Upstream's backend class, our store underneath."""

    @pytest.mark.xfail(
        reason="several upstream MooncakeStore instances in one process share compat's transfer "
        "engine registrations; SGLang runs one per process",
        strict=False,
    )
    def test_keys_differ_across_models_and_ranks(
        self, base_layout: KVLayout, make_harness: Any, rng: random.Random
    ) -> None:
        super().test_keys_differ_across_models_and_ranks(base_layout, make_harness, rng)

    @pytest.mark.xfail(reason="upstream MooncakeStore checks sizes with a bare assert", strict=True)
    def test_bad_input_wrong_sizes(self, make_harness: Any, rng: random.Random) -> None:
        super().test_bad_input_wrong_sizes(make_harness, rng)

    @pytest.mark.xfail(
        reason="upstream MooncakeStore does not check host indices against the pool", strict=True
    )
    def test_bad_input_unknown_slots(self, make_harness: Any, rng: random.Random) -> None:
        super().test_bad_input_unknown_slots(make_harness, rng)
