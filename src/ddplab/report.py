"""The end of the flow: progress lines while training and ``summary.json`` at the end.

Rank 0 prints; other ranks hold a silent Console, so no caller asks ``if rank == 0``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .loop import percentile


class Console:
    """Progress lines on stderr, and an optional local copy of summary.json (``--summary-out``)."""

    def __init__(self, active: bool, summary_out: str = "") -> None:
        self.active, self.summary_out = active, summary_out

    def say(self, text: str) -> None:
        if self.active:
            print(f"[ddplab] {text}", file=sys.stderr, flush=True)

    def save_summary(self, text: str) -> None:
        if self.active and self.summary_out:
            Path(self.summary_out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.summary_out).write_text(text)


@dataclass
class RunStats:
    """Whole-job numbers that end up in summary.json (rank 0's view)."""

    step_times: list[float] = field(default_factory=list)
    data_time: float = 0.0
    samples_per_s: list[float] = field(default_factory=list)
    time_to_first_step_s: float | None = None
    epoch_times: list[float] = field(default_factory=list)
    last: dict[str, float] = field(default_factory=dict)

    def summary(self, wall_time_s: float, world_size: int, global_batch: int,
                steps: int) -> dict[str, Any]:
        busy = sum(self.step_times)
        return {
            "world_size": world_size,
            "global_batch": global_batch,
            "steps": steps,
            "wall_time_s": round(wall_time_s, 3),
            "time_to_first_step_s": self.time_to_first_step_s,
            "samples_per_s_mean": (sum(self.samples_per_s) / len(self.samples_per_s)
                                   if self.samples_per_s else 0.0),
            "step_time_p50_s": percentile(self.step_times, 50),
            "step_time_p95_s": percentile(self.step_times, 95),
            "data_wait_frac": self.data_time / busy if busy else 0.0,
            "epoch_time_s": self.epoch_times,
            "final_metrics": self.last,
        }
