"""Studies, reports and reproduce, end to end: `ddplab study run`, `ddplab report` and
`ddplab reproduce` as a user types them, real torchrun jobs, a real MLflow store."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, job_env, runs
from tests.helpers import cli

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
TINY = {"data.train_samples": 256, "data.eval_samples": 128, "train.epochs": 2,
        "train.log_every": 2, "tracking.system_metrics": False}


def write_study(tmp_path: Path, **fields) -> Path:
    study = {"name": "tiny", "experiment": str(REPO / "experiments" / "quickstart.yaml"),
             "set": TINY, "repeats": 2, "baseline": "one",
             "variants": [{"name": "one", "nproc": 1, "set": {"dist.threads_per_rank": 1}},
                          {"name": "two", "nproc": 2, "set": {"dist.threads_per_rank": 1}}]}
    study.update(fields)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def client(store: str):
    from mlflow import MlflowClient

    return MlflowClient(store)


def study_runs(store: str) -> tuple[object, list]:
    c = client(store)
    exps = [e.experiment_id for e in c.search_experiments()]
    found = c.search_runs(exps) if exps else []
    parents = [r for r in found if r.data.tags.get("ddplab.study_role") == "parent"]
    return parents, [r for r in found if r.data.tags.get("ddplab.study_role") == "job"]


@pytest.mark.parametrize("change, says", [
    ({"colour": "red"}, "colour: unknown key"),
    ({"variants": [{"name": "a"}, {"name": "a"}]}, "variants: got 'a'; variant names must be unique"),
    ({"baseline": "nope"}, "baseline: got 'nope'; must name a variant: one, two"),
    ({"variants": [{"name": "z", "nproc": 0}]}, "variants[0].nproc: got 0; must be an integer in [1, "),
    ({"variants": [{"name": "z", "launcher": "slurmish"}]}, "variants[0].launcher: got 'slurmish'"),
    ({"repeats": -1}, "repeats: got -1"),
    ({"variants": [{"name": "z", "set": {"optim.lr": -1}}]}, "variant z: set 'optim.lr=-1'"),
    ({"repeats": 1000000000000}, "repeats: got 1000000000000; must be an integer in [1, 1000]"),
    ({"variants": [{"name": "z", "set": {"train.amp": "fp16"}}]}, "variant z: train.amp: got 'fp16'"),
    ({"variants": [{"name": "z", "set": {"train.global_batch_size": 99}}]},
     "variant z: train.global_batch_size: got 99"),
    ({"grid": {"nproc": []}}, "grid.nproc: got []"),
    ({"grid": {}}, "grid: got {}; a grid needs at least one key with a list of values"),
    # the experiments' schema engine: bool is no number, unknown keys name the allowed ones
    ({"target_accuracy": True}, "target_accuracy: got True; expected float, not bool"),
    ({"variants": [{"name": "z", "colour": 1}]},
     "variants[0].colour: unknown key; allowed keys: name, nproc, nnodes, launcher, set"),
    ({"variants": {"name": "z"}}, "variants: got {'name': 'z'}; expected a list, each item a mapping"),
    ({"metric_mode": "up"}, "metric_mode: got 'up'; expected one of 'max', 'min'"),
])
def test_a_bad_study_file_is_one_clear_line_and_no_run(tmp_path, store, change, says, monkeypatch,
                                                       capsys):
    """In-process through the CLI's main (the real program's exit code: the test below)."""
    from ddplab import cli as ddplab_cli

    if isinstance(change.get("variants"), list) and "baseline" not in change:
        change = {"baseline": change["variants"][0]["name"], **change}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.delenv("DDPLAB_SET", raising=False)
    code = ddplab_cli.main(["study", "run", str(write_study(tmp_path, **change))])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert "study.yaml" in line and says in line and "Traceback" not in err
    assert runs(store) == [] and not list(tmp_path.glob("checkpoints"))


def test_an_experiment_file_or_a_folder_given_as_a_study_is_said_so(tmp_path, store,
                                                                      monkeypatch, capsys):
    """They read "script: unknown key" and "study file not found"."""
    from ddplab import cli as ddplab_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("name: mine\nscript: {path: train.py}\n")
    (tmp_path / "empty.yaml").write_text("")
    for path, says in ((experiment, "an experiment file, not a study"),
                       (tmp_path, "a directory; a study is a YAML file"),
                       (tmp_path / "empty.yaml", "empty; a study is a YAML mapping")):
        assert ddplab_cli.main(["study", "run", str(path)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert says in line, line
    assert runs(store) == []


def test_the_real_study_command_exits_2_with_one_line(tmp_path, store):
    out = cli(["study", "run", str(write_study(tmp_path, repeats=0))], tmp_path, store)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        f"ddplab: error: {tmp_path / 'study.yaml'}: repeats: got 0; must be an integer in [1, 1000]"]
    assert runs(store) == []


def test_slurm_variants_are_sbatch_jobs_and_need_a_login_node(tmp_path, store):
    """This machine is no Slurm login node: the plan shows the sbatch command, a real run
    stops before anything starts (the container tier, tests/test_compose_fresh.py, runs them)."""
    path = write_study(tmp_path, baseline="s",
                       variants=[{"name": "s", "nnodes": 2, "nproc": 1, "launcher": "slurm"}])
    plan = cli(["study", "run", str(path), "--dry-run"], tmp_path, store)
    assert plan.returncode == 0, plan.stderr
    assert "sbatch --wait --nodes=2 --ntasks-per-node=1 --job-name=ddplab-tiny-s" in plan.stdout
    assert "slurm/cpu.sbatch" in plan.stdout and "checkpoint.dir=checkpoints/studies" in plan.stdout
    out = cli(["study", "run", str(path)], tmp_path, "http://127.0.0.1:9")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "launcher slurm: sbatch is not on PATH: run the study on a Slurm login node" in out.stderr


def test_variants_runs_only_those_and_a_name_it_lacks_is_one_line(tmp_path, store):
    path = write_study(tmp_path)
    out = cli(["study", "run", str(path), "--dry-run", "--variants", "two"], tmp_path, store)
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stdout.splitlines() if x.startswith("  ")]
    assert [x.split(":")[0].strip() for x in lines] == ["two r0", "two r1"]
    from ddplab.config import ConfigError
    from ddplab.study import spec

    study = spec.load_study(path)
    assert spec.only(study, "two,one").baseline == study.baseline == "one"
    assert spec.only(study, "two").baseline == "two"  # the baseline is not among them
    with pytest.raises(ConfigError, match=r"--variants: got 'one,tow'; must name variants of "
                                          r".*comma-separated: one, two$"):
        spec.only(study, "one,tow")
    bad = cli(["study", "run", str(path), "--variants", "tow"], tmp_path, store)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "--variants: got 'tow'" in bad.stderr and runs(store) == []
    # A hostile pass: --variants "" (an unset shell variable) ran every variant.
    empty = cli(["study", "run", str(path), "--dry-run", "--variants", ""], tmp_path, store)
    assert empty.returncode == 2 and "--variants: got ''; must name variants" in empty.stderr


@pytest.mark.parametrize("given, env", [(["--set", "dist.threads_per_rank=2"], {}),
                                         ([], {"DDPLAB_SET": "train.epochs=1 'dist={threads_per_rank: 2}'"})])
def test_a_set_over_what_a_variant_sets_is_refused_in_one_line(tmp_path, store, given, env):
    """A hostile pass: `--set script.flags.lr=0.3` over a study of lr ran every job at 0.3, under
    its variant's name, and the table compared them as different learning rates."""
    path = write_study(tmp_path, variants=[
        {"name": "one", "nproc": 1, "set": {"dist.threads_per_rank": 2}},
        {"name": "two", "nproc": 2, "set": {"dist.threads_per_rank": 1}}])
    out = cli(["study", "run", str(path), "--dry-run", *given], tmp_path, store, **env)
    source = "--set" if given else "DDPLAB_SET"
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    key = "dist.threads_per_rank" if given else "dist"
    assert out.stderr.strip() == (
        f"ddplab: error: {path}: {source} '{key}': variant one sets dist.threads_per_rank itself, "
        f"and {source} comes after it: every variant would run the same value under its own "
        "name; vary it in the study file, or leave it out here"), out.stderr
    fine = cli(["study", "run", str(path), "--dry-run", "--set", "train.epochs=1"], tmp_path, store)
    assert fine.returncode == 0, fine.stderr
    # A key every variant sets alike is no difference to erase (they differ by nproc alone)
    alike = cli(["study", "run", str(write_study(tmp_path)), "--dry-run", *given], tmp_path,
                store, **env)
    assert alike.returncode == 0, alike.stderr


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path, store):
    out = cli(["study", "run", str(write_study(tmp_path)), "--dry-run"], tmp_path, store)
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stdout.splitlines() if x.startswith("  ")]
    # Repeats interleaved and rotated: repeat 1 starts with the second variant.
    assert [x.split(":")[0].strip() for x in lines] == ["one r0", "two r0", "two r1", "one r1"]
    assert "--nproc-per-node=2" in lines[1]
    assert runs(store) == []


