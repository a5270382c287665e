"""Unit: what the MLflow UI is given to open on the runs (the server app's first-visit choice,
the saved views), and the report's plots and table choosing what to show."""

from __future__ import annotations

import json

import pytest

from ddplab import tracking
from ddplab.study import plots, render
from ddplab.tracking import mlflow_app, ui_views
from tests.helpers.study import row, with_ratios

PAGE = b'<!doctype html><html lang="en"><head><meta charset="utf-8"/><script defer src="m.js">'


def test_the_first_visit_choice_comes_before_mlflows_own_script_and_only_once():
    page = mlflow_app.with_runs_view(PAGE)
    assert page.index(b"mlflow.workflowType_v1") < page.index(b"m.js")
    assert b"'\"machine_learning\"'" in page  # JSON, as MLflow's useLocalStorage reads it
    assert b"===null" in page  # a user's own choice (GenAI) is kept
    assert mlflow_app.with_runs_view(page) == page
    assert mlflow_app.with_runs_view(b"no html head") == b"no html head"


def test_the_server_app_serves_mlflows_page_with_the_choice_and_the_api_untouched():
    app = mlflow_app.create_app()  # the Flask app outside uvicorn, as MLflow's basic-auth
    web = app.test_client()
    index = web.get("/")
    assert index.status_code == 200 and mlflow_app.FIRST_VISIT.encode() in index.data
    assert b"static-files/static/js/main" in index.data  # still MLflow's own page
    health = web.get("/health")
    assert health.status_code == 200 and mlflow_app.FIRST_VISIT.encode() not in health.data


def test_the_entry_point_is_registered_for_mlflow_server_app_name():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="mlflow.app") if e.name == "ddplab"]
    assert ep.load() is mlflow_app.create_app


def _envelope(value: str) -> dict:
    """What MLflow 3.17's saved-view parser demands, or it drops the view silently."""
    env = json.loads(value)
    assert isinstance(env["name"], str) and isinstance(env["createdAt"], int)
    assert isinstance(env["state"], str)
    return json.loads(env["state"])


