"""A Hugging Face model as a user arrives with it: no wrapper (its config object built by
``_target_`` in model.args, nothing downloaded), batches as dicts (input_ids, attention_mask,
labels), and the model's own loss (it shifts a causal LM's labels itself). Unit tests first,
then real 2-rank jobs under ddp and fsdp."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ddplab import config
from ddplab.config import ConfigError
from ddplab.workload import batches, userparts
from tests.conftest import job_env, runs

BIN = Path(sys.executable).parent

DICTS = '''
import torch
from torch.utils.data import Dataset

from ddplab.workload import textdata


class CausalLMDicts(Dataset):
    """Samples as Hugging Face's collators make them; labels are the input ids, unshifted."""

    def __init__(self, text, seq_len):
        self.ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.seq_len = seq_len

    def __len__(self):
        return len(self.ids) // self.seq_len

    def __getitem__(self, i):
        ids = self.ids[i * self.seq_len:(i + 1) * self.seq_len]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def build(seq_len, seed):
    return (CausalLMDicts(textdata.generated(320 * seq_len, seed), seq_len),
            CausalLMDicts(textdata.generated(48 * seq_len, seed + 1), seq_len))
'''

GPT2 = {"_target_": "transformers:GPT2Config", "n_layer": 2, "n_head": 2, "n_embd": 32,
        "vocab_size": 256, "n_positions": 32, "bos_token_id": 0, "eos_token_id": 0}


def experiment(tmp_path: Path, **train: object) -> Path:
    (tmp_path / "hfdicts.py").write_text(DICTS)
    path = tmp_path / "hf.yaml"
    path.write_text(yaml.safe_dump({
        "name": "hf-gpt2",
        "data": {"dataset": "hfdicts:build", "seq_len": 32, "batch_size": 8, "eval_batch_size": 16},
        "model": {"name": "transformers:GPT2LMHeadModel", "args": {"config": GPT2}},
        "optim": {"name": "adamw", "lr": 0.003},
        "train": {"loss": "model", "epochs": 2, "log_every": 5, **train},
        "tracking": {"system_metrics": False},
        "checkpoint": {"dir": str(tmp_path / "ck")}}))
    return path


def test_target_builds_the_object_an_argument_describes_and_a_bad_one_is_one_line():
    built = userparts.instantiate("model.args", {"config": GPT2, "plain": [1, {"x": 2}]})
    assert type(built["config"]).__name__ == "GPT2Config" and built["config"].n_layer == 2
    assert built["plain"] == [1, {"x": 2}]
    with pytest.raises(ConfigError, match=r"model.args.config._target_: got 'GPT2Config'; expected"):
        userparts.instantiate("model.args", {"config": {"_target_": "GPT2Config"}})
    with pytest.raises(ConfigError, match=r"model.args.config._target_: got 'transformers:GPT2Config'; "
                                          r"calling it raised"):
        userparts.instantiate("model.args", {"config": {**GPT2, "n_embd": -1, "n_head": "x"}})


def test_dict_batches_split_by_keys_and_a_missing_key_is_one_line():
    raw = {"input_ids": torch.ones(2, 4, dtype=torch.long), "mask": torch.ones(2, 4),
           "y": torch.zeros(2, dtype=torch.long)}
    b = batches.Shape(target_key="y").split(raw)
    assert set(b.inputs) == {"input_ids", "mask"} and b.size == 2
    assert set(batches.Shape(("input_ids",), "y").split(raw).inputs) == {"input_ids"}
    with pytest.raises(ConfigError, match="data.target_key: got 'labels'; the samples' keys are "
                                          "input_ids, mask, y"):
        batches.Shape().split(raw)
    with pytest.raises(ConfigError, match="data.input_keys: got .*the samples have no pixel_values"):
        batches.Shape(("pixel_values",), "y").split(raw)
    with pytest.raises(TypeError, match="has no `loss`"):
        batches.model_loss(torch.zeros(2, 3))


def test_metrics_with_the_models_own_loss_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="train.metrics: .*not with train.loss model"):
        config.load(None, ["train.loss=model",
                           'train.metrics=[{name: f1, fn: "torchmetrics.classification:MulticlassF1Score"}]'])


def _ddplab(args: list[str], cwd: Path, store: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ddplab"), *args], cwd=cwd, env=job_env(store),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
def test_unshifted_labels_under_a_loss_of_ddplabs_are_refused_before_training(tmp_path, store):
    out = _ddplab(["train", str(experiment(tmp_path)), "--set", "train.loss=cross_entropy"],
                  tmp_path, store)
    # "[ddplab] checks: still importing transformers (6 s)": progress a slow import shows on a
    # busy machine, beside the one line of the refusal.
    said = [line for line in out.stderr.splitlines()
            if line.strip() and not line.startswith("[ddplab] checks: still ")]
    assert out.returncode == 2 and len(said) == 1, out.stderr[-2000:]
    assert "the targets equal the input ids" in out.stderr and "train.loss: model" in out.stderr
    assert runs(store) == []


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_hugging_face_gpt2_with_no_wrapper_trains_on_dict_batches(tmp_path, store, strategy):
    out = _ddplab(["run", "--nproc-per-node", "2", str(experiment(tmp_path)), "--set",
                   f"dist.strategy={strategy}"], tmp_path, store, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = runs(store)
    m, t = run.data.metrics, run.data.tags
    assert run.info.status == "FINISHED" and t["ddplab.world_size"] == "2"
    assert t["ddplab.strategy"] == strategy
    assert m["eval/perplexity"] == pytest.approx(math.exp(m["eval/loss"]))
    assert m["eval/loss"] < math.log(256) - 1.0  # learnt: below chance over 256 bytes by a nat
    assert "eval/accuracy" not in m  # the model aligns its labels itself: ddplab does not score
    assert 0 < m["perf/mfu"] < 1 and "flop_counter" in t["ddplab.mfu.flops_source"]
    assert t["ddplab.user.model.dist"].startswith("transformers "), t  # its distribution, version
