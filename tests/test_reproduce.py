"""``ddplab reproduce``'s verdict: what varies run to run (a seeded Hugging Face Trainer's
``train_runtime``, a job's peak memory) is reported, never compared; a run with nothing to
compare says so and is no "differs"; NaN met again is the same; a FAILED run is reproduced when
it fails again the same way; a study's parent is refused in one line. The original and the
reproduction are made with MlflowClient in a real SQLite store and judged by reproduce's own
code (no job runs; the end-to-end reproduce of a real run: tests/test_study.py and
tests/test_script_mode.py)."""

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
    ("memory/peak_rss_mb", True), ("perf/mfu", True), ("train/rank1_busy_s", True),
    ("train/data_wait_frac", True),
    # a time, a rate or memory by other common spellings: a study's 5% floor reads this rule
    ("tokens_per_sec", True), ("train/throughput", True), ("epoch_duration_s", True),
    ("eval/runtime_s", True), ("peak_mem_mb", True), ("gpu_memory_gb", True),
    ("val/f1", False), ("grad_norm_mean", False),
    ("epoch/epoch", False),
    ("loss", False), ("grad_norm", False), ("learning_rate", False), ("epoch", False),
    ("train/loss", False), ("eval/accuracy", False), ("total_flos", False),
])
def test_what_varies_run_to_run_is_named_by_one_rule(metric, timing):
    assert reproduce.varies_run_to_run(metric) is timing


HF_TRAINER = {"loss": [2.31, 1.87, 1.52], "grad_norm": [4.1, 3.2, 2.7],
              "learning_rate": [5e-5, 3.3e-5, 1.7e-5], "epoch": [0.33, 0.67, 1.0]}


def script_run(client, exp: str, metrics: dict[str, list[float]], status: str = "FINISHED",
               **tags: str) -> str:
    """A script-mode run that logged ``metrics`` (a value None: none at that step)."""
    run = client.create_run(exp, tags={"ddplab.mode": "script", **tags})
    for key, values in metrics.items():
        for step, value in enumerate(values):
            if value is not None:
                client.log_metric(run.info.run_id, key, value, step=step)
    client.set_terminated(run.info.run_id, status)
    return run.info.run_id


def judge(store: str, original: dict, again: dict, capsys, code: int = 0, was: dict | None = None,
          now: dict | None = None) -> tuple[int, str, dict, list]:
    """reproduce's verdict on ``again`` as the reproduction of ``original``, its job having
    exited ``code`` (``was``/``now``: script_run's status and tags of each): (exit code, its
    printed line, the new run's tags, differences.csv's rows)."""
    from mlflow import MlflowClient

    c = MlflowClient(store)
    exp = c.create_experiment("hf")
    first = script_run(c, exp, original, **(was or {}))
    new = script_run(c, exp, again, **{"ddplab.reproduces": first, **(now or {})})
    verdict = reproduce._judge(c, c.get_run(first), new, code)
    (line,) = capsys.readouterr().out.strip().splitlines()
    found = [a.path for a in c.list_artifacts(new, "reproduce")]
    rows = list(csv.DictReader(io.StringIO(
        artifact_text(c, new, "reproduce/differences.csv")))) if found else []
    return verdict, line, c.get_run(new).data.tags, rows


def test_a_seeded_trainer_run_is_bitwise_though_its_timings_differ(store, capsys):
    timings = {"train_runtime": [12.4], "train_samples_per_second": [41.3],
               "train_steps_per_second": [5.2], "perf/wall_s": [19.0]}
    slower = {k: [v[0] * 1.3] for k, v in timings.items()}
    code, line, tags, rows = judge(store, {**HF_TRAINER, **timings}, {**HF_TRAINER, **slower},
                                   capsys)
    assert code == 0 and tags["ddplab.reproduce.verdict"] == "bitwise", line
    assert ": bitwise (12 values compared, largest difference 0; 4 values that vary run to run " \
           "reported, not compared; every value: reproduce/differences.csv in run " in line
    compared = {r["metric"] for r in rows if r["compared"] == "yes"}
    reported = {r["metric"] for r in rows if r["compared"] == reproduce.NOT_COMPARED}
    assert compared == set(HF_TRAINER) and reported == set(timings)


