"""The collectives, each with its buffers, its correctness check and its bus-bandwidth factor.

Sizes and bandwidths follow nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md):
``size`` is the whole buffer (all_gather: the gathered output; reduce_scatter: the input;
all_to_all: what each rank sends), algbw = size / time, and busbw = algbw x a factor that
makes every op comparable with the hardware's peak: all_reduce 2(n-1)/n; all_gather,
reduce_scatter, all_to_all, gather, scatter (n-1)/n; broadcast, reduce, send/recv 1.

Buffers hold small integers, so every dtype (bfloat16 and float16 included) sums them
exactly and the check compares for equality.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Newer torch renamed these two (the old names warn); torch 2.7 has only the old ones.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

Run = Callable[[], Any]  # starts the collective; returns its Work (or a list of them)
Check = Callable[[], bool]  # after the first run: did every element come out right?


@dataclass(frozen=True)
class Ctx:
    """One measurement point: the group, this rank, the buffer's elements, where they live."""

    group: Any
    rank: int
    n: int
    numel: int
    device: torch.device
    dtype: torch.dtype

    def full(self, numel: int, value: float) -> torch.Tensor:
        return torch.full((numel,), float(value), device=self.device, dtype=self.dtype)

    def empty(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, device=self.device, dtype=self.dtype)

    @property
    def chunk(self) -> int:
        return self.numel // self.n

    def eq(self, t: torch.Tensor, value: float) -> bool:
        return bool(torch.all(t == value).item())


def _all_reduce(c: Ctx) -> tuple[Run, Check]:
    # Checked after the first run only; later runs keep summing into the same buffer.
    buf = c.full(c.numel, c.rank + 1)
    return (lambda: dist.all_reduce(buf, group=c.group, async_op=True),
            lambda: c.eq(buf, c.n * (c.n + 1) / 2))


def _broadcast(c: Ctx) -> tuple[Run, Check]:
    buf = c.full(c.numel, 7 if c.rank == 0 else 0)
    return (lambda: dist.broadcast(buf, group_src=0, group=c.group, async_op=True),
            lambda: c.eq(buf, 7))


def _reduce(c: Ctx) -> tuple[Run, Check]:
    buf = c.full(c.numel, c.rank + 1)
    expect = c.n * (c.n + 1) / 2

    def run() -> Any:
        buf.fill_(c.rank + 1)  # reduce leaves the non-root buffers unspecified
        return dist.reduce(buf, group_dst=0, group=c.group, async_op=True)
    return run, lambda: c.rank != 0 or c.eq(buf, expect)


def _chunks_are_rank_plus_one(c: Ctx, out: torch.Tensor) -> bool:
    return all(c.eq(part, j + 1) for j, part in enumerate(out.view(c.n, -1)))


def _all_gather(c: Ctx) -> tuple[Run, Check]:
    inp, out = c.full(c.chunk, c.rank + 1), c.empty(c.chunk * c.n)
    return (lambda: ALL_GATHER(out, inp, group=c.group, async_op=True),
            lambda: _chunks_are_rank_plus_one(c, out))


def _gather(c: Ctx) -> tuple[Run, Check]:
    inp = c.full(c.chunk, c.rank + 1)
    out = c.empty(c.chunk * c.n)
    parts = list(out.view(c.n, -1)) if c.rank == 0 else None
    return (lambda: dist.gather(inp, parts, group_dst=0, group=c.group, async_op=True),
            lambda: c.rank != 0 or _chunks_are_rank_plus_one(c, out))


def _scatter(c: Ctx) -> tuple[Run, Check]:
    out = c.empty(c.chunk)
    parts = [c.full(c.chunk, j + 1) for j in range(c.n)] if c.rank == 0 else None
    return (lambda: dist.scatter(out, parts, group_src=0, group=c.group, async_op=True),
            lambda: c.eq(out, c.rank + 1))


def _reduce_scatter(c: Ctx) -> tuple[Run, Check]:
    inp, out = c.full(c.chunk * c.n, c.rank + 1), c.empty(c.chunk)
    return (lambda: REDUCE_SCATTER(out, inp, group=c.group, async_op=True),
            lambda: c.eq(out, c.n * (c.n + 1) / 2))


def _all_to_all(c: Ctx) -> tuple[Run, Check]:
    # Rank r sends chunk j = r*n + j to rank j, so rank r receives j*n + r from rank j.
    inp = torch.cat([c.full(c.chunk, c.rank * c.n + j) for j in range(c.n)])
    out = c.empty(c.chunk * c.n)
    return (lambda: dist.all_to_all_single(out, inp, group=c.group, async_op=True),
            lambda: all(c.eq(part, j * c.n + c.rank) for j, part in enumerate(out.view(c.n, -1))))


def _barrier(c: Ctx) -> tuple[Run, Check]:
    return lambda: dist.barrier(group=c.group, async_op=True), lambda: True


def _send_recv(c: Ctx) -> tuple[Run, Check]:
    # A ring: each rank sends to the next and receives from the previous, all at once.
    send, recv = c.full(c.numel, c.rank + 1), c.empty(c.numel)
    nxt, prev = (c.rank + 1) % c.n, (c.rank - 1) % c.n
    ops = [dist.P2POp(dist.isend, send, group=c.group, group_peer=nxt),
           dist.P2POp(dist.irecv, recv, group=c.group, group_peer=prev)]
    return lambda: dist.batch_isend_irecv(ops), lambda: c.eq(recv, prev + 1)


@dataclass(frozen=True)
class Op:
    name: str
    build: Callable[[Ctx], tuple[Run, Check]]
    factor: Callable[[int], float]
    """busbw / algbw for n ranks (nccl-tests' factors)."""
    min_ranks: int = 1
    sized: bool = True
    """False for barrier: it moves no data, so it is timed once, at size 0."""


def _one(n: int) -> float:
    return 1.0


def _spread(n: int) -> float:
    return (n - 1) / n


OPS: dict[str, Op] = {op.name: op for op in (
    Op("all_reduce", _all_reduce, lambda n: 2 * (n - 1) / n),
    Op("broadcast", _broadcast, _one),
    Op("reduce", _reduce, _one),
    Op("all_gather", _all_gather, _spread),
    Op("gather", _gather, _spread),
    Op("scatter", _scatter, _spread),
    Op("reduce_scatter", _reduce_scatter, _spread),
    Op("all_to_all", _all_to_all, _spread),
    Op("barrier", _barrier, _one, sized=False),
    Op("send_recv", _send_recv, _one, min_ranks=2),
)}


def wait(work: Any, device: torch.device) -> None:
    """Until the collective is done, on the device too (CUDA work completes asynchronously)."""
    for w in work if isinstance(work, list) else [work]:
        if w is not None:
            w.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
