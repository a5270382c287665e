"""Unit-speed: `run.train()` in this process (world size 1, no launcher), the whole pipeline
from config to summary, with a real embedded MLflow store."""

from __future__ import annotations

import json

import pytest
import yaml

from ddplab.config import ConfigError
from ddplab.training import run
from tests.conftest import REPO, runs


def lone_job(tmp_path, monkeypatch) -> str:
    """This process as a lone job (no launcher's variables) in tmp_path, with its own embedded
    store; returns the store's URI."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "DDPLAB_SET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    return store


def test_train_in_process_runs_the_pipeline_to_one_finished_run(tmp_path, monkeypatch):
    store = lone_job(tmp_path, monkeypatch)
    sets = ["data.train_samples=256", "data.eval_samples=64", "data.image_size=8",
            "train.epochs=2", "train.log_every=2", "checkpoint.every_epochs=1",
            "tracking.system_metrics=false"]
    run_id = run.train(str(REPO / "experiments" / "quickstart.yaml"), sets, "summary.json")
    (r,) = runs(store)
    assert r.info.run_id == run_id and r.info.status == "FINISHED"
    assert r.data.tags["ddplab.launcher"] == "none" and r.data.params["train.epochs"] == "2"
    assert r.data.tags["ddplab.mode"] == "loop"  # the kind of job, recorded for both kinds
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["epoch_steps"] == [8, 8]  # 256 / 32 per epoch
    assert len(summary["epoch_samples_per_s"]) == 2 and "eval/accuracy" in summary["final_metrics"]
    # One checkpoint per epoch: the last epoch's is the final one, written once.
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints" / "quickstart").rglob("step-*.pt"))
    assert ckpts == ["step-00000008.pt", "step-00000016.pt"]


@pytest.mark.e2e
def test_a_compiled_model_trains_whole_batches_every_epoch_and_compiles_once(tmp_path, monkeypatch):
    """The epoch's last, shorter batch compiled the model again (27 s of the GPT's job on an
    H200); dropping it first made the next epoch train nothing (its position never reached the
    shard's end)."""
    import functools

    import torch
    import torch._dynamo.utils as dynamo_utils

    store = lone_job(tmp_path, monkeypatch)
    # Dynamo's graphs and guards are the point, not inductor's kernels: aot_eager traces as
    # torch.compile does (DDP's graph splitting, autograd) without compiling C++ for the CPU
    # (with inductor this test took 70 s in the suite on 2 cores; ~30 s alone with aot_eager).
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    dynamo_utils.counters.clear()
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    sets = [f"data.root={tmp_path / 'text.txt'}", "data.seq_len=16", "data.batch_size=8",
            "model.args={n_layer: 1, n_head: 2, n_embd: 32, dropout: 0.0}", "model.compile=true",
            "train.epochs=2", "train.eval_every_epochs=2", "checkpoint.every_epochs=0",
            "tracking.system_metrics=false"]
    run.train(str(REPO / "experiments" / "lm-tiny.yaml"), sets, "summary.json")
    (r,) = runs(store)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert r.info.status == "FINISHED" and summary["epoch_steps"][0] == summary["epoch_steps"][1] > 0
    # one graph, the final evaluation's included: the shorter batch's shape made a second
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dict(dynamo_utils.counters["stats"])


def test_a_signal_while_the_failure_is_recorded_cannot_erase_it(tmp_path, monkeypatch):
    """A rank's collective fails and, while its error is being written down, torchrun's SIGTERM
    arrives (its peer died): the run still ends FAILED with that error, not a bare FAILED."""
    import os
    import signal
    import traceback

    import pytest

    from ddplab.tracking import runs as tracking  # job_run's module

    store = lone_job(tmp_path, monkeypatch)

    def collective_fails(job):
        raise RuntimeError("Connection closed by peer")

    real_format_exc = traceback.format_exc

    def format_exc_and_get_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)  # delivered at the next bytecode, here
        return real_format_exc()

    monkeypatch.setattr(run, "fit", collective_fails)
    monkeypatch.setattr(tracking.traceback, "format_exc", format_exc_and_get_sigterm)
    with pytest.raises(RuntimeError, match="Connection closed"):
        run.train(str(REPO / "experiments" / "quickstart.yaml"),
                  ["data.train_samples=64", "data.eval_samples=32", "tracking.system_metrics=false"])
    (r,) = runs(store)
    assert r.info.status == "FAILED"
    assert "RuntimeError: Connection closed by peer" in r.data.tags["ddplab.error"]