def test_a_tiny_study_gives_a_parent_children_and_a_report_that_adds_up(tmp_path, store):
    path = write_study(tmp_path, grid={"nproc": [1], "optim.lr": [-1]})  # not runnable: refused
    assert cli(["study", "run", str(path)], tmp_path, store).returncode == 2
    # Passes every check before the study (the folder is there), fails inside its job (it is
    # empty): a job that fails while running is recorded and the study goes on.
    (tmp_path / "empty" / "cifar-10-batches-py").mkdir(parents=True)
    bad = {"name": "broken", "nproc": 1, "set": {"data.dataset": "cifar10",
                                                    "data.root": str(tmp_path / "empty")}}
    path = write_study(tmp_path, variants=[
        {"name": "one", "nproc": 1, "set": {"dist.threads_per_rank": 1}},
        {"name": "two", "nproc": 2, "set": {"dist.threads_per_rank": 1}}, bad])
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = cli(["study", "run", str(path)], tmp_path, store, TMPDIR=str(scratch))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # (each torchrun job's /tmp/torchelastic_* was left: its log dir is the study's, removed)
    assert not [p.name for p in scratch.iterdir() if p.name.startswith(("torchelastic_",
                                                                         "ddplab-"))]
    (parent,), children = study_runs(store)
    assert parent.info.status == "FINISHED" and parent.data.tags["ddplab.study"] == "tiny"
    ok = [c for c in children if c.info.status == "FINISHED"]
    assert sorted((c.data.tags["ddplab.variant"], c.data.tags["ddplab.repeat"]) for c in ok) == [
        ("one", "0"), ("one", "1"), ("two", "0"), ("two", "1")]
    failed = [c for c in children if c.data.tags["ddplab.variant"] == "broken"]
    assert len(failed) == 2 and all(c.info.status == "FAILED" for c in failed)
    # The failed job's line says why (it said only "FAILED in 9 s, no samples/s logged").
    (said,) = [ln for ln in out.stdout.splitlines() if ln.strip().startswith("broken r0: FAILED")]
    why = failed[0].data.tags["ddplab.error"].splitlines()[0][:60]
    assert f"no samples/s logged: {why}" in " ".join(out.stdout.split()), said
    assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id for c in children)
    assert {c.data.tags["ddplab.world_size"] for c in ok if c.data.tags["ddplab.variant"] == "two"} == {"2"}

    # The report's table, recomputed here from the children's own metrics.
    arts = client(store).download_artifacts(parent.info.run_id, "results.csv", str(tmp_path))
    rows = {r["variant"]: r for r in csv.DictReader(io.StringIO(Path(arts).read_text()))}
    speed = {v: statistics.median(c.data.metrics["perf/samples_per_s"] for c in ok
                                  if c.data.tags["ddplab.variant"] == v) for v in ("one", "two")}
    assert float(rows["one"]["throughput_median"]) == pytest.approx(speed["one"])
    assert float(rows["two"]["speedup"]) == pytest.approx(speed["two"] / speed["one"])
    assert float(rows["two"]["efficiency"]) == pytest.approx(speed["two"] / speed["one"] / 2)
    assert rows["broken"]["failed"] == "2" and rows["broken"]["throughput_median"] == ""
    names = {a.path for a in client(store).list_artifacts(parent.info.run_id)}
    assert {"report.md", "report.html", "results.csv", "throughput.png", "speedup.png",
            "loss_vs_step.png", "study.yaml"} <= names
    assert "two" in out.stdout and "speedup" in out.stdout  # the table in the terminal
    # The answer is on the parent run itself: per-variant figures, the best, the verdict.
    parent = client(store).get_run(parent.info.run_id)
    assert parent.data.metrics["study/one/samples_per_s_median"] == pytest.approx(speed["one"], rel=1e-3)
    assert parent.data.metrics["study/two/speedup"] == pytest.approx(speed["two"] / speed["one"], rel=1e-3)
    assert parent.data.tags["ddplab.study.best"] in ("one", "two")
    assert parent.data.tags["ddplab.study.verdict"].startswith("two is ")
    assert "broken: 2 of 2 runs failed" in parent.data.tags["mlflow.note.content"]
    assert "Verdict: two is " in out.stdout
    # ...and the runs table opens on it: the study's saved view, its address printed.
    views = client(store).get_experiment(parent.info.experiment_id).tags
    study_view = json.loads(json.loads(views["mlflow.sharedViewState.ddplab-study"])["state"])
    assert "metrics.`study/two/samples_per_s_median`" in study_view["selectedColumns"]
    assert "viewStateShareKey=ddplab-study" in out.stdout

    # Continues (nothing re-run), from the study file as it is now: its parent's study.yaml
    # and ddplab.study_file said what the first run's file said.
    moved = tmp_path / "moved.yaml"
    moved.write_text(path.read_text() + "description: the second time\n")
    again = cli(["study", "run", str(moved)], tmp_path, store)
    assert again.stdout.count("already FINISHED in this study, skipped") == 4
    assert len(study_runs(store)[1]) == len(children) + 2  # only the broken variant again
    # Each attempt's own output file: the rerun's did not write over the file the first
    # attempt's error names (its run id's in its name)
    logs = sorted(p.name for p in (tmp_path / "checkpoints" / "studies" / "tiny" / "logs").iterdir())
    assert [n for n in logs if n.startswith("broken-r0-")] == sorted(
        f"broken-r0-{c.info.run_id[:8]}.log" for c in study_runs(store)[1]
        if c.data.tags["ddplab.variant"] == "broken" and c.data.tags["ddplab.repeat"] == "0")
    assert len(logs) == len(children) + 2, logs
    assert study_runs(store)[0][0].data.tags["ddplab.study_file"] == str(moved)
    resolved = client(store).download_artifacts(parent.info.run_id, "study.yaml", str(tmp_path / "a"))
    assert "the second time" in Path(resolved).read_text()

    # `ddplab report <parent>` rebuilds the report from the store: the page call below does
    # (the same rebuild, then the page), and its output carries the table.
    assert_results_page(tmp_path, store, parent, ok, rows)


