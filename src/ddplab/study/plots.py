"""A study's plots (PNG, matplotlib): throughput with its spread over repeats, speedup vs
resources or the ratio to the baseline, model state vs throughput, and loss/accuracy curves
over steps and time from the runs' metric histories. A compared metric other than throughput is
drawn as itself (compared.png: its median and min-max per variant, its direction in the title),
with no speedup, ratio or memory-vs-throughput chart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..tracking import schema
from .spec import better
from .table import Row, by_name, fmt, is_throughput

PLOTS = {"throughput.png", "speedup.png", "throughput_ratio.png", "loss_vs_step.png",
         "loss_vs_time.png", "accuracy_vs_time.png", "memory_vs_throughput.png", "compared.png"}


STYLES = ("-", "--", ":", "-.")


MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def plots(client: Any, rows: list[Row], by_variant: dict[str, list[Any]], out: Path,
          baseline: str = "") -> list[Path]:
    """The report's PNGs: throughput; speedup vs resources when the variants' resources differ,
    else each variant's throughput ratio to the baseline; curves over steps and time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        made.append(out / name)

    measured = [r for r in rows if r.throughput_median is not None]
    if rows and not is_throughput(rows[0].metric):
        if measured:  # (no run logged the metric: no chart of empty axes)
            fig, ax = plt.subplots(figsize=(7, 4))
            _compared(ax, measured, rows[0].metric, rows[0].metric_mode,
                      by_name(measured, baseline))
            save(fig, "compared.png")
        measured = []  # none of throughput's own charts
    elif measured:
        fig, ax = plt.subplots(figsize=(7, 4))
        _throughput(ax, measured)
        save(fig, "throughput.png")
    scaled = [r for r in measured if r.speedup is not None]
    if len({r.resources for r in scaled}) > 1:
        fig, ax = plt.subplots(figsize=(7, 4))
        _speedup(ax, scaled, baseline)
        save(fig, "speedup.png")
    elif len(scaled) > 1:
        fig, ax = plt.subplots(figsize=(7, 4))
        _ratio(ax, scaled, by_name(measured, baseline))
        save(fig, "throughput_ratio.png")
    if len({r.model_state_mb for r in measured if r.model_state_mb is not None}) > 1:
        # (all at one model state, the chart is a column of dots: the table says it)
        fig, ax = plt.subplots(figsize=(7, 4))
        _memory(ax, [r for r in measured if r.model_state_mb is not None])
        save(fig, "memory_vs_throughput.png")
    curves = {"loss_vs_step.png": ("train/loss", "step"), "loss_vs_time.png": ("train/loss", "time"),
              "accuracy_vs_time.png": ("eval/accuracy", "time")}
    for name, (key, axis) in curves.items():
        series = _series(client, by_variant, key, axis)
        if any(len(xs) > 1 for _, _, xs, _ in series):  # a chart of single points says nothing
            fig, ax = plt.subplots(figsize=(7, 4))
            _curves(ax, series, key, axis)
            save(fig, name)
    return made


def _spread(r: Row) -> tuple[float, float, float]:
    """A measured row's (min, median, max) throughput: table() sets the three together."""
    low, mid, high = r.throughput_min, r.throughput_median, r.throughput_max
    if low is None or mid is None or high is None:
        raise ValueError(f"variant {r.variant}: no throughput measured")
    return low, mid, high


def _throughput(ax: Any, measured: list[Row]) -> None:
    spreads = [_spread(r) for r in measured]
    mids = [mid for _, mid, _ in spreads]
    ax.bar([r.variant for r in measured], mids,
           yerr=[[mid - low for low, mid, _ in spreads],
                 [high - mid for _, mid, high in spreads]], capsize=4,
           color="#4c72b0")
    _label_bars(ax, mids, [fmt(mid) for mid in mids])
    ax.set_ylabel("samples/s (perf/samples_per_s)")
    ax.set_title(f"Throughput per variant: median of {_repeats(measured)}, bars min-max")


def _compared(ax: Any, measured: list[Row], metric: str, mode: str, base: Row | None) -> None:
    spreads = [_spread(r) for r in measured]
    mids = [mid for _, mid, _ in spreads]
    ax.bar([r.variant for r in measured], mids,
           yerr=[[mid - low for low, mid, _ in spreads],
                 [high - mid for _, mid, high in spreads]], capsize=4, color="#4c72b0")
    if base is not None and base.throughput_median is not None:
        ax.axhline(base.throughput_median, color="grey", linestyle="--", linewidth=1,
                   label=f"baseline {base.variant}")
        # Beside the axes: inside, it covered a bar's value label (which 'best' ignores).
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _label_bars(ax, mids, [fmt(mid) for mid in mids])
    ax.set_ylabel(metric)
    # Two lines: a long metric's name ran the one line off the figure.
    ax.set_title(f"{metric} per variant ({better(mode)})\nmedian of {_repeats(measured)}, "
                 "bars min-max", fontsize=10)


