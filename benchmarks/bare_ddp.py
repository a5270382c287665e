"""The baseline: a minimal hand-written DDP loop in the style of the book's chapter 9 script.

Same model (the book CNN), data (ddplab's synthetic set through a plain DataLoader), batch and
thread count as the ddplab job it is compared with; no tracking, no checkpoints, no metrics
beyond the epoch clock. Launched like the book did:
    torchrun --standalone --nproc-per-node 2 benchmarks/bare_ddp.py --out bare.json
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddplab.workload.data import SyntheticImages
from ddplab.workload.models import BookCNN

p = argparse.ArgumentParser()
p.add_argument("--samples", type=int, default=4096)
p.add_argument("--batch", type=int, default=32)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--threads", type=int, default=0)
p.add_argument("--noise", type=float, default=4.0)
p.add_argument("--out", default="")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_num_threads(args.threads or max(1, len(os.sched_getaffinity(0)) // world))
torch.manual_seed(0)

dataset = SyntheticImages(args.samples, 32, 3, 10, args.noise, seed=0)
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
model = DDP(BookCNN(3, 32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
loss_fn = torch.nn.CrossEntropyLoss()

epoch_times = []
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    t0 = time.perf_counter()
    model.train()
    for x, y in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
    epoch_times.append(time.perf_counter() - t0)

if rank == 0 and args.out:
    total = sampler.num_samples * world
    with open(args.out, "w") as f:
        json.dump({"epoch_time_s": epoch_times,
                   "epoch_samples_per_s": [total / t for t in epoch_times]}, f)
dist.destroy_process_group()
