"""Made-up report rows for the verdict and the saved views (unit tests)."""

from __future__ import annotations

from ddplab.study.report import Row


def row(name: str, median: float, low: float, high: float, resources: int = 2,
        accuracy: float = 0.95, backend: str = "gloo", runs: int = 3, failed: int = 0,
        precision: str = "fp32") -> Row:
    return Row(name, runs, failed, median, low, high, None, None, accuracy, 0.1, None, 10.0,
               resources, backend, "torchrun", precision=precision)


def with_ratios(rows: list[Row], baseline: str) -> list[Row]:
    base = next(r for r in rows if r.variant == baseline)
    for r in rows:
        r.speedup = r.throughput_median / base.throughput_median
        r.efficiency = r.speedup / (r.resources / base.resources)
    return rows
