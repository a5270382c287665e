"""A study's named metric (``metric``, ``metric_mode``) is compared as that metric, in its own
direction: its own column and words, never a speed ("samples/s", "speedup", "faster",
"efficiency", the busy-machine alarm are throughput's alone). The reports are built by the
real report code from runs made with MlflowClient in a real SQLite store: no job runs."""

from __future__ import annotations

import csv
import dataclasses
import io
from pathlib import Path

import pytest
import yaml

from ddplab.study import report, runner, spec
from tests.conftest import REPO

SPEED_WORDS = ("samples/s", "speedup", "faster", "slower", "efficiency", "busy machine")


@pytest.mark.parametrize("metric, mode", [
    ("val/loss", "min"), ("eval/loss", "min"), ("train_loss", "min"), ("val_error", "min"),
    ("top1_err", "min"), ("eval/perplexity", "min"), ("val/ppl", "min"), ("perf/wall_s", "min"),
    ("step_time", "min"), ("train_runtime", "min"),
    ("val/acc", "max"), ("eval/accuracy", "max"), ("top1_acc", "max"), ("perf/samples_per_s", "max"),
    ("tokens_per_s", "max"), ("train_samples_per_second", "max"), ("throughput", "max"),
    ("perf/mfu", "max"), ("eval/f1", "max"), ("roc_auc", "max"),
    ("gpu/temp", None), ("grad_accum", None), ("score", None), ("acc_loss", None),
    # A rate of something lower-is-better says both: an error rate is not a throughput.
    ("errors_per_second", None), ("loss_per_s", None), ("throughput_time", None),
])
def test_the_one_rule_infers_the_direction_from_the_name_or_says_it_cannot(metric, mode):
    assert spec.inferred_mode(metric) == mode


