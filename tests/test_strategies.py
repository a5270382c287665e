"""dist.strategy ddp | zero | fsdp: the same training, the memory each rank holds, and
checkpoints that move between strategies and world sizes.

Unit tests for the pieces; the rest are real `torchrun -m ddplab train` jobs on 2 CPU ranks
over gloo (marker ``distributed``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddplab import config
from ddplab.training import strategy
from tests.conftest import QUICK, REPO, ddplab, job_env, runs

QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")


def test_optimizer_state_by_name_and_back_is_the_same_dict():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    names = [n for n, _ in model.named_parameters()]
    by_name = strategy.by_name(opt.state_dict(), names)
    assert set(by_name["state"]) == set(names) and by_name["param_groups"][0]["params"] == names
    back = strategy.by_index(by_name, names)
    assert back["param_groups"] == opt.state_dict()["param_groups"]
    assert all(torch.equal(back["state"][i]["exp_avg"], opt.state_dict()["state"][i]["exp_avg"])
               for i in range(len(names)))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.layers = nn.ModuleList([Layer(), Layer()])


@pytest.mark.parametrize("model_name, wrap, blocks", [
    ("gpt", "", {"Block"}),                     # a built-in model's own blocks
    ("mine:Net", "", {"Layer"}),                # a user's model: its first ModuleList's classes
    ("mine:Net", "Linear,Layer", {"Linear", "Layer"}),  # named in dist.fsdp.wrap
    ("cnn", "", set()),                         # no blocks: the model is one unit
])
def test_fsdp_blocks_come_from_the_config_the_model_or_its_module_list(model_name, wrap, blocks):
    cfg = config.ExperimentConfig(model=config.ModelConfig(name=model_name),
                                  dist=config.DistConfig(fsdp=config.FsdpConfig(wrap=wrap)))
    model = Net() if model_name == "mine:Net" else nn.Sequential(nn.Linear(2, 2))
    assert strategy.block_names(cfg, model) == blocks


def test_model_state_counts_parameters_a_gradient_each_and_the_optimizer_state():
    model = nn.Linear(100, 10)  # 1,010 parameters
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 100)).sum().backward()
    opt.step()
    # 4 bytes x (params + grads + exp_avg + exp_avg_sq); AdamW's step counter is a scalar
    assert strategy.model_state_bytes(model, opt) == 4 * 1010 * 4


def _train(tmp_path, store, strategy_name, nproc=2, *extra):
    out = ddplab(["train", QUICKSTART, *QUICK, "--set", f"dist.strategy={strategy_name}",
                  "--set", "train.max_steps=8", "--set", "train.deterministic=true",
                  "--set", "train.log_every=1", "--set", f"checkpoint.dir={tmp_path / strategy_name}",
                  *extra], tmp_path, job_env(store), nproc=nproc)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return next(r for r in runs(store) if r.data.tags.get("ddplab.strategy") == strategy_name)


def _losses(store, run):
    from mlflow import MlflowClient

    hist = MlflowClient(store).get_metric_history(run.info.run_id, "train/loss")
    return [m.value for m in sorted(hist, key=lambda m: m.step)]


@pytest.mark.distributed
def test_zero_and_fsdp_train_as_ddp_does_and_fsdp_holds_half_the_state(tmp_path, store):
    """...and the fsdp job's checkpoint of 2 ranks resumes on 1 ddp rank and exports."""
    made = {s: _train(tmp_path, store, s) for s in ("ddp", "zero", "fsdp")}
    ddp = _losses(store, made["ddp"])
    assert len(ddp) == 8
    for name in ("zero", "fsdp"):
        assert _losses(store, made[name]) == pytest.approx(ddp, rel=1e-5), name
    state = {s: r.data.metrics["memory/model_state_mb_max"] for s, r in made.items()}
    assert state["fsdp"] <= 0.55 * state["ddp"]
    assert state["zero"] <= state["ddp"]
    assert all(r.data.metrics["memory/peak_rss_mb"] > 100 for r in made.values())
    assert made["fsdp"].data.params["dist.strategy"] == "fsdp"

    # The fsdp job's checkpoint of 2 ranks resumes on 1 ddp rank and exports (one fsdp job for
    # both: the same job, trained again, was this part's own test).
    (saved,) = sorted((tmp_path / "fsdp").glob("quickstart/*/step-*.pt"))
    # Half the ranks with the same per-rank batch would halve the global batch: refused.
    refused = ddplab(["train", QUICKSTART, *QUICK, "--set", f"checkpoint.resume={saved}",
                      "--set", "train.max_steps=8"], tmp_path, job_env(store))  # 1 process
    assert refused.returncode == 2
    assert "global batch of 64 (world size 2)" in refused.stderr
    assert "set data.batch_size=64 to keep it" in refused.stderr
    # The same global batch on 1 rank, under ddp: the parameters are the ones fsdp saved.
    out = ddplab(["train", QUICKSTART, *QUICK, "--set", f"checkpoint.resume={saved}",
                  "--set", "train.max_steps=8", "--set", "data.batch_size=64",
                  "--set", "train.deterministic=true",
                  "--set", f"checkpoint.dir={tmp_path / 'one'}"], tmp_path, job_env(store))
    assert out.returncode == 0, out.stderr[-3000:]
    (again,) = sorted((tmp_path / "one").glob("quickstart/*/step-*.pt"))
    before = torch.load(saved, weights_only=True)["model"]
    after = torch.load(again, weights_only=True)["model"]
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert torch.load(again, weights_only=True)["world_size"] == 1

    exported = tmp_path / "model.pt"
    said = ddplab(["checkpoint", "export", str(tmp_path / "fsdp"), str(exported)], tmp_path,
                  job_env(store))
    assert said.returncode == 0 and "dist.strategy fsdp, world size 2" in said.stdout
    from ddplab.workload import data, models

    cfg = config.load(QUICKSTART, [])
    info = data.describe(cfg.data, data.datasets(cfg.data, 0)[0])
    plain = models.build(cfg.model, info)
    plain.load_state_dict(torch.load(exported, weights_only=True))  # strict: every key, every shape
    assert torch.equal(plain.state_dict()[next(iter(before))], before[next(iter(before))])
