"""The one function that strings the steps together, in the order the data flows:
config -> launch environment -> checks -> process group -> resume -> tracked run -> build
(data, model, state) -> record -> fit (the epoch loop, profiled when asked) -> finish
(checkpoint, summary).

Launched as (any launcher; the rank layout comes from launchers/detect.py):
    ddplab train experiments/quickstart.yaml                                  # one process
    torchrun --standalone --nproc-per-node 2 -m ddplab train experiments/quickstart.yaml
    torchrun --nnodes 2 --node-rank K --rdzv-backend c10d --rdzv-endpoint node0:29400 \\
        --rdzv-id job1 -m ddplab train experiments/quickstart.yaml           # on each node
    mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT ddplab train experiments/quickstart.yaml
    srun --ntasks 4 --ntasks-per-node 2 ddplab train experiments/quickstart.yaml
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence

import numpy as np
import torch

from .. import config, tracking
from ..distributed import group
from ..distributed import layout as launch_layout
from ..launchers import LaunchEnv
from . import checkpoint, checks
from .fit import finish, fit
from .job import build, record_start
from .jobend import Signals, Terminated, say_last, where
from .profiling import profiling

__all__ = ["Signals", "Terminated", "train"]


def train(path: str | None, overrides: Sequence[config.Override], summary_out: str = "",
          script_args: list[str] | None = None) -> str:
    """Run one job, in the order the data flows. Returns the MLflow run id ("" untracked).
    An experiment with a script (``my_train.py``, or a ``script:`` section) runs that script
    on every rank instead of ddplab's loop (scriptmode/)."""
    t_start = time.perf_counter()
    cfg = config.load(path, overrides, script_args)
    if cfg.kind == "script":  # the user's own script runs its own loop, as a sibling of this one
        from . import scriptmode

        return scriptmode.train(cfg, summary_out)
    le = LaunchEnv.from_environ(os.environ)
    _seed(cfg.train)  # before any user part is built (the checks build them): the same on every rank
    parts = checks.before_start(cfg, le, summary_out, torch.cuda.is_available(), path)  # no run yet
    layout = launch_layout.plan_layout(cfg.dist, le)
    with launch_layout.process_group(layout, cfg.dist.timeout_s), Signals() as signals:
        resume = checkpoint.find_and_share(cfg, le.is_rank0, le.world_size)
        with tracking.job_run(cfg, le, layout, resume.run_id, signals) as run:
            job = build(cfg, layout, resume, run, parts, summary_out, t_start)
            record_start(job)
            with profiling(job):  # torch.profiler on every rank, when profile.enabled
                fit(job)
            finish(job)
        group.finish_together()  # no rank leaves before rank 0 has ended the run
    say_last(where(run), le.is_rank0)
    return run.run_id


def _seed(cfg: config.TrainConfig) -> None:
    # One seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    random.seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)  # a user's data callable drawing from numpy
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
