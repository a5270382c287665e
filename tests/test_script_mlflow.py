"""Script mode: the MLflow patterns scripts and their libraries use all join the job's one run
(src/ddplab/training/scriptmode/mlflow_join.py; docs/your-own-script.md, "MLflow in your script").

Real scripts under real torchrun (2 ranks) into a real store. One job (CI's time is short)
runs the MLflow quickstart, Hugging Face's Trainer with report_to="mlflow" and Accelerate's
tracker, one after the other; each test reads its part. Lightning's Trainer with two
MLFlowLoggers (the job's store, and another) is a job of its own, as a Lightning script is.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import ddplab, job_env, once_per_session, runs

# The MLflow quickstart, on EVERY rank (usually only rank 0 logs; the others must not crash),
# then Hugging Face's Trainer (report_to="mlflow"), and Accelerate's tracker (its end_training
# ends the process group).
PATTERNS = '''
import os, sys, tempfile
assert "mlflow" not in sys.modules, "ddplab imported MLflow into the script's process"
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
job = os.environ["MLFLOW_RUN_ID"]

import mlflow
from mlflow import start_run  # the from-import sees the same start_run
assert start_run is mlflow.start_run and start_run.__wrapped__ and mlflow.end_run.__wrapped__
# The quickstart's own line: the job's store, written relative to the current directory (it was
# taken for another store: a run per rank there, the job's run without the script's records).
mlflow.set_tracking_uri("sqlite:///mlflow.db")

exp = mlflow.set_experiment("my-experiment")
with start_run(run_name="my run") as run:
    assert run.info.run_id == job and mlflow.active_run().info.run_id == job, "a second run"
    mlflow.log_param("lr", 0.1)
    mlflow.log_metric("quick/loss", 0.5, step=0)
    with mlflow.start_run(run_name="child", nested=True) as child:
        assert child.info.run_id == job, "a nested run"
        mlflow.log_metric("quick/nested_acc", 0.9)
    mlflow.log_metric("quick/loss", 0.25, step=1)
    # Each rank's own value of one key (plain torchrun: a run per rank), a key of ddplab's own
    # config, a rename through a tag: the script goes on, every value kept, ddplab's name too.
    mlflow.log_param("local_rank", rank)
    mlflow.log_params({"name": "my-name"})
    mlflow.set_tag("ddplab.mode", "mine")  # ddplab's own record stays ddplab's
    if rank == 0:
        mlflow.set_tag("mlflow.runName", "renamed by a tag")
assert mlflow.active_run() is None and os.environ.get("MLFLOW_RUN_ID") == job, "run id forgotten"
mlflow.end_run()  # nothing active: nothing happens
assert exp.experiment_id == mlflow.get_run(job).info.experiment_id, "set_experiment moved away"
dist.barrier()
assert mlflow.MlflowClient().get_run(job).info.status == "RUNNING", "the script ended the job's run"
print(f"rank {rank}: quickstart done", flush=True)

from hf_trainer import train_tiny_gpt2
train_tiny_gpt2(tempfile.mkdtemp())

from accelerate import Accelerator
acc = Accelerator(log_with="mlflow", cpu=True)
acc.init_trackers("acc-project", config={"acc_batch": 8})
acc.log({"acc/loss": 0.75}, step=1)
acc.end_training()  # ends its tracker, and destroys the process group
assert mlflow.MlflowClient().get_run(job).info.status == "RUNNING", "a library ended the job's run"

if rank == 0:  # a store of the script's own: a new run there, as under plain torchrun
    mlflow.set_tracking_uri("sqlite:///" + os.path.join(tempfile.mkdtemp(), "other.db"))
    mlflow.set_experiment("elsewhere")
    with mlflow.start_run(run_name="elsewhere-run"):
        mlflow.log_metric("x", 1.0)
    print("OTHER_STORE", mlflow.get_tracking_uri(), flush=True)
'''

# A Lightning script as its docs write one: Trainer + MLFlowLogger, one logger into the job's
# store, one into another store (a user's own), 2 epochs of 8 steps on each of 2 ranks.
LIGHTNING = '''
import os

import lightning as L
import torch
from lightning.pytorch.loggers import MLFlowLogger
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("lit/train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
joined = MLFlowLogger(experiment_name="lit-exp", run_name="lit-run",
                      tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
elsewhere = MLFlowLogger(experiment_name="lit-elsewhere", tracking_uri="sqlite:///other.db")
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                    strategy="ddp", max_epochs=2, logger=[joined, elsewhere],
                    log_every_n_steps=2, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Net(), DataLoader(data, batch_size=16))
'''

# Hugging Face's Trainer on a tiny GPT-2 built from its config (nothing downloaded); under
# transformers 5 it reports to MLflow only when asked (report_to's default is now "none").
# HF_IDS: its data, 32 sequences of 16 token ids, the labels the inputs (test_script_frameworks
# trains on it too).
HF_IDS = '''
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Ids(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}
'''
HF_TRAINER = HF_IDS + '''

def train_tiny_gpt2(out):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                       n_positions=16, bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=out, report_to="mlflow", run_name="hf-run", max_steps=4,
                             logging_steps=1, per_device_train_batch_size=4, save_strategy="no",
                             use_cpu=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=Ids()).train()
'''


@pytest.fixture(scope="module")
def patterns_job(tmp_path_factory, migrated_store):
    """One torchrun job of PATTERNS (one for the session: four tests read it): its console and
    its store's runs."""
    def job(root: Path) -> subprocess.CompletedProcess:
        shutil.copyfile(migrated_store, root / "mlflow.db")
        (root / "patterns.py").write_text(PATTERNS)
        (root / "hf_trainer.py").write_text(HF_TRAINER)
        return ddplab(["train", str(root / "patterns.py")], root,
                      job_env(f"sqlite:///{root / 'mlflow.db'}", HF_HUB_OFFLINE="1",
                              TOKENIZERS_PARALLELISM="false"), nproc=2)

    root, res = once_per_session(tmp_path_factory, "patterns", job)
    store = f"sqlite:///{root / 'mlflow.db'}"
    return res, runs(store), store