def test_a_scripts_observed_train_loss_is_compared_like_its_own_metrics(store, capsys):
    ran = {**HF_TRAINER, "train/loss": [2.3, 1.9, 1.5], "train_runtime": [12.4]}
    drifted = {**ran, "train/loss": [2.3, 1.9, 1.6], "train_runtime": [12.4]}
    code, line, tags, rows = judge(store, ran, drifted, capsys)
    assert code == 1 and tags["ddplab.reproduce.verdict"] == "differs", line
    assert [r["step"] for r in rows if r["metric"] == "train/loss"] == ["0", "1", "2"]
    # Which value, and where the rest are: one line still.
    assert "largest difference 0.1 at train/loss step 2;" in line, line
    new = line.split(" -> ")[1].split(":")[0]
    assert line.endswith(f"; every value: reproduce/differences.csv in run {new}'s artifacts)")


@pytest.mark.parametrize("logged", [{}, {"perf/wall_s": [3.0], "system/cpu_utilization_percentage": [50.0]}])
def test_a_run_with_nothing_to_compare_says_so_and_is_no_difference(store, capsys, logged):
    again = {k: [v[0] + 1] for k, v in logged.items()}
    code, line, tags, rows = judge(store, logged, again, capsys)
    assert code == 0 and tags["ddplab.reproduce.verdict"] == "nothing logged to compare"
    assert ": nothing logged to compare (the run logged " in line and "differs" not in line
    assert all(r["compared"] == reproduce.NOT_COMPARED for r in rows) and len(rows) == len(logged)


def test_a_timing_memory_or_throughput_value_is_labelled_for_what_it_is(store, capsys):
    varying = {"memory/peak_rss_mb": [812.0], "perf/mfu": [0.31], "epoch_time_s": [4.0]}
    again = {k: [v[0] * 1.1] for k, v in varying.items()}
    code, line, _, rows = judge(store, {**HF_TRAINER, **varying}, {**HF_TRAINER, **again}, capsys)
    assert code == 0 and "3 values that vary run to run reported, not compared" in line, line
    labels = {r["metric"]: r["compared"] for r in rows if r["metric"] in varying}
    assert labels == dict.fromkeys(varying, "no: varies run to run (timing, memory, throughput)")


def test_the_docs_state_the_rule_the_code_applies():
    """studies.md names each kind of name reproduce does not compare, the way the code does."""
    from tests.helpers import REPO

    text = (REPO / "docs" / "studies.md").read_text()
    said = text[text.index("- **Reproduce**"):text.index("**Reports as results pages.**")]
    said = " ".join(said.split())
    for part, example in (("perf/", "perf/mfu"), ("system/", "system/cpu"),
                          ("memory/", "memory/peak_rss_mb"), ("runtime", "train_runtime"),
                          ("throughput", "tok/throughput"), ("duration", "epoch_duration"),
                          ("_per_sec", "tokens_per_sec"), ("eval/runtime_s", "eval/runtime_s"),
                          ("peak_mem_mb", "peak_mem_mb"),
                          ("_per_second", "eval_steps_per_second"), ("_per_s", "tokens_per_s"),
                          ("_busy_s", "train/rank0_busy_s"),
                          ("_wait_frac", "train/data_wait_frac"), ("_time", "epoch_time_s")):
        assert f"`{part}`" in said and reproduce.varies_run_to_run(example), part
    assert "a segment that starts with `time`" in said and reproduce.varies_run_to_run("a/time_s")
    assert "varies run to run (timing, memory, throughput)" in said


NAN = float("nan")


