"""``ddplab report PARENT_RUN_ID``: a study's comparison, built only from what its child runs
logged (tags, metrics, metric histories), so it can be rebuilt later from the store alone.

Per variant: runs finished/failed, median throughput (``perf/samples_per_s``: after the first
epoch, so start-up is not counted) with its min-max over repeats, speedup vs the baseline,
scaling efficiency (speedup / ratio of resources: ranks x threads on CPU, ranks on GPU), final
eval accuracy and loss, time to the target accuracy, wall time, and the backend and launcher
that actually ran. Artifacts of the parent run: report.md, report.html (plots inline),
results.csv, and the plots as PNGs under ``report/``.
"""

from __future__ import annotations

import base64
import csv
import io
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .verdict import Verdict, judge

COLUMNS = ("variant", "runs", "failed", "throughput_median", "throughput_min", "throughput_max",
           "speedup", "efficiency", "eval_accuracy", "eval_loss", "time_to_target_s",
           "wall_time_s", "resources", "backend", "launcher", "model_state_mb", "precision")


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


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _resources(run: Any) -> int:
    """What a variant spends: ranks x threads on CPU, ranks (GPUs) on CUDA."""
    t = run.data.tags
    ranks = int(t.get("ddplab.world_size", "1") or 1)
    if t.get("ddplab.device") == "cuda":
        return ranks
    return ranks * int(t.get("ddplab.threads_per_rank", "1") or 1)


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
            return (m.timestamp - run.info.start_time) / 1000
    return None


ENVIRONMENT_TAGS = {"ddplab.torch_build": "torch", "ddplab.lock": "locked environment",
                    "ddplab.image": "image", "ddplab.git_sha": "code"}


def environment_warnings(children: list[Any]) -> list[str]:
    """A warning per environment fact the variants do not share: a comparison of two torch
    builds or two code versions is not the comparison the study asked for."""
    said = []
    for tag, what in ENVIRONMENT_TAGS.items():
        by_value: dict[str, set[str]] = {}
        for c in children:
            by_value.setdefault(c.data.tags.get(tag, "?"), set()).add(c.data.tags.get("ddplab.variant", "?"))
        if len(by_value) > 1:
            parts = "; ".join(f"{v}: {', '.join(sorted(names))}" for v, names in sorted(by_value.items()))
            said.append(f"WARNING: the variants ran different {what} ({tag}): {parts}.")
    return said


def _precision(run: Any) -> str:
    params = run.data.params
    for key in ("train.amp", "dist.fsdp.mixed_precision"):
        if params.get(key, "none") != "none":
            return params[key]
    return "fp32"


def latest_per_job(children: list[Any]) -> dict[str, list[Any]]:
    """Per variant, one run per repeat: the FINISHED one, else the newest attempt."""
    best: dict[tuple[str, str], Any] = {}
    for c in sorted(children, key=lambda c: c.info.start_time):
        key = (c.data.tags.get("ddplab.variant", "?"), c.data.tags.get("ddplab.repeat", "0"))
        if key not in best or best[key].info.status != "FINISHED":
            best[key] = c
    out: dict[str, list[Any]] = {}
    for (variant, _), c in best.items():
        out.setdefault(variant, []).append(c)
    return out


def table(client: Any, children: list[Any], order: list[str], baseline: str,
          target: float, metric: str = "perf/samples_per_s", mode: str = "max") -> list[Row]:
    """One row per variant; ``metric`` is the compared figure (the throughput columns),
    ``mode`` whether higher (max) or lower (min) is better."""
    by_variant = latest_per_job(children)
    rows = []
    for name in [n for n in order if n in by_variant] + sorted(set(by_variant) - set(order)):
        runs = by_variant[name]
        ok = [r for r in runs if r.info.status == "FINISHED"]
        speeds = [r.data.metrics[metric] for r in ok if metric in r.data.metrics]
        targets = [t for r in ok if (t := time_to_target(client, r, target)) is not None]
        rows.append(Row(
            name, len(runs), len(runs) - len(ok), _median(speeds), min(speeds, default=None),
            max(speeds, default=None), None, None,
            _median([r.data.metrics["eval/accuracy"] for r in ok if "eval/accuracy" in r.data.metrics]),
            _median([r.data.metrics["eval/loss"] for r in ok if "eval/loss" in r.data.metrics]),
            _median(targets) if len(targets) == len(ok) else None,
            _median([(r.info.end_time - r.info.start_time) / 1000 for r in ok if r.info.end_time]),
            _resources(runs[0]), _what_ran(runs, "ddplab.backend", "ddplab.backend_requested"),
            _what_ran(runs, "ddplab.launcher"),
            _median([r.data.metrics["memory/model_state_mb_max"] for r in ok
                     if "memory/model_state_mb_max" in r.data.metrics]),
            _precision(runs[0])))
    return with_ratios(rows, baseline, mode)