def _one_finished_run(res, found):
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert len(found) == 1, [(r.info.run_name, r.info.experiment_id) for r in found]
    (run,) = found
    assert run.info.status == "FINISHED"
    return run


@pytest.mark.e2e
def test_mlflow_quickstart_with_set_experiment_and_nested_runs_joins_the_jobs_run(patterns_job):
    res, found, store = patterns_job
    run = _one_finished_run(res, found)
    from mlflow import MlflowClient

    tags, client = run.data.tags, MlflowClient(store)
    # ddplab's name, kept, with the backend and threads the script's process group had
    assert re.fullmatch(r"patterns script gloo 1n x 2r x \d+t torchrun", run.info.run_name), \
        run.info.run_name
    assert client.get_experiment(run.info.experiment_id).name == "patterns"
    assert tags["ddplab.script_experiment"] == "my-experiment"
    assert tags["ddplab.script_run_name"] == "my run"
    assert json.loads(tags["ddplab.script_run_names"])[:2] == ["my run", "child"]
    assert run.data.params["lr"] == "0.1"
    assert run.data.metrics["quick/nested_acc"] == 0.9
    history = client.get_metric_history(run.info.run_id, "quick/loss")
    assert sorted({(m.step, m.value) for m in history}) == [(0, 0.5), (1, 0.25)]  # both ranks
    assert {r: f"rank {r}: quickstart done" in res.stdout for r in (0, 1)} == {0: True, 1: True}
    # rank 0 says it once; set_experiment made no experiment of that name
    assert res.stderr.count("mlflow.set_experiment('my-experiment') keeps the job's run") == 1
    assert client.get_experiment_by_name("my-experiment") is None


@pytest.mark.e2e
def test_clashing_params_are_kept_apart_and_a_store_of_the_scripts_own_gets_its_run(patterns_job):
    """MLflow refuses a param's second value: each rank's own ``local_rank`` (or a nested
    run's ``lr``) in the one run ended the script with MlflowException, and so did a key of
    ddplab's own config (``name``); a store the script chose itself crashed on the job's run
    id; a ``mlflow.runName`` tag renamed the job's run."""
    from mlflow import MlflowClient

    res, found, store = patterns_job
    run = _one_finished_run(res, found)
    params, tags = run.data.params, run.data.tags
    assert {params["local_rank"], params["local_rank.2"]} == {"0", "1"}, params
    assert params["name"] == "my-name" and params["ddplab.name"] == "patterns"
    assert "param 'local_rank' was logged to the job's run already" in res.stderr
    assert re.fullmatch(r"patterns script gloo 1n x 2r x \d+t torchrun", run.info.run_name)
    assert "renamed by a tag" in json.loads(tags["ddplab.script_run_names"])
    assert (tags["ddplab.mode"], tags["user.ddplab.mode"]) == ("script", "mine")
    uri = next(ln.split()[1] for ln in res.stdout.splitlines() if "OTHER_STORE" in ln)
    other = MlflowClient(uri)
    (elsewhere,) = other.search_runs([other.get_experiment_by_name("elsewhere").experiment_id])
    assert elsewhere.info.run_name == "elsewhere-run" and elsewhere.data.metrics == {"x": 1.0}
    assert elsewhere.data.tags["ddplab.job_run_id"] == run.info.run_id