def test_a_sigterm_that_cuts_a_checkpoint_write_is_recorded_as_the_stop_not_the_write(
        tmp_path, monkeypatch):
    """A peer died and torchrun's SIGTERM reached rank 0 inside torch.save: the run's error was
    the cut write's "CheckpointError: could not write ... (unexpected pos ...)", which the
    verdict took for the cause and named rank 0 instead of the dead peer (seen in CI). The
    rank's error is the stop's, which the verdict knows for a consequence; no half file stays."""
    import os
    import signal

    import pytest
    import torch

    from ddplab.forensics.watch import is_secondary
    from ddplab.training.jobend import Terminated

    store = lone_job(tmp_path, monkeypatch)

    class SigtermWhilePickled:
        def __reduce__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # delivered at the next bytecode: mid-write
            return (int, (0,))

    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: real_save(
        {**obj, "cut": SigtermWhilePickled()}, f, *a, **k))
    with pytest.raises(Terminated, match="terminated by SIGTERM"):
        run.train(str(REPO / "experiments" / "quickstart.yaml"),
                  ["data.train_samples=128", "data.eval_samples=32", "checkpoint.every_steps=2",
                   "tracking.system_metrics=false"])
    (r,) = runs(store)
    error = r.data.tags["ddplab.error"]
    assert r.info.status == "FAILED" and error.startswith("Terminated: terminated by SIGTERM"), error
    assert is_secondary(error) and "could not write" not in error
    assert not list(tmp_path.rglob("*.pt.tmp")) and not list(tmp_path.rglob("step-*.pt"))


def test_summary_json_stays_json_with_nan_and_inf():
    import json

    from ddplab.files import finite_json

    text = finite_json({"loss": float("nan"), "x": [1.0, float("inf")], "n": 3})
    assert json.loads(text) == {"loss": None, "x": [1.0, None], "n": 3}


