"""``ddplab reproduce``'s verdict on runs that did reproduce: timings (a seeded Hugging Face
Trainer's ``train_runtime``) are reported, never compared, and a run with nothing to compare
says so and is no "differs". The original and the reproduction are made with MlflowClient in a
real SQLite store and judged by reproduce's own code (no job runs; the end-to-end reproduce of
a real run: tests/test_study.py and tests/test_script_mode.py)."""

from __future__ import annotations

import csv
import io

import pytest

from ddplab.study import reproduce
from tests.helpers import artifact_text


@pytest.mark.parametrize("metric, timing", [
    ("train_runtime", True), ("eval_runtime", True), ("train_samples_per_second", True),
    ("train_steps_per_second", True), ("tokens_per_s", True), ("epoch_time_s", True),
    ("step_time", True), ("perf/samples_per_s", True), ("perf/wall_s", True),
    ("system/cpu_utilization_percentage", True), ("epoch/time_s", True),
    ("memory/peak_rss_mb", True), ("train/rank1_busy_s", True), ("train/data_wait_frac", True),
    ("epoch/epoch", False),
    ("loss", False), ("grad_norm", False), ("learning_rate", False), ("epoch", False),
    ("train/loss", False), ("eval/accuracy", False), ("total_flos", False),
])
def test_timings_are_named_by_one_rule(metric, timing):
    assert reproduce.is_timing(metric) is timing


HF_TRAINER = {"loss": [2.31, 1.87, 1.52], "grad_norm": [4.1, 3.2, 2.7],
              "learning_rate": [5e-5, 3.3e-5, 1.7e-5], "epoch": [0.33, 0.67, 1.0]}


def script_run(client, exp: str, metrics: dict[str, list[float]], **tags: str) -> str:
    run = client.create_run(exp, tags={"ddplab.mode": "script", **tags})
    for key, values in metrics.items():
        for step, value in enumerate(values):
            client.log_metric(run.info.run_id, key, value, step=step)
    client.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def judge(store: str, original: dict, again: dict, capsys) -> tuple[int, str, dict, list]:
    """reproduce's verdict on ``again`` as the reproduction of ``original``: (exit code, its
    printed line, the new run's tags, differences.csv's rows)."""
    from mlflow import MlflowClient

    c = MlflowClient(store)
    exp = c.create_experiment("hf")
    first = script_run(c, exp, original)
    new = script_run(c, exp, again, **{"ddplab.reproduces": first})
    code = reproduce._judge(c, c.get_run(first), new, 0)
    (line,) = capsys.readouterr().out.strip().splitlines()
    rows = list(csv.DictReader(io.StringIO(
        artifact_text(c, new, "reproduce/differences.csv"))))
    return code, line, c.get_run(new).data.tags, rows


def test_a_seeded_trainer_run_is_bitwise_though_its_timings_differ(store, capsys):
    timings = {"train_runtime": [12.4], "train_samples_per_second": [41.3],
               "train_steps_per_second": [5.2], "perf/wall_s": [19.0]}
    slower = {k: [v[0] * 1.3] for k, v in timings.items()}
    code, line, tags, rows = judge(store, {**HF_TRAINER, **timings}, {**HF_TRAINER, **slower},
                                   capsys)
    assert code == 0 and tags["ddplab.reproduce.verdict"] == "bitwise", line
    assert ": bitwise (12 values compared, largest difference 0; 4 timing values reported, " \
           "not compared)" in line
    compared = {r["metric"] for r in rows if r["compared"] == "yes"}
    reported = {r["metric"] for r in rows if r["compared"] == "no: a timing"}
    assert compared == set(HF_TRAINER) and reported == set(timings)


def test_a_scripts_observed_train_loss_is_compared_like_its_own_metrics(store, capsys):
    ran = {**HF_TRAINER, "train/loss": [2.3, 1.9, 1.5], "train_runtime": [12.4]}
    drifted = {**ran, "train/loss": [2.3, 1.9, 1.6], "train_runtime": [12.4]}
    code, line, tags, rows = judge(store, ran, drifted, capsys)
    assert code == 1 and tags["ddplab.reproduce.verdict"] == "differs", line
    assert [r["step"] for r in rows if r["metric"] == "train/loss"] == ["0", "1", "2"]


@pytest.mark.parametrize("logged", [{}, {"perf/wall_s": [3.0], "system/cpu_utilization_percentage": [50.0]}])
def test_a_run_with_nothing_to_compare_says_so_and_is_no_difference(store, capsys, logged):
    again = {k: [v[0] + 1] for k, v in logged.items()}
    code, line, tags, rows = judge(store, logged, again, capsys)
    assert code == 0 and tags["ddplab.reproduce.verdict"] == "nothing logged to compare"
    assert ": nothing logged to compare (the run logged " in line and "differs" not in line
    assert all(r["compared"] == "no: a timing" for r in rows) and len(rows) == len(logged)