def assert_results_page(tmp_path: Path, store: str, parent, ok: list, rows: dict) -> None:
    """`ddplab report --page`: the report as docs/results/<name>.md, stamped from the runs."""
    bad = cli(["report", parent.info.run_id, "--page", "../escape"], tmp_path, store)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--page: got '../escape'" in bad.stderr
    blocked = tmp_path / "docs" / "results" / "blocked"  # the plots' folder name is a file
    blocked.parent.mkdir(parents=True, exist_ok=True)
    blocked.write_text("not a folder")
    bad = cli(["report", parent.info.run_id, "--page", "blocked"], tmp_path, store)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "ddplab report: error: report --page: cannot write" in bad.stderr
    out = cli(["report", parent.info.run_id, "--page", "tiny-study"], tmp_path, store)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "two" in out.stdout and "speedup" in out.stdout  # the rebuilt report's table
    page = tmp_path / "docs" / "results" / "tiny-study.md"
    text = page.read_text()
    stamp = dict(re.findall(r"^\| (measured|commit|machine|command) \| (.+) \|$", text, re.M))
    assert stamp["commit"].split(" + ")[0] == ok[0].data.tags["ddplab.git_sha"][:10]
    assert stamp["machine"] == ok[0].data.tags["ddplab.machine"]
    assert re.match(r"\d+ cores \(", stamp["machine"])
    first = min(c.info.start_time for c in ok) // 1000
    assert stamp["measured"].startswith(time.strftime("%Y-%m-%d %H:%M", time.gmtime(first)))
    assert stamp["command"].startswith("`ddplab study run ") and "moved.yaml" in stamp["command"]
    assert stamp["command"].endswith(f"ddplab report {parent.info.run_id} --page tiny-study`")
    row = next(line for line in text.splitlines() if line.startswith("| two |"))
    assert f"| {float(rows['two']['speedup']):.3f} |" in row
    linked = re.findall(r"!\[[^]]*\]\((tiny-study/[\w.]+\.png)\)", text)
    assert "tiny-study/throughput.png" in linked
    assert all((page.parent / p).stat().st_size > 1000 for p in linked)