def test_a_diverging_loss_stops_the_job_or_warns_and_summary_stays_json(tmp_path, monkeypatch):
    """NaN losses used to finish the run FINISHED, exit 0, with bare NaN in summary.json."""
    import pytest

    from ddplab.training.fit import LossNotFinite

    store = lone_job(tmp_path, monkeypatch)
    sets = ["data.train_samples=256", "data.eval_samples=64", "data.image_size=8",
            "optim.lr=1e12", "train.log_every=1", "tracking.system_metrics=false"]
    quick = str(REPO / "experiments" / "quickstart.yaml")
    with pytest.raises(LossNotFinite, match=r"train/loss is nan at step \d+ \(epoch 1\): the job stopped"):
        run.train(quick, sets, "stopped.json")
    (failed,) = runs(store)
    assert failed.info.status == "FAILED" and "train/loss is nan" in failed.data.tags["ddplab.error"]
    run.train(quick, [*sets, "train.nonfinite_loss=warn", "checkpoint.dir=warned"], "warned.json")
    summary = json.loads((tmp_path / "warned.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
    assert summary["final_metrics"]["train/loss"] is None
    assert sorted(r.info.status for r in runs(store)) == ["FAILED", "FINISHED"]


def test_training_on_from_a_final_checkpoint_trains_the_rest_of_the_epoch_in_a_new_run(
        tmp_path, monkeypatch):
    """max_steps 4 -> 8 from the finished job's final checkpoint (docs/checkpoints.md: how to
    train longer) trains steps 5-8 on the very samples an uninterrupted 8-step job trains
    (it used to skip the rest of the epoch: with epochs 1, nothing), in a new run that names
    the one it continues; the finished run stays exactly as it was."""
    from mlflow import MlflowClient

    store = lone_job(tmp_path, monkeypatch)
    client = MlflowClient(store)
    quick = str(REPO / "experiments" / "quickstart.yaml")
    sets = ["data.train_samples=512", "data.eval_samples=64", "data.image_size=8",
            "train.epochs=1", "train.log_every=1", "tracking.system_metrics=false",
            "checkpoint.resume=never"]

    def losses(run_id: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}

    first = run.train(quick, [*sets, "train.max_steps=4", "checkpoint.dir=a"])
    (final,) = (tmp_path / "a").rglob("step-00000004.pt")
    before = client.get_run(first)
    longer = run.train(quick, [*sets, "train.max_steps=8", f"checkpoint.resume={final}",
                               "checkpoint.dir=a"])
    whole = run.train(quick, [*sets, "train.max_steps=8", "checkpoint.dir=b"])
    assert longer != first
    assert sorted(losses(longer)) == [5, 6, 7, 8] and sorted(losses(first)) == [1, 2, 3, 4]
    for step in (5, 6, 7, 8):
        assert losses(longer)[step] == pytest.approx(losses(whole)[step], rel=1e-5), step
    after = client.get_run(first)
    assert (after.info.status, after.info.end_time, after.data.tags) == (
        "FINISHED", before.info.end_time, before.data.tags)
    assert client.get_run(longer).data.tags["ddplab.continues_run"] == first
    # Not raised past its step (the docs' example value, typed against a longer job): refused,
    # not a new run that trained nothing (a hostile pass: an empty run, "done: 40 steps").
    with pytest.raises(ConfigError, match=r"final checkpoint of a finished job \(step 4, 0 "
                       r"epoch\(s\) done\).*nothing is left to train; to train it longer, raise "
                       r"train.max_steps above 4 \(0: no cap\)$"):
        run.train(quick, [*sets, "train.max_steps=3", f"checkpoint.resume={final}",
                          "checkpoint.dir=a"])
    assert len(runs(store)) == 3
    # Its run id names its folder too, as for a script job (the loop refused it: no such file).
    by_id = run.train(quick, [*sets, "train.max_steps=6", f"checkpoint.resume={first}",
                              "checkpoint.dir=a"])
    assert sorted(losses(by_id)) == [5, 6] and client.get_run(by_id).data.tags[
        "ddplab.continues_run"] == first
    assert losses(by_id)[6] == pytest.approx(losses(whole)[6], rel=1e-5)


def test_a_resume_across_an_optimizer_or_model_change_is_never_a_key_error(tmp_path, monkeypatch):
    """resume_changes=allow after changing the optimizer used to crash (KeyError:
    'param_groups.0.momentum'); now its state starts fresh, said once. Weights that do not fit
    the model are refused in one line."""
    from ddplab.training.checkpoint import CheckpointError

    lone_job(tmp_path, monkeypatch)
    quick = str(REPO / "experiments" / "quickstart.yaml")
    sets = ["data.train_samples=256", "data.eval_samples=64", "data.image_size=8",
            "tracking.enabled=false", "checkpoint.dir=ck", "checkpoint.every_steps=2"]
    run.train(quick, [*sets, "train.max_steps=3", "checkpoint.resume=never"])
    (mid,) = (tmp_path / "ck").rglob("step-00000002.pt")
    allow = [*sets, f"checkpoint.resume={mid}", "checkpoint.resume_changes=allow"]
    with pytest.warns(UserWarning, match="optimizer state does not fit this optimizer"):
        run.train(quick, [*allow, "optim.name=adamw", "train.max_steps=4"])
    with pytest.raises(CheckpointError, match="the checkpoint's weights do not fit this model"):
        run.train(quick, [*allow, "data.image_size=16", "train.max_steps=4"])


def test_user_parts_are_built_after_every_rank_seeded_numpy_too(tmp_path, monkeypatch):
    """A user's data callable drawing from numpy built a different dataset on each rank: the
    checks step (which builds the user's parts) ran before ddplab seeded, and numpy never was."""
    import numpy as np

    from ddplab.training import checks

    drawn = []

    class Stop(Exception):
        pass

    def first_user_part(*args, **kwargs):
        drawn.append((np.random.rand(), __import__("random").random()))
        raise Stop

    monkeypatch.setattr(checks, "before_start", first_user_part)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DDPLAB_SET"):
        monkeypatch.delenv(name, raising=False)
    for _ in range(2):
        with pytest.raises(Stop):
            run.train(str(REPO / "experiments" / "quickstart.yaml"), ["tracking.enabled=false"])
    assert drawn[0] == drawn[1]


HF_LIKE = """
import torch
from torch import nn


class Output(dict):
    '''Shaped like transformers' ModelOutput: a dict whose keys are also attributes.'''
    __getattr__ = dict.__getitem__


class Net(nn.Module):
    def __init__(self, num_classes, kind):
        super().__init__()
        self.head, self.kind = nn.Linear(3 * 8 * 8, num_classes), kind

    def forward(self, x):
        logits = self.head(x.flatten(1))
        return {"modeloutput": Output(logits=logits, hidden=x), "dict": {"logits": logits},
                "tuple": (logits, x), "tensor": logits}[self.kind]


def build(num_classes, kind="modeloutput"):
    return Net(num_classes, kind)
"""


@pytest.mark.parametrize("kind", ["modeloutput", "dict", "tuple"])
def test_a_model_returning_what_libraries_return_trains_and_evaluates(tmp_path, monkeypatch, kind):
    """A Hugging Face model returns a ModelOutput: its 12 steps trained, then evaluation called
    outputs.float() (~90 lines of traceback per rank, run FAILED). The built-in losses and the
    metrics read its .logits (a dict's 'logits', a tuple's first element)."""
    store = lone_job(tmp_path, monkeypatch)
    (tmp_path / "hflike.py").write_text(HF_LIKE)
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump({
        "name": "hflike", "model": {"name": "hflike:build", "args": {"kind": kind}},
        "data": {"image_size": 8, "train_samples": 128, "eval_samples": 64}}))
    run.train(str(tmp_path / "exp.yaml"), ["train.max_steps=4", "tracking.system_metrics=false"])
    (r,) = runs(store)
    assert r.info.status == "FINISHED" and 0 <= r.data.metrics["eval/accuracy"] <= 1
    assert r.data.metrics["eval/loss"] > 0


def test_an_optimizer_by_import_path_with_its_own_arguments_trains(tmp_path, monkeypatch):
    """optim.name torch.optim:RMSprop with optim.args (refused before: expected one of
    'sgd', 'adam', 'adamw'); the run's optimizer is that class with those arguments."""
    from ddplab.training import strategy

    lone_job(tmp_path, monkeypatch)
    built = []
    real = strategy.spread

    def spy(model, cfg, device):
        out = real(model, cfg, device)
        built.append(out[1])
        return out

    monkeypatch.setattr(strategy, "spread", spy)
    run.train(str(REPO / "experiments" / "quickstart.yaml"),
              ["data.train_samples=128", "data.eval_samples=64", "data.image_size=8",
               "train.max_steps=3", "optim.name=torch.optim:RMSprop", "optim.lr=0.001",
               "optim.args={alpha: 0.95, centered: true}", "tracking.system_metrics=false"])
    (opt,) = built
    group = opt.param_groups[0]
    assert type(opt).__name__ == "RMSprop" and (group["initial_lr"], group["alpha"], group["centered"]) == (
        0.001, 0.95, True)
    (r,) = runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert r.info.status == "FINISHED" and r.data.params["optim.name"] == "torch.optim:RMSprop"


def test_perf_samples_per_s_is_the_steps_rate_not_their_evaluations_and_lr_the_steps_own(
        tmp_path, monkeypatch):
    """perf/samples_per_s counts the steps' time: a job evaluating every 2 steps (each
    evaluation 0.5 s, a metric of the user's) read 20x slower than without them, its epochs'
    wall time taken as the steps' (a hostile pass). And train/lr is the rate the step trained
    with: with 4 warm-up steps to lr 0.01 and no schedule after, step 2 trains at 0.005 (the
    scheduler's last rate after a step is the next step's: 0.0075 was recorded)."""
    store = lone_job(tmp_path, monkeypatch)
    (tmp_path / "slow_metric.py").write_text(
        "import time\n"
        "class Slow:\n"
        "    def __init__(self, **kw): self.n = 0\n"
        "    def update(self, preds, target): time.sleep(0.5); self.n += len(target)\n"
        "    def compute(self): return float(self.n)\n"
        "    def reset(self): self.n = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run.train(str(REPO / "experiments" / "quickstart.yaml"),
              ["data.train_samples=128", "data.eval_samples=16", "data.batch_size=16",
               "data.image_size=8", "train.epochs=2", "train.log_every=2",
               "train.eval_every_steps=2", "optim.warmup_steps=4", "optim.scheduler=none",
               "optim.lr=0.01", "train.metrics=[{name: slow, fn: 'slow_metric:Slow'}]",
               "tracking.system_metrics=false"], "summary.json")
    (r,) = runs(store)
    from mlflow import MlflowClient

    lr = {m.step: m.value for m in MlflowClient(store).get_metric_history(r.info.run_id, "train/lr")}
    assert lr[2] == pytest.approx(0.005) and lr[4] == pytest.approx(0.01) == lr[16], lr
    # 8 evaluations in 16 steps: 4 s; 256 samples over the epochs' wall time read < 64/s
    summary = json.loads((tmp_path / "summary.json").read_text())
    wall = sum(summary["epoch_time_s"])
    assert wall > 4.0
    # (relative, not a figure: CI's loaded machine trained at 164 samples/s where this one ran
    # at 1,040; the old figure was the wall-clock rate, evaluations in it)
    assert r.data.metrics["perf/samples_per_s"] > 2 * 256 / wall, (wall, r.data.metrics)
    assert r.data.metrics["perf/samples_per_s"] == pytest.approx(summary["samples_per_s_steady"])


def test_resuming_a_run_against_another_store_names_the_store_it_was_recorded_in(
        tmp_path, monkeypatch):
    """A rerun with another MLFLOW_TRACKING_URI resumed its checkpoint's run there: "Run with
    id=... not found", two tracebacks (a hostile pass). One line, naming the store its spool
    was made for, and nothing made in the other store's experiment."""
    from ddplab.tracking.store import TrackingError

    first = lone_job(tmp_path, monkeypatch)
    (tmp_path / "dies.py").write_text(
        "import torch\ncalls = 0\ndef loss(outputs, targets):\n    global calls\n"
        "    calls += 1\n    if calls == 5:\n"
        "        raise RuntimeError('the job dies after its step-2 checkpoint')\n"
        "    return torch.nn.functional.cross_entropy(outputs, targets)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sets = ["data.train_samples=64", "data.eval_samples=32", "data.image_size=8",
            "data.batch_size=8", "checkpoint.every_steps=2", "train.loss=dies:loss",
            "tracking.system_metrics=false"]
    with pytest.raises(RuntimeError, match="the job dies"):
        run.train(str(REPO / "experiments" / "quickstart.yaml"), sets)
    (died,) = runs(first)
    run_id = died.info.run_id
    other = f"sqlite:///{tmp_path / 'other.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    with pytest.raises(TrackingError) as e:  # (checkpoint.resume: auto, its step-2 checkpoint)
        run.train(str(REPO / "experiments" / "quickstart.yaml"), sets)
    said = str(e.value)
    assert "\n" not in said and said.startswith(f"checkpoint.resume: the run {run_id} "), said
    assert f"is not in the store {other}; it was recorded in {first}" in said, said
    assert [r.info.run_id for r in runs(first)] == [run_id] and runs(other) == []


def test_onecycle_by_import_path_shapes_the_lr_and_training_on_follows_its_schedule(
        tmp_path, monkeypatch):
    """optim.scheduler torch.optim.lr_scheduler:OneCycleLR gets max_lr (optim.lr) and
    total_steps (the job's) from ddplab, pct_start from scheduler_args: the lr rises, then falls
    to near zero at the last step. A job of 8 steps trained on to 16 from its final checkpoint
    follows the 16-step curve from step 9 exactly as an uninterrupted 16-step job does (its
    saved state knew only 8 steps: loading it failed with "Tried to step 9 times")."""
    from mlflow import MlflowClient

    store = lone_job(tmp_path, monkeypatch)
    sets = ["data.train_samples=512", "data.eval_samples=64", "data.image_size=8", "train.epochs=1",
            "train.log_every=1", "optim.name=torch.optim:RMSprop", "optim.lr=0.01",
            "optim.warmup_steps=0", "optim.scheduler=torch.optim.lr_scheduler:OneCycleLR",
            "optim.scheduler_args={pct_start: 0.25}", "tracking.system_metrics=false",
            "checkpoint.resume=never"]
    quick = str(REPO / "experiments" / "quickstart.yaml")
    client = MlflowClient(store)

    def lr(run_id: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, "train/lr")}

    first = run.train(quick, [*sets, "train.max_steps=8", "checkpoint.dir=a"])
    (final,) = (tmp_path / "a").rglob("step-00000008.pt")
    then = run.train(quick, [*sets, "train.max_steps=16", f"checkpoint.resume={final}",
                             "checkpoint.dir=a"])
    whole = lr(run.train(quick, [*sets, "train.max_steps=16", "checkpoint.dir=b"]))
    assert client.get_run(then).data.tags["ddplab.continues_run"] == first
    assert sorted(lr(then)) == list(range(9, 17))
    assert lr(then) == pytest.approx({s: v for s, v in whole.items() if s > 8})
    curve = [whole[s] for s in range(1, 17)]
    assert max(curve) == pytest.approx(0.01, rel=0.05) and 2 <= curve.index(max(curve)) <= 5
    assert curve[-1] < 0.001, curve
    assert client.get_run(first).data.params["optim.scheduler"] == "torch.optim.lr_scheduler:OneCycleLR"


