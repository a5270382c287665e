"""Script mode under real training frameworks (Accelerate, Lightning): what the run records of
their steps, epochs and loss against what the framework itself counts and logs. Real
frameworks, real torchrun jobs of 2 ranks on CPU; tiny models, synthetic data."""

from __future__ import annotations

import json
import re

import pytest
from mlflow import MlflowClient

from .conftest import ddplab, job_env, runs
from .test_script_mlflow import HF_IDS

# Accelerate's loaders read a batch ahead (so Hugging Face's Trainer's, built on them): the
# torch iterator runs out before the epoch's last step. Its backward divides the loss by
# gradient_accumulation_steps; the script prints the loss it computed, as its users do.
ACCELERATE = '''
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loader = DataLoader(TensorDataset(torch.randn(168, 4), torch.randn(168, 1)), batch_size=4)
model, opt, loader = acc.prepare(model, opt, loader)
for epoch in range(2):
    for x, y in loader:  # 21 batches a rank: 11 optimizer steps an epoch, the last of 1 batch
        with acc.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
    acc.print(f"EPOCH {epoch} LOSS {loss.item():.6f}")
'''

# Lightning under DDP, its loss divided by accumulate_grad_batches before its backward; the
# loss its training_step returns is what it logs (self.log), and what the script prints last.
LIGHTNING = '''
import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))
        self.last = None

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.last = float(loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
net = Net()
trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                    strategy="ddp", max_epochs=2, accumulate_grad_batches=2, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(net, DataLoader(TensorDataset(torch.randn(256, 8), torch.randn(256, 1)), batch_size=16))
if trainer.global_rank == 0:
    print(f"STEPS {trainer.global_step} LAST {net.last:.6f}", flush=True)
'''


def _job(tmp_path, store, script: str) -> tuple:
    path = tmp_path / "train.py"
    path.write_text(script)
    out = ddplab(["train", str(path), "--summary-out", str(tmp_path / "summary.json")], tmp_path,
                 job_env(store), nproc=2)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (run,) = runs(store)
    summary = json.loads((tmp_path / "summary.json").read_text())["observed"]
    return out, run, summary, MlflowClient(store)


@pytest.mark.e2e
def test_accelerates_epochs_and_loss_are_its_own_not_a_step_early_nor_halved(tmp_path, store):
    """A hostile pass: an Accelerate script of 2 epochs of 10 steps was recorded as 3 epochs
    ([9, 10, 1] steps: its last step, begun after the loader read ahead had run out, started
    the next one), and its loss at an epoch's end was half of what the script printed (the
    backward's loss / gradient_accumulation_steps)."""
    out, run, summary, client = _job(tmp_path, store, ACCELERATE)
    printed = [float(v) for v in re.findall(r"EPOCH \d LOSS (\S+)", out.stdout)]
    assert len(printed) == 2, out.stdout[-2000:]
    assert summary["steps"] == 22 and summary["epoch_steps"] == [11, 11], summary
    epochs = client.get_metric_history(run.info.run_id, "epoch/epoch")
    assert [(m.step, m.value) for m in epochs] == [(11, 1.0), (22, 2.0)], epochs
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert [round(loss[11], 6), round(loss[22], 6)] == printed, (loss, printed)


@pytest.mark.e2e
def test_lightnings_loss_under_gradient_accumulation_is_what_its_training_step_returned(
        tmp_path, store):
    """A hostile pass: with accumulate_grad_batches=2, train/loss and the closing line were half
    the loss Lightning logs (its backward's, divided by 2)."""
    out, run, summary, client = _job(tmp_path, store, LIGHTNING)
    steps, last = re.search(r"STEPS (\d+) LAST (\S+)", out.stdout).groups()
    assert summary["steps"] == int(steps) == 8 and summary["epoch_steps"] == [4, 4], summary
    assert round(summary["final_loss"], 6) == float(last), (summary, last)


@pytest.mark.e2e
def test_lightning_run_as_one_process_starts_its_own_ranks_as_under_plain_python(tmp_path, store):
    """A hostile pass: `ddplab train pl_train.py` (one process, no launcher) of a Lightning
    Trainer(devices=2) hung at "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2": the
    script's process was given LOCAL_RANK, which Lightning reads as a launcher having started its
    ranks, so it never started rank 1 (plain `python pl_train.py` trains). One process now gets
    only what env:// needs for a world of one."""
    path = tmp_path / "train.py"
    path.write_text(LIGHTNING.replace('int(os.environ["LOCAL_WORLD_SIZE"])', "2"))
    out = ddplab(["train", str(path), "--set", "dist.hang_after_s=20"], tmp_path, job_env(store))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert re.search(r"STEPS 8 LAST", out.stdout), out.stdout[-2000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.tags["ddplab.world_size"] == "1", run.data.tags


# Hugging Face's Trainer with gradient accumulation: under transformers 5 the model, given
# num_items_in_batch, divides each micro-batch's summed loss by the whole step's token count, and
# the Trainer logs the step's loss as the sum of its micro-batches'. The script prints each
# logged loss with its step.
HF_ACCUMULATING = HF_IDS + '''

class Said(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"HF STEP {state.global_step} LOSS {float(logs['loss']):.6f}", flush=True)


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16,
                                   bos_token_id=0, eos_token_id=0))
args = TrainingArguments(output_dir="out", report_to="none", max_steps=10, logging_steps=1,
                         per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         save_strategy="no", use_cpu=True, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Ids(), callbacks=[Said()]).train()
'''


@pytest.mark.e2e
def test_hugging_faces_loss_under_gradient_accumulation_is_the_one_its_trainer_logs(tmp_path, store):
    """A hostile pass: with gradient_accumulation_steps=2, train/loss was half the loss the
    Trainer logged (4.707 logged, 2.355 recorded): the model's loss, divided by the whole step's
    token count, is each micro-batch's share of the step's loss, not the step's."""
    path = tmp_path / "hf_train.py"
    path.write_text(HF_ACCUMULATING)
    out = ddplab(["train", str(path)], tmp_path, job_env(store, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    said = {int(s): float(v) for s, v in re.findall(r"HF STEP (\d+) LOSS (\S+)", out.stdout)}
    (run,) = runs(store)
    loss = {m.step: m.value for m in MlflowClient(store).get_metric_history(run.info.run_id,
                                                                              "train/loss")}
    assert {4, 8, 10} <= set(loss) and len(said) == 10, (loss, said)
    for step in (4, 8, 10):
        assert loss[step] == pytest.approx(said[step], rel=1e-3), (step, loss, said)
