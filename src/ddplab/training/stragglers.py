"""Which rank the others wait for: one rule for ddplab's loop (fit.py, every logged interval)
and script mode (figures.py, over the whole job). Torch-free.

A rank's *busy* time per step is its own work before the gradient all-reduce (data loading and
forward): DDP's all-reduce evens out step times, so the others' wait shows only there.
"""

from __future__ import annotations

import statistics

RATIO = 1.2
"""A rank busier than this times the median of the others ..."""
INTERVALS = 3
"""... in this many logged intervals in a row (ddplab's loop) is named, once ..."""
FLOOR_S = 0.002
"""... and by more than this per step: a tiny model's sub-millisecond jitter is no straggler."""


def slow(busy: list[float]) -> list[tuple[int, float, float]]:
    """(rank, its busy s, the others' median) for every rank slower than the rule allows."""
    out = []
    for r, mine in enumerate(busy):
        if len(busy) < 2:
            break
        others = statistics.median(busy[:r] + busy[r + 1:])
        if others > 0 and mine > RATIO * others and mine - others > FLOOR_S:
            out.append((r, mine, others))
    return out


def describe(rank: int, host: str, mine: float, others: float, over: str,
             phases: str = "data loading and forward") -> str:
    """The line the run (``ddplab.straggler``) and the console carry; ``phases``: where the
    rank's extra work was, where that is known."""
    return (f"rank {rank} (host {host}) is a straggler: {mine / others:.2f}x the others' median "
            f"work per step before the gradient all-reduce ({mine * 1000:.1f} ms vs "
            f"{others * 1000:.1f} ms: {phases}) {over}; the others wait for it every step")
