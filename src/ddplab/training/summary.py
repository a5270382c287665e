"""The end of the flow: progress lines while training and ``summary.json`` at the end.

Rank 0 prints; other ranks hold a silent Console, so no caller asks ``if rank == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..files import save_copy
from ..log import logger
from .loop import percentile


class Console:
    """Progress lines on stderr, and an optional local copy of summary.json (``--summary-out``)."""

    def __init__(self, active: bool, summary_out: str = "") -> None:
        self.active, self.summary_out = active, summary_out

    def say(self, text: str) -> None:
        if self.active:
            logger().info(text)

    def warn(self, text: str) -> None:
        if self.active:
            logger().warning(text)

    def save_summary(self, text: str) -> None:
        if self.active and self.summary_out:
            save_copy(self.summary_out, text)


@dataclass(frozen=True)
class CpuUse:
    """CPU seconds, all ranks and nodes. CPU, not wall time: every cycle tracking uses is taken
    from the ranks on a busy machine, and CPU time does not jitter with the machine's load."""

    job_s: float
    """Every rank's process plus every node's delivery process."""
    tracking_s: float
    """The delivery processes, rank 0's opening of the run and its appends to the spool."""
    tracking_startup_s: float
    """Of tracking_s, what starting took (importing MLflow, opening the store): paid once."""
    process_s: float
    """This rank's own process."""

    def summary(self) -> dict[str, float]:
        steady_job = self.job_s - self.tracking_startup_s
        return {
            "job_cpu_s": round(self.job_s, 3),
            "tracking_cpu_s": round(self.tracking_s, 3),
            "tracking_startup_cpu_s": round(self.tracking_startup_s, 3),
            "tracking_cpu_share": self.tracking_s / self.job_s if self.job_s else 0.0,
            "tracking_cpu_share_steady": ((self.tracking_s - self.tracking_startup_s) / steady_job
                                          if steady_job > 0 else 0.0),
            "process_cpu_s": round(self.process_s, 3),
        }


@dataclass
class RunStats:
    """Whole-job numbers that end up in summary.json (rank 0's view)."""

    step_times: list[float] = field(default_factory=list)
    data_time: float = 0.0
    samples_per_s: list[float] = field(default_factory=list)
    intervals: list[tuple[float, float, bool]] = field(default_factory=list)
    """Each log interval's samples (all ranks), the slowest rank's step time, and whether it is
    steady (not the profiler's: its steps run slower)."""
    time_to_first_step_s: float | None = None
    first_step_at: float | None = None
    """Wall-clock time (Unix) of the first step's end: a launcher's clock can compare it."""
    epoch_times: list[float] = field(default_factory=list)
    epoch_samples: list[int] = field(default_factory=list)
    """Samples (all ranks) each epoch of THIS attempt really trained: a resumed or
    max_steps-cut epoch counts only its own steps."""
    epoch_steps: list[int] = field(default_factory=list)
    epoch_cpu_s: list[float] = field(default_factory=list)
    """Rank 0's process CPU seconds (all its threads) each epoch."""
    last: dict[str, float] = field(default_factory=dict)
    evaluated_at: int = -1
    """The step of the newest evaluation."""
    early_best: float | None = None
    early_best_step: int = 0
    early_waited: int = 0
    """train.early_stopping: the best value so far, its step, evaluations since."""
    stopped_early: str = ""
    """Why training stopped before its steps ran out ("" = it did not)."""
    slow_streak: dict[int, int] = field(default_factory=dict)
    """Per rank, how many intervals in a row it was a straggler (fit._stragglers)."""
    straggler: str = ""
    """The straggler named in the run ("" = none)."""

    def steady_samples_per_s(self) -> float | None:
        """Throughput once started: all samples over the slowest rank's step time in the log
        intervals after the first (its first step holds start-up, compilation and the first
        data loading) but those the profiler ran in, pooled, not a mean of rates (a 2-sample
        interval at an epoch's end weighed as much as a full one). Evaluations, checkpoints
        and logging between steps are
        not step time: the same job evaluating every 2 steps read 20x slower (a hostile pass);
        nor is a short last epoch alone the figure (one step past an epoch's end read 2x).
        None when no step was timed (an attempt resumed at its last step trains none): 0.0
        would read as a measurement."""
        rest = [i for i in self.intervals[1:] if i[2]] or self.intervals[1:] or self.intervals
        seconds = sum(t for _, t, _ in rest)
        return sum(n for n, _, _ in rest) / seconds if seconds > 0 else None

    def end_epoch(self, seconds: float, samples: int, steps: int, cpu_s: float = 0.0) -> None:
        self.epoch_times.append(seconds)
        self.epoch_samples.append(samples)
        self.epoch_steps.append(steps)
        self.epoch_cpu_s.append(cpu_s)

    def summary(self, wall_time_s: float, world_size: int, global_batch: int, steps: int,
                checkpoint: str | None, tracking_busy_s: float, cpu: CpuUse) -> dict[str, Any]:
        """summary.json: the whole job's numbers, assembled here only."""
        busy = sum(self.step_times)
        return {
            "world_size": world_size,
            "global_batch": global_batch,
            "steps": steps,
            "wall_time_s": round(wall_time_s, 3),
            "time_to_first_step_s": self.time_to_first_step_s,
            "first_step_at": self.first_step_at,
            "samples_per_s_mean": (sum(self.samples_per_s) / len(self.samples_per_s)
                                   if self.samples_per_s else 0.0),
            "samples_per_s_steady": self.steady_samples_per_s(),
            "step_time_p50_s": percentile(self.step_times, 50),
            "step_time_p95_s": percentile(self.step_times, 95),
            "data_wait_frac": self.data_time / busy if busy else 0.0,
            "epoch_time_s": self.epoch_times,
            "epoch_steps": self.epoch_steps,
            "epoch_cpu_s": [round(c, 4) for c in self.epoch_cpu_s],
            "epoch_samples_per_s": [n / t if t > 0 else 0.0
                                    for n, t in zip(self.epoch_samples, self.epoch_times, strict=True)],
            "final_metrics": self.last,
            "stopped_early": self.stopped_early or None,
            "checkpoint": checkpoint,
            "tracking_busy_s": round(tracking_busy_s, 4),
            "tracking_busy_frac": tracking_busy_s / max(wall_time_s, 1e-9),
            **cpu.summary(),
        }
