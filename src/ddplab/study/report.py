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
           "wall_time_s", "resources", "backend", "launcher")


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
          target: float) -> list[Row]:
    by_variant = latest_per_job(children)
    rows = []
    for name in [n for n in order if n in by_variant] + sorted(set(by_variant) - set(order)):
        runs = by_variant[name]
        ok = [r for r in runs if r.info.status == "FINISHED"]
        speeds = [r.data.metrics["perf/samples_per_s"] for r in ok
                  if "perf/samples_per_s" in r.data.metrics]
        targets = [t for r in ok if (t := time_to_target(client, r, target)) is not None]
        rows.append(Row(
            name, len(runs), len(runs) - len(ok), _median(speeds), min(speeds, default=None),
            max(speeds, default=None), None, None,
            _median([r.data.metrics["eval/accuracy"] for r in ok if "eval/accuracy" in r.data.metrics]),
            _median([r.data.metrics["eval/loss"] for r in ok if "eval/loss" in r.data.metrics]),
            _median(targets) if len(targets) == len(ok) else None,
            _median([(r.info.end_time - r.info.start_time) / 1000 for r in ok if r.info.end_time]),
            _resources(runs[0]), _what_ran(runs, "ddplab.backend", "ddplab.backend_requested"),
            _what_ran(runs, "ddplab.launcher")))
    base = next((r for r in rows if r.variant == baseline), None)
    for row in rows:
        if base and base.throughput_median and row.throughput_median:
            row.speedup = row.throughput_median / base.throughput_median
            row.efficiency = row.speedup / (row.resources / base.resources)
    return rows


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)


def markdown(rows: list[Row], title: str, notes: list[str]) -> str:
    heads = ["variant", "runs ok/all", "samples/s median [min-max]", "speedup", "efficiency",
             "eval acc", "eval loss", "time to target s", "wall s", "backend", "launcher"]
    lines = [f"# {title}", "", "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        spread = (f"{_fmt(r.throughput_median)} [{_fmt(r.throughput_min)}-{_fmt(r.throughput_max)}]"
                  if r.throughput_median is not None else "-")
        cells = [r.variant, f"{r.runs - r.failed}/{r.runs}", spread, _fmt(r.speedup),
                 _fmt(r.efficiency), _fmt(r.eval_accuracy), _fmt(r.eval_loss),
                 _fmt(r.time_to_target_s), _fmt(r.wall_time_s), r.backend, r.launcher]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + notes) + "\n"


def plots(client: Any, rows: list[Row], by_variant: dict[str, list[Any]], out: Path) -> list[Path]:
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
    ax.bar([r.variant for r in measured], [r.throughput_median for r in measured],
           yerr=[[r.throughput_median - r.throughput_min for r in measured],
                 [r.throughput_max - r.throughput_median for r in measured]], capsize=4)
    ax.set_ylabel("samples/s (median, min-max over repeats)")
    ax.set_title("throughput per variant")
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    scaled = [r for r in measured if r.speedup is not None]
    ax.plot([r.resources for r in scaled], [r.speedup for r in scaled], "o")
    for r in scaled:
        ax.annotate(r.variant, (r.resources, r.speedup))
    if scaled:
        base = min(r.resources for r in scaled if r.speedup and abs(r.speedup - 1) < 1e-9) \
            if any(abs(r.speedup - 1) < 1e-9 for r in scaled) else 1
        xs = sorted({r.resources for r in scaled})
        ax.plot(xs, [x / base for x in xs], "--", label="ideal")
        ax.legend()
    ax.set_xlabel("resources (ranks x threads, or GPUs)")
    ax.set_ylabel("speedup vs baseline")
    save(fig, "speedup.png")

    curves = {"loss_vs_step.png": ("train/loss", "step"), "loss_vs_time.png": ("train/loss", "time"),
              "accuracy_vs_time.png": ("eval/accuracy", "time")}
    for name, (key, axis) in curves.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for variant, runs in by_variant.items():
            ok = [r for r in runs if r.info.status == "FINISHED"]
            if not ok:
                continue
            hist = sorted(client.get_metric_history(ok[0].info.run_id, key), key=lambda m: m.step)
            xs = [m.step if axis == "step" else (m.timestamp - ok[0].info.start_time) / 1000
                  for m in hist]
            ax.plot(xs, [m.value for m in hist], marker="." if key.startswith("eval") else None,
                    label=variant)
        ax.set_xlabel("optimizer step" if axis == "step" else "wall time since start (s)")
        ax.set_ylabel(key)
        ax.legend()
        save(fig, name)
    return made


