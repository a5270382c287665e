"""Per-rank profiles (``profile.enabled``): torch.profiler on every rank over the chosen steps,
each rank's Chrome trace an artifact of the run, and where a step's time went as metrics.

Time shares, from the trace of each rank (intervals merged, so parallel events count once):
- ``step_ms``: the profiled steps' mean length (torch's ProfilerStep ranges);
- ``compute_frac``: the training thread's aten ops (CPU), or the non-NCCL kernels (CUDA);
- ``comm_frac``: the backend's collectives (gloo/ccl/mpi ranges on its worker threads, NCCL's
  kernels on CUDA), from the moment DDP hands a bucket over until it is reduced;
- ``data_frac``: the batch fetch (``ddplab/data``, recorded in loop.py);
- ``overlap_frac``: the share of communication time during which compute ran too (DDP's
  bucketing lets the all-reduce of late layers run while early layers' backward computes);
- ``exposed_comm_frac``: communication nothing overlapped, the part that costs step time.
"""

from __future__ import annotations

import contextlib
import gzip
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import ProfileConfig

COMM_PREFIXES = ("gloo", "ccl", "mpi", "nccl")
Span = tuple[float, float]


def union(spans: list[Span]) -> list[Span]:
    """Merged, sorted, non-overlapping."""
    out: list[Span] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(spans: list[Span]) -> float:
    return sum(b - a for a, b in spans)


def intersect(x: list[Span], y: list[Span]) -> list[Span]:
    """Both inputs merged (``union``); the overlap, merged."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(x: list[Span], y: list[Span]) -> list[Span]:
    """x without y (both merged)."""
    out = []
    for a, b in x:
        cur = a
        for c, d in y:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


def _span(e: Any) -> Span:
    return (float(e.time_range.start), float(e.time_range.end))


def breakdown(events: list[Any]) -> dict[str, float]:
    """Where the profiled steps' time went (see the module docstring); {} without steps."""
    steps = [e for e in events if e.name.startswith("ProfilerStep")]
    if not steps:
        return {}
    window = union([_span(e) for e in steps])
    main = steps[0].thread
    total = length(window)
    cuda = [e for e in events if str(e.device_type).endswith("CUDA")]
    if cuda:
        comm = [_span(e) for e in cuda if "nccl" in e.name.lower()]
        compute = [_span(e) for e in cuda if "nccl" not in e.name.lower()]
    else:
        comm = [_span(e) for e in events if e.name.split(":", 1)[0].lower() in COMM_PREFIXES]
        compute = [_span(e) for e in events if e.thread == main and e.name.startswith("aten::")]
    data = intersect(union([_span(e) for e in events if e.name == "ddplab/data"]), window)
    comm_u = intersect(union(comm), window)
    compute_u = subtract(intersect(union(compute), window), data)
    overlap = length(intersect(comm_u, compute_u))
    return {
        "step_ms": total / len(steps) / 1e3,  # the profiler's times are microseconds
        "compute_frac": length(compute_u) / total,
        "comm_frac": length(comm_u) / total,
        "data_frac": length(data) / total,
        "overlap_frac": overlap / length(comm_u) if comm_u else 0.0,
        "exposed_comm_frac": (length(comm_u) - overlap) / total,
    }


class NoProfile:
    """``profile.enabled`` false: the loop's ``step()`` costs nothing."""

    def step(self) -> None:
        pass


class Profile(NoProfile):
    """One rank's profiler; the trace and the shares are kept when the window closes."""

    def __init__(self, cfg: ProfileConfig, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.trace: bytes = b""
        self.shares: dict[str, float] = {}
        self.steps = 0
        self.prof = profile(activities=activities, on_trace_ready=self._ready,
                            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup,
                                              active=cfg.active, repeat=1))

    def step(self) -> None:
        self.prof.step()
        self.steps += 1

    def _ready(self, prof: Any) -> None:
        self.shares = breakdown(list(prof.events()))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "trace.pt.trace.json")
            prof.export_chrome_trace(str(path))
            self.trace = gzip.compress(path.read_bytes(), compresslevel=6)


@contextlib.contextmanager
def profiling(job: Any) -> Iterator[None]:
    """Around the epoch loop: every rank profiles (``job.profiler.step()`` after each
    optimizer step); when training went through, rank 0 gathers every rank's trace and shares
    and records them in the run (a collective)."""
    cfg: ProfileConfig = job.cfg.profile
    if not cfg.enabled:
        yield
        return
    prof = Profile(cfg, job.layout.device)
    job.profiler = prof
    with prof.prof:
        yield
    job.profiler = NoProfile()
    _record(job, prof, cfg)


def _record(job: Any, prof: Profile, cfg: ProfileConfig) -> None:
    le = job.layout.le
    mine = (f"node{le.node_rank}-rank{le.rank}", prof.trace, prof.shares)
    every: list[Any] = [None] * le.world_size
    if le.world_size > 1:
        # all_gather, not gather: oneCCL (ccl) has no gather; the traces are gzipped (~1 MB).
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    if not le.is_rank0:
        return
    step = job.state.step
    if not prof.trace:
        job.console.say(f"profile: nothing recorded: the job took {prof.steps} steps, fewer than "
                        f"profile.wait + profile.warmup ({cfg.wait + cfg.warmup}) + 1")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name, trace, shares in every:
            path = Path(tmp, f"{name}.pt.trace.json.gz")
            path.write_bytes(trace)
            job.run.log_file(str(path), "profile")
            rank = name.split("rank")[-1]
            job.run.log_metrics({f"profile/rank{rank}/{k}": v for k, v in shares.items()}, step)
    s = every[0][2]
    job.console.say(
        f"profile ({len(every)} ranks, artifacts profile/*.pt.trace.json.gz, open in "
        f"ui.perfetto.dev): rank 0 step {s.get('step_ms', 0):.1f} ms, compute "
        f"{100 * s.get('compute_frac', 0):.0f}%, communication {100 * s.get('comm_frac', 0):.0f}% "
        f"({100 * s.get('overlap_frac', 0):.0f}% of it overlapped), data "
        f"{100 * s.get('data_frac', 0):.0f}%")