def with_ratios(rows: list[Row], baseline: str, mode: str = "max") -> list[Row]:
    """Each row's speedup over the baseline's median (``mode`` min: a time or a loss, so the
    baseline's over this one's) and efficiency (speedup per unit of resources)."""
    base = next((r for r in rows if r.variant == baseline), None)
    for row in rows:
        if base and base.throughput_median and row.throughput_median:
            row.speedup = row.throughput_median / base.throughput_median
            if mode == "min":
                row.speedup = 1 / row.speedup
            row.efficiency = row.speedup / (row.resources / base.resources)
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)


HEADS = ("variant", "runs ok/all", "samples/s median [min-max]", "speedup", "efficiency",
         "eval acc", "eval loss", "time to target s", "wall s", "model state MB (max rank)",
         "backend, launcher")
NUMERIC = set(HEADS[1:10])


def _cells(r: Row) -> list[str]:
    spread = (f"{_fmt(r.throughput_median)} [{_fmt(r.throughput_min)}-{_fmt(r.throughput_max)}]"
              if r.throughput_median is not None else "-")
    wall = f"{r.wall_time_s:.0f}" if r.wall_time_s is not None else "-"
    return [r.variant, f"{r.runs - r.failed}/{r.runs}", spread, _fmt(r.speedup),
            _fmt(r.efficiency), _fmt(r.eval_accuracy), _fmt(r.eval_loss),
            _fmt(r.time_to_target_s), wall, _fmt(r.model_state_mb), f"{r.backend}, {r.launcher}"]


def _grid(rows: list[Row]) -> tuple[list[str], list[list[str]]]:
    """The table's heads and cells, without the columns no variant has a value in (no target
    accuracy: no "time to target"), so it stays narrow enough for MLflow's artifact pane."""
    cells = [_cells(r) for r in rows]
    keep = [i for i in range(len(HEADS)) if i == 0 or any(c[i] != "-" for c in cells)]
    return [HEADS[i] for i in keep], [[c[i] for i in keep] for c in cells]


def markdown(rows: list[Row], title: str, notes: list[str]) -> str:
    heads, cells = _grid(rows)
    lines = [f"# {title}", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join(lines + [""] + notes) + "\n"


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


def by_name(rows: list[Row], name: str) -> Row | None:
    return next((r for r in rows if r.variant == name), None)


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
    _label_bars(ax, mids, [_fmt(mid) for mid in mids])
    ax.set_ylabel("samples/s (perf/samples_per_s)")
    ax.set_title(f"Throughput per variant: median of {_repeats(measured)}, bars min-max")


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
                    key=lambda r: int(r.data.tags.get("ddplab.repeat", "0") or 0))
        if not ok:
            continue
        run = ok[0]
        hist = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        xs = [float(m.step) if axis == "step" else (m.timestamp - run.info.start_time) / 1000
              for m in hist]
        out.append((variant, run.data.tags.get("ddplab.repeat", "0"), xs, [m.value for m in hist]))
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


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;color:#1f2328;margin:12px;
  max-width:980px;line-height:1.4}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:18px 0 6px}
