"""Script mode: the MLflow patterns scripts and their libraries use all join the job's one run
(src/ddplab/training/scriptmode/mlflow_join.py; docs/your-own-script.md, "MLflow in your script").

Real scripts under real torchrun (2 ranks) into a real store. One job (CI's time is short)
runs the MLflow quickstart, the calls Lightning's MLFlowLogger makes, Hugging Face's Trainer with
report_to="mlflow" and Accelerate's tracker, one after the other; each test reads its part.
"""

from __future__ import annotations

import json
import shutil

import pytest

from .conftest import ddplab, job_env, runs

# The MLflow quickstart, on EVERY rank (usually only rank 0 logs; the others must not crash),
# then Lightning's MLFlowLogger's calls (rank 0, as Lightning's rank_zero_only), Hugging Face's
# Trainer (report_to="mlflow"), and Accelerate's tracker (its end_training ends the process group).
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

exp = mlflow.set_experiment("my-experiment")
with start_run(run_name="my run") as run:
    assert run.info.run_id == job and mlflow.active_run().info.run_id == job, "a second run"
    mlflow.log_param("lr", 0.1)
    mlflow.log_metric("quick/loss", 0.5, step=0)
    with mlflow.start_run(run_name="child", nested=True) as child:
        assert child.info.run_id == job, "a nested run"
        mlflow.log_metric("quick/nested_acc", 0.9)
    mlflow.log_metric("quick/loss", 0.25, step=1)
assert mlflow.active_run() is None and os.environ.get("MLFLOW_RUN_ID") == job, "run id forgotten"
mlflow.end_run()  # nothing active: nothing happens
assert exp.experiment_id == mlflow.get_run(job).info.experiment_id, "set_experiment moved away"
dist.barrier()
assert mlflow.MlflowClient().get_run(job).info.status == "RUNNING", "the script ended the job's run"
print(f"rank {rank}: quickstart done", flush=True)

if rank == 0:
    from lightning_like import MLFlowLoggerCalls
    logger = MLFlowLoggerCalls(run_name="lit-run")
    logger.log_hyperparams({"lit_hidden": 32})
    for step in range(3):
        logger.log_metrics({"lit/train_loss": 1.0 / (step + 1)}, step=step)
    logger.finalize("success")
    assert logger.run_id == job, "Lightning's calls made a second run"

from hf_trainer import train_tiny_gpt2
train_tiny_gpt2(tempfile.mkdtemp())

from accelerate import Accelerator
acc = Accelerator(log_with="mlflow", cpu=True)
acc.init_trackers("acc-project", config={"acc_batch": 8})
acc.log({"acc/loss": 0.75}, step=1)
acc.end_training()  # ends its tracker, and destroys the process group
assert mlflow.MlflowClient().get_run(job).info.status == "RUNNING", "a library ended the job's run"
'''

# What lightning.pytorch.loggers.MLFlowLogger does with MlflowClient (Lightning 2.x, its
# `experiment` property, log_hyperparams, log_metrics, finalize): Lightning is not installed.
LIGHTNING_LIKE = '''
import os
import time

import mlflow
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from mlflow.tracking.context.registry import resolve_tags
from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME


class MLFlowLoggerCalls:
    def __init__(self, experiment_name="lightning_logs", run_name=None,
                 tracking_uri=os.getenv("MLFLOW_TRACKING_URI"), run_id=None):
        self._experiment_name, self._run_name, self._run_id = experiment_name, run_name, run_id
        self._tracking_uri, self._experiment_id, self._initialized = tracking_uri, None, False
        self._client = MlflowClient(tracking_uri)

    @property
    def experiment(self):
        if self._initialized:
            return self._client
        mlflow.set_tracking_uri(self._tracking_uri)
        if self._run_id is not None:
            self._experiment_id = self._client.get_run(self._run_id).info.experiment_id
        else:
            found = self._client.get_experiment_by_name(self._experiment_name)
            self._experiment_id = found.experiment_id if found is not None else \\
                self._client.create_experiment(name=self._experiment_name, artifact_location=None)
            tags = {MLFLOW_RUN_NAME: self._run_name} if self._run_name else {}
            run = self._client.create_run(experiment_id=self._experiment_id, tags=resolve_tags(tags))
            self._run_id = run.info.run_id
        self._initialized = True
        return self._client

    @property
    def run_id(self):
        _ = self.experiment
        return self._run_id

    def log_hyperparams(self, params):
        self.experiment.log_batch(run_id=self.run_id,
                                  params=[Param(k, str(v)) for k, v in params.items()])

    def log_metrics(self, metrics, step=None):
        now = int(time.time() * 1000)
        self.experiment.log_batch(run_id=self.run_id, metrics=[
            Metric(key=k, value=v, timestamp=now, step=step or 0) for k, v in metrics.items()])

    def finalize(self, status="success"):
        status = {"success": "FINISHED", "failed": "FAILED"}.get(status, status)
        if self.experiment.get_run(self.run_id):
            self.experiment.set_terminated(self.run_id, status)
'''

# Hugging Face's Trainer on a tiny GPT-2 built from its config (nothing downloaded); under
# transformers 5 it reports to MLflow only when asked (report_to's default is now "none").
HF_TRAINER = '''
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Ids(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


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
    """One torchrun job of PATTERNS: its console and its store's runs."""
    root = tmp_path_factory.mktemp("patterns")
    shutil.copyfile(migrated_store, root / "mlflow.db")
    store = f"sqlite:///{root / 'mlflow.db'}"
    (root / "patterns.py").write_text(PATTERNS)
    (root / "lightning_like.py").write_text(LIGHTNING_LIKE)
    (root / "hf_trainer.py").write_text(HF_TRAINER)
    res = ddplab(["train", str(root / "patterns.py")], root,
                 job_env(store, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"), nproc=2)
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
    assert run.info.run_name == "patterns script 1n x 2r torchrun"  # ddplab's name, kept
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
def test_lightning_mlflowloggers_client_calls_create_run_lands_in_the_jobs_run(patterns_job):
    res, found, _ = patterns_job
    run = _one_finished_run(res, found)
    assert run.data.params["lit_hidden"] == "32"
    assert run.data.metrics["lit/train_loss"] == pytest.approx(1 / 3)
    assert "lit-run" in json.loads(run.data.tags["ddplab.script_run_names"])
    assert "lightning_logs" in json.loads(run.data.tags["ddplab.script_experiments"])
    note = (f"ddplab: lightning_like asked for a new MLflow run; its records go to the job's run "
            f"{run.info.run_id}")
    assert res.stderr.count(note) == 1, res.stderr[-3000:]


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
