"""Launch targets: one class per way of starting a job's ranks, the only place a launcher's
command line is built.

    Torchrun        N ranks on this host (``ddplab run``, a study's or reproduce's torchrun job)
    NodeTorchrun    this node's ranks of a multi-node job, c10d rendezvous (``ddplab launch``)
    Mpirun          N ranks on this host by Open MPI (a study's or reproduce's mpirun job)
    MpirunHosts     ranks on worker containers or pods over ssh (``ddplab mpi launch``)
    Sbatch          a Slurm batch job (a study's slurm job)
    Compose         compose's simulated nodes (a study's compose and compose-mpi jobs)

What the ranks run is ``train_job()``: ``-m ddplab train`` with the experiment and its ``--set``
values. ``DDPLAB_SET`` is never put on a command line: every rank inherits it and config.load
applies it (file < DDPLAB_SET < --set), so a value is applied once, under every target.

One name per launcher: a study's ``launcher:`` and the run's ``ddplab.launcher`` tag name the
same target through ``by_name`` (the launch environment detect.py reads calls Open MPI's ranks
``openmpi``: ``DETECTED`` maps it). Stdlib only, like detect.py: no torch here.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

#: The target that starts ranks in a launch environment detect.py names (a run's ddplab.launcher
#: tag holds that name), where it is not torchrun: a reproduction on this host starts the same
#: kind of job (Slurm's, a PyTorchJob's, a PMI launcher's ranks are started again by torchrun).
DETECTED = {"openmpi": "mpirun"}

#: The variables an mpirun job forwards to its ranks besides the ones it names (mpirun passes
#: only what -x names).
RANK_VARIABLES = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI")


def train_job(experiment: str | Path, sets: Sequence[str] = (), *, module: str = "",
              extra: Sequence[str] = ()) -> list[str]:
    """What each rank runs, after ``python``: ``-m ddplab train EXPERIMENT [--set K=V ...]``
    (``-m MODULE`` for a packaged script), then ``extra`` (e.g. ``--summary-out P``,
    ``-- script args``)."""
    job = [*([str(experiment)] if experiment else []), *(["-m", module] if module else [])]
    return ["-m", "ddplab", "train", *job, *[x for s in sets for x in ("--set", s)], *extra]


def entry_point(job: Sequence[str]) -> list[str]:
    """``job`` run on another machine: ddplab's own entry point by the path it has here (the
    images install it alike) rather than this python, which a worker need not have."""
    if list(job[:2]) == ["-m", "ddplab"]:
        return [shutil.which("ddplab") or "ddplab", *job[2:]]
    return [sys.executable, *job]


@dataclass(frozen=True)
class Torchrun:
    """``ranks`` processes on this host, torchrun's standalone rendezvous."""

    ranks: int
    name: ClassVar[str] = "torchrun"

    def args(self, job: Sequence[str]) -> list[str]:
        """torchrun's own arguments (what ``torchrun`` is typed with; ddplab run passes them to
        torchrun's ``run`` in its own process)."""
        return ["--standalone", f"--nproc-per-node={self.ranks}", *job]

    def argv(self, job: Sequence[str]) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", *self.args(job)]


@dataclass(frozen=True)
class NodeTorchrun:
    """One node's ranks of a multi-node job that meet at a c10d rendezvous."""

    nnodes: int
    nproc_per_node: int
    endpoint: str
    rdzv_id: str
    is_host: bool
    join_timeout_s: float
    local_addr: str
    max_restarts: int = 0
    name: ClassVar[str] = "torchrun"

    def argv(self, job: Sequence[str]) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run",
                f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc_per_node}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={self.rdzv_id}", f"--rdzv-conf=is_host={str(self.is_host).lower()},"
                f"join_timeout={int(self.join_timeout_s)}",
                f"--local-addr={self.local_addr}", f"--max-restarts={self.max_restarts}", *job]


