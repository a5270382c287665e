"""Worker functions for tests/test_distributed.py (spawned processes import them from here).

Each joins a real gloo process group through a file:// rendezvous in the test's temp dir,
runs ddplab's own loop, and writes what it saw to ``<out>/rank<r>.pt`` for the parent.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ddplab import ccl
from ddplab.config import DataConfig
from ddplab.distributed import choice, group, oneccl
from ddplab.training import loop, strategy
from ddplab.workload import models
from ddplab.workload.data import SyntheticImages, datasets, loaders

SIZE, CLASSES = 8, 4


def _group(rank: int, world: int, tmp: str, name: str = "gloo", timeout_s: int = 120) -> None:
    if name == "ccl":  # as the product does it: register ddplab's build, set oneCCL's variables
        import os

        from ddplab.launchers.detect import LaunchEnv

        impl = choice.import_ccl()
        assert impl.name == "ddplab", impl.why
        oneccl.apply_ccl_env(LaunchEnv("test", rank, world, rank, world, 0, "127.0.0.1", 0),
                              os.environ, impl)
    dist.init_process_group(name, init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)


def _finish() -> None:
    """Tear down as the product does: all ranks done, DDP's reducer collected, then the group.
    (Destroying the group under a live DDP model with a comm hook aborted rank 0 once in CI:
    'terminate called without an active exception'.)"""
    group.finish_together()
    group.destroy_process_group()
    ccl.release_shm()  # as cli.entry does: a spawned ccl rank's libfabric region is not kept


def train_k_steps(rank: int, world: int, tmp: str, global_batch: int, accum: int,
                  steps: int, knobs: dict | None = None, name: str = "gloo") -> None:
    """k optimizer steps of the book CNN with per-rank batch global/(world*accum); ``knobs``
    are DistConfig fields (DDP's knobs, the gradient hook); ``name`` the backend."""
    _group(rank, world, tmp, name)
    torch.save(_k_steps(rank, world, global_batch, accum, steps, knobs), Path(tmp) / f"rank{rank}.pt")
    _finish()


def train_k_steps_each(rank: int, world: int, tmp: str, global_batch: int, steps: int,
                       settings: list[dict]) -> None:
    """``train_k_steps`` once per DDP setting in ``settings``, one after the other in one process
    group (each a fresh model): rank<r>.pt holds the list, in that order."""
    _group(rank, world, tmp)
    out = [_k_steps(rank, world, global_batch, 1, steps, knobs) for knobs in settings]
    torch.save(out, Path(tmp) / f"rank{rank}.pt")
    _finish()


def _k_steps(rank: int, world: int, global_batch: int, accum: int, steps: int,
             knobs: dict | None) -> dict:
    from ddplab.config import DistConfig

    torch.manual_seed(0)
    data = SyntheticImages(global_batch * steps, SIZE, 3, CLASSES, 1.0, seed=0)
    # Unshuffled: step s of rank r holds samples r, r+world, ... of global batch s, so the
    # union over ranks of each step is exactly the 1-rank run's batch s.
    sampler = DistributedSampler(data, world, rank, shuffle=False)
    loader = DataLoader(data, batch_size=global_batch // (world * accum), sampler=sampler)
    model = models.BookCNN(3, SIZE, CLASSES)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = loop.TrainState(
        model=strategy.wrap(model, _plain(), torch.device("cpu"), DistConfig(**(knobs or {}))),
        optimizer=opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        scaler=torch.amp.GradScaler("cpu", enabled=False), device=torch.device("cpu"),
        grad_accum=accum)
    losses = [float(r.loss_sum) / r.samples for r in loop.train_epoch(state, loader)]
    out = {"params": [p.detach().clone() for p in model.parameters()], "steps": state.step,
           "losses": losses}
    del state, model, opt
    import gc

    gc.collect()  # DDP's reducer (and its hook's state) goes before the next model's
    return out


def _plain():
    from ddplab.config import ModelConfig
    return ModelConfig()


def evaluate_shards(rank: int, world: int, tmp: str, size: int) -> None:
    _group(rank, world, tmp)
    torch.manual_seed(0)
    cfg = DataConfig(eval_samples=size, image_size=SIZE, num_classes=CLASSES, eval_batch_size=7)
    ld = loaders(cfg, datasets(cfg, 0), seed=0, rank=rank, world=world, pin=False)
    model = models.BookCNN(3, SIZE, CLASSES)
    from torchmetrics.classification import MulticlassF1Score

    # train.metrics: macro F1 over every rank's samples, and the same metric kept to this rank
    # (sync_on_compute off): what averaging the ranks' values would have used.
    state = loop.TrainState(model=model, optimizer=None, scheduler=None, scaler=None,
                            device=torch.device("cpu"), metrics={
                                "f1": MulticlassF1Score(num_classes=CLASSES, average="macro"),
                                "f1_here": MulticlassF1Score(num_classes=CLASSES, average="macro",
                                                             sync_on_compute=False)})
    r = loop.evaluate(model, ld.eval, state)
    torch.save({"count": r.count, "correct": r.correct, "loss": r.loss, "own": r.own,
                "local": len(ld.eval.sampler)}, Path(tmp) / f"rank{rank}.pt")
    _finish()


def sampler_epochs(rank: int, world: int, tmp: str, size: int) -> None:
    _group(rank, world, tmp)
    cfg = DataConfig(train_samples=size, batch_size=4)
    ld = loaders(cfg, datasets(cfg, 5), seed=5, rank=rank, world=world, pin=False)
    seen = {}
    for epoch in (0, 1):
        ld.sampler.set_epoch(epoch)
        shard = list(ld.sampler)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, shard)
        seen[epoch] = gathered
    torch.save(seen, Path(tmp) / f"rank{rank}.pt")
    _finish()


def reduce_interval(rank: int, world: int, tmp: str) -> None:
    _group(rank, world, tmp)
    meter = loop.Meter()
    # rank r: (r+1) steps of 10 samples with per-sample loss r+1, each step 0.5 s
    for _ in range(rank + 1):
        meter.add(loop.StepResult(1, 0, 10, torch.tensor(10.0 * (rank + 1)), 0.5, 0.1))
    torch.save(loop.reduce_interval(meter, torch.device("cpu")), Path(tmp) / f"rank{rank}.pt")
    _finish()
