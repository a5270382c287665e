"""Script mode: a user's own torchrun script, as it is, as one tracked ddplab job.

Unit tests read configs and the command line in-process; the e2e tests run the book's chapter 9
scripts and a plain script of ours under real torchrun (and mpirun, marked) into a real store.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddplab import cli, config
from ddplab.study.spec import load_study
from ddplab.tracking import schema

from .conftest import REPO, ddplab, job_env, runs
from .helpers import BIN, Server, artifact_text, free_port, left_behind, shm_regions

SCRIPTS = REPO / "experiments" / "scripts"
BOOK_GLOO = SCRIPTS / "gloo_distributed-cnn_cifar10.py"
BOOK_ONECCL = SCRIPTS / "oneccl_distributed-cnn_cifar10.py"
MY_TRAIN = SCRIPTS / "my_train.py"

# A script that misbehaves on request, the way users' scripts do.
FAULTY = '''
import argparse, os, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from ddplab import track
p = argparse.ArgumentParser()
p.add_argument("--fault", default="none")
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if rank == 1 and step == 5:
        if a.fault == "raise":
            raise ValueError(f"bad batch at step {step}")
        if a.fault == "sigkill":
            os.kill(os.getpid(), 9)
        if a.fault == "hang":
            print("rank 1 hangs", flush=True)
            time.sleep(3600)
    track.log({"train/loss": loss.item()}, step=step)
if rank == 0:
    import mlflow
    mlflow.log_metric("plain_mlflow", 1.0)
    mlflow.log_metric("train/samples_per_s", 123.0)  # a name ddplab's observation also writes
    print("rank 0 says goodbye")
dist.destroy_process_group()
if a.fault == "late" and rank == 0:
    time.sleep(3)  # its own evaluation, once the other ranks have gone
    raise RuntimeError("evaluation failed")
'''


# ---- unit: configs and the command line ----

def test_flags_replace_the_same_flag_in_args_and_bools_are_bare():
    s = config.ScriptConfig(path="x.py", args=["--lr", "0.1", "--epochs=3", "pos"],
                            flags={"lr": 0.5, "epochs": 2, "amp": True, "dry": False})
    assert s.argv() == ["pos", "--lr", "0.5", "--epochs", "2", "--amp"]


def test_flag_values_are_read_as_yaml_1_2_reads_them(tmp_path):
    """A hostile pass: PyYAML's YAML 1.1 turned `--set script.flags.seed=010` into --seed 8,
    `t=12:30` into --t 750, and `ans=no` into no flag at all (false)."""
    script = tmp_path / "t.py"
    script.write_text("x = 1\n")
    sets = ["script.flags.seed=010", "script.flags.t=12:30", "script.flags.ans=no",
            "script.flags.amp=on", "script.flags.mask=0o17", "script.flags.big=1_000",
            "script.flags.lr=1e-3", "script.flags.dry=false"]
    assert config.load(script, sets).script.argv() == [
        "--seed", "10", "--t", "12:30", "--ans", "no", "--amp", "on", "--mask", "15",
        "--big", "1000", "--lr", "0.001"]
    study = tmp_path / "s.yaml"
    study.write_text(f"name: s\nexperiment: {script}\nbaseline: 'ampon'\n"
                     "grid: {script.flags.amp: [on, off]}\n")
    from ddplab.study import spec

    assert [v.name for v in spec.load_study(study).variants] == ["ampon", "ampoff"]


@pytest.mark.parametrize("value", ["true", "null", "{x: 1}", "[a]"])
def test_an_environment_value_that_is_not_text_is_refused_in_one_line(tmp_path, value):
    """A hostile pass: `script.env={A: true, B: null}` gave the script A=True and B=None."""
    script = tmp_path / "t.py"
    script.write_text("x = 1\n")
    with pytest.raises(config.ConfigError, match=r"script\.env\.A: got .*; text or a number"):
        config.load(script, [f"script.env={{A: {value}}}"])
    assert config.load(script, ["script.env={A: 'true', B: 3, C: x}"]).script.env == {
        "A": "true", "B": "3", "C": "x"}


def test_a_py_file_is_an_experiment_named_after_it(tmp_path):
    script = tmp_path / "My Train.py"
    script.write_text("print('hi')\n")
    cfg = config.load(script, ["script.flags.lr=0.1"], ["--epochs", "3"])
    assert cfg.name == "My-Train" and cfg.script.path == str(script.resolve())
    assert cfg.script.argv() == ["--epochs", "3", "--lr", "0.1"]


def test_a_script_section_is_relative_to_the_experiment_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "t.py").write_text("x = 1\n")
    exp = tmp_path / "exp.yaml"
    exp.write_text("name: e\nscript: {path: sub/t.py, args: [--n, 3], env: {A: b}}\n")
    cfg = config.load(exp)
    assert cfg.script.path == str((tmp_path / "sub" / "t.py").resolve())
    assert cfg.script.args == ["--n", "3"] and cfg.script.env == {"A": "b"}


@pytest.mark.parametrize("argv, message", [
    (["train", "{d}/missing.py"], "missing.py: script not found"),
    (["train", "{d}/broken.py"], "does not compile: '(' was never closed at line 1"),
    (["train", "{d}/exp.yaml", "--", "--epochs", "3"], "arguments after `--` are for a script"),
    (["train", "{d}/ok.py", "--set", "script.flags.--lr=1"], "script.flags.--lr"),
    (["train", "{d}/ok.py", "--set", "script.env.1A=x"], "script.env.1A"),
    (["train", "{d}/ok.py", "--set", "script.path=ok.txt"], "a Python file (.py)"),
    # the script.path that is missing named, not the script given (which is there)
    (["train", "{d}/ok.py", "--set", "script.path=gone.py"], "script.path: '{d}/gone.py' not found"),
])
def test_bad_script_input_is_one_line_exit_2_before_any_run(tmp_path, capsys, argv, message):
    (tmp_path / "broken.py").write_text("x = (\n")
    (tmp_path / "ok.py").write_text("x = 1\n")
    (tmp_path / "ok.txt").write_text("x = 1\n")
    (tmp_path / "exp.yaml").write_text("name: e\n")
    assert cli.main([a.format(d=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    message = message.format(d=tmp_path)
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_script_flags_without_dashes_dash_get_a_hint(tmp_path, capsys):
    (tmp_path / "ok.py").write_text("x = 1\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["train", str(tmp_path / "ok.py"), "--epochs", "3"])
    assert e.value.code == 2
    assert "go after --: ddplab train" in capsys.readouterr().err


def test_a_study_over_a_script_compares_wall_time_unless_told():
    book = load_study(REPO / "experiments" / "studies" / "ch09-book-scripts.yaml")
    assert (book.metric, book.metric_mode) == ("perf/wall_s", "min")
    lr = load_study(REPO / "experiments" / "studies" / "script-lr-layouts.yaml")
    assert (lr.metric, lr.metric_mode) == ("perf/samples_per_s", "max")
    cfgs = {v.name: lr.config(v) for v in lr.variants}
    assert cfgs["2r-1t-lr0.2"].script.argv() == ["--epochs", "2", "--lr", "0.2"]
    assert cfgs["2r-1t-lr0.2"].dist.threads_per_rank == 1
    oneccl = book.config(book.variant("oneccl-2r"))
    assert oneccl.script.path == str(BOOK_ONECCL.resolve())


# ---- end to end: real torchrun, real store ----

def _logs(store: str, run_id: str) -> dict[str, str]:
    from mlflow import MlflowClient

    client = MlflowClient(store)
    out = {}
    for a in client.list_artifacts(run_id, "logs"):
        out[Path(a.path).name] = artifact_text(client, run_id, a.path)
    return out


@pytest.mark.e2e
def test_the_books_gloo_script_unchanged_is_one_finished_run(tmp_path, store):
    res = ddplab(["train", str(BOOK_GLOO), "--", "--synthetic", "128"], tmp_path, job_env(store),
                 nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = runs(store)
    tags, metrics = run.data.tags, run.data.metrics
    assert run.info.status == "FINISHED"
    assert tags["ddplab.mode"] == "script" and tags["ddplab.backend"] == "gloo"
    assert tags["ddplab.world_size"] == "2" and tags["ddplab.launcher"] == "torchrun"
    assert tags["ddplab.script_args"] == '["--synthetic", "128"]'
    assert tags["ddplab.script_git"] in ("committed", "modified")
    assert len(tags["ddplab.script_sha256"]) == 64
    assert any(k.startswith("system/node0/") for k in metrics)
    assert 0 < metrics["perf/time_to_process_group_s"] <= metrics["perf/wall_s"]
    assert metrics["perf/time_to_first_collective_s"] >= metrics["perf/time_to_process_group_s"]
    logs = _logs(store, run.info.run_id)
    assert set(logs) == {f"rank{r}.{s}.txt" for r in (0, 1) for s in ("stdout", "stderr")}
    assert "Worker 1 - Epoch [5/5]" in logs["rank1.stdout.txt"]
    assert "Accuracy of the network" in logs["rank0.stdout.txt"]  # the script's own eval
    assert "Accuracy of the network" in res.stdout  # and still on the console
    _observed_like_ddplabs_loop(store, run, logs["rank0.stdout.txt"], res.stdout + res.stderr)


def _observed_like_ddplabs_loop(store: str, run, printed: str, console: str) -> None:
    """The book's script logs nothing: its training figures come from observing it."""
    import re

    from mlflow import MlflowClient

    client, metrics = MlflowClient(store), run.data.metrics
    ends = {m.step for m in client.get_metric_history(run.info.run_id, "epoch/time_s")}
    losses = sorted((m.step, m.value) for m in client.get_metric_history(
        run.info.run_id, "train/loss") if m.step in ends)
    said = [float(x) for x in re.findall(r"Worker 0 - Epoch \[\d+/5\], Loss: ([0-9.]+)", printed)]
    assert len(said) == 5 and [round(v, 4) for _, v in losses] == said, (losses, said)
    assert metrics["epoch/epoch"] == 5
    # 128 samples over 2 ranks in batches of 32: 2 steps per epoch, 10 in all, 5 x 128 samples.
    assert max(ends) == 10 and len(ends) == 5
    assert 0 < metrics["perf/mfu"] < 1 and metrics["perf/samples_per_s"] > 0
    per_rank = metrics["train/rank0_samples_per_s"] + metrics["train/rank1_samples_per_s"]
    assert metrics["perf/samples_per_s"] == pytest.approx(per_rank, rel=1e-3)
    assert {"train/step_time_s", "train/data_wait_frac", "train/rank1_busy_s",
            "memory/peak_rss_mb"} <= set(metrics)
    summary = json.loads(artifact_text(client, run.info.run_id, "summary.json"))
    assert summary["steps"] == 10 and summary["samples"] == 640 and summary["epoch_steps"] == [2] * 5
    assert summary["clock"] == run.data.tags["ddplab.script_clock"] == "host"  # a CPU's
    # What the observation's own hooks took of the steady steps: measured, and small (0.2% in
    # make bench-script; a few ms of a busy machine's preemption inside a hook of these 8 tiny
    # steps would cross 2%, so the bound here is loose and the target is the benchmark's).
    assert 0 < summary["observe_frac"] < 0.1 and summary["per_rank"]["1"]["observe_s"] > 0
    assert "done in " in console and "10 steps, train/loss" in console


