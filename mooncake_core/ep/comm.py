"""Per-epoch communicators over torch.distributed backends, built from a shared store.

Contract:

- :func:`open_group` builds a fresh ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL``
  (CUDA) for one membership epoch directly on a :class:`~torch.distributed.PrefixStore`
  keyed by the epoch, without the global default group. Survivors of a failure therefore
  never need the dead rank to form their next group: a group is cheap to build and is
  thrown away when the membership changes.
- :class:`Group` wraps it with all-to-all (even or uneven splits), all-reduce and barrier
  that wait at most ``timeout`` and turn every backend failure (peer reset, timeout, store
  wait timeout) into :class:`GroupFailure`, which the EP engine answers with a membership
  transition.
- ``close()`` drops the backend so peers still blocked in it fail fast (their sockets
  reset) instead of waiting for their own timeout.

The NCCL path follows the same shape (``abort()`` on failure) but is untested here.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as _dist_mod
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    PrefixStore,
    Store,
)

from mooncake_core.errors import EPError

__all__ = ["Group", "GroupFailure", "open_group"]

logger = logging.getLogger(__name__)


class GroupFailure(EPError):
    """A collective of the current epoch failed or timed out; the group is unusable."""


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class Group:
    """One epoch's communicator among ``size`` members.

    Thread-safety: not thread-safe; one caller at a time.
    """

    def __init__(self, backend: Any, rank: int, size: int, device: torch.device, timeout_s: float):
        self._pg: Any = backend
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout_s = timeout_s

    def _wait(self, work: Any, what: str, timeout_s: float | None) -> None:
        t = self.timeout_s if timeout_s is None else timeout_s
        try:
            work.wait(_td(t))
        except Exception as exc:  # backend errors are RuntimeError/DistError subclasses
            raise GroupFailure(f"{what} failed or timed out after {t:.1f}s: {exc}") from exc

    def _require(self) -> Any:
        if self._pg is None:
            raise GroupFailure("group is closed")
        return self._pg

    def all_to_all(
        self,
        send: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int],
        timeout_s: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Exchange rows: ``send_splits[j]`` rows go to member ``j``; returns the received rows
        (in ``out`` when given: contiguous, ``sum(recv_splits)`` rows, same row shape)."""
        pg = self._require()
        if out is None:
            out = torch.empty(
                (int(sum(recv_splits)), *send.shape[1:]), dtype=send.dtype, device=send.device
            )
        try:
            work = pg.alltoall_base(
                out, send.contiguous(), list(recv_splits), list(send_splits), AllToAllOptions()
            )
        except Exception as exc:
            raise GroupFailure(f"all_to_all could not start: {exc}") from exc
        self._wait(work, "all_to_all", timeout_s)
        return out

    def all_reduce(self, t: torch.Tensor, timeout_s: float | None = None) -> torch.Tensor:
        """Sum ``t`` across members in place and return it."""
        pg = self._require()
        try:
            work = pg.allreduce([t], AllreduceOptions())
        except Exception as exc:
            raise GroupFailure(f"all_reduce could not start: {exc}") from exc
        self._wait(work, "all_reduce", timeout_s)
        return t

    def all_gather(
        self, t: torch.Tensor, timeout_s: float | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Concatenate ``t`` from every member along dim 0 (same shape on every member)."""
        pg = self._require()
        if out is None:
            out = torch.empty(
                (self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device
            )
        try:
            work = pg._allgather_base(out, t.contiguous(), AllgatherOptions())
        except Exception as exc:
            raise GroupFailure(f"all_gather could not start: {exc}") from exc
        self._wait(work, "all_gather", timeout_s)
        return out

    def close(self) -> None:
        """Drop the backend; peers blocked in it see a reset instead of waiting."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        if self.device.type == "cuda":
            try:
                pg.abort()
            except Exception:  # pragma: no cover - NCCL only
                logger.debug("NCCL abort failed", exc_info=True)
        del pg


def open_group(
    store: Store,
    prefix: str,
    rank: int,
    size: int,
    *,
    backend: str = "gloo",
    timeout_s: float = 2.0,
    connect_timeout_s: float | None = None,
    host: str = "127.0.0.1",
) -> Group:
    """Build the communicator of one epoch.

    Args:
        store: the shared store (must outlive the ranks).
        prefix: unique per epoch, e.g. ``"mooncake/ep/pg/7/"``.
        rank: this member's index in the epoch's sorted member list.
        size: members in the epoch.
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA, untested here).
        timeout_s: per-collective timeout.
        connect_timeout_s: rendezvous timeout (default ``timeout_s``).
        host: address gloo binds to.

    Raises:
        GroupFailure: a member did not show up within the connect timeout.
    """
    connect = timeout_s if connect_timeout_s is None else connect_timeout_s
    pstore = PrefixStore(prefix, store)
    dist: Any = _dist_mod
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = _td(connect)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            pg: Any = dist.ProcessGroupGloo(pstore, rank, size, opts)
            pg._set_default_timeout(_td(timeout_s))
            device = torch.device("cpu")
        elif backend == "nccl":  # pragma: no cover - needs CUDA
            nccl_cls: Any = dist.ProcessGroupNCCL
            nopts = nccl_cls.Options()
            nopts._timeout = _td(max(connect, timeout_s))
            pg = nccl_cls(pstore, rank, size, nopts)
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise EPError(f"unknown EP backend {backend!r}; use 'gloo' or 'nccl'")
    except EPError:
        raise
    except Exception as exc:
        raise GroupFailure(
            f"could not form the EP group {prefix!r} ({size} members) within {connect:.1f}s: {exc}"
        ) from exc
    logger.debug("opened EP group %s rank %d/%d", prefix, rank, size)
    return Group(pg, rank, size, device, timeout_s)
