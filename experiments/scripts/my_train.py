"""A plain torchrun DDP training script, as users arrive with one: its own flags, loop,
printouts and snapshots. ddplab runs it as it is (docs/your-own-script.md):

    torchrun --standalone --nproc-per-node 2 my_train.py --epochs 2            # without ddplab
    torchrun --standalone --nproc-per-node 2 -m ddplab train experiments/scripts/my_train.py -- --epochs 2
    ddplab study run experiments/studies/script-lr-layouts.yaml

It logs two ways: ``ddplab.track`` (through the node's spool: survives a tracking outage) when
ddplab is installed, and nothing else is needed. Snapshots go to $DDPLAB_CHECKPOINT_DIR when
ddplab gives one (a rerun of the same job resumes there and continues the same run).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

try:
    from ddplab import track
except ImportError:  # the same script without ddplab
    track = None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--fail-at-step", type=int, default=int(os.environ.get("MY_TRAIN_FAIL_AT_STEP", -1)),
                   help="raise on rank 1 at this step (a test; default $MY_TRAIN_FAIL_AT_STEP, a crash "
                        "that is no argument of the job, so a rerun of the same job resumes)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(args.samples, 32)
    y = (x[:, :4].sum(1) > 0).long()  # a learnable rule
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    snapshot = os.path.join(os.environ.get("DDPLAB_CHECKPOINT_DIR", "."), "snapshot.pt")
    first_epoch = 0
    if os.path.exists(snapshot):
        state = torch.load(snapshot)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first_epoch = state["epoch"] + 1
        print(f"rank {rank}: resuming from epoch {first_epoch}")
    if track and rank == 0:
        track.params({"lr": args.lr, "batch_size": args.batch_size, "world_size": world})

    step = first_epoch * len(loader)
    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        t0, seen = time.perf_counter(), 0
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 1 and step == args.fail_at_step:
                raise RuntimeError(f"injected failure at step {step}")
            seen += len(xb) * world
            if track:
                track.log({"train/loss": loss.item()}, step=step)
            step += 1
        rate = seen / (time.perf_counter() - t0)
        print(f"rank {rank} epoch {epoch}: loss {loss.item():.4f}, {rate:.0f} samples/s")
        if track:
            track.log({"perf/samples_per_s": rate, "train/epoch_loss": loss.item()}, step=step)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch}, snapshot)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
