"""Worker functions for tests/test_ccl.py (spawned processes import them from here).

Each rank joins a real process group on ddplab's own ``ccl`` backend (oneCCL underneath)
plus a gloo group over the same ranks, runs every collective on both with the same inputs,
and writes what differed to ``<out>/rank<r>.pt``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ddplab import ccl
from tests.dist_workers import _finish, _group

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64]
FLOATS = {torch.float32, torch.bfloat16, torch.float16, torch.float64}
# Small integers: every sum, product, min and max below is exact in every dtype (bf16 holds
# integers up to 256 exactly), so ccl and gloo must agree bit for bit, whatever their order.
SMALL, LARGE = 7, 65_537
# The names torch 2.14 prefers, and the older ones before it.
ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    return ((torch.arange(n) * (rank + 1) + salt) % 5 + 1).to(dtype)


def cases(rank: int, world: int) -> dict[str, Callable]:
    """name -> fn(dtype, group) -> list of result tensors on this rank."""

    def all_reduce(op):
        def run(dt, g, n=SMALL):
            t = data(rank, n, dt)
            dist.all_reduce(t, op, group=g)
            return [t]
        return run

    def avg(dt, g):  # gloo has no AVG: its SUM divided by the world size is the reference
        t = data(rank, SMALL, dt)
        if g is None:
            dist.all_reduce(t, dist.ReduceOp.AVG)
            return [t]
        dist.all_reduce(t, dist.ReduceOp.SUM, group=g)
        return [t / world]

    def broadcast(dt, g):
        t = data(rank, SMALL, dt)
        dist.broadcast(t, src=world - 1, group=g)
        return [t]

    def reduce(dt, g):
        t = data(rank, SMALL, dt)
        dist.reduce(t, dst=0, group=g)
        return [t] if rank == 0 else []  # only the root's result is defined

    def all_gather(dt, g, n=SMALL):
        out = [torch.zeros(n, dtype=dt) for _ in range(world)]
        dist.all_gather(out, data(rank, n, dt), group=g)
        return out

    def all_gather_uneven(dt, g):  # a different length from each rank
        if g is not None:  # gloo refuses uneven sizes: the reference is every rank's input
            return [data(r, 3 + r, dt) for r in range(world)]
        out = [torch.zeros(3 + r, dtype=dt) for r in range(world)]
        dist.all_gather(out, data(rank, 3 + rank, dt))
        return out

    def all_gather_single(dt, g):
        out = torch.zeros(SMALL * world, dtype=dt)
        ALL_GATHER_SINGLE(out, data(rank, SMALL, dt), group=g)
        return [out]

    def reduce_scatter(dt, g):
        out = torch.zeros(SMALL, dtype=dt)
        dist.reduce_scatter(out, [data(rank, SMALL, dt, salt=i) for i in range(world)], group=g)
        return [out]

    def reduce_scatter_single(dt, g):
        out = torch.zeros(SMALL, dtype=dt)
        REDUCE_SCATTER_SINGLE(out, data(rank, SMALL * world, dt), group=g)
        return [out]

    def all_to_all_single(dt, g):
        out = torch.zeros(2 * world, dtype=dt)
        dist.all_to_all_single(out, data(rank, 2 * world, dt), group=g)
        return [out]

    def all_to_all_uneven(dt, g):  # every rank sends i+1 elements to rank i
        inp = data(rank, sum(i + 1 for i in range(world)), dt)
        out = torch.zeros((rank + 1) * world, dtype=dt)
        dist.all_to_all_single(out, inp, [rank + 1] * world, [i + 1 for i in range(world)], group=g)
        return [out]

    def all_to_all(dt, g):
        out = [torch.zeros(3, dtype=dt) for _ in range(world)]
        dist.all_to_all(out, [data(rank, 3, dt, salt=i) for i in range(world)], group=g)
        return out

    def send_recv(dt, g):  # a chain 0 -> 1 -> ... -> world-1
        got = []
        for src in range(world - 1):
            if rank == src:
                dist.send(data(rank, SMALL, dt), src + 1, group=g)
            elif rank == src + 1:
                t = torch.zeros(SMALL, dtype=dt)
                dist.recv(t, src, group=g)
                got.append(t)
        return got

    def barrier(dt, g):
        dist.barrier(group=g)
        return []

    def non_contiguous(dt, g):  # a transposed view: the result must land in the caller's view
        t = data(rank, 12, dt).view(3, 4).t()
        dist.all_reduce(t, group=g)
        return [t]

    return {
        "all_reduce_sum": all_reduce(dist.ReduceOp.SUM),
        "all_reduce_product": all_reduce(dist.ReduceOp.PRODUCT),
        "all_reduce_min": all_reduce(dist.ReduceOp.MIN),
        "all_reduce_max": all_reduce(dist.ReduceOp.MAX),
        "all_reduce_avg": avg,
        "all_reduce_large": lambda dt, g: all_reduce(dist.ReduceOp.SUM)(dt, g, LARGE),
        "broadcast": broadcast, "reduce": reduce,
        "all_gather": all_gather, "all_gather_uneven": all_gather_uneven,
        "all_gather_large": lambda dt, g: all_gather(dt, g, LARGE),
        "all_gather_into_tensor": all_gather_single,
        "reduce_scatter": reduce_scatter, "reduce_scatter_tensor": reduce_scatter_single,
        "all_to_all_single": all_to_all_single, "all_to_all_single_uneven": all_to_all_uneven,
        "all_to_all": all_to_all, "send_recv": send_recv, "barrier": barrier,
        "non_contiguous": non_contiguous,
    }


def compare_with_gloo(rank: int, world: int, tmp: str) -> None:
    _group(rank, world, tmp, "ccl")
    gloo = dist.new_group(backend="gloo")
    checked, differ = 0, []
    for name, fn in cases(rank, world).items():
        for dt in DTYPES:
            if name == "all_reduce_avg" and dt not in FLOATS:
                continue
            mine, ref = fn(dt, None), fn(dt, gloo)
            checked += 1
            if len(mine) != len(ref) or not all(
                    a.dtype == b.dtype and torch.equal(a, b)
                    for a, b in zip(mine, ref, strict=True)):
                differ.append(f"{name} {dt}: ccl {mine} gloo {ref}")
    errors = {}
    for name, call in (("gather", lambda: dist.gather(torch.ones(2), [torch.ones(2)] * world
                                                      if rank == 0 else None)),
                       ("bool", lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool))),
                       ("avg_int", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                                           dist.ReduceOp.AVG))):
        try:
            call()
            errors[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads the message
            errors[name] = str(e).splitlines()[0]
    torch.save({"checked": checked, "differ": differ, "errors": errors},
               Path(tmp) / f"rank{rank}.pt")
    dist.destroy_process_group(gloo)
    _finish()


def async_overlap(rank: int, world: int, tmp: str) -> None:
    """An async all-reduce returns before it is done, and its Future completes by itself."""
    _group(rank, world, tmp, "ccl")
    big = torch.ones(8 * 2**20)  # 32 MB
    t0 = time.perf_counter()
    work = dist.all_reduce(big, async_op=True)
    returned = time.perf_counter() - t0
    fut = work.get_future()
    value = fut.wait()[0]
    waited = time.perf_counter() - t0
    torch.save({"returned_s": returned, "waited_s": waited, "ok": bool((value == world).all()),
                "done": work.is_completed()}, Path(tmp) / f"rank{rank}.pt")
    _finish()


def missing_peer(rank: int, world: int, tmp: str) -> None:
    """Rank 1 never joins the all-reduce: rank 0 must get an error within the group's timeout,
    not hang."""
    _group(rank, world, tmp, "ccl", timeout_s=3)
    dist.all_reduce(torch.ones(4))  # both ranks: the group works
    if rank == 0:
        t0 = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(4))
            outcome = "completed"
        except Exception as e:  # noqa: BLE001 - the test reads the message
            outcome = str(e).splitlines()[0]
        torch.save({"outcome": outcome, "after_s": time.perf_counter() - t0},
                   Path(tmp) / "rank0.pt")
    else:
        time.sleep(8)  # alive but silent, past rank 0's timeout
        torch.save({}, Path(tmp) / "rank1.pt")
    ccl.release_shm()  # no _finish on a broken group, but its libfabric regions still go


def alone_in_a_group_of_two(tmp: str, timeout_s: int) -> None:
    """Rank 0 of 2 on ccl whose rank 1 never comes (it died during set-up): prints what
    init_process_group raised, then ends as ddplab's ranks do (os._exit), with 3."""
    import os
    import sys

    from tests.dist_workers import _group

    try:
        _group(0, 2, tmp, "ccl", timeout_s)
    except RuntimeError as e:
        print("raised:", str(e).strip().splitlines()[0], flush=True)
        from ddplab import ccl

        ccl.release_shm()  # as ddplab's ranks do before os._exit (cli.py)
        os._exit(3)
    print("made a group of 2 alone", flush=True)
    sys.stdout.flush()
    os._exit(0)