def test_reproduce_says_bitwise_for_a_deterministic_run_and_differs_after_an_edit(tmp_path, store):
    """On lm-tiny: the GPT, byte tokens and AdamW with a cosine schedule, the shipped
    experiment with the most that could drift (one test for ddplab's bitwise reproduce; the
    user's own module is tests/test_userparts.py's)."""
    args = ["train", str(REPO / "experiments" / "lm-tiny.yaml"), "--set", "train.deterministic=true",
            "--set", f"data.root={REPO / 'docs'}", "--set", "train.max_steps=4",
            "--set", "train.eval_every_steps=2", "--set", "train.log_every=2",
            "--set", "data.eval_batch_size=128",
            "--set", "tracking.system_metrics=false", "--set", f"checkpoint.dir={tmp_path / 'ck'}"]
    first = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m",
                            "ddplab", *args], cwd=tmp_path, env=job_env(store),
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    c = client(store)
    (orig,) = c.search_runs([e.experiment_id for e in c.search_experiments()])
    assert orig.info.run_name == "lm-tiny gloo 1n x 2r x 1t torchrun"  # nodes x ranks x threads
    exp = c.get_experiment(orig.info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = cli(["reproduce", orig.info.run_id], tmp_path, store, TMPDIR=str(scratch))
    assert out.returncode == 0 and ": bitwise (" in out.stdout, out.stdout + out.stderr[-2000:]
    assert not list(scratch.glob("ddplab-reproduce-*"))  # its config and checkpoints: scratch
    (copy,) = [r for r in c.search_runs([orig.info.experiment_id])
               if r.data.tags.get("ddplab.reproduces") == orig.info.run_id]
    assert copy.data.tags["ddplab.reproduce.verdict"] == "bitwise"
    assert copy.data.tags["ddplab.world_size"] == "2" and copy.data.tags["ddplab.launcher"] == "torchrun"

    edited = yaml.safe_load(Path(c.download_artifacts(orig.info.run_id, "config.yaml",
                                                      str(tmp_path))).read_text())
    edited["optim"]["lr"] = 0.05
    c.log_text(orig.info.run_id, yaml.safe_dump(edited), "config.yaml")
    out = cli(["reproduce", orig.info.run_id], tmp_path, store)
    assert out.returncode == 1 and ": differs (" in out.stdout, out.stdout + out.stderr[-2000:]

    # Ctrl-C mid-job (a terminal's SIGINT to reproduce's process group): subprocess.run SIGKILLed
    # the launcher and the scratch folder went from under the ranks: the run ended FAILED with
    # no metric, or KILLED blaming "the spool deleted" (a hostile pass). Now KILLED, as a job's.
    edited["train"]["max_steps"] = 400
    c.log_text(orig.info.run_id, yaml.safe_dump(edited), "config.yaml")
    proc = subprocess.Popen([str(BIN / "ddplab"), "reproduce", orig.info.run_id], cwd=tmp_path,
                            env=job_env(store, TMPDIR=str(scratch)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        running = [r for r in c.search_runs([orig.info.experiment_id], "attributes.status = "
                                            "'RUNNING'") if "ddplab.reproduces" in r.data.tags]
        if running and c.get_metric_history(running[0].info.run_id, "train/loss"):
            break
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    said = proc.communicate(timeout=180)[0]
    stopped = c.get_run(running[0].info.run_id)
    assert proc.returncode == 130 and stopped.info.status == "KILLED", said[-3000:]
    assert stopped.data.tags["ddplab.error"] == "interrupted (SIGINT / Ctrl-C)", said[-3000:]
    assert c.get_metric_history(stopped.info.run_id, "train/loss"), said[-3000:]
    # (nor its launcher's torchrun folder, left by a SIGKILL: it ended as it does)
    assert not list(scratch.glob("ddplab-*")), (list(scratch.iterdir()), said[-3000:])


def test_a_gpu_variant_beyond_the_visible_gpus_is_skipped_with_its_reason(tmp_path, store):
    import torch

    need = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
    path = write_study(tmp_path, baseline="gpu", variants=[
        {"name": "gpu", "nproc": need, "set": {"dist.device": "cuda", "dist.backend": "nccl"}}])
    out = cli(["study", "run", str(path)], tmp_path, store)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert f"gpu r0: skipped: needs {need} GPU(s)" in out.stdout
    (parent,), children = study_runs(store)
    assert children == [] and parent.data.tags["ddplab.skipped.gpu"].startswith(f"needs {need}")
    report = Path(client(store).download_artifacts(parent.info.run_id, "report.md", str(tmp_path)))
    assert "Skipped gpu: needs" in report.read_text()


def test_a_study_interrupted_while_its_report_is_made_ends_its_parent_killed(tmp_path, store,
                                                                             monkeypatch, capsys):
    """Ctrl-C or kill in the report's making (after the last job) left the parent FINISHED,
    its verdict there but no report.html, results.csv or plots (a hostile pass, 5 of 5). In
    process, a study whose one job is skipped (no GPU): the interrupt is raised in the report."""
    import torch

    from ddplab import cli
    from ddplab.study import report

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    need = (torch.cuda.device_count() if torch.cuda.is_available() else 0) + 1
    path = write_study(tmp_path, baseline="gpu", variants=[
        {"name": "gpu", "nproc": need, "set": {"dist.device": "cuda", "dist.backend": "nccl"}}])
    monkeypatch.setattr(report, "build", interrupted)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        code = cli.main(["study", "run", str(path)])
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    out = capsys.readouterr().out
    (parent,), _ = study_runs(store)
    assert code == 130 and parent.info.status == "KILLED", out
    assert "interrupted while its report was made" in out


SHIPPED = sorted(p.name for p in (REPO / "experiments" / "studies").glob("*.yaml"))
# Run for real (reduced): ddplab's loop and a user's script. Every other shipped study is
# resolved, planned and checked below without running: its variants' features (strategies,
# bf16, ccl, the GPT, compose) have their own tests, and running all of them cost ~7 min of CI.
RUN_FOR_REAL = ("ch09-threads-vs-processes.yaml", "script-lr-layouts.yaml")
# Both layouts and both learning rates of the script's grid, in two jobs of its four; chapter
# 9's threads and its ccl processes (its gloo processes are every other test's job).
SOME_VARIANTS = {"script-lr-layouts.yaml": "1r-2t-lr0.05,2r-1t-lr0.2",
                 "ch09-threads-vs-processes.yaml": "1r-2t,2r-1t-ccl"}


@pytest.mark.parametrize("shipped", SHIPPED)
def test_each_shipped_study_resolves_plans_and_passes_its_checks(shipped):
    """Every variant's config resolves (a bad set key stops it), the plan covers every variant
    and repeat, and each variant passes the checks its job would run on this host."""
    from ddplab.study.runner import check_variants, command
    from ddplab.study.spec import load_study

    study = load_study(REPO / "experiments" / "studies" / shipped)
    plan = study.plan()
    assert {v.name for v, _ in plan} == {v.name for v in study.variants}
    assert len(plan) == len(study.variants) * study.repeats
    check_variants(study)
    for v, r in plan:
        if v.launcher in ("torchrun", "mpirun"):
            assert str(study.experiment) in command(study, v, r)
    # A variant this host cannot run (ch10's GPUs here) is skipped saying what it needs, and
    # only such a variant: every other one went through the checks above.
    import torch

    from ddplab.study.runner import cannot_run_here

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for v in study.variants:
        cfg, need = study.config(v), v.nproc * v.nnodes
        wants_gpus = cfg.dist.device == "cuda" or cfg.dist.backend == "nccl"
        expected = f"needs {need} GPU(s), {gpus} visible here" if wants_gpus and need > gpus else ""
        assert cannot_run_here(study, v) == expected, v.name


@pytest.mark.parametrize("shipped", RUN_FOR_REAL)
def test_each_shipped_study_runs_reduced(tmp_path, store, shipped):
    """The chosen shipped studies run, one repeat of a few steps: each variant ends FINISHED
    or is skipped with its reason; ccl without its bindings says it fell back."""
    study = yaml.safe_load((REPO / "experiments" / "studies" / shipped).read_text())
    experiment = REPO / "experiments" / "studies" / study["experiment"]
    base = {"data": {"dataset": "script"}} if experiment.suffix == ".py" else \
        yaml.safe_load(experiment.read_text())
    small = ["--set", "data.train_samples=256", "--set", "train.epochs=2",
             "--set", "train.max_steps=8"]
    # The eval size through DDPLAB_SET (issue 51: it works under every command): each job's
    # ranks inherit it, so every child records it.
    env = {"DDPLAB_SET": "data.eval_samples=128"}
    if base["data"]["dataset"] == "script":  # a script's own size flags, where it has them
        sizes = {"script.flags.synthetic": 128, "script.flags.samples": 256,
                 "script.flags.epochs": 1}
        small = [a for k, v in sizes.items() if k in study.get("set", {})
                 for a in ("--set", f"{k}={v}")]
        env = {}
    if base["data"]["dataset"] == "cifar10":  # not on this machine: the same shapes, generated
        small += ["--set", "data.dataset=synthetic"]
    if base["data"]["dataset"] == "tokens":  # its text is relative to the repository root
        small += ["--set", f"data.root={REPO / base['data']['root']}",
                  "--set", "data.seq_len=16"]  # a quarter of the compute: bf16 is emulated here
    chosen = {v["name"] for v in study["variants"]}
    if shipped in SOME_VARIANTS:  # the rest would run the same code again
        chosen = set(SOME_VARIANTS[shipped].split(","))
        small += ["--variants", SOME_VARIANTS[shipped]]
    out = cli(["study", "run", str(REPO / "experiments" / "studies" / shipped), "--repeats", "1",
               *small], tmp_path, store, **env)
    if any(v.get("launcher", "").startswith("compose") for v in study["variants"]):
        # Containers cannot reach a local SQLite store: one clear line before anything runs.
        # (tests/test_study_compose.py runs it against a server, in the container tier.)
        assert out.returncode == 2 and "need a tracking SERVER" in out.stderr, out.stderr
        assert runs(store) == []
        return
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (parent,), children = study_runs(store)
    skipped = {k.split(".", 2)[2] for k in parent.data.tags if k.startswith("ddplab.skipped.")}
    ran = {c.data.tags["ddplab.variant"] for c in children if c.info.status == "FINISHED"}
    assert ran | skipped == chosen and not ran & skipped
    for c in children:
        t = c.data.tags
        assert not env or c.data.params["data.eval_samples"] == "128", c.data.params
        if t.get("ddplab.backend_requested") == "ccl" and t["ddplab.backend"] == "gloo":
            assert "fallback" in t["ddplab.backend_reason"]


@pytest.mark.parametrize("args", [["report", "no-such-run"], ["reproduce", "no-such-run"],
                                  ["diagnose", "no-such-run"]])
def test_report_and_reproduce_of_an_unknown_run_are_one_line(tmp_path, store, args):
    out = cli(args, tmp_path, store)
    assert out.returncode == 2 and "no-such-run" in out.stderr and "not found" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_study_against_a_dead_server_stops_at_once_with_one_line(tmp_path):
    from tests.helpers import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    out = cli(["study", "run", str(write_study(tmp_path))], tmp_path, dead, timeout=60)
    assert out.returncode == 1 and "unreachable" in out.stderr and "Traceback" not in out.stderr


def start_long_study(tmp_path: Path, store: str, **sets: object) -> subprocess.Popen:
    """A study whose one job runs long enough; returns once that job is training."""
    import time

    path = write_study(tmp_path, set={**TINY, "train.epochs": 50, **sets})
    study_runs(store)  # the store's tables first: two processes creating them at once collide
    # In a process group of its own in this session, as a shell starts a job: the kernel drops
    # Ctrl-Z's stop for an orphaned group (no parent in the session outside it), as CI's was.
    proc = subprocess.Popen([str(BIN / "ddplab"), "study", "run", str(path)], cwd=tmp_path,
                            env=job_env(store), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, process_group=0)
    deadline = time.monotonic() + 120
    while not any(c.data.metrics.get("train/loss") for c in study_runs(store)[1]):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-2000:]
        time.sleep(0.5)
    return proc


# SIGTERM only: it takes Ctrl-C's own path (the unit test below: SIGTERM and SIGHUP get
# SIGINT's handler, KeyboardInterrupt); a second study sent SIGINT cost ~20 s for that path.
@pytest.mark.parametrize("sig", ["SIGTERM"])
def test_ctrl_c_or_termination_ends_the_parent_killed_and_leaves_no_child_running(
        tmp_path, store, sig):
    """Ctrl-C in a terminal reaches the study (the foreground group), not its job (its own
    session); so does `kill` (SIGTERM) or a closed terminal (SIGHUP, which takes SIGTERM's path:
    the unit test below). The study stops the job, whose run ends KILLED, then ends the parent
    KILLED."""
    import os
    import signal

    proc = start_long_study(tmp_path, store)
    os.kill(proc.pid, getattr(signal, sig))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:]
    (parent,), children = study_runs(store)
    assert parent.info.status == "KILLED"
    assert [c.info.status for c in children] == ["KILLED"]
    # The report says so (it said only "one: 1 of 1 runs failed", and nothing of "two").
    assert "WARNING: the study was interrupted before its end" in out, out[-3000:]
    assert "never run: two" in out, out[-3000:]


def test_ctrl_z_pauses_the_study_with_its_job_and_fg_continues_it_without_a_hang_verdict(
        tmp_path, store):
    """Ctrl-Z reaches the study, neither its job (its own session) nor torchrun's ranks (theirs):
    the job trained on while the study was stopped. Now the whole job pauses with it, and a
    pause longer than dist.hang_after_s is no hang once continued (the job's watch, paused as
    well, counted the silence: the job was killed as hung). Then SIGTERM ends it KILLED."""
    import os
    import signal
    import time

    from ddplab.subprocs import _descendants, state

    proc = start_long_study(tmp_path, store, **{"dist.hang_after_s": 3})
    job = _descendants(proc.pid)[1:]
    assert len(job) >= 3, job  # (setpriv's) torchrun, its rank, the node's delivery process
    os.kill(proc.pid, signal.SIGTSTP)  # what a terminal's Ctrl-Z sends its foreground group
    time.sleep(9)  # three times hang_after_s
    assert {pid: state(pid) for pid in [proc.pid, *job]} == dict.fromkeys([proc.pid, *job], "T")
    os.kill(proc.pid, signal.SIGCONT)  # fg
    _, (child,) = study_runs(store)
    steps = len(client(store).get_metric_history(child.info.run_id, "train/loss"))
    deadline = time.monotonic() + 60
    while len(client(store).get_metric_history(child.info.run_id, "train/loss")) <= steps + 2:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    time.sleep(4)  # past hang_after_s since it continued
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:]
    _, children = study_runs(store)  # (one: a job killed as hung, the study went on to "two")
    assert [(c.info.status, c.data.tags.get("ddplab.verdict", "")) for c in children] == [
        ("KILLED", "")], out[-2000:]


