"""Shared fixtures. Tests run real processes: torchrun, make, the ddplab CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STAND_INS = REPO / "tests" / "stand_ins"
QUICK = [  # a smaller quickstart for tests that need a real job but not its full length
    "--set", "data.train_samples=1024", "--set", "data.eval_samples=256",
    "--set", "train.epochs=1", "--set", "train.log_every=4",
    "--set", "tracking.system_metrics_interval_s=1",
]


@pytest.fixture
def store(tmp_path: Path) -> str:
    """A fresh embedded MLflow store for one test."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


# A machine where `make setup-ccl` never ran: ddplab's own ccl backend is not there.
NO_CCL = {"DDPLAB_CCL_HOME": "/nonexistent/ddplab-ccl"}


def job_env(store: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_",
                                "PMI_", "SLURM_", "PET_", "TORCHELASTIC"))}
    env.update({"MLFLOW_TRACKING_URI": store, "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def ddplab(args: list[str], cwd: Path, env: dict[str, str], nproc: int = 0,
           timeout: int = 300) -> subprocess.CompletedProcess:
    """``ddplab train ...`` as a user types it: one process, or under torchrun."""
    bindir = Path(sys.executable).parent
    cmd = [str(bindir / "ddplab")] if nproc == 0 else [
        str(bindir / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m", "ddplab"]
    return subprocess.run(cmd + args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def runs(store: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(store)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps) if exps else []