@pytest.mark.e2e
def test_mlflow_and_track_land_in_the_one_run_and_a_rank_failure_is_named(tmp_path, store):
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    ok = ddplab(["train", str(script)], tmp_path, job_env(store), nproc=2)
    assert ok.returncode == 0, ok.stderr[-3000:]
    (run,) = runs(store)  # plain mlflow.log_metric made no second run
    assert run.data.metrics["plain_mlflow"] == 1.0 and "train/loss" in run.data.metrics
    # Names the script logs itself are the script's alone: the observation writes none of them.
    from mlflow import MlflowClient

    history = MlflowClient(store).get_metric_history
    assert sorted(m.step for m in history(run.info.run_id, "train/loss")) == list(range(8))
    assert [(m.step, m.value) for m in history(run.info.run_id, "train/samples_per_s")] == [(0, 123.0)]
    assert "train/step_time_s" in run.data.metrics  # what it does not log, observed
    for fault, why in (("raise", "ValueError: bad batch at step 5"), ("sigkill", "killed by SIGKILL")):
        bad = ddplab(["train", str(script), "--set", "checkpoint.resume=never", "--",
                      "--fault", fault], tmp_path, job_env(store), nproc=2)
        assert bad.returncode != 0
        assert "done in " not in bad.stdout + bad.stderr  # a success's closing line, not a failure's
        failed = [r for r in runs(store) if r.info.status == "FAILED"]
        assert len(failed) == (1 if fault == "raise" else 2)
        error = max(failed, key=lambda r: r.info.start_time).data.tags["ddplab.error"]
        first = error.splitlines()[0]
        assert first.startswith("the script failed on rank 1 (host ") and why in first, error
        if fault == "raise":  # the user's traceback, once, from their own file
            assert 'faulty.py", line' in error and "ddplab/scriptmode" not in error
    assert not [r for r in runs(store) if r.info.status == "RUNNING"]