def html(md_rows: list[Row], title: str, notes: list[str], pngs: list[Path]) -> str:
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(getattr(r, c))}</td>" for c in COLUMNS) + "</tr>"
                   for r in md_rows)
    images = "".join(
        f'<h3>{p.stem}</h3><img alt="{p.stem}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}">' for p in pngs)
    note = "".join(f"<p>{n}</p>" for n in notes)
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
            "<style>td,th{border:1px solid #ccc;padding:3px 8px}table{border-collapse:collapse}"
            f"</style></head><body><h1>{title}</h1><table><tr>{head}</tr>{body}</table>{note}"
            f"{images}</body></html>")


def results_csv(rows: list[Row]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS)
    w.writeheader()
    for r in rows:
        w.writerow(asdict(r))
    return buf.getvalue()


def build(client: Any, parent_id: str, study: Any = None, console: Any = None) -> list[Row]:
    """The report of one study's parent run, logged to that run and printed."""
    parent = client.get_run(parent_id)
    tags = parent.data.tags
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent_id}'", max_results=5000)
    order = [v.name for v in study.variants] if study else []
    baseline = study.baseline if study else tags.get("ddplab.study_baseline", "")
    target = study.target_accuracy if study else float(tags.get("ddplab.study_target", 0) or 0)
    if study:
        client.set_tag(parent_id, "ddplab.study_baseline", baseline)
        client.set_tag(parent_id, "ddplab.study_target", str(target))
    rows = table(client, children, order or sorted({c.data.tags.get("ddplab.variant", "?")
                                                    for c in children}), baseline, target)
    title = f"study {tags.get('ddplab.study', parent_id)}"
    notes = [f"Baseline: {baseline}. Throughput: perf/samples_per_s of each finished run "
             "(epochs after the first); speedup = median / the baseline's median; efficiency = "
             "speedup / (resources / the baseline's resources)."]
    if target:
        notes.append(f"Time to target: first evaluation with accuracy >= {target}.")
    notes += [f"Skipped {k.split('.', 2)[2]}: {v}." for k, v in sorted(tags.items())
              if k.startswith("ddplab.skipped.")]
    notes += environment_warnings(children)
    verdict = judge(rows, baseline, single_epoch=_single_epoch(children))
    notes = [f"Verdict: {verdict.text}"] + [f"WARNING: {w}." for w in verdict.warnings] + notes
    record_answer(client, parent_id, rows, verdict, study)
    md = markdown(rows, title, notes)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        pngs = plots(client, rows, latest_per_job(children), out) if children else []
        (out / "report.md").write_text(md)
        (out / "report.html").write_text(html(rows, title, notes, pngs))
        (out / "results.csv").write_text(results_csv(rows))
        client.log_artifacts(parent_id, str(out))
    if console is not None:
        _print(rows, title, console)
        console.print(f"Verdict: {verdict.text}")
        for w in verdict.warnings:
            console.print(f"WARNING: {w}")
    return rows


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
                           ("efficiency", r.efficiency), ("eval_accuracy", r.eval_accuracy)):
            if value is not None:
                metrics[f"study/{r.variant}/{key}"] = round(float(value), 4)
    for k, v in metrics.items():
        client.log_metric(parent_id, k, v)
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
    for c in ("variant", "ok/all", "samples/s", "speedup", "efficiency", "eval acc", "wall s",
              "backend", "launcher"):
        t.add_column(c)
    for r in rows:
        t.add_row(r.variant, f"{r.runs - r.failed}/{r.runs}", _fmt(r.throughput_median),
                  _fmt(r.speedup), _fmt(r.efficiency), _fmt(r.eval_accuracy),
                  _fmt(r.wall_time_s), r.backend, r.launcher)
    console.print(t)
