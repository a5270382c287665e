"""Spawning real gloo process groups in-process (torch.multiprocessing, file:// rendezvous)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests import dist_workers

# A spawned rank is a new interpreter that imports torch and ddplab again: ~3.5 s of CPU for
# ranks whose work takes a fraction of that, ~90 of them in make test. A forkserver imports them
# once (per test process) and forks each rank from there; the rendezvous, the process group and
# the work stay each rank's own, as under spawn.
mp.get_context("forkserver").set_forkserver_preload(["torch", "tests.dist_workers"])


def spawn(fn, world: int, tmp: Path, *args) -> list[dict]:
    mp.start_processes(fn, args=(world, str(tmp), *args), nprocs=world, join=True,
                       start_method="forkserver")
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def reference(tmp: Path, global_batch: int, steps: int) -> dict:
    ref = tmp / "ref"
    ref.mkdir()
    return spawn(dist_workers.train_k_steps, 1, ref, global_batch, 1, steps)[0]
