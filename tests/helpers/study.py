"""Made-up report rows for the verdict and the saved views (unit tests)."""

from __future__ import annotations

from ddplab.study.table import Row, with_ratios

__all__ = ["row", "with_ratios"]  # the report's own ratios, not a copy


def row(name: str, median: float, low: float, high: float, resources: int = 2,
        accuracy: float = 0.95, backend: str = "gloo", runs: int = 3, failed: int = 0,
        precision: str = "fp32") -> Row:
    return Row(name, runs, failed, median, low, high, None, None, accuracy, 0.1, None, None, None,
               10.0, resources, backend, "torchrun", precision=precision)
