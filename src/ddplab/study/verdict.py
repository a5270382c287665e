"""The study's answer in words: which variant is best, whether each differs from the baseline
beyond the repeats' own spread, and what should make a reader distrust the numbers.

Built only from the report's rows (report.Row), so it can be tested on made-up results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NOISE = 0.05
"""Ratios within 5% of 1 are "within noise" however tight the repeats (the machines drift
10-20% minute to minute; interleaved repeats cancel most of it, not all)."""
SPREAD_WARN = 0.15
"""A variant whose repeats spread more than this (max - min over the median) is flagged."""
ACCURACY_EQUAL = 0.01
EFFICIENCY_WARN = 1.5
"""Efficiency above this with the SAME resources and arithmetic (precision) as the baseline is not
a layout's doing: the baseline was slowed by something else. A layout can win what the other
one lost to exposed communication (2 gloo ranks on 2 cores expose about a quarter of a step,
so 1 rank x 2 threads may reach ~1.3x them); bf16 against fp32 may win more."""


@dataclass
class Verdict:
    best: str = ""
    lines: list[str] = field(default_factory=list)
    """One sentence per variant against the baseline."""
    warnings: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return " ".join(self.lines) or "no variant could be compared with the baseline"


def _spread(row: Any) -> float | None:
    if not row.throughput_median or row.throughput_min is None or row.throughput_max is None:
        return None
    return (row.throughput_max - row.throughput_min) / row.throughput_median


def _compare(row: Any, base: Any) -> str:
    """"faster", "slower" or "within noise", from the ratio's range over the repeats."""
    low = row.throughput_min / base.throughput_max if base.throughput_max else 0
    high = row.throughput_max / base.throughput_min if base.throughput_min else float("inf")
    if abs(row.speedup - 1) <= NOISE or low <= 1 <= high:
        return f"within noise (range {low:.2f}-{high:.2f})"
    return f"{'faster' if low > 1 else 'slower'} (range {low:.2f}-{high:.2f})"


def _accuracy(row: Any, base: Any) -> str:
    if row.eval_accuracy is None or base.eval_accuracy is None:
        return ""
    diff = row.eval_accuracy - base.eval_accuracy
    return "; accuracy equal" if abs(diff) < ACCURACY_EQUAL else f"; accuracy {diff:+.3f}"


def judge(rows: list[Any], baseline: str, single_epoch: bool = False) -> Verdict:
    """The verdict of a study from its rows (speedup and efficiency already computed)."""
    v = Verdict()
    measured = [r for r in rows if r.throughput_median]
    if measured:
        v.best = max(measured, key=lambda r: r.throughput_median).variant
    base = next((r for r in rows if r.variant == baseline and r.throughput_median), None)
    for row in rows:
        _warn(v, row, base)
        if base is None or row is base or row.speedup is None:
            continue
        v.lines.append(f"{row.variant} is {row.speedup:.2f}x {baseline}, {_compare(row, base)} "
                       f"over {row.runs - row.failed} repeat(s){_accuracy(row, base)}.")
    if single_epoch:
        v.warnings.append("one epoch only: throughput comes from its log intervals after the "
                          "first, not from whole steady epochs; run train.epochs >= 2 to trust it")
    return v


def _warn(v: Verdict, row: Any, base: Any) -> None:
    spread = _spread(row)
    if spread is not None and spread > SPREAD_WARN and row.runs - row.failed > 1:
        v.warnings.append(f"{row.variant}: its repeats spread {spread:.0%} (over "
                          f"{SPREAD_WARN:.0%}): the machine was busy, or the runs too short")
    if (base is not None and row is not base and row.efficiency is not None
            and row.resources == base.resources and row.precision == base.precision
            and row.efficiency > EFFICIENCY_WARN):
        v.warnings.append(f"{row.variant}: efficiency {row.efficiency:.2f} with the same resources "
                          f"as {base.variant} ({row.resources}): more than the cores can give; "
                          "the baseline was slowed by something else (a busy machine?)")
    if "(asked" in row.backend:
        v.warnings.append(f"{row.variant}: ran on {row.backend}: the backend fell back")
    if row.failed:
        v.warnings.append(f"{row.variant}: {row.failed} of {row.runs} runs failed")
