"""What the MLflow UI shows of ddplab's runs without any column picking: saved views.

MLflow 3's runs table shows Created, Dataset, Duration, Source and Models until a user picks
columns, one at a time. Its "Views" menu saves a column layout on the experiment itself, as the
experiment tag ``mlflow.sharedViewState.<key>`` (a JSON envelope: name, createdAt, updatedAt,
and the page state as a JSON string), and opens it from a link with ``viewStateShareKey=<key>``.
ddplab saves such a view on every experiment it creates (throughput, accuracy, backend, layout)
and one per study (each variant's median throughput and speedup, the verdict, the best), and
every address it prints opens the runs table in that view.
"""

from __future__ import annotations

import json
import time
from typing import Any

from . import schema

TAG_PREFIX = "mlflow.sharedViewState."  # MLflow 3.17's UI: constants o6 / ex ("viewStateShareKey")
RUNS_VIEW = "ddplab-runs"
STUDY_VIEW = "ddplab-study"


def metric(key: str) -> str:
    return f"metrics.`{key}`"


def tag(key: str) -> str:
    return f"tags.`{key}`"


def param(key: str) -> str:
    return f"params.`{key}`"


# Every job: the one throughput to quote, what it learned, and where and how it ran.
RUN_COLUMNS = [metric("perf/samples_per_s"), metric("eval/accuracy"), metric("eval/loss"),
               tag(schema.BACKEND), tag(schema.WORLD_SIZE), tag(schema.THREADS_PER_RANK),
               tag(schema.NNODES), tag(schema.LAUNCHER), tag(schema.VARIANT)]


def study_columns(variants: list[str], answer: str, figure: str) -> list[str]:
    """The parent run's answer (each variant's ``study/<v>/<answer>``: its median throughput, or
    the compared figure's median), the verdict and the best, then what its child runs fill
    (``figure``, the compared one). The UI puts metrics before tags whatever the order here,
    so the view keeps few columns and the verdict stays on screen; a child's variant, backend
    and layout are in its run name. (A study of val/acc showed throughput columns, empty.)"""
    per_variant = [metric(f"study/{v}/{answer}") for v in variants]
    return per_variant + [metric(figure), metric("eval/accuracy"),
                          tag(schema.STUDY_VERDICT), tag(schema.STUDY_BEST)]


def study_widths(variants: list[str], answer: str, figure: str) -> dict[str, int]:
    narrow = {metric(f"study/{v}/{answer}"): 110 for v in variants}
    return narrow | {metric(figure): 110, metric("eval/accuracy"): 100,
                     tag(schema.STUDY_VERDICT): 480}


def envelope(name: str, columns: list[str], widths: dict[str, int] | None = None) -> str:
    """The tag value MLflow's UI reads a saved view from (its saved-view parser: a string
    ``name``, a number ``createdAt``, the page state as a JSON string ``state``)."""
    now = int(time.time() * 1000)
    state = {"selectedColumns": columns, "columnWidths": widths or {}}
    return json.dumps({"name": name, "createdAt": now, "updatedAt": now,
                       "state": json.dumps(state)})


def save(client: Any, experiment_id: str, key: str, name: str, columns: list[str],
         widths: dict[str, int] | None = None) -> None:
    """A convenience: a server that refuses it (a user without EDIT on a team server's
    experiment, HTTP 403) leaves the experiment without the view, and the job goes on.

    Asked once more when the store refuses it otherwise: two jobs opening their first runs in
    a new experiment at once both find no view and both insert it, and the store refuses the
    second insert (SQLite: "UNIQUE constraint failed: experiment_tags", seen in CI); asked
    again, the tag is there and is updated."""
    from mlflow.exceptions import MlflowException

    value = envelope(name, columns, widths)
    for attempt in (1, 2):
        try:
            client.set_experiment_tag(experiment_id, TAG_PREFIX + key, value)
            return
        except MlflowException as e:
            if e.get_http_status_code() == 403:
                return
            if attempt == 2:
                raise


def ensure_runs_view(client: Any, experiment: Any) -> None:
    """The experiment's "ddplab: runs" view, saved once (a user's edits to it stay)."""
    if TAG_PREFIX + RUNS_VIEW not in (experiment.tags or {}):
        save(client, experiment.experiment_id, RUNS_VIEW, "ddplab: runs", RUN_COLUMNS)


def save_study_view(client: Any, experiment_id: str, variants: list[str], answer: str,
                    figure: str) -> None:
    """The study's view, rewritten with each report (the variants may have changed); ``answer``
    and ``figure``: the parent's per-variant metric (study/report.py's answer_key) and the
    children's compared one."""
    save(client, experiment_id, STUDY_VIEW, "ddplab: study answer",
         study_columns(variants, answer, figure), study_widths(variants, answer, figure))