def test_every_experiment_ddplab_creates_has_the_runs_view_and_keeps_a_users_edit(tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = tracking.experiment_id(client, "quickstart")
    tags = client.get_experiment(exp).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    state = _envelope(tags[ui_views.TAG_PREFIX + ui_views.RUNS_VIEW])
    assert "metrics.`perf/samples_per_s`" in state["selectedColumns"]
    assert "tags.`ddplab.backend`" in state["selectedColumns"]
    client.set_experiment_tag(exp, ui_views.TAG_PREFIX + ui_views.RUNS_VIEW, "mine")
    assert tracking.experiment_id(client, "quickstart") == exp
    assert client.get_experiment(exp).tags[ui_views.TAG_PREFIX + ui_views.RUNS_VIEW] == "mine"
    client.create_experiment("made-elsewhere")  # an experiment ddplab did not create gets one too
    other = tracking.experiment_id(client, "made-elsewhere")
    assert ui_views.TAG_PREFIX + ui_views.RUNS_VIEW in client.get_experiment(other).tags


def test_the_study_view_leads_with_each_variants_throughput_and_the_verdict():
    columns = ui_views.study_columns(["1r-2t", "2r-1t"], "samples_per_s_median",
                                     "perf/samples_per_s")
    assert columns[:2] == ["metrics.`study/1r-2t/samples_per_s_median`",
                           "metrics.`study/2r-1t/samples_per_s_median`"]
    assert "tags.`ddplab.study.verdict`" in columns
    state = _envelope(ui_views.envelope("x", columns))
    assert state["selectedColumns"] == columns


@pytest.mark.parametrize("view, route", [
    ("", "#/experiments/3/runs?workflowType=machine_learning"),
    ("ddplab-study", "#/experiments/3/runs?workflowType=machine_learning&viewStateShareKey=ddplab-study"),
])
def test_an_experiment_address_is_its_runs_table_in_the_view(monkeypatch, view, route):
    monkeypatch.delenv("DDPLAB_UI_URL", raising=False)
    assert tracking.ui_address("http://mlflow:5000", "3", view=view) == f": http://mlflow:5000/{route}"


def _plots(tmp_path, rows):
    return {p.name for p in plots.plots(None, rows, {}, tmp_path, rows[0].variant)}


def test_speedup_is_drawn_only_when_resources_differ_else_the_ratio_to_the_baseline(tmp_path):
    equal = with_ratios([row("1r-2t", 1000, 990, 1010, resources=2),
                         row("2r-1t", 800, 790, 810, resources=2)], "1r-2t")
    (tmp_path / "equal").mkdir()
    assert _plots(tmp_path / "equal", equal) == {"throughput.png", "throughput_ratio.png"}
    scaling = with_ratios([row("1r", 500, 490, 510, resources=1),
                           row("2r", 900, 880, 910, resources=2)], "1r")
    (tmp_path / "scaling").mkdir()
    assert _plots(tmp_path / "scaling", scaling) == {"throughput.png", "speedup.png"}


def test_the_table_drops_columns_no_variant_has_and_keeps_the_rest():
    rows = with_ratios([row("a", 1000, 990, 1010), row("b", 900, 880, 910)], "a")
    heads, cells = render.grid(rows)
    assert "time to target s" not in heads  # no target accuracy in this study
    assert heads[0] == "variant" and "speedup" in heads and "backend, launcher" in heads
    assert cells[1][heads.index("speedup")] == "0.900"
    assert "time to target s" not in render.markdown(rows, "t", [])
    rows[0].time_to_target_s = 12.0
    assert "time to target s" in render.grid(rows)[0]


def test_report_html_puts_the_verdict_on_top_and_shows_markup_in_names_as_text(tmp_path):
    """report.html comes from a jinja2 template with autoescape: a variant named like a tag,
    or a note with '&', is text in the page, never markup that would break it."""
    rows = with_ratios([row("<b>wide</b>", 1000, 990, 1010), row("a & b", 900, 880, 910)],
                       "<b>wide</b>")
    png = tmp_path / "throughput.png"
    png.write_bytes(b"\x89PNG made up")
    page = render.html(rows, "study <s>", ["Verdict: a & b is slower", "WARNING: odd", "n"], [png])
    assert "<b>wide</b>" not in page and "&lt;b&gt;wide&lt;/b&gt;" in page
    assert "<title>study &lt;s&gt;</title>" in page
    assert page.index('class="verdict">Verdict: a &amp; b is slower') < page.index("<table>")
    assert page.index('class="warning">WARNING: odd') < page.index("<table>")
    assert page.index('<p class="note">n</p>') > page.index("</table>")
    assert page.count('<td class="num">') == 2 * 7  # the numeric columns, right-aligned
    assert 'alt="throughput" src="data:image/png;base64,iVBORyBtYWRlIHVw' in page


def test_two_jobs_saving_the_view_at_once_both_go_on(tmp_path):
    """Two jobs open their first runs in a new experiment together: both find no view, the
    other job's insert lands first and the store refuses this one's (SQLite's UNIQUE
    constraint, seen in CI; a real store, the race stood in for by a client that lets the
    other job's insert in first, then refuses as SQLite did). The view is saved, no error."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import BAD_REQUEST

    real = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = real.create_experiment("together")
    stale = real.get_experiment(exp)  # read before either job saved the view

    class OtherJobFirst:
        calls = 0

        def set_experiment_tag(self, *args):
            OtherJobFirst.calls += 1
            if OtherJobFirst.calls == 1:
                real.set_experiment_tag(*args)  # the other job's insert
                raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: "
                                      "experiment_tags.key, experiment_tags.experiment_id",
                                      error_code=BAD_REQUEST)
            return real.set_experiment_tag(*args)

    ui_views.ensure_runs_view(OtherJobFirst(), stale)
    state = _envelope(real.get_experiment(exp).tags[ui_views.TAG_PREFIX + ui_views.RUNS_VIEW])
    assert "metrics.`perf/samples_per_s`" in state["selectedColumns"]
    assert OtherJobFirst.calls == 2


def test_no_chart_of_empty_axes_when_no_run_logged_the_compared_metric(tmp_path):
    """report.html showed compared.png with empty axes, titled "median of  repeat(s)"."""
    import dataclasses

    unlogged = [dataclasses.replace(row(n, 1.0, 1.0, 1.0), metric="val/f1", metric_mode="max",
                                    throughput_median=None) for n in ("a", "b")]
    assert _plots(tmp_path, unlogged) == set()
    logged = [dataclasses.replace(r, throughput_median=0.5, throughput_min=0.4,
                                  throughput_max=0.6) for r in unlogged]
    assert _plots(tmp_path, logged) == {"compared.png"}


def test_a_script_studys_table_has_no_empty_eval_column_and_a_small_mfu_is_not_zero():
    """Beside a script's own val/acc the console showed an "eval acc" column of dashes; the
    report an MFU of "0.0%" for a tiny model's 0.03%."""
    import dataclasses
    import io

    from rich.console import Console

    rows = [dataclasses.replace(row(n, 0.8, 0.7, 0.9, accuracy=None), metric="val/acc",
                                metric_mode="max", mfu=0.0003) for n in ("a", "b")]
    out = io.StringIO()
    render.print_table(rows, "t", Console(file=out, width=200))
    assert "eval acc" not in out.getvalue() and "val/acc" in out.getvalue(), out.getvalue()
    names, cells = render.grid(rows)
    assert cells[0][names.index("MFU")] == "0.03%", (names, cells)
    rows = [dataclasses.replace(r, eval_accuracy=0.5) for r in rows]
    out = io.StringIO()
    render.print_table(rows, "t", Console(file=out, width=200))
    assert "eval acc" in out.getvalue()


def test_a_script_studys_table_shows_the_train_loss_and_speed_beside_its_compared_time(
        tmp_path, store):
    """A hostile pass: a study over a script's learning rate compared its wall time, and its
    table had no loss nor samples/s, though every job's run held both (observed)."""
    import io

    from mlflow import MlflowClient
    from rich.console import Console

    from ddplab.study.table import table

    c = MlflowClient(store)
    exp = c.create_experiment("s")
    children = []
    for variant, loss, speed, wall in (("lr0.05", 0.50, 3000.0, 5.0), ("lr0.2", 0.24, 2900.0, 5.2)):
        run = c.create_run(exp, tags={"ddplab.variant": variant, "ddplab.repeat": "0",
                                      "ddplab.mode": "script"}).info.run_id
        for key, value in (("train/loss", loss), ("perf/samples_per_s", speed),
                           ("perf/wall_s", wall)):
            c.log_metric(run, key, value)
        c.set_terminated(run, "FINISHED")
        children.append(c.get_run(run))
    rows = table(c, children, ["lr0.05", "lr0.2"], "lr0.05", 0.0, "perf/wall_s", "min")
    assert [(r.train_loss, r.samples_per_s) for r in rows] == [(0.5, 3000.0), (0.24, 2900.0)]
    names, cells = render.grid(rows)
    assert cells[1][names.index("train loss")] == "0.240", (names, cells)
    assert cells[1][names.index("samples/s")] == "2,900", (names, cells)
    out = io.StringIO()
    render.print_table(rows, "t", Console(file=out, width=250))
    assert "train loss" in out.getvalue() and "2,900" in out.getvalue(), out.getvalue()
    assert "train_loss" in render.results_csv(rows).splitlines()[0]
    # Where throughput is the compared figure, no second samples/s column
    rows = table(c, children, ["lr0.05", "lr0.2"], "lr0.05", 0.0)
    assert rows[0].samples_per_s is None and "samples/s" not in render.grid(rows)[0]