@pytest.mark.e2e
def test_lightnings_mlflowlogger_lands_in_the_jobs_run_and_one_in_another_store_is_linked(
        tmp_path, store, migrated_store):
    """Lightning's MLFlowLogger makes its run through MlflowClient.create_run: in the job's store
    that is the job's run; in another store (which ddplab does not own) it is the user's own
    run, linked both ways and said in one line naming the fix."""
    from mlflow import MlflowClient

    shutil.copyfile(migrated_store, tmp_path / "other.db")  # two ranks would race to create it
    (tmp_path / "lit.py").write_text(LIGHTNING)
    res = ddplab(["train", str(tmp_path / "lit.py")], tmp_path, job_env(store), nproc=2)
    run = _one_finished_run(res, runs(store))
    job, tags = run.info.run_id, run.data.tags
    assert re.fullmatch(r"lit script gloo 1n x 2r x \d+t torchrun", run.info.run_name), \
        run.info.run_name
    assert (tags["ddplab.script_experiment"], tags["ddplab.script_run_name"]) == ("lit-exp", "lit-run")
    assert run.data.params["hidden"] == "16"
    client = MlflowClient(store)
    logged = {m.step: m.value for m in client.get_metric_history(job, "lit/train_loss")}
    assert sorted(logged) == [1, 3, 5, 7, 9, 11, 13, 15]  # Lightning's steps, every 2nd
    # The observation sees Lightning's loop too: its loss is Lightning's, its samples the batch's.
    observed = {m.step: m.value for m in client.get_metric_history(job, "train/loss")}
    assert observed[16] == pytest.approx(logged[15], abs=1e-6), (observed, logged)
    assert run.data.metrics["perf/samples_per_s"] > 0
    assert res.stderr.count(f"ddplab: lightning asked for a new MLflow run; its records go to "
                            f"the job's run {job}") == 1, res.stderr[-3000:]

    other = MlflowClient(f"sqlite:///{tmp_path / 'other.db'}")
    (mine,) = other.search_runs([e.experiment_id for e in other.search_experiments()])
    assert "lit/train_loss" in mine.data.metrics
    assert mine.data.tags["ddplab.job_run_id"] == job
    assert mine.data.tags["ddplab.job_tracking_uri"] == store
    assert json.loads(tags["ddplab.script_other_runs"]) == [
        {"tracking_uri": "sqlite:///other.db", "run_id": mine.info.run_id}]
    said = (f"ddplab: lightning made its own MLflow run {mine.info.run_id} in another tracking "
            f"store (sqlite:///other.db), not in the job's run {job}: leave its tracking_uri out")
    assert res.stderr.count(said) == 1, res.stderr[-3000:]


@pytest.mark.e2e
def test_accelerates_mlflow_tracker_lands_in_the_jobs_run(patterns_job):
    res, found, _ = patterns_job
    run = _one_finished_run(res, found)
    assert run.data.params["acc_batch"] == "8" and run.data.metrics["acc/loss"] == 0.75
    assert "acc-project" in json.loads(run.data.tags["ddplab.script_experiments"])


@pytest.mark.e2e
def test_hf_trainer_report_to_mlflow_logs_its_loss_into_the_jobs_run(patterns_job):
    res, found, store = patterns_job
    run = _one_finished_run(res, found)
    assert "hf-run" in json.loads(run.data.tags["ddplab.script_run_names"])
    assert {"loss", "train_loss"} <= set(run.data.metrics)
    assert run.data.params["max_steps"] == "4"
    from mlflow import MlflowClient

    steps = [m.step for m in MlflowClient(store).get_metric_history(run.info.run_id, "loss")]
    assert sorted(steps) == [1, 2, 3, 4]  # rank 0's Trainer logs, once a step


