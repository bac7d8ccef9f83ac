"""``mooncake.pg`` (ours): the ``mooncake-cpu`` torch.distributed backend, in real processes.

Three ranks start with ``init_process_group("mooncake-cpu", tcp://127.0.0.1:<free port>)``
and a gloo group over the same processes; every collective runs on both with the same
inputs and must give the same result (integer-valued data, so float sums are exact in any
order; random floats are compared with a tolerance). Bad input gets one line. Then rank 2
is SIGKILLed between collectives: the survivors' next allreduce completes without it and
``get_active_ranks`` shows it deactivated; a replacement process on seat 2
(``is_extension=True``) calls ``join_group()``, the survivors call ``activate_ranks``, and
a three-rank allreduce is right again on all three. Last, the replacement dies part way
through an allreduce (its data reaches rank 0 only): both survivors leave it out.

The published wheel cannot run ``mooncake.pg`` (its non-CUDA build lacks the compiled
module), so there is no published side here; behaviour follows the design documents.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_file(path: Path, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path.name} did not appear")
        time.sleep(0.02)


# ---------------------------------------------------------------------- the ranks
def _check_collectives(dist: Any, torch: Any, pg: Any, rank: int, gloo: Any) -> None:
    n = 3
    R = dist.ReduceOp

    def both(fn: Any) -> tuple[Any, Any]:
        return fn(None), fn(gloo)

    def same(a: Any, b: Any, what: str) -> None:
        if isinstance(a, (list, tuple)):
            for x, y in zip(a, b, strict=True):
                same(x, y, what)
            return
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: ours {a} gloo {b}"

    base = torch.arange(12).reshape(3, 4) + 7 * rank
    data = {"f32": base.float() - 20, "i64": base.clone(), "f64": base.double() * 0.5}
    for dt, x in data.items():
        ops = ["SUM", "PRODUCT", "MIN", "MAX"] + (
            ["BAND", "BOR", "BXOR"] if dt == "i64" else ["AVG"]
        )
        for op in ops:

            def allreduce(g: Any, x: Any = x, op: str = op) -> Any:
                t = x.clone()
                dist.all_reduce(t, op=getattr(R, op), group=g)
                return t

            same(*both(allreduce), f"all_reduce {dt} {op}")
    # 360 KB: the reduce-scatter + all-gather path (rank_main lowers pg.SPLIT_BYTES)
    big = (torch.arange(300 * 300) % 97 + rank).float().reshape(300, 300)
    assert big.numel() * 4 >= pg.SPLIT_BYTES
    for op in ("SUM", "MAX", "AVG"):

        def allreduce_big(g: Any, op: str = op) -> Any:
            t = big.clone()
            dist.all_reduce(t, op=getattr(R, op), group=g)
            return t

        same(*both(allreduce_big), f"all_reduce 360 KB {op}")
    x = data["f32"]

    def broadcast(g: Any) -> Any:
        t = x.clone()
        dist.broadcast(t, src=1, group=g)
        return t

    def all_gather(g: Any) -> Any:
        outs = [torch.full_like(x, -1.0) for _ in range(n)]
        dist.all_gather(outs, x, group=g)
        return outs

    def all_gather_into(g: Any) -> Any:
        out = torch.empty(n * 3, 4)
        dist.all_gather_into_tensor(out, x, group=g)
        return out

    def reduce_scatter(g: Any) -> Any:
        out = torch.empty(4)
        dist.reduce_scatter(out, [x[i] * (i + 1) for i in range(n)], op=R.MAX, group=g)
        return out

    def reduce_scatter_tensor(g: Any) -> Any:
        out = torch.empty(1, 4)
        dist.reduce_scatter_tensor(out, x, group=g)
        return out

    def all_to_all(g: Any) -> Any:
        outs = [torch.empty(4) for _ in range(n)]
        dist.all_to_all(outs, [x[i] + 100 * rank for i in range(n)], group=g)
        return outs

    def all_to_all_single(g: Any) -> Any:
        out = torch.empty(3, 4)
        dist.all_to_all_single(out, x, group=g)
        return out

    def all_to_all_uneven(g: Any) -> Any:
        # rank r sends i+1 rows to rank i and receives r+1 rows from each
        inp = torch.arange(6 * 2).reshape(6, 2) + 50 * rank
        out = torch.empty(3 * (rank + 1), 2, dtype=inp.dtype)
        dist.all_to_all_single(out, inp, [rank + 1] * n, [1, 2, 3], group=g)
        return out

    def reduce(g: Any) -> Any:
        t = x.clone()
        dist.reduce(t, dst=2, op=R.SUM, group=g)
        return t if rank == 2 else torch.zeros(1)

    def gather(g: Any) -> Any:
        outs = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
        dist.gather(x, outs, dst=0, group=g)
        return outs or [torch.zeros(1)]

    def scatter(g: Any) -> Any:
        out = torch.empty(4)
        dist.scatter(out, [x[i] * 3 for i in range(n)] if rank == 1 else None, src=1, group=g)
        return out

    def send_recv(g: Any) -> Any:
        out = torch.empty_like(x)
        if rank % 2 == 0:
            dist.send(x + 1, dst=(rank + 1) % n, group=g)
            dist.recv(out, src=(rank - 1) % n, group=g)
        else:
            dist.recv(out, src=(rank - 1) % n, group=g)
            dist.send(x + 1, dst=(rank + 1) % n, group=g)
        return out

    for fn in (
        broadcast,
        all_gather,
        all_gather_into,
        reduce_scatter,
        reduce_scatter_tensor,
        all_to_all,
        all_to_all_single,
        all_to_all_uneven,
        reduce,
        gather,
        scatter,
        send_recv,
    ):
        same(*both(fn), fn.__name__)
    dist.barrier()
    # random floats: sums in another order than gloo's ring, so equal within rounding
    torch.manual_seed(rank)
    r = torch.randn(1000, dtype=torch.float32)
    ours, theirs = r.clone(), r.clone()
    dist.all_reduce(ours)
    dist.all_reduce(theirs, group=gloo)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    assert pg.get_active_ranks().tolist() == [1, 1, 1] and pg.get_num_synced_ranks() == 3


def _check_bad_input(dist: Any, torch: Any) -> None:
    def one_line(exc_type: type[BaseException], words: str, fn: Any) -> None:
        with pytest.raises(exc_type) as info:
            fn()
        msg = str(info.value)
        assert "\n" not in msg and words in msg, msg

    meta = torch.empty(4, device="meta")  # no CUDA device here: any non-CPU tensor takes this path
    one_line(ValueError, "meta tensor refused", lambda: dist.all_reduce(meta))
    one_line(
        ValueError,
        "BAND needs an integer",
        lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND),
    )
    one_line(
        ValueError,
        "PREMUL_SUM is not supported",
        lambda: dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(2.0)),
    )
    one_line(
        ValueError,
        "AVG needs a floating",
        lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.AVG),
    )
    # torch itself refuses mixed dtypes within a list; a mismatched shape reaches us
    mixed = [torch.empty(3), torch.empty(4), torch.empty(3)]
    one_line(
        ValueError,
        "tensor 1 of the list is torch.float32[4]",
        lambda: dist.all_gather(mixed, torch.ones(3)),
    )
    one_line(
        ValueError,
        "the large tensor is torch.float32[9], it must be torch.int64[3 x 3 ranks]",
        lambda: dist.reduce_scatter_tensor(torch.empty(3, dtype=torch.int64), torch.ones(9)),
    )
    one_line(
        ValueError,
        "must be torch.float32[3 x 3 ranks]",
        lambda: dist.all_gather_into_tensor(torch.empty(9, dtype=torch.int64), torch.ones(3)),
    )


def rank_main(rank: int, port: int, tmp: str, role: str) -> None:
    """One process of the test (run as ``python test_compat_pg.py RANK PORT TMP ROLE``)."""
    import torch
    import torch.distributed as dist

    import mooncake_core.compat

    assert mooncake_core.compat.install(force=True)
    from mooncake import pg

    done = Path(tmp)
    init = f"tcp://127.0.0.1:{port}"
    pg.SPLIT_BYTES = 256 << 10  # so that 360-400 KB tensors take the split all_reduce path
    if role == "replacement":
        opts = pg.MooncakeBackendOptions(3, is_extension=True)
        dist.init_process_group(
            "mooncake-cpu", init_method=init, rank=rank, world_size=3, pg_options=opts
        )
        assert pg.get_active_ranks().tolist()[rank] == 0
        pg.join_group()  # blocks until the survivors activate seat 2
    else:
        opts = pg.MooncakeBackendOptions(3)
        dist.init_process_group(
            "mooncake-cpu", init_method=init, rank=rank, world_size=3, pg_options=opts
        )
        gloo = dist.new_group(backend="gloo")
        _check_collectives(dist, torch, pg, rank, gloo)
        if rank == 0:
            _check_bad_input(dist, torch)
        (done / f"ready.{rank}").touch()
        if rank == 2:
            time.sleep(120)  # killed here
            return
        _wait_file(done / "killed")
        t = torch.full((5,), float(rank + 1))
        dist.all_reduce(t)  # rank 2 is gone: 1 + 2
        assert t.tolist() == [3.0] * 5, t
        assert pg.get_active_ranks().tolist() == [1, 1, 0]
        assert opts.active_ranks.tolist() == [1, 1, 0]  # the mirror tensor, updated in place
        assert pg.get_peer_state(None, [0, 1, 2]) == [True, True, False]
        pg.activate_ranks(None, [2])  # blocks until the replacement asked to join
    assert pg.get_active_ranks().tolist() == [1, 1, 1]
    t = torch.full((100_000,), float(rank + 1))  # 400 KB: reduce-scatter + all-gather
    dist.all_reduce(t)
    assert torch.equal(t, torch.full_like(t, 6.0)), t
    (done / f"rejoined.{rank}").touch()
    # Rank 2 dies part way through an allreduce: its data reaches rank 0, not rank 1. The
    # members' masks make both survivors leave it out (rank 0 alone would have summed 6).
    if role == "replacement":
        _die_after_sending_to_rank_0(dist)
    # (400 KB: it dies in the reduce-scatter step; the whole-tensor path then runs)
    t = torch.full((100_000,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full_like(t, 3.0)), t
    assert pg.get_active_ranks().tolist() == [1, 1, 0]


def _die_after_sending_to_rank_0(dist: Any) -> None:
    seats = dist.group.WORLD.seats
    send = seats.engine.put_tensor_async

    def partial(tensor: Any, peer: str, key: str) -> Any:
        if peer == seats.peers[0]:
            fut = send(tensor, peer, key)
            fut.result()  # delivered to rank 0
            return fut
        # die once both survivors' data is here (their sends to rank 2 succeeded), before
        # anything reaches rank 1: only the masks tell rank 0 that rank 1 lacks it
        for src in (0, 1):
            seats.engine.get_tensor(f"{key.rsplit('/', 1)[0]}/{src}", timeout=30)
        os.kill(os.getpid(), signal.SIGKILL)

    seats.engine.put_tensor_async = partial


def _spawn(rank: int, port: int, tmp: Path, role: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
    code = f"import test_compat_pg as t; t.rank_main({rank}, {port}, {str(tmp)!r}, {role!r})"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.timeout(120)
def test_mooncake_cpu_matches_gloo_survives_a_killed_rank_and_readmits_a_replacement(
    tmp_path: Path,
) -> None:
    port = _free_port()
    procs = [_spawn(r, port, tmp_path, "member") for r in range(3)]
    extra: list[subprocess.Popen[str]] = []
    try:
        for r in range(3):
            while not (tmp_path / f"ready.{r}").exists():
                if any(p.poll() not in (None, 0) for p in procs):
                    bad = next(p for p in procs if p.poll() not in (None, 0))
                    pytest.fail(f"a rank failed:\n{bad.communicate()[0][-4000:]}")
                time.sleep(0.05)
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait()
        (tmp_path / "killed").touch()
        extra.append(_spawn(2, port, tmp_path, "replacement"))
        for p in [procs[0], procs[1], *extra]:
            out, _ = p.communicate(timeout=90)
            assert p.returncode == (-signal.SIGKILL if p in extra else 0), out[-4000:]
        assert sorted(f.name for f in tmp_path.glob("rejoined.*")) == [
            "rejoined.0",
            "rejoined.1",
            "rejoined.2",
        ]
    finally:
        for p in [*procs, *extra]:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_without_torch_import_mooncake_pg_is_one_clear_line() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import mooncake_core.compat; assert mooncake_core.compat.install(force=True)\n"
        "try:\n    import mooncake.pg\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "ERR mooncake.pg needs torch: pip install 'mooncake-core[ep]'", out


if __name__ == "__main__":  # pragma: no cover - the ranks import this module by name
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
