"""The quickstart's job written as each peer's own documentation writes it: a plain torchrun
DDP loop, Lightning Fabric, Lightning's Trainer (with or without its MLFlowLogger) and Hugging
Face Accelerate. Same model (the book's CNN), same synthetic data and seed, same global batch,
epochs and threads as the ddplab job bench_peers.py runs beside them. Launched by torchrun:

    torchrun --standalone --nproc-per-node 2 benchmarks/peers/peer_job.py --framework fabric --out f.json

Rank 0 writes what it measured: each epoch's wall and process CPU seconds and steps, and the
wall-clock time of the first step's end (the harness compares it with its launch time).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from ddplab.workload.data import SyntheticImages
from ddplab.workload.models import BookCNN

FRAMEWORKS = ("plain", "fabric", "trainer", "trainer-mlflow", "accelerate")


class Clock:
    """Rank 0's clocks, fed the same way by every framework."""

    def __init__(self) -> None:
        self.first_step_at: float | None = None
        self.epochs: list[dict[str, float]] = []
        self.t = self.c = 0.0
        self.steps = 0

    def epoch_start(self) -> None:
        self.t, self.c, self.steps = time.perf_counter(), time.process_time(), 0

    def step(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.time()
        self.steps += 1

    def epoch_end(self) -> None:
        self.epochs.append({"wall_s": time.perf_counter() - self.t,
                            "cpu_s": time.process_time() - self.c, "steps": self.steps})


def data(a: argparse.Namespace) -> SyntheticImages:
    return SyntheticImages(a.samples, 32, 3, 10, 4.0, seed=0)  # the quickstart's set


def new_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return BookCNN(3, 32, 10)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def plain(a: argparse.Namespace, clock: Clock) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler

    cuda = a.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", 0))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = DDP(new_model().to(device), device_ids=[local] if cuda else None)
    opt, loss_fn = sgd(model.parameters()), torch.nn.CrossEntropyLoss()
    sampler = DistributedSampler(data(a), shuffle=True, seed=0)
    loader = DataLoader(sampler.dataset, batch_size=a.batch, sampler=sampler)
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        clock.epoch_start()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
            clock.step()
        _sync(device)
        clock.epoch_end()
    dist.destroy_process_group()


def fabric(a: argparse.Namespace, clock: Clock) -> None:
    import lightning as L

    f = L.Fabric(accelerator=a.device, devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp")
    f.launch()  # under torchrun: the processes exist already
    model = new_model()
    model, opt = f.setup(model, sgd(model.parameters()))
    loader = f.setup_dataloaders(DataLoader(data(a), batch_size=a.batch, shuffle=True))
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(a.epochs):
        if hasattr(loader.sampler, "set_epoch"):  # Fabric's DistributedSampler
            loader.sampler.set_epoch(epoch)
        clock.epoch_start()
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            f.backward(loss_fn(model(x), y))
            opt.step()
            clock.step()
        _sync(f.device)
        clock.epoch_end()


def trainer(a: argparse.Namespace, clock: Clock, mlflow: bool) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = new_model()
            self.loss_fn = torch.nn.CrossEntropyLoss()

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss = self.loss_fn(self.net(x), y)
            self.log("train/loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return sgd(self.parameters())

        def train_dataloader(self) -> DataLoader:
            return DataLoader(data(a), batch_size=a.batch, shuffle=True)

    class Timing(L.Callback):
        def on_train_epoch_start(self, *_: Any) -> None:
            clock.epoch_start()

        def on_train_batch_end(self, *_: Any) -> None:
            clock.step()

        def on_train_epoch_end(self, *_: Any) -> None:
            clock.epoch_end()

    logger: Any = False
    if mlflow:
        from lightning.pytorch.loggers import MLFlowLogger

        logger = MLFlowLogger(experiment_name="bench-peers-lightning",
                              tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))
    t = L.Trainer(accelerator=a.device, devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp",
                  max_epochs=a.epochs, logger=logger, log_every_n_steps=8, callbacks=[Timing()],
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, num_sanity_val_steps=0)
    t.fit(Module())


def accelerate(a: argparse.Namespace, clock: Clock) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=a.device == "cpu")
    model = new_model()
    model, opt, loader = acc.prepare(model, sgd(model.parameters()),
                                     DataLoader(data(a), batch_size=a.batch, shuffle=True))
    loss_fn = torch.nn.CrossEntropyLoss()
    for epoch in range(a.epochs):
        loader.set_epoch(epoch)
        clock.epoch_start()
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            acc.backward(loss_fn(model(x), y))
            opt.step()
            clock.step()
        _sync(acc.device)
        clock.epoch_end()


def _sync(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=FRAMEWORKS, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=6144)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    clock = Clock()
    if a.framework == "plain":
        plain(a, clock)
    elif a.framework == "fabric":
        fabric(a, clock)
    elif a.framework.startswith("trainer"):
        trainer(a, clock, mlflow=a.framework == "trainer-mlflow")
    else:
        accelerate(a, clock)
    if int(os.environ.get("RANK", 0)) == 0:
        with open(a.out, "w") as f:
            json.dump({"first_step_at": clock.first_step_at, "epochs": clock.epochs,
                       "world_size": int(os.environ.get("WORLD_SIZE", 1))}, f)


if __name__ == "__main__":
    main()