@dataclass(frozen=True)
class Mpirun:
    """``ranks`` processes on this host by Open MPI; the run, the rendezvous address and any
    tracking login are forwarded (mpirun passes a variable only when -x names it)."""

    ranks: int
    forward: Sequence[str] = ()
    name: ClassVar[str] = "mpirun"

    def argv(self, job: Sequence[str]) -> list[str]:
        names = [*RANK_VARIABLES, *self.forward, "MASTER_ADDR", "MASTER_PORT"]
        return ["mpirun", "-np", str(self.ranks), "--oversubscribe", "--bind-to", "none",
                *[x for n in names for x in ("-x", n)], sys.executable, *job]


@dataclass(frozen=True)
class MpirunHosts:
    """``slots`` ranks on each of ``hosts`` over ssh, Open MPI's own traffic pinned to
    ``network`` (the wrong-interface trap); rank 0's host is the rendezvous."""

    hosts: Sequence[str]
    slots: int
    ssh_options: Sequence[str]
    network: str
    master_port: int
    forward: Sequence[str] = ()
    name: ClassVar[str] = "mpirun"

    def argv(self, job: Sequence[str]) -> list[str]:
        return [
            "mpirun", "-np", str(len(self.hosts) * self.slots),
            "--host", ",".join(f"{h}:{self.slots}" for h in self.hosts),
            "--map-by", "slot", "--bind-to", "none",
            "--mca", "plm_rsh_agent", "ssh", "--mca", "plm_rsh_args", " ".join(self.ssh_options),
            # Only this launcher holds the key and known_hosts: no worker may ssh on (tree spawn).
            "--mca", "plm_rsh_no_tree_spawn", "1",
            "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", self.network,
            "--mca", "oob_tcp_if_include", self.network,
            "-x", f"MASTER_ADDR={self.hosts[0]}", "-x", f"MASTER_PORT={self.master_port}",
            *[x for n in self.forward for x in ("-x", n)],
            *entry_point(job),
        ]


@dataclass(frozen=True)
class Sbatch:
    """A Slurm batch job of ``nodes`` x ``ntasks_per_node``, waited for (--wait returns the
    job's code); the batch script takes the experiment and ``--set`` values."""

    nodes: int
    ntasks_per_node: int
    job_name: str
    script: Path
    name: ClassVar[str] = "slurm"

    def argv(self, experiment: str | Path, sets: Sequence[str]) -> list[str]:
        return ["sbatch", "--wait", f"--nodes={self.nodes}",
                f"--ntasks-per-node={self.ntasks_per_node}", f"--job-name={self.job_name}",
                str(self.script), str(experiment), *[x for s in sets for x in ("--set", s)]]


@dataclass(frozen=True)
class Compose:
    """compose's simulated nodes: ``file``'s services up, no dependencies (the caller's tracking
    server stands); the job's layout and overrides reach them through ``env``."""

    file: Path
    services: Sequence[str]
    exit_code_from: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    name: ClassVar[str] = "compose"

    def argv(self) -> list[str]:
        up = ["docker", "compose", "-f", str(self.file), "up", "--no-deps"]
        code = ["--exit-code-from", self.exit_code_from] if self.exit_code_from else []
        return [*up, *code, *self.services]


def local(launcher: str, ranks: int, forward: Sequence[str] = ()) -> Torchrun | Mpirun:
    """The target a study's or a reproduction's local job names (``torchrun`` or ``mpirun``),
    or the one a run's recorded launch environment was started by (``DETECTED``)."""
    kind = DETECTED.get(launcher, launcher)
    return Mpirun(ranks, tuple(forward)) if kind == "mpirun" else Torchrun(ranks)


#: torchrun's options typed after ``ddplab train`` (which runs inside a launcher, taking none of
#: them): the launcher that takes each, for the command line's one-line hint (cli.py).
MISPLACED_FOR_TRAIN: dict[str, str] = {
    "--nproc-per-node": "ddplab run --nproc-per-node N",
    "--nproc_per_node": "ddplab run --nproc-per-node N",
    "--nnodes": "ddplab launch --nnodes N",
    **{flag: f"torchrun {flag} ... -m ddplab train" for flag in (
        "--standalone", "--rdzv-endpoint", "--rdzv_endpoint", "--master-port", "--master_port",
        "--max-restarts", "--max_restarts")},
}
