"""Shared fixtures. Tests run real processes: torchrun, make, the ddplab CLI."""

from __future__ import annotations

import os
import shutil
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


@pytest.fixture(scope="session")
def migrated_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow store with its schema made, once per session: each new store cost its
    first user ~1 s of schema migration, in every test that trains."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("migrated") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(tmp_path: Path, migrated_store: Path) -> str:
    """A fresh embedded MLflow store for one test (a copy of the migrated empty one): tests
    that prove nothing was recorded look for runs, not for the file."""
    target = tmp_path / "mlflow.db"
    shutil.copyfile(migrated_store, target)
    return f"sqlite:///{target}"


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