.verdict{background:#eef7ee;border-left:4px solid #2da44e;padding:8px 10px;margin:8px 0}
.warning{background:#fff8e1;border-left:4px solid #d4a72c;padding:6px 10px;margin:4px 0}
.scroll{overflow-x:auto}
table{border-collapse:collapse;font-size:12px;width:100%}
th{background:#f3f4f6;text-align:left;vertical-align:bottom}
td,th{border:1px solid #d0d7de;padding:3px 6px}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.note{color:#57606a;font-size:12px}
figure{margin:12px 0}img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:12px;color:#57606a}
"""


def html(md_rows: list[Row], title: str, notes: list[str], pngs: list[Path]) -> str:
    """report.html: the verdict and warnings on top, the table, then the plots; sized to fit
    MLflow's artifact pane (the table scrolls by itself rather than cut columns)."""
    from html import escape

    heads, cells = _grid(md_rows)
    head = "".join(f"<th>{escape(h)}</th>" for h in heads)
    body = "".join("<tr>" + "".join(
        f"<td class='num'>{escape(c)}</td>" if h in NUMERIC else f"<td>{escape(c)}</td>"
        for h, c in zip(heads, row, strict=True)) + "</tr>" for row in cells)
    top = "".join(
        f"<div class='verdict'>{escape(n)}</div>" if n.startswith("Verdict:") else
        f"<div class='warning'>{escape(n)}</div>" if n.startswith("WARNING:") else ""
        for n in notes)
    rest = "".join(f"<p class='note'>{escape(n)}</p>" for n in notes
                   if not n.startswith(("Verdict:", "WARNING:")))
    images = "".join(
        f"<figure><img alt='{p.stem}' src='data:image/png;base64,"
        f"{base64.b64encode(p.read_bytes()).decode()}'><figcaption>{p.name}</figcaption></figure>"
        for p in pngs)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{escape(title)}</h1>{top}"
            f"<div class='scroll'><table><tr>{head}</tr>{body}</table></div>{rest}"
            f"<h2>Plots</h2>{images}</body></html>")


def results_csv(rows: list[Row]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS)
    w.writeheader()
    for r in rows:
        w.writerow(asdict(r))
    return buf.getvalue()


def build(client: Any, parent_id: str, study: Any = None, console: Any = None,
          uri: str = "", page: Path | None = None) -> list[Row]:
    """The report of one study's parent run, logged to that run and printed (with the
    addresses of the answer in the MLflow UI when ``uri`` is given), and written as the
    results page ``page`` when given."""
    parent = client.get_run(parent_id)
    tags = parent.data.tags
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent_id}'", max_results=5000)
    order = [v.name for v in study.variants] if study else []
    baseline = study.baseline if study else tags.get("ddplab.study_baseline", "")
    target = study.target_accuracy if study else float(tags.get("ddplab.study_target", 0) or 0)
    metric = study.metric if study else tags.get("ddplab.study_metric", "perf/samples_per_s")
    mode = study.metric_mode if study else tags.get("ddplab.study_metric_mode", "max")
    if study:
        client.set_tag(parent_id, "ddplab.study_baseline", baseline)
        client.set_tag(parent_id, "ddplab.study_target", str(target))
        client.set_tag(parent_id, "ddplab.study_metric", metric)
        client.set_tag(parent_id, "ddplab.study_metric_mode", mode)
    # Without the study file, the variants in the order they first ran (the study's order).
    rows = table(client, children, order or list(latest_per_job(children)), baseline, target,
                 metric, mode)
    title = f"study {tags.get('ddplab.study', parent_id)}"
    single = _single_epoch(children)
    steady = ("its log intervals after the first (one epoch)" if single
              else "the epochs after the first")
    figure = (f"Throughput: perf/samples_per_s of each finished run ({steady}); speedup = "
              "median / the baseline's median" if metric == "perf/samples_per_s" else
              f"Compared figure (the throughput columns): {metric} of each finished run, "
              f"{'lower' if mode == 'min' else 'higher'} is better; speedup = "
              + ("the baseline's median / this median" if mode == "min"
                 else "median / the baseline's median"))
    notes = [f"Baseline: {baseline}. {figure}; efficiency = speedup / (resources / the "
             "baseline's resources: ranks x threads on CPU, GPUs on CUDA)."]
    if target:
        notes.append(f"Time to target: first evaluation with accuracy >= {target}.")
    notes += [f"Skipped {k.split('.', 2)[2]}: {v}." for k, v in sorted(tags.items())
              if k.startswith("ddplab.skipped.")]
    notes += environment_warnings(children)
    verdict = judge(rows, baseline, single_epoch=single)
    notes = [f"Verdict: {verdict.text}"] + [f"WARNING: {w}." for w in verdict.warnings] + notes
    record_answer(client, parent_id, rows, verdict, study)
    md = markdown(rows, title, notes)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        pngs = plots(client, rows, latest_per_job(children), out, baseline) if children else []
        (out / "report.md").write_text(md)
        (out / "report.html").write_text(html(rows, title, notes, pngs))
        (out / "results.csv").write_text(results_csv(rows))
        _drop_stale_plots(client, parent, {p.name for p in pngs})
        client.log_artifacts(parent_id, str(out))
        if page is not None:
            from . import page as results_page

            results_page.write(page, parent, children, md, pngs)
    if console is not None:
        _print(rows, title, console)
        console.print(f"Verdict: {verdict.text}")
        for w in verdict.warnings:
            console.print(f"WARNING: {w}")
        if uri:
            _print_addresses(uri, parent.info.experiment_id, parent_id, console)
    return rows


def _print_addresses(uri: str, experiment_id: str, parent_id: str, console: Any) -> None:
    from ..tracking import ui_address
    from ..tracking.ui_views import STUDY_VIEW

    console.print(f"The answer, one row per run (view \"ddplab: study answer\")"
                  f"{ui_address(uri, experiment_id, view=STUDY_VIEW)}", soft_wrap=True)
    console.print(f"report.html, report.md, results.csv and the plots: the parent run's "
                  f"Artifacts tab{ui_address(uri, experiment_id, parent_id)}", soft_wrap=True)


PLOTS = {"throughput.png", "speedup.png", "throughput_ratio.png", "loss_vs_step.png",
         "loss_vs_time.png", "accuracy_vs_time.png", "memory_vs_throughput.png"}


def _drop_stale_plots(client: Any, parent: Any, made: set[str]) -> None:
    """A rebuilt report replaces its files; a plot the new one does not draw (speedup.png once
    the variants' resources are equal) must not stay behind next to it, telling the old story."""
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    stale = {a.path for a in client.list_artifacts(parent.info.run_id)} & (PLOTS - made)
    repo = get_artifact_repository(parent.info.artifact_uri)
    for path in sorted(stale):
        try:
            repo.delete_artifacts(path)
        except Exception:  # noqa: BLE001 - a store that cannot delete keeps it; the report lists its own
            continue


def _single_epoch(children: list[Any]) -> bool:
    return any(c.data.params.get("train.epochs") == "1" for c in children
               if c.info.status == "FINISHED")


def record_answer(client: Any, parent_id: str, rows: list[Row], verdict: Verdict,
                  study: Any) -> None:
    """The answer on the parent run itself, so its row in the runs table shows it: per-variant
    metrics, the best variant, the verdict (also its description), the fixed settings."""
    metrics = {}
    for r in rows:
        for key, value in (("samples_per_s_median", r.throughput_median), ("speedup", r.speedup),
                           ("efficiency", r.efficiency), ("eval_accuracy", r.eval_accuracy),
                           ("model_state_mb", r.model_state_mb)):
            if value is not None:
                metrics[f"study/{r.variant}/{key}"] = round(float(value), 4)
    for k, v in metrics.items():
        client.log_metric(parent_id, k, v)
    from ..tracking.ui_views import save_study_view

    save_study_view(client, client.get_run(parent_id).info.experiment_id, [r.variant for r in rows])
    client.set_tag(parent_id, "ddplab.study.best", verdict.best or "none")
    client.set_tag(parent_id, "ddplab.study.verdict", verdict.text[:4000])
    client.set_tag(parent_id, "ddplab.study.warnings", str(len(verdict.warnings)))
    warnings = "".join(f"\n- {w}" for w in verdict.warnings)
    client.set_tag(parent_id, "mlflow.note.content", f"{verdict.text}{warnings}"[:5000])
    if study is not None:
        for k, v in {**study.set, "repeats": study.repeats, "baseline": study.baseline}.items():
            try:
                client.log_param(parent_id, f"study.{k}", str(v)[:6000])
            except Exception:  # noqa: BLE001 - a rerun that raised repeats: the first value stays
                continue


def _print(rows: list[Row], title: str, console: Any) -> None:
    from rich.table import Table

    t = Table(title=title)
    memory = any(r.model_state_mb is not None for r in rows)
    for c in ("variant", "ok/all", "samples/s", "speedup", "efficiency", "eval acc", "wall s",
              *(["state MB"] if memory else []), "backend", "launcher"):
        t.add_column(c)
    for r in rows:
        t.add_row(r.variant, f"{r.runs - r.failed}/{r.runs}", _fmt(r.throughput_median),
                  _fmt(r.speedup), _fmt(r.efficiency), _fmt(r.eval_accuracy),
                  _fmt(r.wall_time_s), *([_fmt(r.model_state_mb)] if memory else []),
                  r.backend, r.launcher)
    console.print(t)
