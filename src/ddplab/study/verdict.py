"""The study's answer in words: which variant is best, whether each differs from the baseline
beyond the repeats' own spread, and what should make a reader distrust the numbers.

Throughput (perf/samples_per_s) is judged as a speed: "1.20x, faster", efficiency alarms. Any
other compared metric is judged as itself, in its own direction (metric_mode): "+12% val/acc vs
a, better", "b has the lowest val/loss".

Built only from the report's rows (report.Row), so it can be tested on made-up results.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..tracking.naming import varies_run_to_run
from .spec import better
from .table import Row, fmt, is_throughput

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
    headline: str = ""
    """A compared metric other than throughput: which variant has the best of it."""

    nothing: str = "no variant could be compared with the baseline"
    """What the text says when there is no comparison (no finished run logged the figure)."""

    @property
    def text(self) -> str:
        said = " ".join(([self.headline] if self.headline else []) + self.lines)
        return said or self.nothing


def _spread(row: Row) -> float | None:
    if not row.throughput_median or row.throughput_min is None or row.throughput_max is None:
        return None
    return (row.throughput_max - row.throughput_min) / abs(row.throughput_median)


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


def _change(row: Any, base: Any) -> str:
    """A named metric against the baseline: "+12% val/acc vs a (0.850 vs 0.759), better (range
    +5% to +20%)": "better", "worse" or "within the repeats' range" in the metric's direction,
    from the range of the differences over the repeats; a figure that varies run to run (a
    time, a rate, memory: reproduce's rule) has throughput's 5% floor, the machines' drift,
    which a loss or an accuracy does not have."""

    metric, scale = row.metric, abs(base.throughput_median) or None
    low = row.throughput_min - base.throughput_max
    high = row.throughput_max - base.throughput_min

    def rel(x: float) -> str:
        return f"{x / scale:+.1%}" if scale else f"{x:+.3g}"
    said = (f"{rel(row.throughput_median - base.throughput_median)} {metric} vs {base.variant} "
            f"({fmt(row.throughput_median)} vs {fmt(base.throughput_median)})")
    if low == high == 0:
        return f"{said}, the same"
    if low <= 0 <= high:
        return f"{said}, within the repeats' range ({rel(low)} to {rel(high)})"
    if varies_run_to_run(metric) and scale and \
            abs(row.throughput_median - base.throughput_median) / scale <= NOISE:
        return (f"{said}, within noise (a timing's {NOISE:.0%} floor; range {rel(low)} to "
                f"{rel(high)})")
    up = low > 0
    word = "better" if up == (row.metric_mode != "min") else "worse"
    return f"{said}, {word} (range {rel(low)} to {rel(high)})"


def judge(rows: list[Any], baseline: str, single_epoch: bool = False) -> Verdict:
    """The verdict of a study from its rows (with_ratios already applied: each row names the
    compared metric and its mode)."""
    v = Verdict()
    measured = [r for r in rows if r.measured]
    throughput = not rows or is_throughput(rows[0].metric)
    if rows and not measured and any(r.unlogged or r.not_finite for r in rows):
        v.nothing = (f"no finished run logged a value of {rows[0].metric} to compare (the "
                     "warnings say which; each run's metrics are in the MLflow UI)")
    lowest = bool(rows) and rows[0].metric_mode == "min"
    if measured:
        pick = min if lowest else max
        top = pick(measured, key=lambda r: r.throughput_median)
        v.best = top.variant
        if not throughput and len(measured) == 1 < len(rows):  # (not "the highest" of one)
            v.headline = (f"only {top.variant} has a {top.metric} to compare "
                          f"({fmt(top.throughput_median)}; {better(top.metric_mode)}): no other "
                          "variant's finished run logged one (the warnings say why).")
        elif not throughput:
            v.headline = (f"{top.variant} has the {'lowest' if lowest else 'highest'} "
                          f"{top.metric} ({fmt(top.throughput_median)}; "
                          f"{better(top.metric_mode)}).")
    base = next((r for r in rows if r.variant == baseline and r.measured), None)
    for row in rows:
        _warn(v, row, base)
        if base is None or row is base or not row.measured:
            continue
        repeats = f"over {_compared(row)} repeat(s){_accuracy(row, base)}."
        if throughput and row.speedup is not None:
            v.lines.append(f"{row.variant} is {row.speedup:.2f}x {baseline}, "
                           f"{_compare(row, base)} {repeats}")
        elif not throughput:
            v.lines.append(f"{row.variant}: {_change(row, base)} {repeats}")
    # (a wall time, a rate, memory as much as throughput: a script study's default figure too)
    timing = bool(rows) and (throughput or varies_run_to_run(rows[0].metric))
    if timing and len(measured) > 1 and all(_compared(r) <= 1 for r in measured):
        what = "a speed" if throughput else f"a {rows[0].metric}"
        v.warnings.append(f"one repeat per variant: {what} difference has no spread to be "
                          f"judged by, only the {NOISE:.0%} floor (this machine's drift can pass "
                          "it); run repeats >= 3, interleaved, to trust "
                          f"{'faster or slower' if throughput else 'better or worse'}")
    if single_epoch and throughput:
        v.warnings.append("one epoch only: throughput comes from its log intervals after the "
                          "first, a short job's mostly warm-up; run train.epochs >= 2 to trust it")
    return v


def _compared(row: Any) -> int:
    """The repeats behind a row's median: not those that failed, logged nothing, or diverged."""
    return int(row.runs - row.failed - row.unlogged - row.not_finite)


def _warn(v: Verdict, row: Any, base: Any) -> None:
    spread = _spread(row)
    if spread is not None and spread > SPREAD_WARN and row.runs - row.failed > 1:
        if is_throughput(row.metric):
            v.warnings.append(f"{row.variant}: its repeats spread {spread:.0%} (over "
                              f"{SPREAD_WARN:.0%}): the machine was busy, or the runs too short")
        else:
            v.warnings.append(f"{row.variant}: its repeats' {row.metric} spread {spread:.0%} of "
                              f"its median (over {SPREAD_WARN:.0%}): a difference smaller than "
                              "that is not the variant's")
    if (base is not None and row is not base and row.efficiency is not None
            and row.resources == base.resources and row.precision == base.precision
            and row.efficiency > EFFICIENCY_WARN):
        v.warnings.append(f"{row.variant}: efficiency {row.efficiency:.2f} with the same resources "
                          f"as {base.variant} ({row.resources}): more than the cores can give; "
                          "the baseline was slowed by something else (a busy machine?)")
    if row.mfu is not None and row.mfu > 1:  # (a CPU's peak is measured at the job's start)
        v.warnings.append(f"{row.variant}: perf/mfu {row.mfu:.0%}, above the peak: the peak measured "
                          "at its start was low (a busy machine?); its MFU says nothing")
    if "(asked" in row.backend:
        v.warnings.append(f"{row.variant}: ran on {row.backend}: the backend fell back")
    if row.failed:
        v.warnings.append(f"{row.variant}: {row.failed} of {row.runs} runs failed")
    finished = row.runs - row.failed
    if row.unlogged:
        v.warnings.append(f"{row.variant}: {row.unlogged} of {finished} finished runs logged no "
                          f"{row.metric}")
    if row.not_finite:
        v.warnings.append(f"{row.variant}: {row.not_finite} of {finished} finished runs ended "
                          f"with {row.metric} nan or inf (diverged?): left out of its median")
