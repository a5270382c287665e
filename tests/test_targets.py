"""Unit (lint tier): launch targets are the only place a launcher's command line is built, and
the names a study, a run's tag and a reproduction use lead to one target each."""

from __future__ import annotations

import ast
import sys
import typing
from pathlib import Path

from ddplab.launchers import targets
from ddplab.study import spec

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "src" / "ddplab"
# What only a launcher's command line contains (torchrun's, mpirun's, sbatch's, compose's).
LAUNCH_WORDS = ("torch.distributed.run", "--standalone", "--rdzv-backend", "--oversubscribe",
                "plm_rsh_agent", "--exit-code-from", "--ntasks-per-node")


def test_no_module_but_targets_builds_a_launch_command():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "targets.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
                    node.value.startswith(w) for w in LAUNCH_WORDS):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    assert not found, "launch argv built outside launchers/targets.py:\n" + "\n".join(found)


def test_every_study_launcher_names_a_target():
    names = {cls.name for cls in (targets.Torchrun, targets.Mpirun, targets.Sbatch,
                                  targets.Compose)}
    assert set(typing.get_args(spec.Launcher)) - {"compose-mpi"} == names


def test_a_reproduction_starts_the_kind_of_job_the_run_recorded():
    """A run's ddplab.launcher tag holds the launch environment's name (detect.py's)."""
    job = targets.train_job("exp.yaml", ["train.epochs=1"])
    assert job == ["-m", "ddplab", "train", "exp.yaml", "--set", "train.epochs=1"]
    mpi = targets.local("openmpi", 4, ["MLFLOW_TRACKING_TOKEN"]).argv(job)
    assert mpi[:3] == ["mpirun", "-np", "4"] and mpi[-len(job) - 1:] == [sys.executable, *job]
    forwarded = [mpi[i + 1] for i, x in enumerate(mpi) if x == "-x"]
    assert forwarded == ["MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN",
                         "MASTER_ADDR", "MASTER_PORT"]
    for recorded in ("torchrun", "slurm", "pytorchjob", "none"):
        assert targets.local(recorded, 2).argv(job) == [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            *job], recorded


def test_ddplab_set_is_never_put_on_a_command_line(monkeypatch):
    """Every rank inherits DDPLAB_SET and applies it once (config.load): a launcher that also
    passed it as --set would apply it twice, or, as a tuple, fail on every rank."""
    monkeypatch.setenv("DDPLAB_SET", "train.epochs=1")
    job = targets.train_job("exp.yaml", ["train.lr=0.1"], extra=["--", "--x"])
    argvs = [targets.Torchrun(2).argv(job), targets.Mpirun(2).argv(job),
             targets.NodeTorchrun(2, 1, "h:1", "id", True, 5, "h").argv(job),
             targets.MpirunHosts(["w0"], 1, [], "10.0.0.0/8", 29500, ["DDPLAB_SET"]).argv(job),
             targets.Sbatch(2, 1, "j", Path("cpu.sbatch")).argv("exp.yaml", ["train.lr=0.1"])]
    for argv in argvs:
        assert "train.epochs=1" not in " ".join(argv) and "train.lr=0.1" in argv, argv


def test_the_slurm_clusters_config_is_written_without_running_anything(tmp_path):
    """slurm-node.sh writes slurm.conf through an unquoted here-document (its node list expands):
    a comment's backquoted `sbatch --wait` in it ran sbatch on every node's start. And its
    MinJobAge keeps `sbatch --wait` polling every 8 s, not 32 (docs/slurm.md)."""
    import re
    import subprocess

    script = (REPO / "docker" / "slurm" / "slurm-node.sh").read_text()
    block = re.search(r"^cat > /etc/slurm/slurm.conf <<CONF\n.*?^CONF\n", script, re.S | re.M)
    assert block, "slurm-node.sh no longer writes slurm.conf in one here-document"
    conf, ran = tmp_path / "slurm.conf", tmp_path / "ran"
    (tmp_path / "bin").mkdir()
    for tool in ("sbatch", "srun", "scontrol", "squeue", "sinfo"):
        (tmp_path / "bin" / tool).write_text(f"#!/bin/sh\necho {tool} >> {ran}\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    out = subprocess.run(["bash", "-c", block.group(0).replace("/etc/slurm/slurm.conf", str(conf))],
                         env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "nodes": "node[1-2]",
                              "cpus": "2", "memory_mb": "4000"}, capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert not ran.exists(), f"writing slurm.conf ran: {ran.read_text()}"
    assert "NodeName=node[1-2] CPUs=2 RealMemory=4000" in conf.read_text()
    assert int(re.search(r"^MinJobAge=(\d+)$", conf.read_text(), re.M).group(1)) <= 16