def write_study(tmp_path: Path, **fields) -> Path:
    study = {"name": "lr", "experiment": str(REPO / "experiments" / "quickstart.yaml"),
             "baseline": "lr0.01", "variants": [{"name": "lr0.01"}, {"name": "lr0.3"}], **fields}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def test_a_metric_the_rule_cannot_place_is_refused_in_one_line(tmp_path, store, monkeypatch,
                                                                capsys):
    from ddplab import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("DDPLAB_SET", raising=False)
    assert cli.main(["study", "run", str(write_study(tmp_path, metric="gpu/temp")),
                     "--dry-run"]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert "Traceback" not in err
    assert f"{tmp_path / 'study.yaml'}: metric_mode: " in line and "'gpu/temp'" in line
    assert line.endswith("set metric_mode: max or min")
    # metric_mode against the default metric's own direction, no metric named: a slip.
    assert cli.main(["study", "run", str(write_study(tmp_path, metric_mode="min")),
                     "--dry-run"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("metric_mode: 'min' without a metric: the default, perf/samples_per_s, "
                         "is compared as higher is better; name the metric you mean (metric: NAME)")
    # ... or named: its words are a speed's ("b is 1.11x a, slower" was named the best).
    assert cli.main(["study", "run", str(write_study(tmp_path, metric="perf/samples_per_s",
                                                     metric_mode="min")), "--dry-run"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("metric_mode: got 'min' for perf/samples_per_s, a throughput: higher is "
                         "better; leave metric_mode out, or name the metric you mean"), line


def test_a_small_value_keeps_its_digits():
    """An MFU of 1.1e-05 read 0.000 in the table, the verdict and the plots' labels."""
    from ddplab.study.table import fmt

    assert [fmt(v) for v in (1.1e-05, 0.0, 0.0123, 0.85, 12.5, 1234.0)] == [
        "1.1e-05", "0.000", "0.0123", "0.850", "12.500", "1,234"]


@pytest.mark.parametrize("fields, says", [
    ({"metric": "val/loss"}, "compares val/loss, lower is better (inferred from its name"),
    ({"metric": "val/acc"}, "compares val/acc, higher is better (inferred from its name"),
    ({"metric": "gpu/temp", "metric_mode": "min"}, "compares gpu/temp, lower is better (metric_mode: min)"),
    ({}, "compares perf/samples_per_s, higher is better (the default figure"),
])
def test_the_dry_run_says_what_is_compared_and_which_way(tmp_path, store, monkeypatch, capsys,
                                                         fields, says):
    from ddplab import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("DDPLAB_SET", raising=False)
    assert cli.main(["study", "run", str(write_study(tmp_path, **fields)), "--dry-run"]) == 0
    assert says in capsys.readouterr().out


def record_study(store: str, study: spec.Study, values: dict[str, list[float | None]],
                 tags: dict | None = None, status: dict | None = None) -> tuple:
    """A study's parent and its children as a real study leaves them, each child logging
    ``values[variant][repeat]`` as the study's metric (and no samples/s: a script), with
    ``tags[(variant, repeat)]``, FINISHED or ``status[(variant, repeat)]``."""
    from mlflow import MlflowClient

    tags, status = tags or {}, status or {}
    c = MlflowClient(store)
    exp = c.create_experiment(study.name)
    parent = c.create_run(exp, tags={"ddplab.study": study.name, "ddplab.study_role": "parent"})
    pid = parent.info.run_id
    for variant, repeats in values.items():
        for r, value in enumerate(repeats):
            run = c.create_run(exp, tags={
                "mlflow.parentRunId": pid, "ddplab.study_role": "job", "ddplab.variant": variant,
                "ddplab.repeat": str(r), "ddplab.world_size": "2", "ddplab.threads_per_rank": "1",
                "ddplab.backend": "gloo", "ddplab.launcher": "torchrun", "ddplab.mode": "script"})
            if value is not None:  # None: a run that logged no value of it
                c.log_metric(run.info.run_id, study.metric, value)
            c.log_metric(run.info.run_id, "perf/wall_s", 30.0)
            for k, v in tags.get((variant, r), {}).items():
                c.set_tag(run.info.run_id, k, v)
            c.set_terminated(run.info.run_id, status.get((variant, r), "FINISHED"))
    return c, pid


def build(tmp_path: Path, store: str, study: spec.Study, values: dict, **runs: dict) -> tuple:
    from rich.console import Console

    c, pid = record_study(store, study, values, **runs)
    out = io.StringIO()
    report.build(c, pid, study, Console(file=out, width=200), "")
    files = {n: Path(c.download_artifacts(pid, n, str(tmp_path))).read_text()
             for n in ("report.md", "report.html", "results.csv")}
    return c.get_run(pid), out.getvalue(), files


@pytest.mark.parametrize("experiment", ["train.py", "train.yaml"])
def test_a_script_study_compares_its_wall_time_by_default_given_as_a_py_or_an_experiment_file(
        tmp_path, store, monkeypatch, capsys, experiment):
    """A script's study defaults to perf/wall_s whether its experiment is the script or an
    experiment file naming it (``script:``): the file once got the loop's throughput."""
    from ddplab import cli

    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({"name": "t", "script": {"path": "train.py"}}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("DDPLAB_SET", raising=False)
    study = write_study(tmp_path, experiment=experiment)
    assert cli.main(["study", "run", str(study), "--dry-run"]) == 0
    assert "compares perf/wall_s, lower is better (the default figure" in capsys.readouterr().out


def test_a_named_higher_is_better_metric_is_compared_as_itself_not_as_a_speed(tmp_path, store):
    """val/acc 0.85 vs 0.56 at the same resources: once "1.51x, faster" with a busy-machine
    alarm (efficiency 1.51 > 1.5) under a samples/s column."""
    study = spec.load_study(write_study(tmp_path, metric="val/acc", repeats=2))
    assert (study.metric, study.metric_mode) == ("val/acc", "max")
    parent, console, files = build(tmp_path, store, study,
                                   {"lr0.01": [0.56, 0.57], "lr0.3": [0.85, 0.86]})
    verdict = parent.data.tags["ddplab.study.verdict"]
    assert parent.data.tags["ddplab.study.best"] == "lr0.3"
    assert verdict.startswith("lr0.3 has the highest val/acc (0.855; higher is better).")
    assert "lr0.3: +51.3% val/acc vs lr0.01 (0.855 vs 0.565), better" in verdict
    assert parent.data.tags["ddplab.study.warnings"] == "0"
    assert "ddplab.study_target" not in parent.data.tags  # no target: not a target of 0.0
    md, html = files["report.md"], files["report.html"]
    assert "| val/acc median [min-max], higher is better | vs baseline |" in md
    assert "| lr0.3 | 2/2 | 0.855 [0.850-0.860] | +51.3% |" in md
    # The wall time beside it is the job's own perf/wall_s, not the run's start to end (which
    # adds the launcher's start-up: it ranked a script study's variants the other way).
    walls = {row["variant"]: row["wall_time_s"] for row in csv.DictReader(
        io.StringIO(files["results.csv"]))}
    assert walls == {"lr0.01": "30.0", "lr0.3": "30.0"}, walls
    assert "<th>val/acc median [min-max], higher is better</th>" in html
    assert "val/acc (higher is better)" in console and "vs baseline" in console
    for text in (verdict, md, html, console):
        assert not [w for w in SPEED_WORDS if w in text], text
    assert parent.data.metrics["study/lr0.3/val/acc_median"] == pytest.approx(0.855)
    assert parent.data.metrics["study/lr0.3/vs_baseline"] == pytest.approx(0.29 / 0.565, rel=1e-3)
    assert not [k for k in parent.data.metrics if "samples_per_s" in k or "speedup" in k]
    assert [a.path for a in _pngs(store, parent)] == ["compared.png"]


def _pngs(store, parent):
    from mlflow import MlflowClient

    return [a for a in MlflowClient(store).list_artifacts(parent.info.run_id)
            if a.path.endswith(".png")]


def test_a_named_loss_without_metric_mode_is_lower_is_better_and_the_best_is_the_lowest(
        tmp_path, store):
    """metric: val/loss alone once meant higher is better: the best named was the worse one."""
    study = spec.load_study(write_study(tmp_path, metric="val/loss"))
    assert (study.metric_mode, study.mode_source) == ("min", "its name")
    parent, console, files = build(tmp_path, store, study, {"lr0.01": [0.9], "lr0.3": [0.3]})
    verdict = parent.data.tags["ddplab.study.verdict"]
    assert parent.data.tags["ddplab.study.best"] == "lr0.3"
    assert verdict.startswith("lr0.3 has the lowest val/loss (0.300; lower is better).")
    # The other variant's runs logged none (they failed): not "the lowest" of one
    parent, _, _ = build(tmp_path, store, dataclasses.replace(study, name="lr-one"),
                         {"lr0.01": [None], "lr0.3": [0.3]})
    assert parent.data.tags["ddplab.study.verdict"].startswith(
        "only lr0.3 has a val/loss to compare (0.300; lower is better): no other variant's "
        "finished run logged one"), parent.data.tags["ddplab.study.verdict"]
    assert "lr0.3: -66.7% val/loss vs lr0.01 (0.300 vs 0.900), better (range" in verdict
    assert "val/loss median [min-max], lower is better" in files["report.md"]
    assert "Compared: val/loss, lower is better" in files["report.md"]
    assert "val/loss (lower is better)" in console
    for text in (verdict, files["report.md"], console):
        assert not [w for w in SPEED_WORDS if w in text], text
    # `ddplab report` from the store alone (no study file) keeps the direction it recorded.
    from mlflow import MlflowClient

    c = MlflowClient(store)
    report.build(c, parent.info.run_id)
    assert c.get_run(parent.info.run_id).data.tags["ddplab.study.best"] == "lr0.3"


def test_a_diverged_variant_is_never_the_best_and_a_missing_value_is_said(tmp_path, store):
    """A nan val/loss (lr 1e30) was crowned best ("+nan% ..., better"); a variant whose runs
    logged no val/loss vanished from the comparison without a word."""
    study = spec.load_study(write_study(tmp_path, metric="val/loss", repeats=2))
    parent, console, files = build(tmp_path, store, study, {
        "lr0.01": [0.40, 0.42], "lr0.3": [float("nan"), 0.30]})
    verdict = parent.data.tags["ddplab.study.verdict"]
    assert parent.data.tags["ddplab.study.best"] == "lr0.3"  # its one finite repeat
    assert "nan" not in verdict, verdict
    warning = ("lr0.3: 1 of 2 finished runs ended with val/loss nan or inf (diverged?): left "
               "out of its median")
    assert warning in console and warning in files["report.md"], console
    # Every repeat diverged: no best; a variant that logged nothing is named.
    study = dataclasses.replace(study, name="all-nan")
    parent, console, files = build(tmp_path, store, study, {
        "lr0.01": [None, None], "lr0.3": [float("nan"), float("nan")]})
    assert parent.data.tags["ddplab.study.best"] == "none"
    assert parent.data.tags["ddplab.study.verdict"].startswith(
        "no finished run logged a value of val/loss to compare")
    assert "lr0.01: 2 of 2 finished runs logged no val/loss" in console
    assert "lr0.3: 2 of 2 finished runs ended with val/loss nan or inf" in console
    assert files["results.csv"].splitlines()[0].startswith(
        "variant,runs,failed,val/loss_median,val/loss_min,val/loss_max,")


def test_the_console_has_every_warning_of_the_report_and_a_failed_runs_straggler_none(
        tmp_path, store):
    """report.md listed a straggler the console did not print; and one from a FAILED run of 3
    steps, whose figures the study counts nowhere."""
    study = spec.load_study(write_study(tmp_path, metric="val/loss", repeats=2))
    straggler = {"ddplab.straggler": "rank 1 (host h) is a straggler: 3.0x the others' median"}
    parent, console, files = build(
        tmp_path, store, study, {"lr0.01": [0.4, 0.4], "lr0.3": [0.3, 0.3]},
        tags={("lr0.3", 0): straggler, ("lr0.3", 1): straggler}, status={("lr0.3", 1): "FAILED"})
    said = [x for x in console.splitlines() if "straggler" in x]
    assert len(said) == 1 and "lr0.3 (repeat 0," in said[0], console
    assert said[0].strip() in files["report.md"]
    assert "lr0.3 (repeat 1," not in files["report.md"]
    # ...and the parent run's description and warnings count have it too (a hostile pass: only
    # the verdict's own warnings reached the run)
    from mlflow import MlflowClient

    parent = MlflowClient(store).get_run(parent.info.run_id)
    assert "lr0.3 (repeat 0," in parent.data.tags["mlflow.note.content"]
    assert parent.data.tags["ddplab.study.warnings"] == str(
        sum(line.startswith("WARNING:") for line in files["report.md"].splitlines()))
    assert ("Compared: val/loss, lower is better (inferred from its name; metric_mode: max or "
            "min sets it)") in files["report.md"]
    # The study's saved view shows that answer (it asked for samples/s columns, all empty)
    import json

    views = MlflowClient(store).get_experiment(parent.info.experiment_id).tags
    columns = json.loads(json.loads(views["mlflow.sharedViewState.ddplab-study"])["state"])[
        "selectedColumns"]
    assert {"metrics.`study/lr0.3/val/loss_median`", "metrics.`val/loss`"} <= set(columns), columns
    assert not [c for c in columns if "samples_per_s" in c], columns
    assert "study/lr0.3/val/loss_median" in parent.data.metrics


def test_throughput_keeps_its_speedup_and_its_words(tmp_path, store):
    study = spec.load_study(write_study(tmp_path))
    parent, console, files = build(tmp_path, store, study,
                                   {"lr0.01": [100.0], "lr0.3": [120.0]})
    assert parent.data.tags["ddplab.study.verdict"].startswith("lr0.3 is 1.20x lr0.01, faster")
    assert "samples/s median [min-max] | speedup |" in files["report.md"]
    assert parent.data.metrics["study/lr0.3/speedup"] == pytest.approx(1.2)


def test_a_script_jobs_line_shows_the_compared_metric_not_zero_samples_per_s(tmp_path):
    """A script logs no samples/s and no eval/accuracy: its line once said "0 samples/s, eval
    accuracy nan"."""
    study = spec.load_study(write_study(tmp_path, metric="val/acc"))
    line = runner.job_figures(study, {"val/acc": 0.8512, "perf/wall_s": 30.0})
    assert line == "val/acc 0.8512"
    assert runner.job_figures(study, {"perf/wall_s": 30.0}) == "val/acc not logged"
    loop = spec.load_study(write_study(tmp_path))
    assert runner.job_figures(loop, {"perf/samples_per_s": 1234.0, "eval/accuracy": 0.9}) == \
        "1,234 samples/s, eval accuracy 0.9000"


def test_a_time_within_the_machines_drift_is_within_noise_a_loss_is_not(tmp_path, store):
    """One repeat of a wall time 7.5% lower read "better"; times drift as throughput does (its
    5% floor), a loss does not."""
    study = spec.load_study(write_study(tmp_path, metric="epoch/time_s"))
    parent, _, _ = build(tmp_path, store, study, {"lr0.01": [10.0], "lr0.3": [9.6]})
    verdict = parent.data.tags["ddplab.study.verdict"]
    assert "-4.0% epoch/time_s vs lr0.01 (9.600 vs 10.000), within noise" in verdict, verdict
    (tmp_path / "b").mkdir()
    study = spec.load_study(write_study(tmp_path / "b", metric="epoch/time_s", name="b"))
    parent, _, _ = build(tmp_path / "b", store, study, {"lr0.01": [10.0], "lr0.3": [9.0]})
    assert "-10.0% epoch/time_s vs lr0.01 (9.000 vs 10.000), better" in \
        parent.data.tags["ddplab.study.verdict"]
    (tmp_path / "c").mkdir()
    study = spec.load_study(write_study(tmp_path / "c", metric="val/loss", name="c"))
    parent, _, _ = build(tmp_path / "c", store, study, {"lr0.01": [1.0], "lr0.3": [0.98]})
    assert "-2.0% val/loss vs lr0.01 (0.980 vs 1.000), better" in \
        parent.data.tags["ddplab.study.verdict"]


@pytest.mark.parametrize("fields, said", [
    # The script's own init_process_group decides: two jobs alike but for an unread key (an
    # nccl variant was "skipped: needs 1 GPU(s)").
    ({"grid": {"dist.backend": ["gloo", "nccl"]}},
     "study.yaml: variant backendgloo: set 'dist.backend': a script job reads only "
     "dist.threads_per_rank, dist.timeout_s, dist.hang_after_s; its backend"),
    ({"set": {"dist.find_unused_parameters": True}},
     "study.yaml: set 'dist.find_unused_parameters': a script job reads only"),
    # The study's own set is no variant's ("variant lr0.01: set 'train.epochs=3'").
    ({"set": {"train.epochs": 3}}, "study.yaml: set 'train.epochs=3': train.epochs: got 3; a "
                                   "script job runs your script's own loop"),
    ({"experiment": "missing.py"}, "study.yaml: experiment: got 'missing.py'; not found: "),
    # the nested form of a key the script reads is no refusal; of one it does not, named whole
    ({"set": {"dist": {"threads_per_rank": 2, "backend": "nccl"}}},
     "study.yaml: set 'dist.backend': a script job reads only"),
])
def test_a_script_study_varies_only_what_the_script_reads_and_says_whose_set_is_wrong(
        tmp_path, store, monkeypatch, capsys, fields, said):
    from ddplab import cli

    (tmp_path / "train.py").write_text("print('training')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("DDPLAB_SET", raising=False)
    fields = {"experiment": "train.py", **fields}
    if "grid" in fields:
        fields.update(variants=[], baseline="backendgloo")
    assert cli.main(["study", "run", str(write_study(tmp_path, **fields)), "--dry-run"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert said in line, line
    if "variant" not in said:
        assert "variant" not in line, line


def test_a_metric_no_job_logged_names_the_closest_they_did_and_spaces_are_refused(
        tmp_path, store, monkeypatch, capsys):
    """A slip in the metric's name ended with best=none and nothing to go on."""
    from ddplab import cli

    study = spec.load_study(write_study(tmp_path, metric="perf/wal_s"))
    parent, console, _ = build(tmp_path, store, study, {"lr0.01": [None], "lr0.3": [None]})
    assert parent.data.tags["ddplab.study.verdict"].endswith("; did you mean perf/wall_s?")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    capsys.readouterr()
    assert cli.main(["study", "run", str(write_study(tmp_path, metric="val/acc ")),
                     "--dry-run"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("metric: got 'val/acc '; a metric's name, as the runs log it, without "
                         "spaces around it"), line



def test_a_script_studys_jobs_are_not_skipped_for_a_backend_the_script_does_not_read(
        tmp_path, store, monkeypatch, capsys):
    """The experiment file's (or --set's) dist.backend: nccl skipped every job "needs 1 GPU(s)";
    on the command line it is refused as in the study file."""
    from ddplab import cli
    from ddplab.study.runner import cannot_run_here

    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "exp.yaml").write_text("name: e\nscript: {path: train.py}\ndist: {backend: nccl}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("DDPLAB_SET", raising=False)
    study = spec.load_study(write_study(tmp_path, experiment="exp.yaml",
                                        set={"dist": {"threads_per_rank": 1}}))
    assert [cannot_run_here(study, v) for v in study.variants] == ["", ""]
    assert cli.main(["study", "run", str(write_study(tmp_path, experiment="train.py")),
                     "--dry-run", "--set", "dist.backend=nccl"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "study.yaml: --set 'dist.backend': a script job reads only" in line, line


def test_one_repeat_per_variant_warns_that_faster_or_slower_has_no_spread_behind_it(
        tmp_path, store):
    """A hostile pass: one repeat each, 6% apart on a shared 2-core machine, read "slower (range
    0.94-0.94)" with no warning; this machine's plain torchrun, run twice, differs 2-2.5%."""
    study = spec.load_study(write_study(tmp_path, metric="perf/samples_per_s"))
    parent, console, files = build(tmp_path, store, study, {"lr0.01": [100.0], "lr0.3": [94.0]})
    assert "lr0.3 is 0.94x lr0.01, slower" in parent.data.tags["ddplab.study.verdict"]
    said = "one repeat per variant: a speed difference has no spread to be judged by"
    assert said in files["report.md"] and said in console.replace("\n", " "), console
    (tmp_path / "b").mkdir()
    study = spec.load_study(write_study(tmp_path / "b", metric="perf/samples_per_s", name="b",
                                        repeats=3))
    parent, console, files = build(tmp_path / "b", store, study,
                                   {"lr0.01": [100.0, 101.0, 99.0], "lr0.3": [94.0, 93.0, 94.5]})
    assert "slower" in parent.data.tags["ddplab.study.verdict"]
    assert "one repeat" not in files["report.md"] and parent.data.tags["ddplab.study.warnings"] == "0"
    # A hostile pass: a script study's default, its wall time, said "+5.1% ... worse" of one
    # repeat each without the warning; a loss varies with the seed only, and has none.
    for metric, one, warned in (("perf/wall_s", [9.5], True), ("val/loss", [0.5], False)):
        (tmp_path / metric[-4:]).mkdir()
        study = spec.load_study(write_study(tmp_path / metric[-4:], metric=metric,
                                            metric_mode="min", name=metric[-4:].strip("/")))
        parent, console, files = build(tmp_path / metric[-4:], store, study,
                                       {"lr0.01": [10.0] if warned else [0.6], "lr0.3": one})
        said = f"one repeat per variant: a {metric} difference has no spread to be judged by"
        assert (said in files["report.md"]) == warned, files["report.md"][-1500:]
