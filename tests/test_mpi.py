"""MPI tier: a real, native `mpirun` (Open MPI) launching ddplab on this machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUICK, REPO, job_env, runs
from tests.helpers import free_port

pytestmark = pytest.mark.mpi


def test_native_mpirun_gives_one_finished_run(tmp_path, store):
    mpirun = shutil.which("mpirun")
    assert mpirun, "Open MPI is not installed: apt-get install openmpi-bin (CI does)"
    env = job_env(store, MASTER_PORT=str(free_port()))
    if os.geteuid() == 0:  # CI runs as root; the images never do (they run as uid 10001)
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    out = subprocess.run(
        [mpirun, "--oversubscribe", "-np", "2", "-x", "MLFLOW_TRACKING_URI", "-x", "MASTER_PORT",
         "-x", "PATH", str(Path(sys.executable).parent / "ddplab"), "train",
         str(REPO / "experiments" / "quickstart.yaml"), *QUICK],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    t = run.data.tags
    assert run.info.status == "FINISHED"
    assert (t["ddplab.launcher"], t["ddplab.world_size"], t["ddplab.nproc_per_node"]) == (
        "openmpi", "2", "2")
    assert run.data.metrics["eval/accuracy"] > 0


def test_doctor_reports_unreachable_ssh_hosts(tmp_path, store):
    """The hosts come from a hostfile, as under the MPI operator; nothing listens on the port."""
    assert shutil.which("ssh"), "the OpenSSH client is missing: apt-get install openssh-client"
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2  # a comment\n\n")
    env = job_env(store, OMPI_MCA_orte_default_hostfile=str(hostfile),
                  OMPI_MCA_plm_rsh_args=f"-p {free_port()} -o StrictHostKeyChecking=yes")
    out = subprocess.run([str(Path(sys.executable).parent / "ddplab"), "doctor"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert any(line.startswith("problem: ssh to 127.0.0.1 fails:") for line in out.stdout.splitlines())


def test_bench_collectives_under_mpirun(tmp_path, store):
    """The collectives benchmark under another launcher: Open MPI's ranks, gloo's collectives."""
    env = job_env(store, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    out = subprocess.run(
        [shutil.which("mpirun") or "mpirun", "--oversubscribe", "-np", "2", "-x", "MLFLOW_TRACKING_URI",
         "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "PATH",
         str(Path(sys.executable).parent / "ddplab"), "bench", "collectives", "--backend", "gloo",
         "--ops", "all_reduce,all_to_all", "--sizes", "4K", "--iters", "3", "--no-support"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    assert (run.info.status, run.data.params["launcher"], run.data.params["world_size"]) == (
        "FINISHED", "openmpi", "2")
    assert "gloo/cpu/all_to_all/busbw_GBps" in run.data.metrics
