"""Which process am I? One pure function from the environment to the rank layout.

``LaunchEnv.from_environ(os.environ)`` recognises, in this order (the first whose variables
are present wins, because outer launchers leave theirs behind for inner ones):

- torchrun (``TORCHELASTIC_RUN_ID`` or ``LOCAL_RANK`` with RANK/WORLD_SIZE)
- Kubeflow PyTorchJob pod started without torchrun (``PET_NNODES``/``PET_NODE_RANK`` + RANK)
- Open MPI ``mpirun`` (``OMPI_COMM_WORLD_*``)
- Intel MPI / MPICH hydra (``PMI_RANK``/``PMI_SIZE``)
- Slurm ``srun`` (``SLURM_PROCID``/``SLURM_NTASKS``)
- none: one process, world size 1.

It reads, never writes: no side effects, so it is tested with tables of real launcher
environments (tests/test_launch.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import BadInput

DEFAULT_MASTER_PORT = 29500


class LaunchError(BadInput, ValueError):
    """Incomplete or contradictory launcher variables."""


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def nnodes(self) -> int:
        """Nodes in the job, assuming the same number of ranks on each (what every launcher here does)."""
        return max(1, -(-self.world_size // self.local_world_size))

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def is_node_leader(self) -> bool:
        """Local rank 0: the one process per node that does per-node work (system metrics)."""
        return self.local_rank == 0

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> LaunchEnv:
        _refuse_partial_env(env)
        for detect in (_torchrun, _pytorchjob, _openmpi, _pmi, _slurm):
            found = detect(env)
            if found is not None:
                _refuse_contradiction(found, env)
                return _check(found)
        return cls("none", 0, 1, 0, 1, 0, "127.0.0.1", DEFAULT_MASTER_PORT)


ENV_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
OTHER_RANK_VARS = {"OMPI_COMM_WORLD_RANK": "OMPI_COMM_WORLD_SIZE", "PMI_RANK": "PMI_SIZE",
                   "SLURM_PROCID": "SLURM_NTASKS"}


def _refuse_partial_env(env: Mapping[str, str]) -> None:
    """RANK/WORLD_SIZE/LOCAL_RANK come as a set (torchrun and env:// launchers set all three).
    Part of the set, with no torchrun agent and no Kubeflow pod around it, is a mistake that
    would otherwise train silently as a single process."""
    if "TORCHELASTIC_RUN_ID" in env or "PET_NNODES" in env or "PET_NODE_RANK" in env:
        return
    present = [v for v in ENV_RANK_VARS if v in env]
    if present and len(present) < len(ENV_RANK_VARS) and not any(v in env for v in OTHER_RANK_VARS):
        missing = [v for v in ENV_RANK_VARS if v not in env]
        shown = ", ".join(f"{v}={env[v]}" for v in present)
        raise LaunchError(f"{shown} set but {' and '.join(missing)} not: set all of "
                          f"{', '.join(ENV_RANK_VARS)} (or start the job with torchrun)")


def _refuse_contradiction(found: LaunchEnv, env: Mapping[str, str]) -> None:
    """An MPI or Slurm launch whose RANK/WORLD_SIZE say something else (a leftover export).
    torchrun inside mpirun or srun is fine: its own variables win, as they should."""
    if found.launcher in ("torchrun", "pytorchjob"):
        return
    for name, value in (("RANK", found.rank), ("WORLD_SIZE", found.world_size)):
        if name in env and env[name] != str(value):
            raise LaunchError(f"{found.launcher} gives {name.lower().replace('_', ' ')} {value} but "
                              f"{name}={env[name]} is also set: unset {name}, or launch with one launcher")


def _int(env: Mapping[str, str], name: str) -> int:
    if name not in env:
        raise LaunchError(f"{name} is not set, but other launcher variables are")
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r} is not an integer") from None


def _positive(env: Mapping[str, str], name: str) -> int:
    """A count that divides: zero or less is an error here, not a ZeroDivisionError later."""
    value = _int(env, name)
    if value < 1:
        raise LaunchError(f"{name}={env[name]!r} must be >= 1")
    return value


def _master(env: Mapping[str, str], launcher: str, local_world: int, world: int) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR", "")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
    if not addr:
        if local_world < world:
            raise LaunchError(
                f"{launcher}: MASTER_ADDR is not set and the job spans several nodes; pass it "
                "to every rank (mpirun -x MASTER_ADDR -x MASTER_PORT, or export it)"
            )
        addr = "127.0.0.1"  # every rank is on this node
    return addr, port


def _torchrun(env: Mapping[str, str]) -> LaunchEnv | None:
    if "TORCHELASTIC_RUN_ID" not in env and "LOCAL_RANK" not in env:
        return None
    world = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    addr, port = _master(env, "torchrun", local_world, world)
    return LaunchEnv("torchrun", _int(env, "RANK"), world, _int(env, "LOCAL_RANK"), local_world,
                     _int(env, "GROUP_RANK") if "GROUP_RANK" in env else 0, addr, port)


def _pytorchjob(env: Mapping[str, str]) -> LaunchEnv | None:
    # The operator sets RANK = pod index and WORLD_SIZE = replicas x nprocPerNode; each pod is
    # one process only when nprocPerNode is 1 (otherwise torchrun must start the ranks).
    if "PET_NNODES" not in env and "PET_NODE_RANK" not in env:
        return None
    nproc = env.get("PET_NPROC_PER_NODE", "1")
    if nproc not in ("1", "auto", "cpu"):
        raise LaunchError(
            f"PyTorchJob pod with PET_NPROC_PER_NODE={nproc}: start ddplab through torchrun "
            "(`torchrun -m ddplab train ...`) so that each pod runs its local ranks"
        )
    world = _int(env, "WORLD_SIZE")
    addr, port = _master(env, "pytorchjob", 1, world)
    rank = _int(env, "RANK")
    return LaunchEnv("pytorchjob", rank, world, 0, 1, rank, addr, port)


def _openmpi(env: Mapping[str, str]) -> LaunchEnv | None:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    local_world = _positive(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    # OMPI_COMM_WORLD_NODE_RANK is the rank on the node across *all* jobs, not a node index;
    # mpirun's default by-slot mapping fills nodes in order, so the node is rank // local size.
    addr, port = _master(env, "openmpi", local_world, world)
    return LaunchEnv("openmpi", rank, world, _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), local_world,
                     rank // local_world, addr, port)


def _pmi(env: Mapping[str, str]) -> LaunchEnv | None:
    if "PMI_RANK" not in env:
        return None
    rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
    local_world = _positive(env, "MPI_LOCALNRANKS") if "MPI_LOCALNRANKS" in env else max(world, 1)
    local_rank = _int(env, "MPI_LOCALRANKID") if "MPI_LOCALRANKID" in env else rank
    addr, port = _master(env, "pmi", local_world, world)
    return LaunchEnv("pmi", rank, world, local_rank, local_world, rank // local_world, addr, port)


def _slurm_tasks_on_node(env: Mapping[str, str]) -> int:
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    # SLURM_TASKS_PER_NODE looks like "2(x3),1": expand, then take this node's entry.
    spec = env.get("SLURM_TASKS_PER_NODE", "")
    counts: list[int] = []
    for count, reps in re.findall(r"(\d+)(?:\(x(\d+)\))?", spec):
        counts += [int(count)] * int(reps or 1)
    node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    if node < len(counts):
        return counts[node]
    return _int(env, "SLURM_NTASKS")  # a single-node step


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: "node[07-09,12],gpu1" -> "node07"."""
    item = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist.strip())
    if not item:
        raise LaunchError(f"SLURM_JOB_NODELIST={nodelist!r} is not a Slurm hostlist")
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], item.group(0))


