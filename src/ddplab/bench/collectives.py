"""``ddplab bench collectives``: time every collective on every backend, check each result,
and find which op works on which backend and device here (the support matrix).

    ddplab bench collectives                                   # one process (world size 1)
    torchrun --standalone --nproc-per-node 2 -m ddplab bench collectives \\
        --backend gloo --ops all_reduce --sizes 1M,64M
    mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 ddplab bench collectives

Every rank runs this. A gloo "control" group (the default one) carries the bookkeeping: a
barrier before each timed call so all ranks start together, and the per-call times, of
which the slowest rank's counts (a collective is done when its last rank is). Each backend
under test gets its own group, so a backend that fails cannot take the bookkeeping with it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..training.loop import percentile
from . import BACKENDS
from .ops import Ctx, Op, wait

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
PROBE_BYTES = 4096


@dataclass
class Result:
    backend: str
    device: str
    op: str
    size: int
    """Bytes of the whole buffer (nccl-tests' convention, see ops.py)."""
    iters: int
    p50_s: float
    p95_s: float
    algbw: float
    """Bytes per second."""
    busbw: float
    ok: bool

    def row(self) -> dict[str, Any]:
        return {"backend": self.backend, "device": self.device, "op": self.op,
                "size_bytes": self.size, "iters": self.iters,
                "p50_ms": round(self.p50_s * 1e3, 4), "p95_ms": round(self.p95_s * 1e3, 4),
                "algbw_GBps": round(self.algbw / 1e9, 4), "busbw_GBps": round(self.busbw / 1e9, 4),
                "correct": self.ok}


@dataclass(frozen=True)
class Plan:
    backends: list[str]
    ops: list[Op]
    sizes: list[int]
    dtype: torch.dtype
    device: str
    """auto: nccl on CUDA, every other backend on the CPU."""
    iters: int
    warmup: int
    point_s: float
    """Time budget per measurement point: fewer iterations for big sizes (at least 3)."""


def device_for(backend: str, requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda", _local_gpu()) if backend == "nccl" else torch.device("cpu")
    return torch.device("cuda", _local_gpu()) if requested == "cuda" else torch.device("cpu")


def _local_gpu() -> int:
    import os

    n = max(1, torch.cuda.device_count())
    return int(os.environ.get("LOCAL_RANK", "0")) % n


class Bench:
    """One rank's side of the benchmark; ``control`` is the default (gloo) group."""

    def __init__(self, plan: Plan, rank: int, n: int, timeout_s: float) -> None:
        self.plan, self.rank, self.n = plan, rank, n
        self.timeout = timeout_s
        self.groups: dict[str, Any] = {}

    def group(self, backend: str) -> Any:
        """The backend's own group (made once). Raises when the backend cannot start here."""
        if backend not in self.groups:
            import datetime

            self.groups[backend] = dist.new_group(
                backend=backend, timeout=datetime.timedelta(seconds=self.timeout))
        return self.groups[backend]

    # ---- agreement over the control group ----

    def _all(self, ok: bool) -> bool:
        """True when every rank says True."""
        t = torch.tensor([1 if ok else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _slowest(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    # ---- one op, once: does it work? ----

    def try_op(self, backend: str, device: torch.device, op: Op, size: int
               ) -> tuple[Any, str]:
        """(the op's run function, "") when it runs and checks out on every rank, else
        (None, why). The first run's result is the one checked."""
        if self.n < op.min_ranks:
            return None, f"needs at least {op.min_ranks} ranks"
        why = ""
        run = None
        try:
            ctx = Ctx(self.group(backend), self.rank, self.n, _numel(size, self.plan.dtype, self.n),
                      device, self.plan.dtype)
            run, check = op.build(ctx)
            wait(run(), device)
            if not check():
                why = "wrong result"
        except Exception as e:  # noqa: BLE001 - the reason is the support matrix's "no"
            why = _first_line(e)
        if not self._all(not why):
            return None, why or "failed on another rank"
        return run, ""

    # ---- one op at one size: the timing ----

    def measure(self, backend: str, device: torch.device, op: Op, size: int) -> Result | str:
        run, why = self.try_op(backend, device, op, size)
        if run is None:
            return why
        p = self.plan
        per_call = self._timed(run, device, p.warmup)
        estimate = max(self._slowest([statistics.median(per_call)])[0], 1e-7)
        iters = int(min(p.iters, max(3, p.point_s // estimate)))
        times = self._slowest(self._timed(run, device, iters))
        p50, p95 = percentile(times, 50), percentile(times, 95)  # as summary.json's step times
        nbytes = _numel(size, p.dtype, self.n) * _itemsize(p.dtype) if op.sized else 0
        algbw = nbytes / p50 if p50 > 0 else 0.0
        return Result(backend, device.type, op.name, nbytes, iters, p50, p95, algbw,
                      algbw * op.factor(self.n), True)

    def _timed(self, run: Any, device: torch.device, iters: int) -> list[float]:
        times = []
        for _ in range(max(1, iters)):
            dist.barrier()  # every rank starts the call together (control group)
            t0 = time.perf_counter()
            wait(run(), device)
            times.append(time.perf_counter() - t0)
        return times


def _numel(size: int, dtype: torch.dtype, n: int) -> int:
    """Elements for ``size`` bytes, a multiple of the world size (chunks must be equal)."""
    per = max(1, size // _itemsize(dtype))
    return max(n, per - per % n)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}"[:160]


# ---- the support matrix ----

def devices_here() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def support(bench: Bench, ops: list[Op]) -> dict[tuple[str, str], dict[str, str]]:
    """(backend, device) -> op -> "yes" or "no: why", for every backend ddplab knows."""
    from ..distributed.choice import available

    matrix: dict[tuple[str, str], dict[str, str]] = {}
    for device_name in ("cpu", "cuda"):
        table = available(device_name)
        for backend in BACKENDS:
            matrix[(backend, device_name)] = _column(bench, ops, backend, device_name, table)
    return matrix


def _column(bench: Bench, ops: list[Op], backend: str, device_name: str,
            table: dict[str, tuple[bool, str]]) -> dict[str, str]:
    if device_name not in devices_here():
        return {op.name: "no: no CUDA device here" for op in ops}
    usable, why = table[backend]
    if not usable:
        return {op.name: f"no: {why}" for op in ops}
    device = device_for(backend, device_name)
    out = {}
    for op in ops:
        run, reason = bench.try_op(backend, device, op, PROBE_BYTES)
        out[op.name] = "yes" if run is not None else f"no: {reason}"
    return out
