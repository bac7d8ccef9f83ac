"""``MigrationContract``: the PD (prefill -> decode) migration checks.

An engine that moves a request's KV blocks from a prefill engine to a decode engine
through an adapter's migration backend offers a :class:`MigrationPair`: two engine ranks,
each a process of its own, linked the way the engine links them, with the engine's own
block memory. :class:`~mooncake_conformance.adapter.AdapterContract` inherits these
checks; an adapter without such a pair skips them with its reason (the
``migration_pair`` fixture, see :mod:`mooncake_conformance.fixtures`).

- ``test_migration_round_trips_blocks_between_processes``: scattered prefill blocks land
  byte for byte in the chosen decode blocks; every other decode block is untouched.
- ``test_failed_migration_frees_blocks_and_reports_an_error``: with the prefill process
  stalled, a migration through the engine's request path fails within the pair's
  deadline with a clear error, the decode engine has all its blocks back, the backend's
  own call raises too, and the next migration works again.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["MigrationContract", "MigrationOutcome", "MigrationPair"]

#: extra seconds a failure may take past the pair's deadline on a loaded machine
SLACK_S = 5.0


@dataclass
class MigrationOutcome:
    """What the decode engine made of one migration request.

    ``decode_blocks``: the blocks the request holds once the engine answered it (empty
    after a failure: the engine took them back without waiting for the session to end);
    ``free_before`` / ``free_after``: the decode engine's free blocks before the request
    and after its session ended."""

    ok: bool
    error: str = ""
    decode_blocks: list[int] = field(default_factory=list)
    free_before: int = 0
    free_after: int = 0


class MigrationPair(Protocol):
    """A prefill rank and a decode rank in two processes, linked by the adapter's backend."""

    #: bytes of one block (every pool and layer of it)
    block_bytes: int
    prefill_blocks: int
    decode_blocks: int
    #: the longest a migration may run before it has failed (deadline plus wind-down)
    deadline_s: float

    def fill_prefill(self, seed: int) -> None:
        """Random bytes (from ``seed``) into every prefill block."""

    def zero_decode(self) -> None:
        """Zero every decode block."""

    def digests(self, side: str, blocks: Sequence[int]) -> list[str]:
        """SHA-256 of each block's bytes on ``side`` (``"prefill"`` or ``"decode"``)."""

    def migrate(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Pull prefill block ``a`` into decode block ``b`` for each pair, through the
        backend as the engine calls it; raises on failure."""

    def request(self, session_id: int, prefill_blocks: Sequence[int]) -> MigrationOutcome:
        """One migration request through the decode engine's own request path (it
        allocates the decode blocks); returns after the request ended."""

    def stalled_prefill(self) -> AbstractContextManager[None]:
        """Inside: the prefill process is stopped (alive, answering nothing)."""


class MigrationContract:
    """The migration checks (mix in fixtures that provide ``migration_pair``)."""

    def test_migration_round_trips_blocks_between_processes(
        self, migration_pair: MigrationPair, rng: random.Random
    ) -> None:
        pair = migration_pair
        n = min(6, pair.prefill_blocks, pair.decode_blocks)
        src = rng.sample(range(pair.prefill_blocks), n)
        dst = rng.sample(range(pair.decode_blocks), n)
        pair.fill_prefill(rng.randrange(1 << 30))
        pair.zero_decode()
        pair.migrate(list(zip(src, dst, strict=True)))
        assert pair.digests("decode", dst) == pair.digests("prefill", src), (
            "migrated decode blocks differ from their prefill blocks"
        )
        rest = [b for b in range(pair.decode_blocks) if b not in dst]
        zero = hashlib.sha256(bytes(pair.block_bytes)).hexdigest()
        assert set(pair.digests("decode", rest)) <= {zero}, "bytes landed outside the blocks"

    def test_failed_migration_frees_blocks_and_reports_an_error(
        self, migration_pair: MigrationPair, rng: random.Random
    ) -> None:
        pair = migration_pair
        pair.fill_prefill(rng.randrange(1 << 30))

        def good(session: int) -> None:
            blocks = rng.sample(range(pair.prefill_blocks), 3)
            out = pair.request(session, blocks)
            assert out.ok, f"session {session}: {out.error}"
            assert len(out.decode_blocks) == len(blocks)
            assert pair.digests("decode", out.decode_blocks) == pair.digests("prefill", blocks)
            assert out.free_after == out.free_before, "the ended request kept decode blocks"

        # the link in use first: a stall then hits a running transfer, not the first contact
        good(1000 + rng.randrange(1000))
        with pair.stalled_prefill():
            t0 = time.monotonic()
            out = pair.request(
                2000 + rng.randrange(1000), rng.sample(range(pair.prefill_blocks), 3)
            )
            took = time.monotonic() - t0
            assert not out.ok, "a migration from a stalled prefill engine succeeded"
            assert len(out.error) >= 15, f"error too terse to act on: {out.error!r}"
            assert took < pair.deadline_s + SLACK_S, f"the failure took {took:.1f} s"
            assert not out.decode_blocks, f"the failed request still holds blocks: {out}"
            assert out.free_after == out.free_before, f"blocks lost after the failure: {out}"
            t0 = time.monotonic()
            try:
                pair.migrate([(0, 0)])
            except Exception as exc:  # the adapter's own error type
                assert len(str(exc)) >= 15, f"error too terse to act on: {exc!r}"
            else:
                raise AssertionError("the backend's migrate from a stalled prefill returned")
            took = time.monotonic() - t0
            assert took < pair.deadline_s + SLACK_S, f"the failure took {took:.1f} s"
        good(3000 + rng.randrange(1000))
