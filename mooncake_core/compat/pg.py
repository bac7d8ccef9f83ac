"""``mooncake.pg``: the Mooncake PG torch.distributed backends, for CPU tensors.

Importing this module registers the backends ``mooncake-cpu`` and ``mooncake`` with
:func:`torch.distributed.Backend.register_backend` (``extended_api``: the
``pg_options`` given to ``init_process_group`` / ``new_group`` reach the creator)::

    import mooncake_core.compat; mooncake_core.compat.install()
    from mooncake import pg
    dist.init_process_group("mooncake-cpu", init_method=..., rank=r, world_size=n,
                            pg_options=pg.MooncakeBackendOptions(n))

A group has ``max_group_size`` fixed seats and an ``active_ranks`` mask (an int32 tensor:
the one given to :class:`MooncakeBackendOptions` is updated in place, the published
"mirror"). Collectives run among the active ranks and skip the others; a rank found failed
during a collective is deactivated (``auto_deactivate_on_failure``) so the survivors'
collective completes, and the survivors then agree on the mask (``auto_sync_on_failure``).
A replacement starts with ``is_extension=True`` on a free seat, calls :func:`join_group`
and blocks until the active ranks call :func:`activate_ranks` with its seat.

Both backend names run the same implementation, for CPU tensors: data moves through our
transfer engine (:mod:`mooncake_core.compat.pg_core`). There is no GPU data path here, so a
CUDA (or any non-CPU) tensor is refused with one line; ``mooncake`` exists so that code
written for the GPU backend runs on CPU tensors unchanged. Every call runs to completion
before it returns, so ``async_op=True`` hands back a finished work. docs/compat.md has the
rest (published behaviour is read from the design documents: the published non-CUDA wheel
does not ship the compiled module its ``pg.py`` imports, so it cannot run this module).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

try:
    import torch
    import torch.distributed as dist
except ImportError:
    raise ImportError("mooncake.pg needs torch: pip install 'mooncake-core[ep]'") from None
from torch._C import _distributed_c10d as _c10d
from torch.futures import Future

from mooncake_core.compat import engine as compat_engine
from mooncake_core.compat.pg_core import PGError, PGTimeout, RankFailure, Seats
from mooncake_core.compat.pg_ops import assign, check_tensors, reduce_op, reduce_tensors
from mooncake_core.transfer import TransferEngine

__all__ = [
    "MooncakeBackendOptions",
    "MooncakeProcessGroup",
    "PGError",
    "PGTimeout",
    "RankFailure",
    "activate_ranks",
    "deactivate_ranks",
    "get_active_ranks",
    "get_num_synced_ranks",
    "get_peer_state",
    "join_group",
    "recover_ranks",
    "set_device_filter",
    "set_host_ip",
    "set_transfer_engine",
    "sync_after_failure",
]

logger = logging.getLogger(__name__)

_state: dict[str, Any] = {"host": "127.0.0.1", "engine": None, "filters": []}
#: an all_reduce of at least this many bytes among 3+ ranks runs as reduce-scatter then
#: all-gather (each rank sends 2(n-1)/n of the tensor instead of n-1 times it, in two
#: exchanges instead of one; on 2 loaded cores with 3 ranks it breaks even at 8 MiB)
SPLIT_BYTES = 4 << 20
_engine_lock = threading.Lock()


class MooncakeBackendOptions:
    """Options of a Mooncake PG group, given as ``pg_options``.

    ``MooncakeBackendOptions(max_group_size)`` opens every seat;
    ``MooncakeBackendOptions(active_ranks)`` (a 1-D int tensor, one entry per seat, 1 =
    active) opens the seats marked 1 and keeps that tensor as the live mirror.
    ``is_extension``: this process joins a running group (then :func:`join_group`).
    """

    is_extension: bool = False
    auto_deactivate_on_failure: bool = True
    auto_sync_on_failure: bool = True

    def __init__(
        self,
        active_ranks: torch.Tensor | int,
        is_extension: bool = False,
        auto_deactivate_on_failure: bool = True,
        auto_sync_on_failure: bool = True,
    ) -> None:
        if isinstance(active_ranks, torch.Tensor):
            if active_ranks.dim() != 1 or active_ranks.numel() == 0:
                raise ValueError(
                    "MooncakeBackendOptions: active_ranks must be a non-empty 1-D tensor"
                )
            if active_ranks.is_floating_point() or active_ranks.device.type != "cpu":
                raise ValueError(
                    "MooncakeBackendOptions: active_ranks must be an integer CPU tensor, got "
                    f"{active_ranks.dtype} on {active_ranks.device}"
                )
            self._active = active_ranks
        elif isinstance(active_ranks, int) and not isinstance(active_ranks, bool):
            if active_ranks < 1:
                raise ValueError(
                    f"MooncakeBackendOptions: max_group_size must be >= 1, got {active_ranks}"
                )
            self._active = torch.ones(active_ranks, dtype=torch.int32)
        else:
            raise TypeError(
                "MooncakeBackendOptions: give max_group_size (int) or active_ranks (tensor), "
                f"got {type(active_ranks).__name__}"
            )
        for name, value in (
            ("is_extension", is_extension),
            ("auto_deactivate_on_failure", auto_deactivate_on_failure),
            ("auto_sync_on_failure", auto_sync_on_failure),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"MooncakeBackendOptions: {name} must be a bool, got {value!r}")
        self.is_extension = is_extension
        self.auto_deactivate_on_failure = auto_deactivate_on_failure
        self.auto_sync_on_failure = auto_sync_on_failure

    @property
    def max_group_size(self) -> int:
        """The number of seats."""
        return int(self._active.numel())

    @property
    def active_ranks(self) -> torch.Tensor:
        """The seat mask this group keeps up to date (in place)."""
        return self._active

    def __repr__(self) -> str:
        return (
            f"MooncakeBackendOptions(active_ranks={self._active.tolist()}, "
            f"is_extension={self.is_extension})"
        )


# ---------------------------------------------------------------------- engine set-up
def set_host_ip(host_ip: str) -> None:
    """The address this process's transfer engine listens on and advertises (loopback by
    default). Call it before the first group: the process's engine starts with it."""
    if not isinstance(host_ip, str) or not host_ip.strip():
        raise ValueError(f"set_host_ip: a host address is needed, got {host_ip!r}")
    if _state["engine"] is not None:
        logger.warning(
            "set_host_ip(%r): the transfer engine already runs as %s; it stays there",
            host_ip,
            _state["engine"].name,
        )
    _state["host"] = host_ip.strip()