def test_early_stopping_on_a_torchmetrics_f1_stops_when_it_stops_improving(tmp_path, monkeypatch):
    """train.metrics brings torchmetrics' macro F1 into evaluation (eval/f1, num_classes from
    the data) and train.early_stopping watches it: with an lr of 0 it never moves, so after
    `patience` evaluations without improvement the job stops, FINISHED, saying why and when."""
    store = lone_job(tmp_path, monkeypatch)
    run.train(str(REPO / "experiments" / "quickstart.yaml"),
              ["data.train_samples=256", "data.eval_samples=64", "data.image_size=8",
               "train.epochs=4", "train.eval_every_steps=2", "optim.lr=1e-12",
               "optim.scheduler=none", "optim.warmup_steps=0",
               "train.metrics=[{name: f1, fn: torchmetrics.classification:MulticlassF1Score, "
               "args: {average: macro}}]",
               "train.early_stopping={metric: eval/f1, mode: max, patience: 2, min_delta: 0.001}",
               "tracking.system_metrics=false"], "summary.json")
    (r,) = runs(store)
    summary = json.loads((tmp_path / "summary.json").read_text())
    # best at step 2 (the first evaluation), no better at 4 and 6: stopped at 6 of 32 steps.
    assert r.info.status == "FINISHED" and summary["steps"] == 6
    assert summary["stopped_early"].startswith("stopped early at step 6: eval/f1 did not improve")
    assert 0 <= r.data.metrics["eval/f1"] <= 1
    assert r.data.tags["ddplab.user.metric.f1"] == "torchmetrics.classification:MulticlassF1Score"
    assert r.data.tags["ddplab.user.metric.f1.git"].startswith("installed")
    assert r.data.tags["ddplab.stopped_early"] == summary["stopped_early"]


