"""A script job's training figures from what each rank's observation reported (observe.py),
put together by rank 0's supervisor once every rank has ended: the names ddplab's own loop
records, ``summary.json`` and the closing line. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...tracking import schema
from .. import stragglers

STRAGGLER_MIN_STEPS = 10
"""Steps every rank must have made for a straggler to be named: the median of a few steps'
data wait and forward (a 3-step smoke test's) is their noise, not a rank's pace."""

MOSTLY = 0.8
"""A straggler's work named by its phase (data loading, forward) when that phase holds at least
this share of its data wait + forward."""
TRAIN_LOSS, SAMPLES_PER_S, MFU = "train/loss", "perf/samples_per_s", "perf/mfu"


@dataclass
class Figures:
    """What the run records of a script's training; empty when nothing was observed."""

    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    line: str = ""
    straggler: str = ""
    step: int = 0
    mixed: list[str] = field(default_factory=list)
    """Names the observation logged before the script (any rank) logged them itself
    (schema.OBSERVED_MIXED): their series in the run holds both, said on the console."""
    last_log: dict[str, Any] | None = None
    """Rank 0's last log point, when its script was stopped before putting it in the spool
    ({"step": ..., "metrics": ...}, the script's own names left out)."""


def observed(outcomes: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each rank's observation (ranks that observed nothing left out)."""
    out = {}
    for r, o in outcomes.items():
        seen = (o.get("observed") or {}).get("observe")
        if isinstance(seen, dict) and seen.get("steps"):
            out[r] = seen
    return out


def figures(outcomes: dict[int, dict[str, Any]], wall_s: float) -> Figures:
    ranks = observed(outcomes)
    if 0 not in ranks:
        return Figures()
    zero = ranks[0]
    # A rate only where a rank timed steps after its first (a script that failed at its first
    # step logged 0.0 samples/s, which reads as a measurement).
    rates = {r: float(o["samples_per_s"]) for r, o in ranks.items() if o.get("samples_per_s")}
    total = sum(rates.values())
    metrics: dict[str, float] = {SAMPLES_PER_S: round(total, 3)} if rates else {}
    for r, o in sorted(ranks.items()):
        if r in rates:
            metrics[f"train/rank{r}_samples_per_s"] = rates[r]
        metrics[f"train/rank{r}_busy_s"] = float(o.get("busy_s") or 0.0)
    memory = {name: max(float(o[key]) for o in ranks.values() if key in o)
              for name, key in (("memory/peak_rss_mb", "peak_rss_mb"),
                                ("memory/peak_allocated_mb", "peak_allocated_mb"))
              if any(key in o for o in ranks.values())}
    metrics.update(memory)
    mfu, tags = _mfu(ranks, total)
    if mfu is not None:
        metrics[MFU] = float(f"{mfu:.6g}")  # (a CPU's 2.883e-05 was stored as 2.9e-05)
    # The script's own names, whichever rank logged them (a name only rank 1 logs, too).
    own = {n for o in ranks.values() for n in o.get("own_names") or []}
    metrics = {k: v for k, v in metrics.items() if k not in own}
    if zero.get("clock"):
        tags[schema.SCRIPT_CLOCK] = str(zero["clock"])
    fig = Figures(metrics=metrics, tags=tags, step=int(zero["steps"]))
    sent = set(zero.get("sent_names") or [])
    fig.mixed = sorted(own & sent)
    if sent - own:
        fig.tags[schema.OBSERVED] = ",".join(sorted(sent - own))
    if fig.mixed:
        fig.tags[schema.OBSERVED_MIXED] = ",".join(fig.mixed)
    pending = zero.get("pending")
    if isinstance(pending, dict) and isinstance(pending.get("metrics"), dict):
        kept = {k: v for k, v in pending["metrics"].items() if k not in own}
        fig.last_log = {"step": int(pending.get("step") or 0), "metrics": kept,
                        "ts": int(pending.get("ts") or 0)} if kept else None
    fig.straggler = _straggler(ranks, outcomes)
    if fig.straggler:
        fig.tags[schema.STRAGGLER] = fig.straggler
    fig.summary = _summary(ranks, {**metrics, SAMPLES_PER_S: round(total, 3) if rates else None,
                                   **({MFU: float(f"{mfu:.6g}")} if mfu is not None else {})},
                           wall_s, fig.straggler)
    fig.line = _line(zero, wall_s, total if rates else None, mfu, own)
    return fig


def _line(zero: dict[str, Any], wall_s: float, total: float | None, mfu: float | None,
          own: set[str]) -> str:
    """The closing console line, the observed figures; under a name the script logs itself
    (whose value in the run is the script's), a plain word, not the name."""
    def name(metric: str, word: str) -> str:
        return f"observed {word}" if metric in own else metric

    parts = [f"done in {wall_s:.1f}s: {zero['steps']} steps"]
    loss = zero.get("loss")
    if isinstance(loss, (int, float)):
        shown = f"{loss:.4f}"  # a loss that is 0 (pytorch/examples' one-class toy) read -0.0000
        parts.append(f"{name(TRAIN_LOSS, 'loss')} {shown.removeprefix('-') if float(shown) == 0 else shown}")
    if total is not None:
        parts.append(f"{total:.0f} {'observed ' if SAMPLES_PER_S in own else ''}samples/s")
    if mfu is not None:
        parts.append(f"{name(MFU, 'MFU')} {mfu:.4g}")  # (a CPU's tiny model: 1.1e-05, not 0)
    return ", ".join(parts)


def _mfu(ranks: dict[int, dict[str, Any]], samples_per_s: float
         ) -> tuple[float | None, dict[str, str]]:
    """perf/mfu as ddplab's loop counts it: rank 0's FLOPs per sample x the job's samples/s
    (its forwards' rows/s for a counted figure) over the job's peak (every distinct device
    once, every CPU rank's own measurement)."""
    zero = ranks[0]
    flops = float(zero.get("flops_per_sample") or 0.0)
    if zero.get("flops_source") != "script.flops_per_sample":
        # A count is per row the model took: its rate, which a GAN's fakes and SAM's second
        # pass are in (samples/s is bounded by what the loaders gave: observe.Observer._bounded)
        samples_per_s = sum(float(o.get("rows_per_s") or o.get("samples_per_s") or 0.0)
                            for o in ranks.values())
    peaks = {o.get("peak_where", r): float(o.get("peak_flops_s") or 0.0) for r, o in ranks.items()}
    peak = sum(peaks.values())
    tags = {schema.MFU_FLOPS_SOURCE: str(zero.get("flops_source", "not counted"))}
    if not flops or not peak or not samples_per_s:  # (no rate: no MFU, not an MFU of 0)
        return None, tags
    tags.update({schema.MFU_FLOPS_PER_SAMPLE: f"{flops:.4g}",
                 schema.MFU_PEAK_TFLOPS: f"{peak / 1e12:.4g}",
                 schema.MFU_PEAK_SOURCE: f"{zero.get('peak_source', '')} ({len(peaks)} x)"})
    return samples_per_s * flops / peak, tags


def _straggler(ranks: dict[int, dict[str, Any]], outcomes: dict[int, dict[str, Any]]) -> str:
    if len(ranks) < 2 or sorted(ranks) != list(range(len(ranks))) or \
            min(int(o.get("steps") or 0) for o in ranks.values()) < STRAGGLER_MIN_STEPS:
        return ""
    busy = [float(ranks[r].get("busy_s") or 0.0) for r in range(len(ranks))]
    slow = stragglers.slow(busy)
    if not slow:
        return ""
    r, mine, others = max(slow, key=lambda s: s[1] / s[2])
    wait, forward = (float(ranks[r].get(k) or 0.0) for k in ("data_wait_s", "forward_s"))
    phases = "data loading" if wait >= MOSTLY * (wait + forward) > 0 else \
        "forward" if forward >= MOSTLY * (wait + forward) > 0 else "data loading and forward"
    if phases == "data loading" and ranks[r].get("loaders") and \
            float(ranks[r].get("loader_s") or 0.0) < wait / 2:
        # Its data loaders' next() took under half of it: other work between its steps (a
        # rank's own logging or bookkeeping), not loading.
        phases = "between steps, outside its data loader"
    steps = int(ranks[r].get("steady_steps") or ranks[r]["steps"])
    return stragglers.describe(r, str(outcomes.get(r, {}).get("host", "?")), mine, others,
                               f"(the median of its {steps} steady steps)", phases)


def _summary(ranks: dict[int, dict[str, Any]], metrics: dict[str, float | None], wall_s: float,
             straggler: str) -> dict[str, Any]:
    zero = ranks[0]
    epochs = zero.get("epochs") or []
    steady = float(zero.get("steady_s") or 0.0)
    return {
        "mode": "script (observed)",
        "world_size": len(ranks),
        "steps": zero["steps"],
        "samples": sum(int(o.get("samples") or 0) for o in ranks.values()),
        "wall_time_s": round(wall_s, 3),
        "samples_per_s_steady": metrics.get(SAMPLES_PER_S),
        "mfu": metrics.get(MFU),
        "final_loss": zero.get("loss"),
        "clock": zero.get("clock"),
        # What the observation itself took of rank 0's steady steps (its hooks' own time).
        "observe_frac": round(float(zero.get("observe_s") or 0.0) / steady, 6) if steady else None,
        "epoch_time_s": [e.get("time_s") for e in epochs],
        "epoch_steps": [e.get("steps") for e in epochs],
        "per_rank": {str(r): {k: o.get(k) for k in ("steps", "samples", "samples_per_s",
                                                     "busy_s", "data_wait_s", "forward_s",
                                                     "backward_s", "observe_s",
                                                     "peak_rss_mb")}
                     for r, o in sorted(ranks.items())},
        "straggler": straggler or None,
        "memory": {k: v for k, v in metrics.items() if k.startswith("memory/")},
    }
