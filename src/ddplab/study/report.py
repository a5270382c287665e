"""``ddplab report PARENT_RUN_ID``: a study's comparison (``table``), judged (``verdict``),
drawn (``plots``) and written (``render``), then recorded on the parent run: report.md,
report.html (plots inline), results.csv and the plots as PNGs under ``report/``, the answer as
the parent's metrics and tags. Built only from the store, so it can be rebuilt later.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ..tracking import schema
from .plots import PLOTS, plots
from .render import html, markdown, print_table, results_csv
from .spec import Study, better, inferred_mode
from .table import (
    THROUGHPUT,
    Row,
    environment_warnings,
    is_throughput,
    latest_per_job,
    straggler_warnings,
    table,
)
from .verdict import Verdict, judge


def build(client: Any, parent_id: str, study: Study | None = None, console: Any = None,
          uri: str = "", page: Path | None = None, interrupted: bool = False) -> list[Row]:
    """The report of one study's parent run, logged to that run and printed (with the
    addresses of the answer in the MLflow UI when ``uri`` is given), and written as the
    results page ``page`` when given; ``interrupted``: the study was stopped before its end
    (said first, with the variants it never ran)."""
    parent = client.get_run(parent_id)
    tags = parent.data.tags
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent_id}'", max_results=5000)
    order = [v.name for v in study.variants] if study else []
    baseline = study.baseline if study else tags.get(schema.STUDY_BASELINE, "")
    target = study.target_accuracy if study else float(tags.get(schema.STUDY_TARGET, 0) or 0)
    metric = study.metric if study else tags.get(schema.STUDY_METRIC, THROUGHPUT)
    # A parent recorded before the mode was: the rule the study file would have used.
    mode = study.metric_mode if study else (tags.get(schema.STUDY_METRIC_MODE)
                                            or inferred_mode(metric) or "max")
    if study:
        client.set_tag(parent_id, schema.STUDY_BASELINE, baseline)
        if target:  # (no target: no tag, not a target of 0.0)
            client.set_tag(parent_id, schema.STUDY_TARGET, str(target))
        client.set_tag(parent_id, schema.STUDY_METRIC, metric)
        client.set_tag(parent_id, schema.STUDY_METRIC_MODE, mode)
    # Without the study file, the variants in the order they first ran (the study's order).
    rows = table(client, children, order or list(latest_per_job(children)), baseline, target,
                 metric, mode)
    title = f"study {tags.get(schema.STUDY, parent_id)}"
    single = _single_epoch(children)
    steady = "the steps of its log intervals after the first"
    if any(c.data.tags.get(schema.MODE) == "script" for c in children):  # (observed steps)
        steady = ("ddplab's loop: the steps of its log intervals after the first; a script: the "
                  "figure it logged itself, else its observed steps less the first and the one its "
                  "first MLflow call (its store's opening) ran in")
    if is_throughput(metric):
        notes = [f"Baseline: {baseline}. Throughput: perf/samples_per_s of each finished run "
                 f"({steady}), {better(mode)}; speedup = median / the baseline's median; "
                 "efficiency = speedup / (resources / the baseline's resources: ranks x threads "
                 "on CPU, GPUs on CUDA)."]
    else:
        # Where the direction came from is known from the study file (a rebuilt report has
        # only the parent's tags: the direction alone).
        compared = study.direction if study else f"{metric}, {better(mode)}"
        notes = [f"Baseline: {baseline}. Compared: {compared}: the last value each finished run "
                 "logged, median and min-max over the repeats; vs baseline = (median - the "
                 "baseline's median) / the baseline's (where the baseline's is 0: the verdict "
                 "gives the difference itself)."]
    if target:
        notes.append(f"Time to target: first evaluation with accuracy >= {target}.")
    notes += [f"Skipped {k.split('.', 2)[2]}: {v}." for k, v in sorted(tags.items())
              if k.startswith(schema.SKIPPED_PREFIX)]
    verdict = judge(rows, baseline, single_epoch=single)
    # Every warning in one list: the parent's description and its warnings count held the
    # verdict's alone ("the variants ran different code" was in the report, not on the run).
    verdict.warnings += [w.removeprefix("WARNING: ").removesuffix(".") for w in
                         environment_warnings(children) + straggler_warnings(children)]
    if rows and not verdict.best:
        verdict.nothing += _did_you_mean(rows[0].metric, children)
    if interrupted:
        ran = {r.variant for r in rows}
        missing = [name for name in order if name not in ran]
        verdict.warnings.insert(0, "the study was interrupted before its end: a job it stopped "
                                   "(KILLED) counts as failed below"
                                + (f"; never run: {', '.join(missing)}" if missing else ""))
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
        print_table(rows, title, console)
        console.print(f"Verdict: {verdict.text}")
        for w in verdict.warnings:
            console.print(f"WARNING: {w}", soft_wrap=True, markup=False)
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


def answer_key(metric: str) -> str:
    """The name of a variant's compared median on the parent run (``study/<variant>/<this>``),
    the one rule for the answer's metrics and the study view's columns."""
    return "samples_per_s_median" if is_throughput(metric) else f"{metric}_median"


def record_answer(client: Any, parent_id: str, rows: list[Row], verdict: Verdict,
                  study: Study | None) -> None:
    """The answer on the parent run itself, so its row in the runs table shows it: per-variant
    metrics, the best variant, the verdict (also its description), the fixed settings."""
    metrics = {}
    for r in rows:
        # Throughput as samples_per_s_median (the study view's columns); another metric under
        # its own name, with its change vs the baseline: never as a speed.
        figure = ((answer_key(r.metric), r.throughput_median), ("speedup", r.speedup),
                  ("efficiency", r.efficiency)) if is_throughput(r.metric) else (
                  (answer_key(r.metric), r.throughput_median), ("vs_baseline", r.change))
        for key, value in (*figure, ("eval_accuracy", r.eval_accuracy),
                           ("model_state_mb", r.model_state_mb)):
            if value is not None:
                metrics[f"study/{r.variant}/{key}"] = round(float(value), 4)
    for k, v in metrics.items():
        client.log_metric(parent_id, k, v)
    from ..tracking.ui_views import save_study_view

    parent = client.get_run(parent_id)
    compared = rows[0].metric if rows else THROUGHPUT
    save_study_view(client, parent.info.experiment_id, [r.variant for r in rows],
                    answer_key(compared), compared)
    client.set_tag(parent_id, schema.STUDY_BEST, verdict.best or "none")
    client.set_tag(parent_id, schema.STUDY_VERDICT, verdict.text[:4000])
    client.set_tag(parent_id, schema.STUDY_WARNINGS, str(len(verdict.warnings)))
    warnings = "".join(f"\n- {w}" for w in verdict.warnings)
    client.set_tag(parent_id, "mlflow.note.content", f"{verdict.text}{warnings}"[:5000])
    if study is not None:
        # A param is set once (MLflow refuses another value): a rerun that raised the repeats
        # keeps the first value.
        for k, v in {**study.set, "repeats": study.repeats, "baseline": study.baseline}.items():
            if f"study.{k}" not in parent.data.params:
                client.log_param(parent_id, f"study.{k}", str(v)[:schema.PARAM_LIMIT])


def _did_you_mean(metric: str, children: list[Any]) -> str:
    """The names the jobs did log that are closest to a compared metric none logged (a slip:
    ``val/acc `` with a space, ``val_acc`` for ``val/acc``)."""
    import difflib

    logged = sorted({k for c in children for k in c.data.metrics})
    if metric in logged:  # logged, but by failed runs only, or NaN: no slip of the name
        return ""
    close = difflib.get_close_matches(metric.strip(), logged, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""