@pytest.mark.parametrize("original, again, verdict, said, step1", [
    # A diverged job that diverged again, bitwise: NaN where NaN was.
    ({"loss": [2.3, NAN, NAN]}, {"loss": [2.3, NAN, NAN]}, "bitwise",
     "3 values compared, largest difference 0;", ("nan", "nan", "0.0")),
    ({"loss": [2.3, NAN, NAN]}, {"loss": [2.3, 1.9, NAN]}, "differs",
     "3 values compared: 1 missing or NaN on one side (the first: loss step 1);",
     ("nan", "1.9", "nan")),
    # A NaN logged is no value missing: the rerun that never logged step 1 differs.
    ({"loss": [2.3, NAN, 1.9]}, {"loss": [2.3, None, 1.8]}, "differs",
     "1 missing or NaN on one side (the first: loss step 1), largest other difference 0.1 at "
     "loss step 2;", ("nan", "", "nan")),
])
def test_nan_met_again_at_the_same_step_is_the_same_and_nan_against_a_number_differs(
        store, capsys, original, again, verdict, said, step1):
    code, line, tags, rows = judge(store, original, again, capsys)
    assert tags["ddplab.reproduce.verdict"] == verdict and code == (verdict == "differs"), line
    assert said in line, line
    cells = {r["step"]: (r["original"], r["new"], r["abs_diff"]) for r in rows}
    assert cells["1"] == step1


ERROR = ("the script failed on rank 1 (host vm): ValueError: bad batch at step 3; then rank(s) 0 "
         "failed or were stopped\n\nTraceback (most recent call last):\n  File \"tr.py\", line "
         "{}, in <module>\nValueError: bad batch at step 3")
FIRST_LINE = ERROR.split("\n")[0]


@pytest.mark.parametrize("code, now, exit_code, said", [
    # The same first line, another traceback (a line moved): the failure came back.
    (1, {"status": "FAILED", "ddplab.error": ERROR.format(40)}, 0,
     f"reproduced (it failed again: {FIRST_LINE})"),
    (1, {"status": "FAILED", "ddplab.error": "rank 0 (host vm): killed by SIGKILL"}, 1,
     f"differs (the original failed: {FIRST_LINE}; the rerun failed: rank 0 (host vm): killed "
     "by SIGKILL)"),
    (0, {}, 1, f"differs (the original failed: {FIRST_LINE}; the rerun finished)"),
])
def test_a_failed_run_is_reproduced_when_it_fails_again_the_same_way(store, capsys, code, now,
                                                                      exit_code, said):
    was = {"status": "FAILED", "ddplab.error": ERROR.format(31)}
    verdict, line, tags, _ = judge(store, {"loss": [2.3]}, {"loss": [2.3]}, capsys, code, was, now)
    assert verdict == exit_code and line.endswith(f": {said}"), line
    assert tags["ddplab.reproduce.verdict"] == ("failed_again" if exit_code == 0 else "differs")


def test_a_finished_runs_rerun_that_failed_says_how(store, capsys):
    now = {"status": "FAILED", "ddplab.error": ERROR.format(31)}
    verdict, line, tags, _ = judge(store, {"loss": [2.3]}, {}, capsys, 1, None, now)
    assert verdict == 1 and tags["ddplab.reproduce.verdict"] == "differs"
    assert line.endswith(f": differs (the job exited 1: {FIRST_LINE}; nothing compared)"), line