def slurm_master(env: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR and MASTER_PORT from the allocation, where the user set neither: the first
    node of the step (or job), and a port from the job id, so two jobs sharing a node do not
    collide (the convention of Lightning's and torchtitan's Slurm support)."""
    out = {}
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    if "MASTER_ADDR" not in env and nodelist:
        out["MASTER_ADDR"] = first_host(nodelist)
    if "MASTER_PORT" not in env and env.get("SLURM_JOB_ID", "").isdigit():
        out["MASTER_PORT"] = str(20000 + int(env["SLURM_JOB_ID"]) % 20000)
    return out


def _slurm(env: Mapping[str, str]) -> LaunchEnv | None:
    # sbatch alone sets SLURM_JOB_ID but not SLURM_PROCID: only srun-started tasks count.
    if "SLURM_PROCID" not in env:
        return None
    world = _int(env, "SLURM_NTASKS")
    local_world = _slurm_tasks_on_node(env)
    addr, port = _master({**env, **slurm_master(env)}, "slurm", local_world, world)
    node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    return LaunchEnv("slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID"),
                     local_world, node, addr, port)


def _check(le: LaunchEnv) -> LaunchEnv:
    problems = []
    if le.world_size < 1:
        problems.append(f"world size {le.world_size} < 1")
    if not 0 <= le.rank < le.world_size:
        problems.append(f"rank {le.rank} is outside 0..{le.world_size - 1}")
    if le.local_world_size < 1 or le.local_world_size > le.world_size:
        problems.append(f"local world size {le.local_world_size} is outside 1..{le.world_size}")
    if not 0 <= le.local_rank < le.local_world_size:
        problems.append(f"local rank {le.local_rank} is outside 0..{le.local_world_size - 1}")
    if not 0 < le.master_port < 65536:
        problems.append(f"MASTER_PORT {le.master_port} is not a TCP port")
    if problems:
        raise LaunchError(f"{le.launcher} variables are contradictory: " + "; ".join(problems))
    return le
