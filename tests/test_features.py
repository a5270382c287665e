"""Unit: each training feature a config switch turns on does what it says (and is off when off).

bf16 autocast, channels_last, grad_clip, the LR schedules' values step by step, pin_cores,
DataLoader workers with persistent workers, and torch.compile over DDP (one rank, gloo).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddplab.config import DataConfig, DistConfig, ModelConfig, OptimConfig
from ddplab.distributed import cpu as cpu_layout
from ddplab.launchers.detect import LaunchEnv
from ddplab.training import loop, strategy
from ddplab.workload import data, models, optim

CPU = torch.device("cpu")


def state(model: nn.Module, lr: float = 0.1, **kw) -> loop.TrainState:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return loop.TrainState(model=model, optimizer=opt,
                           scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                           scaler=torch.amp.GradScaler("cpu", enabled=False), device=CPU, **kw)


def _forward_dtype(amp: str) -> torch.dtype:
    model = models.BookCNN(3, 8, 4)
    seen: list[torch.dtype] = []
    model.classifier[-1].register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    s = state(model, amp=amp)
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    loop.micro_step(s, s.batch((x, y)), group_size=1, sync_grads=True)
    assert model.classifier[-1].weight.grad is not None
    return seen[0]


def test_bf16_autocast_runs_the_forward_in_bf16_and_none_in_fp32():
    assert _forward_dtype("bf16") == torch.bfloat16
    assert _forward_dtype("none") == torch.float32


def test_channels_last_reaches_the_weights_and_the_batches():
    model = models.prepare(models.BookCNN(3, 8, 4), ModelConfig(channels_last=True), CPU)
    assert model.features[0].weight.is_contiguous(memory_format=torch.channels_last)
    x = state(model, channels_last=True).batch((torch.randn(2, 3, 8, 8), torch.zeros(2))).inputs
    assert x.is_contiguous(memory_format=torch.channels_last)
    x = state(model, channels_last=False).batch((torch.randn(2, 3, 8, 8), torch.zeros(2))).inputs
    assert not x.is_contiguous(memory_format=torch.channels_last)


def _update_norm(grad_clip: float) -> float:
    """Norm of one plain-SGD update (lr 1) from a gradient of norm 200."""
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    model.weight.grad = torch.full_like(model.weight, 100.0)  # norm 200
    s = state(model, lr=1.0, grad_clip=grad_clip)
    loop.optimizer_step(s)
    return model.weight.detach().norm().item()


def test_grad_clip_bounds_the_update_and_zero_leaves_it_alone():
    assert _update_norm(0.5) == pytest.approx(0.5, rel=1e-4)
    assert _update_norm(0.0) == pytest.approx(200.0, rel=1e-6)


def _lrs(cfg: OptimConfig, steps: int, total: int) -> list[float]:
    opt = optim.optimizer(nn.Linear(1, 1), cfg)
    sched = optim.scheduler(opt, cfg, total)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("cfg, expected", [
    (OptimConfig(lr=1.0, scheduler="none"), [1.0] * 6),
    (OptimConfig(lr=1.0, scheduler="none", warmup_steps=4), [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]),
    (OptimConfig(lr=2.0, scheduler="step", step_size=2, gamma=0.5),
     [2.0, 2.0, 1.0, 1.0, 0.5, 0.5]),
    (OptimConfig(lr=1.0, scheduler="step", warmup_steps=2, step_size=2, gamma=0.1),
     [0.5, 1.0, 1.0, 1.0, 0.1, 0.1]),
    # cosine over 4 steps after 2 warm-up steps: 1, cos^2(pi/8)=0.8536, 0.5, 0.1464, then 0.
    (OptimConfig(lr=1.0, scheduler="cosine", warmup_steps=2),
     [0.5, 1.0, 1.0, 0.853553, 0.5, 0.146447, 0.0, 0.0]),
])
def test_lr_schedule_values_step_by_step(cfg, expected):
    assert _lrs(cfg, len(expected), total=6) == pytest.approx(expected, abs=1e-6)


def test_pin_cores_gives_each_local_rank_its_own_block():
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    le = LaunchEnv("torchrun", 1, 2, 1, 2, 0, "127.0.0.1", 29500)
    try:
        threads, pinned = cpu_layout.apply_cpu_layout(
            DistConfig(pin_cores=True, threads_per_rank=1), le, "gloo")
        expected = cores[len(cores) // 2:] if len(cores) >= 2 else cores
        assert pinned == expected and os.sched_getaffinity(0) == set(expected)
        assert threads == 1 and torch.get_num_threads() == 1
        _, unpinned = cpu_layout.apply_cpu_layout(DistConfig(threads_per_rank=1), le, "gloo")
        assert unpinned == []
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize("persistent", [True, False])
def test_loader_workers_cover_the_shard_and_persist_when_asked(persistent):
    cfg = DataConfig(train_samples=64, eval_samples=16, image_size=8, batch_size=8,
                     num_workers=2, persistent_workers=persistent)
    loaders = data.loaders(cfg, data.datasets(cfg, 0), seed=0, rank=0, world=1, pin=False)
    pids = []
    for epoch in range(2):
        loaders.sampler.set_position(epoch, 0)
        batches = iter(loaders.train)
        pids.append({w.pid for w in batches._workers})
        assert sum(y.shape[0] for _, y in batches) == 64
    # The same two workers both epochs when persistent; two new ones each epoch otherwise.
    assert len(pids[0]) == len(pids[1]) == 2 and (pids[0] == pids[1]) == persistent


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_compile_wraps_ddp_and_computes_what_eager_does(one_rank_group):
    torch.manual_seed(0)
    eager = strategy.wrap(models.BookCNN(3, 8, 4), ModelConfig(), CPU)
    compiled = strategy.wrap(strategy.unwrap(eager), ModelConfig(compile=True), CPU)
    assert hasattr(compiled, "_orig_mod") and strategy.unwrap(compiled) is strategy.unwrap(eager)
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-4, atol=1e-5)
    # model.compile_mode reaches torch.compile (the modes themselves are torch's)
    asked: list[str] = []
    real = torch.compile
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(torch, "compile", lambda m, mode=None: asked.append(mode) or real(m))
    try:
        strategy.wrap(strategy.unwrap(eager), ModelConfig(compile=True, compile_mode="reduce-overhead"), CPU)
    finally:
        monkeypatch.undo()
    assert asked == ["reduce-overhead"]


def _host_waits_in_steady_steps(monkeypatch, exact: bool) -> dict[str, int]:
    """Run 6 steps of the loop and count, from step 2 on (step 1 waits once, by design), every
    call that makes the host wait on the device: a synchronize, and a tensor read to the host."""
    counts = {"synchronize": 0, "item": 0, "cpu": 0, "tolist": 0}
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    s = state(model, exact_step_times=exact)
    # A CPU never waits, so the device is said to be CUDA for the clock alone: the one place
    # that decides whether to wait (a fake GPU for what cannot run here).
    monkeypatch.setattr(loop.StepClock, "_event",
                        lambda self: object() if self.cuda and not self.exact else None)
    cuda = torch.device("cuda")
    real_init = loop.StepClock.__init__
    monkeypatch.setattr(loop.StepClock, "__init__",
                        lambda self, device, exact=False, *rest: real_init(self, cuda, exact, *rest))
    steady = {"on": False}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            if steady["on"]:
                counts[name] += 1
            return original(*args, **kwargs) if original is not None else None
        return wrapper

    monkeypatch.setattr(loop, "_sync", counting("synchronize", None))
    for name in ("item", "cpu", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    data = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(6)]
    for result in loop.train_epoch(s, data):
        steady["on"] = result.step >= 1
    return counts


def test_the_steady_step_never_waits_on_the_device_unless_asked(monkeypatch):
    assert _host_waits_in_steady_steps(monkeypatch, exact=False) == {
        "synchronize": 0, "item": 0, "cpu": 0, "tolist": 0}
    assert _host_waits_in_steady_steps(monkeypatch, exact=True)["synchronize"] == 5


def test_sync_debug_covers_each_steady_step_and_nothing_else(monkeypatch):
    """train.sync_debug: torch's sync debug mode is on while each step after the epoch's first
    and the process's second runs (where the optimizer steps), off where the loop yields (log
    points wait there)."""
    mode = {"now": "default", "calls": 0}

    def set_mode(m):
        mode["now"], mode["calls"] = m, mode["calls"] + 1

    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    data = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(6)]
    s = state(model, sync_debug="off")
    list(loop.train_epoch(s, data))
    assert mode["calls"] == 0  # off, or (next) on a CPU: never touched
    s = state(model, sync_debug="error")
    list(loop.train_epoch(s, data))
    assert mode["calls"] == 0
    # A fake GPU (none runs here): the clock is told the device is CUDA, as in the test above.
    monkeypatch.setattr(loop.StepClock, "_event", lambda self: None)
    monkeypatch.setattr(loop, "_sync", lambda device: None)
    real_init = loop.StepClock.__init__
    monkeypatch.setattr(loop.StepClock, "__init__", lambda self, device, exact=False,
                        sync_debug="off": real_init(self, torch.device("cuda"), exact, sync_debug))
    s = state(model, sync_debug="error")  # a new process's: its first two steps are not checked
    at_step: list[str] = []
    s.optimizer.register_step_post_hook(lambda opt, args, kwargs: at_step.append(mode["now"]))
    at_yield = [mode["now"] for _ in loop.train_epoch(s, data)]
    # the epoch's first step (lazy initialisation) and the process's second (DDP's bucket
    # rebuild, which reads back to the host) run unchecked, every later step checked
    assert at_step == ["default", "default"] + ["error"] * 4 and at_yield == ["default"] * 6
    mode["now"] = "warn"  # the user's own mode, set before: back to it after each step
    at_yield = [mode["now"] for _ in loop.train_epoch(s, data)]
    assert at_step[6:] == ["warn"] + ["error"] * 5 and at_yield == ["warn"] * 6


def test_an_evaluation_leaves_the_model_in_the_mode_it_found(one_rank_group):
    """train.eval_every_steps evaluates mid-epoch: dropout and batch norm must train again after
    it, not for the rest of the epoch in eval mode."""
    from torch.utils.data import DataLoader, TensorDataset

    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.Linear(16, 4))
    s = state(model)
    data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,))), batch_size=8)
    model.train()
    assert loop.evaluate(model, data, s).correct >= 0 and model.training
    assert all(m.training for m in model.modules())
    model.eval()
    loop.evaluate(model, data, s)
    assert not model.training