def _label_bars(ax: Any, heights: list[float], texts: list[str]) -> None:
    """Each bar's value beside its error bar (not under it); the variant names slanted when
    they would run into each other."""
    for i, (h, text) in enumerate(zip(heights, texts, strict=True)):
        ax.annotate(text, (i, h), ha="left", va="bottom", xytext=(5, 2),
                    textcoords="offset points", fontsize=8,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})
    names = [t.get_text() for t in ax.get_xticklabels()]
    if len(names) > 5 or sum(len(n) for n in names) > 48:
        ax.tick_params(axis="x", labelrotation=30)
        for t in ax.get_xticklabels():
            t.set_horizontalalignment("right")


def _memory(ax: Any, rows: list[Row]) -> None:
    for i, r in enumerate(rows):
        ax.plot(r.model_state_mb, r.throughput_median, MARKERS[i % len(MARKERS)], markersize=9,
                label=r.variant)
    ax.set_xlabel("model state per rank, MB (parameters + gradients + optimizer; max over ranks)")
    ax.set_ylabel("samples/s (median)")
    ax.set_title("What each variant holds per rank vs its throughput")
    ax.legend(fontsize=8)


def _repeats(rows: list[Row]) -> str:
    counts = sorted({r.runs - r.failed for r in rows})
    return f"{'/'.join(map(str, counts))} repeat(s)"


def _speedup(ax: Any, scaled: list[Row], baseline: str) -> None:
    for i, r in enumerate(scaled):
        ax.plot(r.resources, r.speedup, MARKERS[i % len(MARKERS)], label=r.variant, markersize=8)
    base = by_name(scaled, baseline)
    unit = base.resources if base else 1
    xs = sorted({r.resources for r in scaled})
    ax.plot(xs, [x / unit for x in xs], "--", color="grey", label="ideal (linear)")
    ax.set_xticks(xs)
    ax.set_xlabel("resources (ranks x threads on CPU, GPUs on CUDA)")
    ax.set_ylabel(f"speedup vs {baseline}")
    ax.set_title(f"Speedup vs resources (baseline {baseline}, medians)")
    ax.legend(fontsize=8)


def _ratio(ax: Any, scaled: list[Row], base: Row | None) -> None:
    from .verdict import NOISE

    names = [r.variant for r in scaled]
    speedups = [r.speedup for r in scaled if r.speedup is not None]  # all: scaled rows have one
    def span(r: Row, speedup: float) -> tuple[float, float]:  # the ratio's range over the repeats
        if base is None or not base.throughput_max or not base.throughput_min:
            return 0.0, 0.0
        low, _, high = _spread(r)
        return (max(0.0, speedup - low / base.throughput_max),
                max(0.0, high / base.throughput_min - speedup))

    spans = [span(r, s) for r, s in zip(scaled, speedups, strict=True)]
    ax.bar(names, speedups, color="#4c72b0",
           yerr=[[below for below, _ in spans], [above for _, above in spans]], capsize=4)
    ax.axhspan(1 - NOISE, 1 + NOISE, color="grey", alpha=0.2, label=f"within noise (±{NOISE:.0%})")
    ax.axhline(1.0, color="grey", linewidth=1)
    _label_bars(ax, speedups, [f"{s:.2f}x" for s in speedups])
    base_name = base.variant if base else "the baseline"
    ax.set_ylabel(f"throughput / {base_name}'s")
    ax.set_title(f"Throughput vs {base_name} at equal resources ({scaled[0].resources}); "
                 "bars: the repeats' range")
    ax.legend(fontsize=8)


def _series(client: Any, by_variant: dict[str, list[Any]], key: str,
            axis: str) -> list[tuple[str, str, list[float], list[float]]]:
    """(variant, repeat, xs, ys) from each variant's first finished repeat."""
    out = []
    for variant, runs in by_variant.items():
        ok = sorted((r for r in runs if r.info.status == "FINISHED"),
                    key=lambda r: int(r.data.tags.get(schema.REPEAT, "0") or 0))
        if not ok:
            continue
        run = ok[0]
        hist = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        xs = [float(m.step) if axis == "step" else (m.timestamp - run.info.start_time) / 1000
              for m in hist]
        out.append((variant, run.data.tags.get(schema.REPEAT, "0"), xs, [m.value for m in hist]))
    return out


def _curves(ax: Any, series: list[tuple[str, str, list[float], list[float]]], key: str,
            axis: str) -> None:
    seen: dict[tuple[float, ...], str] = {}
    for i, (variant, repeat, xs, ys) in enumerate(series):
        same = seen.get(tuple(ys)) if axis == "step" else None
        seen.setdefault(tuple(ys), variant)
        label = f"{variant} r{repeat}" + (f" (= {same}: same values)" if same else "")
        ax.plot(xs, ys, linestyle=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)],
                markevery=max(1, len(xs) // 12), markersize=5, label=label)
    what = "loss (train/loss)" if key == "train/loss" else "eval accuracy (eval/accuracy)"
    x_label = "optimizer step" if axis == "step" else "wall time since the run started (s)"
    ax.set_xlabel(x_label)
    ax.set_ylabel(key)
    repeats = sorted({r for _, r, _, _ in series})
    ax.set_title(f"{what} vs {'step' if axis == 'step' else 'time'}: "
                 f"repeat {'/'.join('r' + r for r in repeats)} of each variant")
    ax.legend(fontsize=8)
