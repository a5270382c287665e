"""A study's comparison as rows, one per variant, built only from what its child runs logged
(tags, metrics, metric histories): runs finished/failed, the compared figure's median and
min-max over repeats, its change vs the baseline; for throughput (perf/samples_per_s) alone the
speedup vs the baseline and scaling efficiency (speedup / ratio of resources: ranks x threads on
CPU, ranks on GPU); MFU (how far from the devices' peak), final eval accuracy and loss, time to
the target accuracy, wall time, and the backend and launcher that actually ran.

The compared figure's columns keep their historical names (``throughput_*``) whatever it is;
``metric`` and ``metric_mode`` in each row say what it is.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from ..tracking import schema
from .spec import THROUGHPUT


def is_throughput(metric: str) -> bool:
    """Whether the compared figure is throughput, the one with a speedup and an efficiency (and
    the words "faster", "slower"); any other metric is compared as itself."""
    return metric == THROUGHPUT

COLUMNS = ("variant", "runs", "failed", "throughput_median", "throughput_min", "throughput_max",
           "speedup", "efficiency", "eval_accuracy", "eval_loss", "train_loss", "samples_per_s",
           "time_to_target_s",
           "wall_time_s", "resources", "backend", "launcher", "model_state_mb", "precision", "mfu",
           "change", "metric", "metric_mode", "unlogged", "not_finite")


@dataclass
class Row:
    variant: str
    runs: int
    failed: int
    throughput_median: float | None
    throughput_min: float | None
    throughput_max: float | None
    speedup: float | None
    efficiency: float | None
    eval_accuracy: float | None
    eval_loss: float | None
    train_loss: float | None
    """Median of the finished runs' last train/loss (a script's observed one too): what a
    study over a learning rate compares when its figure is a time."""
    samples_per_s: float | None
    """Median perf/samples_per_s where the compared figure is another (a script study's wall
    time): the speed beside it; None where throughput is the compared figure itself."""
    time_to_target_s: float | None
    wall_time_s: float | None
    resources: int
    backend: str
    launcher: str
    model_state_mb: float | None = None
    """The most model state (parameters, gradients, optimizer state) one rank held: what a
    sharding strategy saves (memory/model_state_mb_max)."""
    precision: str = "fp32"
    """The arithmetic the variant trained in (train.amp, or FSDP's mixed precision): a bf16
    variant may outrun fp32 on the same cores, which a layout cannot."""
    mfu: float | None = None
    """Median perf/mfu: how far the variant is from its devices' peak (training/mfu.py)."""
    change: float | None = None
    """The compared figure's median relative to the baseline's: (this - base) / |base|, signed
    as the figure moves (+0.12: 12% more of it, better or worse as metric_mode says)."""
    metric: str = THROUGHPUT
    """The compared figure (the throughput_* columns)."""
    metric_mode: str = "max"
    """max: higher of it is better; min: lower."""
    unlogged: int = 0
    """Finished runs that logged no value of the compared figure (left out of its median)."""
    not_finite: int = 0
    """Finished runs whose last value of it was nan or inf (diverged): left out of its median,
    where one would have made the median, and so the best, a nan."""

    @property
    def measured(self) -> bool:
        """It has a median of the compared figure (a throughput of 0 is none; a loss of 0 is one)."""
        if self.throughput_median is None:
            return False
        return bool(self.throughput_median) or not is_throughput(self.metric)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _resources(run: Any) -> int:
    """What a variant spends: ranks x threads on CPU, ranks (GPUs) on CUDA."""
    t = run.data.tags
    ranks = int(t.get(schema.WORLD_SIZE, "1") or 1)
    if t.get(schema.DEVICE) == "cuda":
        return ranks
    return ranks * int(t.get(schema.THREADS_PER_RANK, "1") or 1)


def _what_ran(runs: list[Any], key: str, asked: str = "") -> str:
    got = sorted({r.data.tags.get(key, "?") for r in runs})
    said = "/".join(got) or "?"
    # "auto" picking gloo is no fallback; asking for ccl and getting gloo is, and is said.
    wanted = sorted({r.data.tags.get(asked, "") for r in runs} - {"", "auto"}) if asked else []
    if wanted and wanted != got:
        return f"{said} (asked {'/'.join(wanted)})"
    return said


def time_to_target(client: Any, run: Any, target: float) -> float | None:
    if not target:
        return None
    for m in sorted(client.get_metric_history(run.info.run_id, "eval/accuracy"),
                    key=lambda m: m.timestamp):
        if m.value >= target:
            seconds: float = (m.timestamp - run.info.start_time) / 1000
            return seconds
    return None


ENVIRONMENT_TAGS = {schema.TORCH_BUILD: "torch", schema.LOCK: "locked environment",
                    schema.IMAGE: "image", schema.GIT_SHA: "code"}


def environment_warnings(children: list[Any]) -> list[str]:
    """A warning per environment fact the variants do not share: a comparison of two torch
    builds or two code versions is not the comparison the study asked for."""
    said = []
    counted = [c for runs in latest_per_job(children).values() for c in runs]  # (not an attempt
    # a rerun replaced: a failed job run again after a commit read "different code")
    for tag, what in ENVIRONMENT_TAGS.items():
        by_value: dict[str, set[str]] = {}
        for c in counted:  # (a job that failed before it said what it ran on contradicts none)
            if tag in c.data.tags:
                by_value.setdefault(c.data.tags[tag], set()).add(c.data.tags.get(schema.VARIANT, "?"))
        if len(by_value) > 1:
            parts = "; ".join(f"{v}: {', '.join(sorted(names))}" for v, names in sorted(by_value.items()))
            said.append(f"WARNING: the variants ran different {what} ({tag}): {parts}.")
    return said


def straggler_warnings(children: list[Any]) -> list[str]:
    """A warning per counted run that named a straggler (``ddplab.straggler``): its throughput is
    the slow rank's, which the others waited for every step, not the layout's."""
    said = []
    for variant, runs in latest_per_job(children).items():
        for c in sorted(runs, key=lambda c: c.data.tags.get(schema.REPEAT, "0")):
            # A failed run's figures are counted nowhere (and a few steps' straggler is noise).
            named = c.data.tags.get(schema.STRAGGLER, "") if c.info.status == "FINISHED" else ""
            if named:
                said.append(f"WARNING: {variant} (repeat {c.data.tags.get(schema.REPEAT, '0')}, "
                            f"run {c.info.run_id}): {named}.")
    return said


def _precision(run: Any) -> str:
    params: dict[str, str] = run.data.params
    for key in ("train.amp", "dist.fsdp.mixed_precision"):
        if params.get(key, "none") != "none":
            return params[key]
    return "fp32"


def _wall_s(run: Any) -> float | None:
    """The job's own wall time (a script's perf/wall_s, the loop's perf/wall_time_s), else the
    run's start to end in MLflow, which adds the launcher's start-up and the run's opening:
    beside a compared perf/wall_s, that ranked a script study's variants the other way."""
    for key in ("perf/wall_s", "perf/wall_time_s"):
        if key in run.data.metrics:
            return float(run.data.metrics[key])
    return (run.info.end_time - run.info.start_time) / 1000 if run.info.end_time else None


def latest_per_job(children: list[Any]) -> dict[str, list[Any]]:
    """Per variant, one run per repeat: the FINISHED one, else the newest attempt."""
    best: dict[tuple[str, str], Any] = {}
    for c in sorted(children, key=lambda c: c.info.start_time):
        key = (c.data.tags.get(schema.VARIANT, "?"), c.data.tags.get(schema.REPEAT, "0"))
        if key not in best or best[key].info.status != "FINISHED":
            best[key] = c
    out: dict[str, list[Any]] = {}
    for (variant, _), c in best.items():
        out.setdefault(variant, []).append(c)
    return out


def table(client: Any, children: list[Any], order: list[str], baseline: str,
          target: float, metric: str = THROUGHPUT, mode: str = "max") -> list[Row]:
    """One row per variant; ``metric`` is the compared figure (the throughput columns),
    ``mode`` whether higher (max) or lower (min) is better."""
    by_variant = latest_per_job(children)
    rows = []
    for name in [n for n in order if n in by_variant] + sorted(set(by_variant) - set(order)):
        runs = by_variant[name]
        ok = [r for r in runs if r.info.status == "FINISHED"]
        logged = [r.data.metrics[metric] for r in ok if metric in r.data.metrics]
        speeds = [x for x in logged if math.isfinite(x)]
        targets = [t for r in ok if (t := time_to_target(client, r, target)) is not None]
        rows.append(Row(
            name, len(runs), len(runs) - len(ok), _median(speeds), min(speeds, default=None),
            max(speeds, default=None), None, None,
            _median([r.data.metrics["eval/accuracy"] for r in ok if "eval/accuracy" in r.data.metrics]),
            _median([r.data.metrics["eval/loss"] for r in ok if "eval/loss" in r.data.metrics]),
            _median([r.data.metrics["train/loss"] for r in ok if "train/loss" in r.data.metrics]),
            None if is_throughput(metric) else _median(
                [r.data.metrics[THROUGHPUT] for r in ok if THROUGHPUT in r.data.metrics]),
            _median(targets) if len(targets) == len(ok) else None,
            _median([w for r in ok if (w := _wall_s(r)) is not None]),
            _resources(runs[0]), _what_ran(runs, schema.BACKEND, schema.BACKEND_REQUESTED),
            _what_ran(runs, schema.LAUNCHER),
            _median([r.data.metrics["memory/model_state_mb_max"] for r in ok
                     if "memory/model_state_mb_max" in r.data.metrics]),
            _precision(runs[0]),
            _median([r.data.metrics["perf/mfu"] for r in ok if "perf/mfu" in r.data.metrics]),
            metric=metric, metric_mode=mode, unlogged=len(ok) - len(logged),
            not_finite=len(logged) - len(speeds)))
    return with_ratios(rows, baseline, mode, metric)


def with_ratios(rows: list[Row], baseline: str, mode: str = "max",
                metric: str = THROUGHPUT) -> list[Row]:
    """Each row's change vs the baseline's median; for throughput also its speedup over the
    baseline's (``mode`` min: the baseline's over this one's) and efficiency (speedup per unit
    of resources). Any other metric has neither: a loss or an accuracy is not a speed."""
    for row in rows:
        row.metric, row.metric_mode = metric, mode
    base = next((r for r in rows if r.variant == baseline and r.measured), None)
    for row in rows:
        if base is None or base.throughput_median is None or not row.measured \
                or row.throughput_median is None:
            continue
        if base.throughput_median:
            row.change = (row.throughput_median - base.throughput_median) / abs(base.throughput_median)
        if is_throughput(metric):
            row.speedup = row.throughput_median / base.throughput_median
            if mode == "min":
                row.speedup = 1 / row.speedup
            row.efficiency = row.speedup / (row.resources / base.resources)
    return rows


def by_name(rows: list[Row], name: str) -> Row | None:
    return next((r for r in rows if r.variant == name), None)


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        # three significant digits below 0.1 (an MFU of 1.1e-05 read 0.000, every variant alike)
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}" if abs(v) >= 0.1 or v == 0 else \
            f"{v:.3g}"
    return str(v)
