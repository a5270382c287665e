"""Spawning real gloo process groups in-process (torch.multiprocessing, file:// rendezvous)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests import dist_workers


def spawn(fn, world: int, tmp: Path, *args) -> list[dict]:
    mp.spawn(fn, args=(world, str(tmp), *args), nprocs=world, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def reference(tmp: Path, global_batch: int, steps: int) -> dict:
    ref = tmp / "ref"
    ref.mkdir()
    return spawn(dist_workers.train_k_steps, 1, ref, global_batch, 1, steps)[0]