def test_a_closed_terminal_and_kill_stop_a_study_as_ctrl_c_does():
    """SIGHUP and SIGTERM both become Ctrl-C's KeyboardInterrupt in a running study, and
    Ctrl-C keeps it (the end-to-end test above sends SIGTERM for real)."""
    import signal

    from ddplab.subprocs import stop_on_termination

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    ctrl_c = signal.getsignal(signal.SIGINT)
    try:
        stop_on_termination()
        assert {s: signal.getsignal(s) for s in before} == dict.fromkeys(
            before, signal.default_int_handler)
        assert signal.getsignal(signal.SIGINT) is ctrl_c  # Ctrl-C's own handler, untouched
    finally:
        for s, handler in {**before, signal.SIGINT: ctrl_c}.items():
            signal.signal(s, handler)


def test_a_study_killed_outright_takes_its_running_job_with_it(tmp_path, store):
    """SIGKILL leaves the study no chance to act: the kernel's parent-death signal still stops
    its job (own session, so nothing else would), whose run ends KILLED, not RUNNING forever."""
    import os
    import signal
    import time

    proc = start_long_study(tmp_path, store)
    job = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                          text=True).stdout.split()]
    assert job, "the study's job launcher was not found"
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 120
    while any(Path(f"/proc/{pid}").exists() for pid in job) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(Path(f"/proc/{pid}").exists() for pid in job), "the job outlived its study"
    _, children = study_runs(store)
    said = "".join(p.read_text()[-3000:] for p in tmp_path.glob("checkpoints/studies/*/logs/*.log"))
    assert [c.info.status for c in children] == ["KILLED"], (
        [c.data.tags.get("ddplab.error") for c in children], said)