def set_device_filter(device_filter: Sequence[str]) -> None:
    """The RDMA devices the published backend may use. Recorded; our data path is TCP, so
    it selects nothing (logged once)."""
    if isinstance(device_filter, str) or not all(isinstance(d, str) for d in device_filter):
        raise TypeError("set_device_filter: a list of device names is needed")
    _state["filters"] = list(device_filter)
    logger.info(
        "mooncake.pg: device filter %s recorded; the TCP data path ignores it", device_filter
    )


def set_transfer_engine(engine: Any) -> None:
    """Use this transfer engine (ours, or a ``mooncake.engine.TransferEngine`` after
    ``initialize``) for the groups created from now on."""
    inner = engine.get_engine() if isinstance(engine, compat_engine.TransferEngine) else engine
    if not isinstance(inner, TransferEngine):
        raise TypeError(
            f"set_transfer_engine: a mooncake TransferEngine is needed, got {type(engine).__name__}"
        )
    _state["engine"] = inner.start()


def _engine() -> TransferEngine:
    with _engine_lock:
        eng = _state["engine"]
        if eng is None:
            te = compat_engine.TransferEngine()
            if te.initialize(_state["host"], "P2PHANDSHAKE", "tcp", "") != 0:
                raise PGError(f"mooncake.pg: cannot start a transfer engine on {_state['host']}")
            eng = _state["engine"] = te.get_engine()
        assert isinstance(eng, TransferEngine)
        return eng


# ---------------------------------------------------------------------- the process group
def _done(result: Any) -> dist.Work:
    fut: Future[Any] = Future()
    fut.set_result(result)
    work: dist.Work = _c10d._create_work_from_future(fut)  # type: ignore[attr-defined]
    return work


# torch's stubs overload several methods with the ProcessGroup-level signatures; this class
# implements the ones the torch.distributed functions call on a Python process group
_ProcessGroup: Any = dist.ProcessGroup