@pytest.mark.e2e
def test_a_script_that_ends_its_run_failed_gets_a_failed_run(tmp_path, store):
    """``mlflow.end_run(status="FAILED")`` (a script that saw its loss diverge and says so)
    was dropped: the run read FINISHED. The script's exit code stays its own, 0."""
    script = tmp_path / "gives_up.py"
    script.write_text("import mlflow\nmlflow.start_run()\nmlflow.log_metric('loss', float('nan'))\n"
                      "mlflow.end_run(status='FAILED')\nprint('gave up', flush=True)\n")
    out = ddplab(["train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path,
                 job_env(store))
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FAILED"
    assert "mlflow.end_run(status='FAILED')" in run.data.tags["ddplab.error"]
    assert f"MLflow run {run.info.run_id} FAILED" in out.stdout + out.stderr


IN_PROCESS = '''
import json, os, sys
from ddplab.training.scriptmode import mlflow_join
mlflow_join.install()
import mlflow
with mlflow.start_run(run_name="search"):
    assert mlflow.log_param("learning_rate", 0.01) == 0.01  # MLflow's own documented answer
    ops = mlflow.set_tags({"mlflow.runName": "renamed"}, synchronous=False)
    ops.wait()  # an asynchronous call answers with operations to wait for, as MLflow's
    for trial, lr in enumerate([0.1, 10.0]):
        try:
            with mlflow.start_run(run_name=f"trial-{trial}", nested=True):
                mlflow.log_param("lr", lr)
                if lr > 1:
                    raise FloatingPointError("diverged")  # caught: the search goes on
        except FloatingPointError:
            pass
for trial in range(2):  # flat trials, the first raising (caught): MLflow ended it FAILED
    try:
        with mlflow.start_run(run_name=f"flat-{trial}"):
            if trial == 0:
                raise FloatingPointError("diverged")
    except FloatingPointError:
        pass
    print("AFTER_RAISE", json.load(open(os.environ["DDPLAB_SCRIPT_REPORT"])).get("asked_status"))
mlflow.start_run()
mlflow.end_run(status="FAILED")
mlflow.set_tag("why", "diverged")  # MLflow's own start of a run for it: the FAILED stays
print("AFTER_TAG", json.load(open(os.environ["DDPLAB_SCRIPT_REPORT"])).get("asked_status"))
mlflow.end_run()
with mlflow.start_run(run_name="after"):  # the script's own start: that was a trial's end
    pass


class Callback:  # Hugging Face's MLflowCallback: its __del__ ends whatever run is active
    def __del__(self):
        if mlflow.active_run() is not None:
            mlflow.end_run()


with mlflow.start_run(run_name="outer") as outer:
    with mlflow.start_run(run_name="library's"):  # MLFLOW_RUN_ID set: it started one
        callback = Callback()
    del callback
    print("OUTER_ACTIVE", mlflow.active_run() is not None)
print("REPORT", open(os.environ["DDPLAB_SCRIPT_REPORT"]).read())
'''


def test_the_joined_calls_answer_as_mlflows_and_a_failed_nested_trial_is_not_the_jobs(
        tmp_path, store):
    """mlflow.log_param answered str(value), an asynchronous set_tags None (no .wait()), and a
    trial that raised (and was caught), nested or not, or one the script ended FAILED before
    starting the next, ended the whole job's run FAILED."""
    import os
    import subprocess
    import sys

    from mlflow import MlflowClient

    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("joined")).info.run_id
    report = tmp_path / "report.json"
    report.write_text("{}")
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, "MLFLOW_RUN_ID": run_id,
           "DDPLAB_SCRIPT_REPORT": str(report), "MLFLOW_EXPERIMENT_NAME": "from-env"}
    out = subprocess.run([sys.executable, "-c", IN_PROCESS], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(report.read_text()).get("asked_status") is None
    said = out.stdout.splitlines()
    assert said.count("AFTER_RAISE None") == 2 and "AFTER_TAG FAILED" in said, out.stdout
    assert "OUTER_ACTIVE True" in said, out.stdout  # (a finalizer ended the script's own run)
    # Said once, for the explicit end_run (every rank printed it as an exception left a `with`).
    assert out.stderr.count("ended the job's run FAILED") == 1, out.stderr
    params = client.get_run(run_id).data.params
    assert (params["lr"], params["lr.2"]) == ("0.1", "10.0") and params["learning_rate"] == "0.01"
    # The experiment MLflow would have started the run in, said as set_experiment's (silent).
    assert client.get_run(run_id).data.tags["ddplab.script_experiment"] == "from-env"
    assert out.stderr.count("ddplab: MLFLOW_EXPERIMENT_NAME=from-env keeps the job's run in "
                            "experiment 'joined'") == 1, out.stderr


RACE = '''
import sys, time
from ddplab.training.scriptmode import mlflow_join
mlflow_join.install()
import mlflow
mlflow.set_tag("warm", "up")  # (the store's connection made before the race)
start = float(sys.argv[1])
time.sleep(max(0.0, start - time.time()))
for i in range(40):
    mlflow.set_tag(f"key{i}", "same on every rank")
    mlflow.set_tags({f"keys{i}": "same on every rank"})
print("done")
'''


def test_every_rank_setting_the_same_tags_at_once_is_no_crash(tmp_path, store):
    """MLflow's SQL store reads, then inserts: two ranks writing one key of the one run at the
    same moment failed one of them (UNIQUE constraint failed: tags.key, tags.run_uuid), 17 of 60
    calls in a helper's run. Under plain torchrun each rank had its own run."""
    import os
    import subprocess
    import sys
    import time

    from mlflow import MlflowClient

    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("race")).info.run_id
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, "MLFLOW_RUN_ID": run_id}
    start = str(time.time() + 8)
    procs = [subprocess.Popen([sys.executable, "-c", RACE, start], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    assert client.get_run(run_id).data.tags["key39"] == "same on every rank"