@pytest.mark.e2e
def test_a_hung_script_stopped_by_its_launcher_says_where_each_rank_was(tmp_path, store):
    """Rank 1 sleeps at step 5, rank 0 waits for it in DDP's all-reduce: nobody fails, so the
    job only ends when it is stopped (here torchrun gets SIGTERM, as from Slurm or Kubernetes).
    Each rank's stack, asked of the script before it is stopped, says where it was."""
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2",
           "-m", "ddplab", "train", str(script), "--", "--fault", "hang"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(store), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "rank 1 hangs" in line:
            break
    time.sleep(2)  # rank 0 is in its all-reduce by now
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    (run,) = runs(store)
    error = run.data.tags["ddplab.error"]
    assert run.info.status in ("FAILED", "KILLED") and "while no rank had failed" in error, error
    assert "rank 1 at faulty.py:" in error and "(stacks in forensics/)" in error, error
    from mlflow import MlflowClient

    client = MlflowClient(store)
    kept = {a.path for a in client.list_artifacts(run.info.run_id, "forensics")}
    assert {"forensics/rank0.stack.txt", "forensics/rank1.stack.txt"} <= kept, kept
    rank1 = Path(client.download_artifacts(run.info.run_id, "forensics/rank1.stack.txt", str(tmp_path)))
    assert "sleep" in rank1.read_text() or 'faulty.py", line' in rank1.read_text()