def test_a_resume_at_the_last_steps_checkpoint_still_records_its_evaluation(tmp_path, monkeypatch):
    """A job that died after its last step's checkpoint, before its evaluation: the rerun
    resumed that step and evaluated, but recorded none of it (no eval/*, epoch/*, memory/*,
    perf/wall_time_s): the steps already in the run were skipped whole, not metric by metric.
    And its perf/samples_per_s was 0.0 for an attempt that timed no step."""
    from mlflow import MlflowClient

    from ddplab.training import fit

    store = lone_job(tmp_path, monkeypatch)
    client = MlflowClient(store)
    quick = str(REPO / "experiments" / "quickstart.yaml")
    sets = ["data.train_samples=256", "data.eval_samples=64", "data.image_size=8",
            "train.epochs=1", "train.log_every=2", "tracking.system_metrics=false",
            "checkpoint.every_steps=8", "checkpoint.every_epochs=0"]

    def died(job):
        raise RuntimeError("killed before its evaluation")

    with monkeypatch.context() as m:
        m.setattr(fit, "_evaluate", died)
        with pytest.raises(RuntimeError, match="killed before its evaluation"):
            run.train(quick, sets)
    (first,) = runs(store)
    assert "eval/loss" not in first.data.metrics
    again = run.train(quick, sets)
    assert again == first.info.run_id  # resumed at step 8, the last
    done = client.get_run(again)
    assert done.info.status == "FINISHED"
    history = {k: [m.step for m in client.get_metric_history(again, k)]
               for k in ("eval/loss", "train/loss", "epoch/time_s", "perf/wall_time_s")}
    assert history == {"eval/loss": [8], "train/loss": [2, 4, 6, 8], "epoch/time_s": [8],
                       "perf/wall_time_s": [8]}, history
    assert "perf/samples_per_s" not in done.data.metrics  # no step of this attempt was timed