def test_compose_and_slurm_files_come_from_the_studys_checkout_not_the_package(tmp_path,
                                                                                monkeypatch):
    """An installed package has no compose/ beside it: the checkout is found from the study
    file (or the working directory), so a pip-installed ddplab runs a clone's study."""
    from types import SimpleNamespace

    from ddplab.study.runner import checkout

    clone = tmp_path / "clone"
    (clone / "compose").mkdir(parents=True)
    (clone / "compose" / "multinode.yml").write_text("services: {}\n")
    (clone / "experiments" / "studies").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert checkout(SimpleNamespace(path=clone / "experiments" / "studies" / "s.yaml")) == clone
    loose = SimpleNamespace(path=elsewhere / "s.yaml")
    assert checkout(loose) == REPO  # nothing above either: the checkout installed in place
    monkeypatch.chdir(clone / "experiments")
    assert checkout(loose) == clone  # a study file outside, run from inside a clone


def test_a_slurm_study_on_a_login_node_finds_its_batch_script_or_says_where_it_looked(
        tmp_path, store):
    """Past `which sbatch` (a stand-in sbatch on PATH: no Slurm here), the batch script is
    looked up the way the jobs will be submitted: the checkout's, else DDPLAB_SBATCH_SCRIPT."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    path = write_study(tmp_path, baseline="s",
                       variants=[{"name": "s", "nnodes": 2, "nproc": 1, "launcher": "slurm"}])
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = cli(["study", "run", str(path)], tmp_path, "sqlite:///x.db", **env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "need a tracking SERVER" in out.stderr  # the repository's slurm/cpu.sbatch was found
    gone = cli(["study", "run", str(path)], tmp_path, "sqlite:///x.db",
               DDPLAB_SBATCH_SCRIPT=str(tmp_path / "none.sbatch"), **env)
    assert gone.returncode == 2 and "Traceback" not in gone.stderr, gone.stderr
    assert f"no batch script at {tmp_path / 'none.sbatch'}" in gone.stderr


def test_a_checkpoint_dir_the_user_sets_holds_the_studys_jobs(tmp_path, store):
    """`ddplab study run FILE --set checkpoint.dir=X` was overridden by the study's own
    checkpoints/studies/... (relative to wherever the user stood), with no word said."""
    path = write_study(tmp_path, set={**TINY, "checkpoint.dir": str(tmp_path / "mine")})
    plan = cli(["study", "run", str(path), "--dry-run"], tmp_path, store)
    assert plan.returncode == 0, plan.stderr
    dirs = set(re.findall(r"checkpoint\.dir=(\S+)", plan.stdout))
    assert dirs and all(d.startswith(str(tmp_path / "mine" / "studies" / "tiny")) for d in dirs), dirs
    plan = cli(["study", "run", str(path), "--dry-run", "--set",
                f"checkpoint.dir={tmp_path / 'cli'}"], tmp_path, store)
    dirs = set(re.findall(r"checkpoint\.dir=(\S+)", plan.stdout))
    assert dirs and all(d.startswith(str(tmp_path / "cli" / "studies")) for d in dirs), dirs