def test_a_failed_run_is_said_to_have_failed_before_it_runs_again(store, tmp_path, capsys,
                                                                  monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # as reproduce() sets
    c = MlflowClient(store)
    first = script_run(c, c.create_experiment("x"), {}, "FAILED",
                       **{"ddplab.error": ERROR.format(31)})
    c.log_text(first, "kind: script\n", "config.yaml")
    run, config = reproduce._recorded(c, store, first, tmp_path)
    assert run.info.run_id == first and config.read_text() == "kind: script\n"
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert said == (f"ddplab reproduce: warning: run {first} FAILED ({FIRST_LINE}): rerunning it "
                    "says whether the failure reproduces")


def test_a_studys_parent_run_is_refused_in_one_line(store, monkeypatch, capsys):
    from mlflow import MlflowClient

    c = MlflowClient(store)
    exp = c.create_experiment("s")
    parent = script_run(c, exp, {}, **{"ddplab.study": "hb-s9", "ddplab.study_role": "parent",
                                       "ddplab.study_file": "studies/hb.yaml"})
    # Its jobs are named by their run ids (it said "`ddplab report PARENT` lists them": no id).
    job = script_run(c, exp, {}, **{"mlflow.parentRunId": parent, "ddplab.variant": "a",
                                    "ddplab.repeat": "0"})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    assert reproduce.reproduce(parent, strict=False) == 2
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert said == (f"ddplab reproduce: error: run {parent} is study hb-s9's parent run (it ran "
                    f"no job itself): reproduce one of its jobs (a r0 {job}) or rerun the study "
                    "(`ddplab study run studies/hb.yaml`)")
    assert {r.info.run_id for r in c.search_runs([exp])} == {parent, job}  # no rerun started


@pytest.mark.parametrize("named, cwd", [("{tmp}/gone.py", "{tmp}"), ("-m gone.train", "{tmp}"),
                                        ("-m gone.train", "{tmp}/removed")])
def test_a_script_that_is_gone_is_refused_in_one_line_before_any_run(store, monkeypatch, capsys,
                                                                     tmp_path, named, cwd):
    """It said "gone here", then started a job that failed on it: a FAILED run and "differs"."""
    from mlflow import MlflowClient

    named, cwd = named.format(tmp=tmp_path), cwd.format(tmp=tmp_path)
    c = MlflowClient(store)
    first = script_run(c, c.create_experiment("x"), {"train/loss": [0.5]}, **{
        "ddplab.script": named, "ddplab.script_cwd": cwd})
    c.log_text(first, "name: gone\nscript: {path: x.py}\n", "config.yaml")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    assert reproduce.reproduce(first, strict=False) == 2
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert said.startswith(f"ddplab reproduce: error: script {named}: the run ran it")
    assert ("which is gone here" in said) == cwd.endswith("removed"), said
    assert said.endswith(": nothing to run again"), said
    assert len(c.search_runs([c.get_run(first).info.experiment_id])) == 1


def test_a_difference_after_the_script_was_edited_says_so_in_the_verdict(store, capsys):
    """The edit was said only in a warning before the rerun's output, far above the verdict."""
    from mlflow import MlflowClient

    c = MlflowClient(store)
    exp = c.create_experiment("edited")
    first = script_run(c, exp, {"val/acc": [0.5]})
    new = script_run(c, exp, {"val/acc": [0.7]})
    edited = "; script /x/t.py: changed since the run (sha256 aaaa then, bbbb now)"
    assert reproduce._judge(c, c.get_run(first), new, 0, edited) == 1
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert ": differs (" in line and line.endswith(f"{edited})"), line
    # ... and when the edited script's rerun failed (the likeliest end of an edit)
    assert reproduce._judge(c, c.get_run(first), new, 3, edited) == 1
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "differs (the job exited 3: " in line and line.endswith(f"compared{edited})"), line


def test_a_run_still_running_or_stopped_before_its_config_is_refused_in_one_line(
        store, monkeypatch, capsys):
    """A hostile pass: a RUNNING run was run again beside its own job (exit 0, "nothing logged
    to compare"); a job KILLED before it recorded its config said only MLflow's "Failed to
    download artifacts from path 'config.yaml'"."""
    from mlflow import MlflowClient

    c = MlflowClient(store)
    exp = c.create_experiment("x")
    running = c.create_run(exp, tags={"ddplab.mode": "script"}).info.run_id
    c.log_text(running, "name: x\nscript: {path: x.py}\n", "config.yaml")
    killed = script_run(c, exp, {}, "KILLED", **{"ddplab.error": "interrupted (SIGINT / Ctrl-C)"})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    assert reproduce.reproduce(running, strict=False) == 2
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert said == (f"ddplab reproduce: error: run {running} is still RUNNING: reproduce it once "
                    "its job has ended (a job killed outright leaves its run RUNNING until "
                    "`ddplab sync` ends it)")
    assert reproduce.reproduce(killed, strict=False) == 2
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert said.startswith(f"ddplab reproduce: error: run {killed} (KILLED: interrupted (SIGINT / "
                           "Ctrl-C)) has no config.yaml to run again: its job ended before "
                           "recording it ("), said
    assert len(c.search_runs([exp])) == 2  # no rerun started