class MooncakeProcessGroup(_ProcessGroup):  # type: ignore[misc]
    """The ``mooncake-cpu`` / ``mooncake`` process group (see the module doc)."""

    def __init__(self, seats: Seats, backend_name: str) -> None:
        super().__init__(seats.rank, seats.size)
        self.seats = seats
        self._name = backend_name

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self._name

    def __repr__(self) -> str:
        return (
            f"MooncakeProcessGroup({self._name}, rank={self.seats.rank}, seats={self.seats.size})"
        )

    # ------------------------------------------------------------------ helpers
    def _all(self, payload: torch.Tensor) -> tuple[dict[int, torch.Tensor], list[int]]:
        return self.seats.exchange({r: payload for r in self.seats.members_view()})

    def _check_peer(self, got: torch.Tensor, like: torch.Tensor, src: int, what: str) -> None:
        if got.dtype != like.dtype or got.shape != like.shape:
            raise PGError(
                f"mooncake.pg {what}: rank {src} sent {got.dtype}{list(got.shape)}, "
                f"this rank has {like.dtype}{list(like.shape)}"
            )

    def _root(self, root: int, members: list[int], what: str) -> None:
        if root not in members:
            raise RankFailure(f"mooncake.pg {what}: root rank {root} is inactive or failed")

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = reduce_op(opts, "allreduce")
        check_tensors(tensors, "allreduce", op)
        for t in tensors:
            parts = self.seats.participants()
            big = t.numel() * t.element_size() >= SPLIT_BYTES and t.is_contiguous()
            if big and len(parts) > 2 and self._allreduce_split(t.detach().view(-1), parts, op):
                continue
            got, members = self._all(t.detach().contiguous())
            for r in members:
                self._check_peer(got[r], t, r, "allreduce")
            assign(t, reduce_tensors([got[r] for r in members], op))
        return _done(tensors)

    def _allreduce_split(self, flat: torch.Tensor, parts: list[int], op: str) -> bool:
        """Reduce-scatter, then all-gather, the result written into ``flat`` (a view of the
        caller's tensor): each participant reduces one chunk (in rank order, so the result
        is the same as the whole-tensor path's). False when a rank failed in either step
        (every rank sees it alike): ``flat`` is untouched and the caller runs the
        whole-tensor path among the survivors."""
        chunks = list(torch.tensor_split(flat, len(parts)))
        mine = chunks[parts.index(self.seats.rank)]
        got, members = self.seats.exchange(dict(zip(parts, chunks, strict=True)))
        if members != parts:
            return False
        for r in members:
            self._check_peer(got[r], mine, r, "allreduce")
        reduced = reduce_tensors([got[r] for r in members], op)
        got, members = self.seats.exchange({r: reduced for r in parts})
        if members != parts:
            return False
        for i, r in enumerate(parts):
            self._check_peer(got[r], chunks[i], r, "allreduce")
            assign(chunks[i], got[r])
        return True

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        check_tensors(tensors, "broadcast")
        root = int(opts.rootRank) if opts is not None else 0
        empty = torch.empty(0, dtype=tensors[0].dtype)
        for t in tensors:
            payload = t.detach().contiguous() if self.seats.rank == root else empty
            got, members = self._all(payload)
            self._root(root, members, "broadcast")
            if self.seats.rank != root:
                self._check_peer(got[root], t, root, "broadcast")
                assign(t, got[root])
        return _done(tensors)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        check_tensors(input_tensors, "allgather")
        for outs, inp in zip(output_tensors, input_tensors, strict=True):
            self._check_list(outs, inp, "allgather")
            got, members = self._all(inp.detach().contiguous())
            for r in members:
                self._check_peer(got[r], inp, r, "allgather")
                assign(outs[r], got[r])
        return _done(output_tensors)

    def _check_list(self, outs: list[torch.Tensor], like: torch.Tensor, what: str) -> None:
        if len(outs) != self.seats.size:
            raise ValueError(
                f"mooncake.pg {what}: the list holds {len(outs)} tensors, the group has "
                f"{self.seats.size} ranks"
            )
        check_tensors(outs, what)
        for i, o in enumerate(outs):
            if o.dtype != like.dtype or o.shape != like.shape:
                raise ValueError(
                    f"mooncake.pg {what}: tensor {i} of the list is {o.dtype}{list(o.shape)}, "
                    f"the input is {like.dtype}{list(like.shape)}"
                )

    def _chunks(self, big: torch.Tensor, small: torch.Tensor, what: str) -> list[torch.Tensor]:
        check_tensors([big, small], what)
        if big.dtype != small.dtype or big.numel() != small.numel() * self.seats.size:
            raise ValueError(
                f"mooncake.pg {what}: the large tensor is {big.dtype}[{big.numel()}], it must be "
                f"{small.dtype}[{small.numel()} x {self.seats.size} ranks]"
            )
        if not big.is_contiguous():
            raise ValueError(f"mooncake.pg {what}: the large tensor must be contiguous")
        return [c.view(small.shape) for c in torch.split(big.view(-1), small.numel())]

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:  # noqa: A002
        chunks = self._chunks(output, input, "all_gather_into_tensor")
        got, members = self._all(input.detach().contiguous())
        for r in members:
            self._check_peer(got[r], input, r, "all_gather_into_tensor")
            assign(chunks[r], got[r])
        return _done([output])

    _allgather_base = all_gather_single

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> dist.Work:
        op = reduce_op(opts, "reduce_scatter")
        check_tensors(output_tensors, "reduce_scatter", op)
        for out, ins in zip(output_tensors, input_tensors, strict=True):
            self._check_list(ins, out, "reduce_scatter")
            self._reduce_scatter(out, [i.detach().contiguous() for i in ins], op, "reduce_scatter")
        return _done(output_tensors)

    def _reduce_scatter(
        self, out: torch.Tensor, ins: list[torch.Tensor], op: str, what: str
    ) -> None:
        got, members = self.seats.exchange({r: ins[r] for r in self.seats.members_view()})
        for r in members:
            self._check_peer(got[r], out, r, what)
        assign(out, reduce_tensors([got[r] for r in members], op))

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> dist.Work:  # noqa: A002
        op = reduce_op(opts, "reduce_scatter_tensor")
        check_tensors([output], "reduce_scatter_tensor", op)
        chunks = self._chunks(input, output, "reduce_scatter_tensor")
        self._reduce_scatter(output, [c.contiguous() for c in chunks], op, "reduce_scatter_tensor")
        return _done([output])

    _reduce_scatter_base = reduce_scatter_single

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        for lst, name in ((output_tensors, "output"), (input_tensors, "input")):
            if len(lst) != self.seats.size:
                raise ValueError(
                    f"mooncake.pg all_to_all: {name} list length {len(lst)} != "
                    f"{self.seats.size} ranks"
                )
        check_tensors([*output_tensors, *input_tensors], "all_to_all")
        self._alltoall(
            output_tensors, [t.detach().contiguous() for t in input_tensors], "all_to_all"
        )
        return _done(output_tensors)

    def _alltoall(
        self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], what: str
    ) -> None:
        got, members = self.seats.exchange({r: ins[r] for r in self.seats.members_view()})
        for r in members:
            self._check_peer(got[r], outs[r], r, what)
            assign(outs[r], got[r])

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        check_tensors([output, input], "all_to_all_single")
        n = self.seats.size
        outs = self._split(output, output_split_sizes, "output")
        ins = self._split(input, input_split_sizes, "input")
        if output.dtype != input.dtype:
            raise ValueError(
                f"mooncake.pg all_to_all_single: output {output.dtype}, input {input.dtype}"
            )
        assert len(outs) == len(ins) == n
        self._alltoall(outs, [c.contiguous() for c in ins], "all_to_all_single")
        return _done([output])

    alltoall_base = all_to_all_single

    def _split(self, t: torch.Tensor, sizes: list[int], name: str) -> list[torch.Tensor]:
        n = self.seats.size
        if not sizes:
            if t.shape[0] % n:
                raise ValueError(
                    f"mooncake.pg all_to_all_single: {name} dim 0 ({t.shape[0]}) does not split "
                    f"evenly over {n} ranks; give split sizes"
                )
            sizes = [t.shape[0] // n] * n
        if len(sizes) != n or sum(sizes) != t.shape[0]:
            raise ValueError(
                f"mooncake.pg all_to_all_single: {name} split sizes {sizes} must be {n} numbers "
                f"adding up to {t.shape[0]}"
            )
        return list(torch.split(t, sizes))

    def barrier(self, opts: Any = None) -> dist.Work:
        self._all(torch.empty(0, dtype=torch.uint8))
        return _done(None)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = reduce_op(opts, "reduce")
        check_tensors(tensors, "reduce", op)
        root = int(opts.rootRank)
        for t in tensors:
            empty = torch.empty(0, dtype=t.dtype)
            view = self.seats.members_view()
            got, members = self.seats.exchange(
                {r: t.detach().contiguous() if r == root else empty for r in view}
            )
            if self.seats.rank == root:
                for r in members:
                    self._check_peer(got[r], t, r, "reduce")
                assign(t, reduce_tensors([got[r] for r in members], op))
        return _done(tensors)

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> dist.Work:
        check_tensors(input_tensors, "gather")
        root, me = int(opts.rootRank), self.seats.rank
        inp = input_tensors[0]
        if me == root:
            self._check_list(output_tensors[0], inp, "gather")
        empty = torch.empty(0, dtype=inp.dtype)
        view = self.seats.members_view()
        got, members = self.seats.exchange(
            {r: inp.detach().contiguous() if r == root else empty for r in view}
        )
        self._root(root, members, "gather")
        if me == root:
            for r in members:
                self._check_peer(got[r], inp, r, "gather")
                assign(output_tensors[0][r], got[r])
        return _done(output_tensors)

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> dist.Work:
        check_tensors(output_tensors, "scatter")
        root, me = int(opts.rootRank), self.seats.rank
        out = output_tensors[0]
        view = self.seats.members_view()
        empty = torch.empty(0, dtype=out.dtype)
        if me == root:
            self._check_list(input_tensors[0], out, "scatter")
            payloads = {r: input_tensors[0][r].detach().contiguous() for r in view}
        else:
            payloads = {r: empty for r in view}
        got, members = self.seats.exchange(payloads)
        self._root(root, members, "scatter")
        self._check_peer(got[root], out, root, "scatter")
        assign(out, got[root])
        return _done(output_tensors)

    # ------------------------------------------------------------------ point to point
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> dist.Work:  # noqa: N803
        check_tensors(tensors, "send")
        for t in tensors:
            self.seats.send(t.detach().contiguous(), int(dstRank), int(tag))
        return _done(None)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> dist.Work:  # noqa: N803
        check_tensors(tensors, "recv")
        for t in tensors:
            got = self.seats.recv(int(srcRank), int(tag))
            self._check_peer(got, t, int(srcRank), "recv")
            assign(t, got)
        return _done(tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        raise PGError(
            "mooncake.pg recv: a source rank is needed (recv from any source is not supported)"
        )


# ---------------------------------------------------------------------- creators
def _creator(backend_name: str) -> Any:
    def create(dist_opts: Any, options: Any) -> MooncakeProcessGroup:
        size = int(dist_opts.group_size)
        opts = options if options is not None else MooncakeBackendOptions(size)
        if not isinstance(opts, MooncakeBackendOptions):
            raise TypeError(
                f"{backend_name}: pg_options must be mooncake.pg.MooncakeBackendOptions, "
                f"got {type(opts).__name__}"
            )
        if opts.max_group_size != size:
            raise ValueError(
                f"{backend_name}: max_group_size {opts.max_group_size} != world size {size}: "
                "give every seat a rank (start the later ones with is_extension=True)"
            )
        active = opts.active_ranks
        seats = Seats(
            _engine(),
            dist_opts.store,
            int(dist_opts.group_rank),
            active,
            gid=f"mcpg/{dist_opts.group_id}",
            timeout_s=float(dist_opts.timeout.total_seconds()),
            is_extension=opts.is_extension,
            auto_deactivate=opts.auto_deactivate_on_failure,
            auto_sync=opts.auto_sync_on_failure,
        )
        return MooncakeProcessGroup(seats, backend_name)

    return create


def _register() -> None:
    for name, devices in (("mooncake-cpu", ["cpu"]), ("mooncake", ["cpu", "cuda"])):
        if name.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(name, _creator(name), extended_api=True, devices=devices)


_register()


# ---------------------------------------------------------------------- helpers
def _seats(backend: Any) -> Seats:
    pg = dist.group.WORLD if backend is None else backend
    if isinstance(pg, MooncakeProcessGroup):
        return pg.seats
    raise TypeError(
        "mooncake.pg: a Mooncake PG group is needed (the group from init_process_group / "
        f"new_group with backend 'mooncake-cpu' or 'mooncake'), got {type(pg).__name__}"
    )


def get_active_ranks(backend: Any = None) -> torch.Tensor:
    """A copy of the group's seat mask (int32, 1 = active)."""
    return _seats(backend).active_ranks()


def get_num_synced_ranks(backend: Any = None) -> int:
    """How many ranks took part in the group's last membership agreement (start, a sync
    after a failure, an activation)."""
    return _seats(backend).synced


def get_peer_state(backend: Any, ranks: Iterable[int]) -> list[bool]:
    """For each rank: does its process answer (a ping of its transfer engine)."""
    return _seats(backend).peer_state([int(r) for r in ranks])


def activate_ranks(backend: Any, ranks: Iterable[int]) -> None:
    """Collective among the active ranks: admit the processes waiting in
    :func:`join_group` on these seats (blocks until each has asked)."""
    _seats(backend).activate([int(r) for r in ranks])


recover_ranks = activate_ranks


def deactivate_ranks(backend: Any, ranks: Iterable[int]) -> None:
    """Collective among the active ranks: the union of the lists leaves the group."""
    _seats(backend).deactivate([int(r) for r in ranks])


def join_group(backend: Any = None) -> None:
    """For a process started with ``is_extension=True``: block until an online rank
    activates this one, then take part in the group's collectives."""
    _seats(backend).join()


def sync_after_failure(backend: Any = None) -> None:
    """Collective among the active ranks: agree on the seat mask (a seat any of them
    deactivated, or that does not answer, is inactive for all)."""
    _seats(backend).sync()