@pytest.mark.e2e
def test_a_rerun_of_a_failed_script_job_resumes_its_snapshot_in_the_same_run(tmp_path, store):
    # The same job (script, sha256, arguments) crashed once: the crash is no argument of it.
    first = ddplab(["train", str(MY_TRAIN), "--", "--epochs", "3", "--samples", "256"],
                   tmp_path, job_env(store, MY_TRAIN_FAIL_AT_STEP="10"), nproc=2)
    assert first.returncode != 0
    (failed,) = runs(store)
    assert failed.info.status == "FAILED"
    again = ddplab(["train", str(MY_TRAIN), "--", "--epochs", "3", "--samples", "256"],
                   tmp_path, job_env(store), nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.run_id == failed.info.run_id and run.info.status == "FINISHED"
    assert "resuming from epoch 2" in again.stdout
    assert run.data.tags["ddplab.resumed_from"] == run.info.run_id
    # The run ends as the finished attempt ended: its figures (logged after the failed attempt's
    # steps, which the observation of a resumed script cannot number), not the failed one's;
    # one value per step; the failed attempt's verdict and ranks' endings set aside.
    from mlflow import MlflowClient

    client = MlflowClient(store)
    summary = json.loads(artifact_text(client, run.info.run_id, "summary.json"))
    assert run.data.metrics["perf/wall_s"] == pytest.approx(summary["wall_time_s"], abs=1e-3)
    assert run.data.metrics["train/rank1_samples_per_s"] == summary["per_rank"]["1"]["samples_per_s"]
    # (train/loss and perf/samples_per_s are the script's own, logged on its own steps.)
    for name in ("perf/wall_s", "train/rank1_samples_per_s", "train/step_time_s", "epoch/time_s"):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, name)]
        assert len(steps) == len(set(steps)), (name, steps)
    assert not {k for k in run.data.tags if k.startswith(("ddplab.verdict", "ddplab.forensics.",
                                                          "ddplab.error"))}, run.data.tags
    aside = [a.path for a in client.list_artifacts(run.info.run_id, "resumes")]
    assert any(p.startswith("resumes/error-before-step") for p in aside), aside
    # Each rank's error file of the failed attempt is kept, beside its error, not as this run's.
    assert not client.list_artifacts(run.info.run_id, "forensics")
    (files,) = [p for p in aside if p.startswith("resumes/forensics-before-step")]
    assert any(a.path.endswith(".error.txt") for node in client.list_artifacts(run.info.run_id, files)
               for a in client.list_artifacts(run.info.run_id, node.path)), files
    # A rerun lines up with the script's own series, not with ddplab's observed ones, whose step
    # axis went on counting from the failed attempt while the script went back to its epoch 2:
    # reproduce said "differs" on epoch/epoch, every value the script logged being bitwise equal.
    assert "epoch/epoch" in run.data.tags["ddplab.observed"].split(","), run.data.tags
    rerun = subprocess.run([str(Path(sys.executable).parent / "ddplab"), "reproduce",
                            run.info.run_id], cwd=tmp_path, env=job_env(store),
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0 and ": bitwise (" in rerun.stdout, rerun.stdout + rerun.stderr[-3000:]
    assert "as the run was resumed: ddplab's observed epoch/epoch" in rerun.stdout, rerun.stdout


# A script whose own train/loss is one value at step 0 (mlflow.log_metric without a step, after
# its first step), whose first attempt fails on rank 1 at step 25 and whose second, resumed,
# runs 6 steps.
RESUMED_AT_STEP_0 = '''
import os
from pathlib import Path

import mlflow
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
snapshot = Path(os.environ["DDPLAB_CHECKPOINT_DIR"]) / f"rank{dist.get_rank()}.pt"
first = not snapshot.exists()
torch.save({}, snapshot)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(30 if first else 6):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 0 and dist.get_rank() == 0:
        mlflow.log_metric("train/loss", loss.item())  # at step 0, as MLflow logs without one
    if first and step == 25 and dist.get_rank() == 1:
        raise ValueError("crash at step 25")
dist.destroy_process_group()
'''


@pytest.mark.e2e
def test_a_resumed_script_whose_own_loss_is_at_step_0_still_ends_with_its_own_figures(
        tmp_path, store):
    """The run's steps are not the script's alone: the failed attempt's end figures sit at its
    observed step count (25), above any step of the script's own train/loss (0): the resumed
    attempt's, logged after the highest step of any metric, are the run's at the end."""
    script = tmp_path / "resumed.py"
    script.write_text(RESUMED_AT_STEP_0)
    assert ddplab(["train", str(script)], tmp_path, job_env(store), nproc=2).returncode != 0
    again = ddplab(["train", str(script)], tmp_path, job_env(store), nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.tags["ddplab.resumed_from"] == run.info.run_id
    from mlflow import MlflowClient

    client = MlflowClient(store)
    summary = json.loads(artifact_text(client, run.info.run_id, "summary.json"))
    assert summary["steps"] == 6, summary
    assert run.data.metrics["perf/wall_s"] == pytest.approx(summary["wall_time_s"], abs=1e-3)
    for r in ("0", "1"):
        assert run.data.metrics[f"train/rank{r}_busy_s"] == summary["per_rank"][r]["busy_s"]


# A plain DDP script that logs nothing, whose rank 1 loads its data slowly (or hangs there).
SLOW_DATA = '''
import argparse, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
p = argparse.ArgumentParser()
p.add_argument("--fault", default="slow")
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
class Data(Dataset):
    fetched = 0
    def __len__(self):
        return 2 * 8 * 16
    def __getitem__(self, i):
        Data.fetched += 1
        if rank == 1 and a.fault == "slow" and Data.fetched % 8 == 1:
            time.sleep(0.05)  # 50 ms per batch of 8
        if rank == 1 and a.fault == "hang" and Data.fetched == 6 * 8 + 1:
            print("rank 1 hangs loading step 7's batch", flush=True)
            time.sleep(3600)
        return torch.randn(16), torch.randn(1)
loader = DataLoader(Data(), batch_size=8, sampler=DistributedSampler(Data()))
model = DDP(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(1):
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
print(f"rank {rank} loss {loss.item():.4f}")
dist.destroy_process_group()
'''


@pytest.mark.e2e
def test_a_slow_ranks_data_is_named_the_straggler_and_its_hang_by_rank_phase_and_step(tmp_path,
                                                                                        store):
    """Observed without a line of ddplab in the script: the straggler from data wait and
    forward (not step time, which DDP's all-reduce evens out), and a hang from the phases'
    heartbeats, as for ddplab's own loop."""
    script = tmp_path / "slow_data.py"
    script.write_text(SLOW_DATA)
    slow = ddplab(["train", str(script)], tmp_path, job_env(store), nproc=2)
    assert slow.returncode == 0, slow.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED"
    named = run.data.tags["ddplab.straggler"]
    # Its extra work was its data loading: named so (not "data loading and forward").
    assert named.startswith("rank 1 (host ") and " ms: data loading) " in named, named
    assert "steady steps" in named, named
    assert "warning: rank 1 (host " in slow.stdout + slow.stderr
    assert run.data.metrics["train/rank1_busy_s"] > 0.04 > run.data.metrics["train/rank0_busy_s"]
    hang = ddplab(["train", str(script), "--set", "dist.hang_after_s=4", "--set",
                   "checkpoint.resume=never", "--", "--fault", "hang"], tmp_path,
                  job_env(store), nproc=2)
    assert hang.returncode != 0
    hung = next(r for r in runs(store) if r.info.run_id != run.info.run_id)
    assert hung.info.status == "FAILED"
    verdict = hung.data.tags["ddplab.verdict"]
    assert verdict.startswith("rank 1 (host ") and "at step 7 in data loading" in verdict, verdict
    assert "rank 0 waits in backward" in verdict, verdict
    # Each rank's own line says the hang watch stopped it, not a bare SIGKILL of unknown origin.
    said = "the job hung: stopped by ddplab's hang watch: rank 1 stopped at step 7 in data loading"
    assert said in hang.stderr and "killed by SIGKILL" not in hang.stderr, hang.stderr[-3000:]
    # Where in the script each rank was, from its stack (diagnose said only "stack ...").
    ranks = {e["rank"]: e for e in json.loads(hung.data.tags["ddplab.script_ranks"]) if "rank" in e}
    line = next(i for i, text in enumerate(SLOW_DATA.splitlines(), 1) if "sleep(3600)" in text)
    assert ranks[1]["where"] == f"slow_data.py:{line} in __getitem__", ranks[1]


RESTARTED = '''
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"]
snap = os.path.join(os.environ["DDPLAB_CHECKPOINT_DIR"], "snap.pt")
start = torch.load(snap)["step"] + 1 if os.path.exists(snap) else 0
print(f"rank {rank} attempt {attempt} from step {start}")
model = DDP(torch.nn.Linear(4, 1))
for step in range(start, 6):
    model(torch.randn(2, 4)).sum().backward()
    if rank == 0:
        torch.save({"step": step}, snap)
    dist.barrier()
    if step == 3 and rank == 1 and attempt == "0":
        raise RuntimeError("the first attempt dies")
dist.destroy_process_group()
'''


@pytest.mark.e2e
def test_torchrun_max_restarts_continues_the_same_run_from_the_snapshot(tmp_path, store):
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    bindir = Path(sys.executable).parent
    res = subprocess.run([str(bindir / "torchrun"), "--standalone", "--max-restarts", "1",
                          "--nproc-per-node", "2", "-m", "ddplab", "train", str(script)],
                         cwd=tmp_path, env=job_env(store), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "rank 1 attempt 1 from step 4" in res.stdout
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.tags["ddplab.resumed_from"] == run.info.run_id


@pytest.mark.e2e
def test_reproduce_reruns_a_script_and_strict_refuses_a_changed_one(tmp_path, store):
    script = tmp_path / "my_train.py"
    shutil.copy(MY_TRAIN, script)
    first = ddplab(["train", str(script), "--", "--samples", "128", "--epochs", "1"], tmp_path,
                   job_env(store), nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    (run,) = runs(store)
    again = subprocess.run([str(Path(sys.executable).parent / "ddplab"), "reproduce",
                            run.info.run_id], cwd=tmp_path, env=job_env(store),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and ": bitwise (" in again.stdout, again.stderr[-3000:]
    new = next(r for r in runs(store) if r.info.run_id != run.info.run_id)
    assert new.data.tags["ddplab.reproduce.verdict"] == "bitwise"
    assert new.data.tags["ddplab.script_args"] == run.data.tags["ddplab.script_args"]
    # Its snapshots were reproduce's scratch: no tag points at the removed folder.
    assert new.data.tags["ddplab.checkpoint_dir"] == "none (reproduce's scratch, removed)"
    script.write_text(script.read_text() + "\n# changed\n")
    strict = subprocess.run([str(Path(sys.executable).parent / "ddplab"), "reproduce", "--strict",
                             run.info.run_id], cwd=tmp_path, env=job_env(store),
                            capture_output=True, text=True, timeout=300)
    assert strict.returncode == 2 and "changed since the run" in strict.stderr
    assert len(runs(store)) == 2  # refused before any run


@pytest.mark.e2e
def test_reproducing_a_failed_script_run_says_it_failed_again_without_torchruns_traceback(
        tmp_path, store):
    """Before its verdict, reproduce showed torchrun's own ~50 lines (its traceback of
    ChildFailedError, its "Root Cause" banner): ddplab run's one line now."""
    script = tmp_path / "fails.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "raise RuntimeError('boom')\n")
    first = ddplab(["train", str(script)], tmp_path, job_env(store), nproc=2)
    assert first.returncode != 0
    (run,) = runs(store)
    again = subprocess.run([str(Path(sys.executable).parent / "ddplab"), "reproduce",
                            run.info.run_id], cwd=tmp_path, env=job_env(store),
                           capture_output=True, text=True, timeout=300)
    said = again.stdout + again.stderr
    assert again.returncode == 0 and "reproduced (it failed again" in said, said[-3000:]
    assert "ChildFailedError" not in said and "Root Cause" not in said, said[-3000:]
    assert "ddplab: error: rank " in said, said[-3000:]


OUTAGE = '''
import os, time, torch.distributed as dist
from ddplab import track
dist.init_process_group("gloo")
while not os.path.exists(os.environ["SERVER_DOWN"]):  # the test kills the server first
    time.sleep(0.1)
for step in range(5):
    track.log({"score": step * 1.5}, step=step)
dist.barrier()
dist.destroy_process_group()
'''


@pytest.mark.e2e
def test_track_records_survive_a_server_down_for_the_whole_script_and_sync_delivers(tmp_path):
    server = Server(tmp_path)
    server.start()
    try:
        script, flag, ck = tmp_path / "outage.py", tmp_path / "down", tmp_path / "ck"
        script.write_text(OUTAGE)
        job = subprocess.Popen(
            [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "ddplab", "train",
             str(script), "--set", f"checkpoint.dir={ck}", "--set",
             "tracking.delivery_timeout_s=4"], cwd=tmp_path,
            env=job_env(server.uri, SERVER_DOWN=str(flag)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while not list(ck.rglob("spool/node0/meta.json")):  # the run exists: now the outage
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0][-3000:]
            time.sleep(0.2)
        run_id = json.loads(next(ck.rglob("spool/node0/meta.json")).read_text())["run_id"]
        server.kill()
        flag.touch()
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 0, out[-3000:]
        assert "ddplab sync" in out, out[-2000:]  # the job says what is left and how to send it
        server.start()
        synced = subprocess.run([str(BIN / "ddplab"), "sync", str(ck)], cwd=tmp_path,
                                env=job_env(""), capture_output=True, text=True, timeout=180)
        assert synced.returncode == 0, synced.stdout + synced.stderr
        client = server.client()
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert [(m.step, m.value) for m in client.get_metric_history(run_id, "score")] == \
            [(s, s * 1.5) for s in range(5)]
        assert {a.path for a in client.list_artifacts(run_id, "logs")} >= {"logs/rank1.stdout.txt"}
        assert len(client.search_runs([run.info.experiment_id])) == 1
    finally:
        server.kill()


@pytest.mark.e2e
def test_one_process_is_a_world_of_one_without_local_rank_for_the_stand_in_and_the_script(
        tmp_path, store):
    """One process (no launcher) gives the script RANK=0 and WORLD_SIZE=1, not LOCAL_RANK (as
    plain python gives none; Lightning read it as its ranks started outside it). A review: the
    oneCCL stand-in then refused to import ("RANK=0, WORLD_SIZE=1 set but LOCAL_RANK not"); and a
    script that reads LOCAL_RANK is told why it is not there."""
    from ddplab import ccl

    if ccl.missing():
        pytest.skip(f"ddplab's ccl is not built here ({ccl.missing()}); make test builds it")
    (tmp_path / "cc.py").write_text(
        "import oneccl_bindings_for_pytorch  # noqa: F401\nimport torch.distributed as dist\n"
        "dist.init_process_group('ccl')\nprint('CCL WORLD', dist.get_world_size())\n")
    res = ddplab(["train", str(tmp_path / "cc.py")], tmp_path, job_env(store))
    assert res.returncode == 0 and "CCL WORLD 1" in res.stdout, res.stderr[-3000:]
    (tmp_path / "lr.py").write_text("import os\nprint(int(os.environ['LOCAL_RANK']))\n")
    res = ddplab(["train", str(tmp_path / "lr.py")], tmp_path, job_env(store))
    assert res.returncode == 1 and "KeyError: 'LOCAL_RANK' (one process, no launcher: nothing " \
        "gave it GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE" in res.stderr, res.stderr[-3000:]


@pytest.mark.e2e
def test_the_books_oneccl_script_runs_on_ddplabs_ccl_standing_in(tmp_path, store):
    from ddplab import ccl

    if ccl.missing():
        pytest.skip(f"ddplab's ccl is not built here ({ccl.missing()}); make test builds it")
    before = shm_regions()
    res = ddplab(["train", str(BOOK_ONECCL), "--", "--synthetic", "128"], tmp_path,
                 job_env(store), nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.tags["ddplab.backend"] == "ccl"
    assert "standing in for oneccl_bindings_for_pytorch" in run.data.tags["ddplab.ccl_impl"]
    # The script's processes end by os._exit too: their libfabric regions (64 MB each) go.
    assert left_behind(before) == set()


@pytest.mark.mpi
def test_the_books_gloo_script_under_mpirun(tmp_path, store):
    env = job_env(store, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                  PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    res = subprocess.run(
        [shutil.which("mpirun") or "mpirun", *root, "-np", "2", "--oversubscribe", "--bind-to",
         "none", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "MLFLOW_TRACKING_URI", "-x",
         "PATH", "ddplab", "train", str(BOOK_GLOO), "--", "--synthetic", "128"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.tags["ddplab.launcher"] == "openmpi"
    assert run.data.tags["ddplab.world_size"] == "2"
    assert len(_logs(store, run.info.run_id)) == 4


@pytest.mark.e2e
def test_summary_out_of_a_script_job(tmp_path, store):
    script = tmp_path / "one.py"
    script.write_text("import sys; print('one rank, no process group'); sys.exit(0)\n")
    out = tmp_path / "summary.json"
    res = ddplab(["train", str(script), "--summary-out", str(out)], tmp_path, job_env(store))
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(out.read_text())
    (run,) = runs(store)
    assert summary["run_id"] == run.info.run_id and summary["ranks"][0]["code"] == 0
    assert run.data.tags["ddplab.backend"].startswith("none")


@pytest.mark.e2e
@pytest.mark.parametrize("args, message", [
    (["{quickstart}", "--set", "dist.backend=nccl"], "nccl needs a CUDA device"),
    (["{quickstart}", "--set", "dist.backend=mpi"], "'mpi' is not available"),
    (["{quickstart}", "--set", "dist.strategy=fsdp", "--set", "dist.bucket_cap_mb=5"], "fsdp"),
    (["{quickstart}", "--set", "train.epochs=[1"], "not valid YAML"),
    (["{missing}"], "not found"),
])
def test_ddplab_run_refuses_in_one_line_before_torchrun_starts(tmp_path, store, args, message):
    """What `make run` runs: the refusals knowable before the ranks start are one line, exit 2,
    and no torchrun banner or traceback (each rank used to print its own, then torchrun's)."""
    argv = [a.format(quickstart=REPO / "experiments" / "quickstart.yaml",
                     missing=tmp_path / "missing.py") for a in args]
    out = subprocess.run([str(BIN / "ddplab"), "run", "--nproc-per-node", "2", *argv],
                         cwd=tmp_path, env=job_env(store), capture_output=True, text=True,
                         timeout=120)
    lines = [x for x in (out.stdout + out.stderr).splitlines() if x.strip()]
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], lines
    assert not Path(store.removeprefix("sqlite:///")).exists() or runs(store) == []


@pytest.mark.e2e
def test_ddplab_run_starts_torchrun_for_a_script_and_its_arguments(tmp_path, store):
    scratch = tmp_path / "tmp"  # the jobs' TMPDIR: nothing of them is left in it
    scratch.mkdir()
    out = subprocess.run([str(BIN / "ddplab"), "run", "--nproc-per-node", "2", str(MY_TRAIN),
                          "--", "--epochs", "1", "--samples", "128"], cwd=tmp_path,
                         env=job_env(store, TMPDIR=str(scratch)), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.tags["ddplab.launcher"] == "torchrun"
    assert json.loads(run.data.tags["ddplab.script_args"]) == ["--epochs", "1", "--samples", "128"]
    # A failed job ends on its run too: after torchrun's own report, the run's id and address.
    bad = subprocess.run([str(BIN / "ddplab"), "run", "--nproc-per-node", "2", str(MY_TRAIN),
                          "--", "--epochs", "1", "--samples", "128"], cwd=tmp_path,
                         env=job_env(store, MY_TRAIN_FAIL_AT_STEP="1", TMPDIR=str(scratch)),
                         capture_output=True, text=True, timeout=300)
    failed = next(r for r in runs(store) if r.info.status == "FAILED")
    *_, said, last = bad.stderr.strip().splitlines()
    assert bad.returncode != 0 and last.startswith(f"[ddplab] MLflow run {failed.info.run_id} "
                                                   "FAILED in "), bad.stderr[-3000:]
    assert "done in " not in bad.stdout + bad.stderr
    # the failed rank's error, read from its torchrun error file before that file's folder went
    assert re.match(r"ddplab: error: ranks? [0-9,]+ failed \(exit code 1\): \S+", said), said
    # torchrun's own folder for those files (/tmp/torchelastic_*: left by plain torchrun, 287 a CI
    # run) and ddplab's run-line and script files; torch's compile cache is a cache, kept
    left = sorted(p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], bad.stderr[-2000:]


SCALED = '''
import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
x, y = torch.randn(64, 8), torch.randn(64, 1)
for step in range(1, 21):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    if step <= 5:  # AMP's pattern: the backward runs from the loss x 1024
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    elif step <= 10:  # a list scaled at once; a tensor backed twice (retain_graph)
        mine, other = scaler.scale([loss, loss * 0])
        mine.backward(retain_graph=True)
        other.backward(retain_graph=True)
        mine.backward()
        scaler.step(opt)
        scaler.update()
    else:  # the functional form
        torch.autograd.backward(loss)
        opt.step()
    print(f"step {step} loss {loss.item():.6f}")
'''


@pytest.mark.e2e
def test_the_loss_under_a_grad_scaler_and_through_autograd_backward_is_the_scripts(tmp_path, store):
    """A GradScaler's backward starts from the scaled loss, and ``torch.autograd.backward(loss)``
    does not go through ``Tensor.backward``: train/loss is still what the script printed."""
    import re

    from mlflow import MlflowClient

    script = tmp_path / "scaled.py"
    script.write_text(SCALED)
    res = ddplab(["train", str(script)], tmp_path, job_env(store))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    printed = {int(s): float(v) for s, v in re.findall(r"step (\d+) loss ([0-9.]+)", res.stdout)}
    (run,) = runs(store)
    logged = {m.step: m.value for m in MlflowClient(store).get_metric_history(
        run.info.run_id, "train/loss")}
    assert {10, 20} <= set(logged), logged
    for step in (10, 20):
        assert logged[step] == pytest.approx(printed[step], abs=1e-5), (step, logged, printed)
    assert run.data.metrics["train/step_time_s"] > 0


FSDP_SCRIPT = '''
import os
import sys

import torch
import torch.distributed as dist

# The observation attaches to FSDP only once the script imports it: nothing of FSDP's (600
# modules, sympy's among them) is loaded for a script that never does.
# One write each: the two ranks share the pipe, and print's pieces of one rank can fall between
# the other's.
os.write(1, f"fsdp loaded before the script asked: {'torch.distributed.fsdp' in sys.modules} "
            f"{'sympy' in sys.modules}\\n".encode())
from torch.distributed.fsdp import fully_shard  # FSDP2 (FSDP1's wrapper class needs a GPU)

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(12):
    x, y = torch.randn(24, 8), torch.randn(24, 1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
'''


@pytest.mark.e2e
def test_an_fsdp_script_is_observed_and_fsdp_is_not_loaded_for_it(tmp_path, store):
    script = tmp_path / "fsdp_script.py"
    script.write_text(FSDP_SCRIPT)
    res = ddplab(["train", str(script)], tmp_path, job_env(store), nproc=2)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert res.stdout.count("fsdp loaded before the script asked: False False") == 2, res.stdout
    from mlflow import MlflowClient

    (run,) = runs(store)
    summary = json.loads(artifact_text(MlflowClient(store), run.info.run_id, "summary.json"))
    # FSDP2 is no wrapper: the batch is counted at the first module called, the sharded
    # root: 12 steps x 24 samples x 2 ranks.
    assert (summary["steps"], summary["samples"]) == (12, 576), summary
    assert run.data.metrics["perf/samples_per_s"] > 0 and "train/loss" in run.data.metrics


@pytest.mark.e2e
def test_what_a_script_sets_before_importing_torch_holds_as_under_plain_python(tmp_path, store):
    """torch reads OMP_NUM_THREADS once, at its import: the book's chapter 9 scripts set it
    first (their threads per rank), so ddplab must not import torch before the script does."""
    script = tmp_path / "threads.py"
    script.write_text('import os\nos.environ["OMP_NUM_THREADS"] = "1"\nimport torch\n'
                      'print("threads", torch.get_num_threads())\n')
    res = ddplab(["train", str(script), "--set", "tracking.enabled=false"], tmp_path,
                 job_env(store, OMP_NUM_THREADS="2"))
    assert res.returncode == 0 and "threads 1" in res.stdout, res.stdout + res.stderr[-2000:]


# One process, no DDP: a parameterless module of the data pipeline called first in each step,
# the model called with keyword arguments only, two micro-batches per optimizer step; or the
# model compiled with fullgraph=True.
ALONE = '''
import argparse, torch, torch.nn as nn
p = argparse.ArgumentParser(); p.add_argument("--compile", action="store_true"); a = p.parse_args()
torch.manual_seed(0)
class Net(nn.Module):
    def __init__(self):
        super().__init__(); self.l1 = nn.Linear(5, 32); self.l2 = nn.Linear(32, 1)
    def forward(self, x=None):
        return self.l2(torch.relu(self.l1(x)))
net = Net()
model = torch.compile(net, fullgraph=True, backend="eager") if a.compile else net
prep = nn.Identity()  # a transform (torchvision's are modules) with nothing to train
opt = torch.optim.SGD(net.parameters(), lr=0.01)
for step in range(12):
    for micro in range(2):
        x = torch.stack([prep(torch.rand(5)) for _ in range(8)])
        (model(x=x).pow(2).mean() / 2).backward()
    opt.step(); opt.zero_grad()
print("12 steps of 16 samples")
'''


@pytest.mark.e2e
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-fullgraph"])
def test_a_single_process_script_is_observed_at_its_model_also_compiled(tmp_path, store, compiled):
    """Without DDP the model is the first module a step calls that has parameters to train: not
    the data pipeline's transform (its image's 3 channels were counted as the batch), with its
    keyword arguments (``model(x=x)`` gave 0 samples/s), every micro-batch (only the first was
    counted); compiled with fullgraph=True the script ran under plain python but crashed under
    ddplab (the hooks' clocks traced by Dynamo)."""
    from mlflow import MlflowClient

    script = tmp_path / "alone.py"
    script.write_text(ALONE)
    out = ddplab(["train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--",
                  *(["--compile"] if compiled else [])], tmp_path, job_env(store))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "global hooks" not in out.stderr and "Graph break" not in out.stderr, out.stderr[-3000:]
    (run,) = runs(store)
    summary = json.loads(artifact_text(MlflowClient(store), run.info.run_id, "summary.json"))
    # (the model found at its first call: that call's keyword arguments are not seen)
    assert summary["steps"] == 12 and summary["samples"] == (192 if compiled else 184), summary
    assert summary["samples_per_s_steady"] > 0 and summary["mfu"] > 0, summary
    # The FLOP count's own forward, after the script's end, is no evaluation after "done": the
    # eager model's run was said to have died outright (SIGKILL or the OOM killer) at step 13.
    assert schema.VERDICT not in run.data.tags and "died" not in out.stderr, out.stderr[-3000:]


# A GAN in DCGAN's order (D on real and fake, D's step; D on fake again, G's step), two epochs
# of ten iterations through a DistributedSampler; or an error raised inside loss.backward().
GAN = '''
import argparse, torch, torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset, DistributedSampler
p = argparse.ArgumentParser(); p.add_argument("--fail", action="store_true"); a = p.parse_args()
class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x.clone()
    @staticmethod
    def backward(ctx, g): raise ValueError("bad gradient")
torch.manual_seed(0)
D, G = nn.Linear(4, 1), nn.Linear(2, 4)
optD, optG = torch.optim.SGD(D.parameters(), lr=0.01), torch.optim.SGD(G.parameters(), lr=0.01)
data = TensorDataset(torch.randn(80, 4))
sampler = DistributedSampler(data, num_replicas=1, rank=0)
for epoch in range(2):
    sampler.set_epoch(epoch)
    for (real,) in DataLoader(data, batch_size=8, sampler=sampler):
        fake = G(torch.randn(8, 2))
        lossD = D(real).mean() - D(fake.detach()).mean()
        optD.zero_grad(); lossD.backward(); optD.step()
        lossG = -D(Boom.apply(fake) if a.fail else fake).mean()
        optG.zero_grad(); lossG.backward(); optG.step()
print("20 iterations")
'''


@pytest.mark.e2e
def test_a_gan_in_dcgans_order_is_one_step_an_iteration_and_logs_once_a_step(tmp_path, store):
    """The generator's step after new forwards counted as a step of its own (40, not 20); an
    epoch ending on a log point's step logged train/loss twice at that step."""
    from mlflow import MlflowClient

    script = tmp_path / "gan.py"
    script.write_text(GAN)
    out = ddplab(["train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path,
                 job_env(store))
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    client = MlflowClient(store)
    assert json.loads(artifact_text(client, run.info.run_id, "summary.json"))["steps"] == 20
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == [10, 20], steps


@pytest.mark.e2e
def test_an_error_inside_backward_shows_the_users_frames_not_ddplabs_hooks(tmp_path, store):
    script = tmp_path / "gan.py"
    script.write_text(GAN)
    out = ddplab(["train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--",
                  "--fail"], tmp_path, job_env(store))
    assert out.returncode == 1
    assert 'gan.py", line 22, in <module>' in out.stderr and "ValueError: bad gradient" in out.stderr
    assert "scriptmode" not in out.stderr, out.stderr[-3000:]


def test_a_folder_or_an_extensionless_script_says_how_to_run_it(tmp_path, capsys):
    """`python DIR` and `python train` run; `ddplab train` takes a .py file: the refusal said
    only that an experiment is YAML, or that its top level must be a mapping."""
    (tmp_path / "pkgdir").mkdir()
    (tmp_path / "pkgdir" / "__main__.py").write_text("print('hi')\n")
    (tmp_path / "train").write_text("#!/usr/bin/env python3\nimport sys\nprint(sys.argv)\n")
    assert cli.main(["train", str(tmp_path / "pkgdir")]) == 2
    assert f"give {tmp_path / 'pkgdir' / '__main__.py'}" in capsys.readouterr().err
    assert cli.main(["train", str(tmp_path / "train")]) == 2
    assert "a Python script? script mode runs a .py file" in capsys.readouterr().err


# What a script sees of how it was started, and how deep its frames sit (code that walks the
# stack, as torch does on each manual_seed before CUDA starts, pays for every frame below).
WHERE = '''
import os, pickle, sys, traceback
class Thing:
    pass
print("DEPTH", len(traceback.extract_stack()))
print("MAIN", __name__, __file__, getattr(__spec__, "name", None), os.path.abspath(sys.argv[0]),
      sys.modules["__main__"].__dict__ is globals(), sys.path[0])
print("PICKLED", type(pickle.loads(pickle.dumps(Thing()))).__name__)
'''


def _said(out: str) -> dict[str, str]:
    return {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in out.splitlines()
            if ln.split(" ", 1)[0] in ("DEPTH", "MAIN", "PICKLED")}


@pytest.mark.e2e
def test_a_script_runs_as_under_python_one_frame_above_the_bottom(tmp_path, store):
    """As a file and as ``-m pkg.module``: the script's __main__, its file, its argv[0] and
    sys.path[0] are python's own, its classes pickle, and its top level sits one frame above
    where python puts it (ddplab's boot.py), not under runpy's and ddplab's nine: torch formats
    the whole stack on each manual_seed while CUDA is not started, which torchvision's FakeData
    calls for every sample (5% of the book's chapter 9 step, bench-script)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "where.py").write_text(WHERE)
    (tmp_path / "where.py").write_text(WHERE)
    env = job_env(store)
    for target in (["where.py"], ["-m", "pkg.where"]):
        plain = subprocess.run([sys.executable, *target], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=60)
        res = ddplab(["train", *target, "--set", "tracking.enabled=false"], tmp_path, env)
        assert res.returncode == 0 and plain.returncode == 0, res.stderr[-2000:] + plain.stderr
        ours, theirs = _said(res.stdout), _said(plain.stdout)
        assert ours["MAIN"] == theirs["MAIN"] and ours["PICKLED"] == theirs["PICKLED"] == "Thing"
        assert int(ours["DEPTH"]) <= int(theirs["DEPTH"]) + 1, (target, ours, theirs)


# A script's end as python makes it: its own annotations (no __future__ of ddplab's), its
# __builtins__ the module, its non-daemon thread and executor finished, then its atexit
# handler, its unclosed file flushed, its temporary file deleted and its __del__ run (with its
# globals still there).
ENDS = '''
import atexit, builtins, concurrent.futures, multiprocessing, sys, tempfile, threading, time
def f(x: int) -> int:
    return x
print("ANNOTATIONS", f.__annotations__["x"] is int, __builtins__ is builtins)
printed = threading.Event()
def later(what, after):
    after.wait(30)  # (the order the two print in is the script's, not the scheduler's)
    print("FINISHED", what, flush=True)
    printed.set()
sleeping = threading.Event()
threading.Thread(target=later, args=("thread", sleeping)).start()
concurrent.futures.ThreadPoolExecutor(1).submit(later, "executor", printed)
threading.Timer(0.3, sleeping.set).start()
atexit.register(print, "ATEXIT")
log = open("log.txt", "w")
log.write("unclosed\\n")
tmp = tempfile.NamedTemporaryFile(dir=".", prefix="tmp-", delete=True)
class Held:
    def __del__(self):  # uses a global: python finalises it while its globals are still there
        sys.stdout.write("DEL\\n")
        sys.stdout.flush()
held = Held()
'''
HOOKED = '''
import sys
sys.excepthook = lambda t, v, tb: print("HOOK", t.__name__, v, file=sys.stderr)
raise ValueError("boom")
'''


def test_a_rank_held_past_its_script_by_a_thread_says_which_thread():
    """python waits at a script's end for its non-daemon threads, forever if one never ends,
    while the rank's heartbeat says "done": no hang for the watch. The rank says which thread
    holds it, then again while it does, and nothing once it is free. (In a process of its own:
    a test process has other libraries' threads.)"""
    code = """
import sys, threading
from ddplab.training.scriptmode import child
release = threading.Event()
class Stderr:  # the upload ends once the rank has said so twice (no race with the clock)
    lines = 0
    def write(self, text):
        sys.__stderr__.write(text)
        Stderr.lines += text.count("\\n")
        if Stderr.lines == 2:
            release.set()
    def flush(self):
        sys.__stderr__.flush()
sys.stderr = Stderr()
uploader = threading.Thread(target=release.wait, name="uploader")
uploader.start()
child._say_who_holds_the_end((0.2, 1.0))
uploader.join()
for t in threading.enumerate():
    if t.name == "ddplab-end-held":
        t.join(30)  # free: it says nothing more, and goes
child._say_who_holds_the_end((0.0, 0.0))  # no thread holds it: no watcher either
print([t.name for t in threading.enumerate() if t.name == "ddplab-end-held"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "RANK": "1"})
    said = out.stderr.strip().splitlines()
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    assert said == ["ddplab: rank 1's script has ended; its process waits for its non-daemon "
                    "thread 'uploader', as python does (Ctrl-C stops the job)"] * 2, said


@pytest.mark.e2e
def test_a_script_ends_as_under_python_and_its_excepthook_shows_its_failure(tmp_path, store):
    """What python does at a script's end, ddplab's script process does before it ends without
    the interpreter's teardown: found by a hostile pass (the unclosed file was empty, the
    threads cut off, the annotations strings, the temporary file left behind)."""
    env = job_env(store)
    said = {}
    for how, cmd in (("python", [sys.executable, "ends.py"]),
                     ("ddplab", [str(BIN / "ddplab"), "train", "ends.py", "--set",
                                 "tracking.enabled=false"])):
        (tmp_path / how).mkdir()
        (tmp_path / how / "ends.py").write_text(ENDS)
        res = subprocess.run(cmd, cwd=tmp_path / how, env=env, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr[-2000:]
        said[how] = [ln for ln in res.stdout.splitlines() if not ln.startswith("[ddplab]")]
        assert (tmp_path / how / "log.txt").read_text() == "unclosed\n", how
        assert not list((tmp_path / how).glob("tmp-*")), how
    assert said["ddplab"] == said["python"], said
    assert said["python"][0] == "ANNOTATIONS True True" and "DEL" in said["python"]
    (tmp_path / "hooked.py").write_text(HOOKED)
    res = ddplab(["train", "hooked.py", "--set", "tracking.enabled=false"], tmp_path, env)
    assert res.returncode == 1 and "HOOK ValueError boom" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
