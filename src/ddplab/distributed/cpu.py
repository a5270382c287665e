"""This node's CPU layout: how many cores each rank may use (affinity, cgroup quota, Slurm's
allocation, compose's simulated nodes), its threads and its pinned block. Oversubscription
ruins CPU DDP: two ranks' thread pools fighting for the same cores train slower than one rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ..config import DistConfig
from ..launchers import LaunchEnv


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def cpu_quota(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    """CPUs allowed by the cgroup v2 quota (``docker run --cpus``, Kubernetes limits), or None.

    A quota leaves every core in the affinity mask, so counting cores alone oversubscribes a
    container that may use one CPU's worth of time."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def usable_cpu_count() -> int:
    """Cores this process may use: its affinity, capped by the cgroup quota (at least 1)."""
    cores = len(usable_cores())
    quota = cpu_quota()
    return max(1, min(cores, int(quota))) if quota else cores


def nodes_on_host(env: Mapping[str, str]) -> int:
    """``DDPLAB_NODES_ON_HOST``: how many simulated nodes share this machine (1 when unset), or
    one ConfigError line (the checks step asks first)."""
    from ..config import ConfigError

    value = env.get("DDPLAB_NODES_ON_HOST", "")
    if not value:
        return 1
    if not (value.isascii() and value.isdigit() and 1 <= int(value) <= 4096):
        raise ConfigError(f"DDPLAB_NODES_ON_HOST: got {value!r}; a whole number from 1 to 4096 "
                          "(the nodes that share this machine's cores), or unset")
    return int(value)


def node_cpus(le: LaunchEnv, env: Mapping[str, str]) -> int:
    """CPUs the local ranks share: Slurm's allocation when srun started each rank (a site
    without Slurm's task affinity leaves every core in the mask), else what this process may
    use, split between the nodes that share this machine (``DDPLAB_NODES_ON_HOST``: the
    compose files simulate NNODES nodes on one host, and each container sees all its cores)."""
    cpus = max(1, usable_cpu_count() // nodes_on_host(env))
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if le.launcher == "slurm" and per_task.isdigit() and int(per_task) > 0:
        return min(cpus, int(per_task) * le.local_world_size)
    return cpus


def cores_per_rank(le: LaunchEnv, env: Mapping[str, str]) -> int:
    return max(1, node_cpus(le, env) // max(1, le.local_world_size))


def ccl_worker_count(env: Mapping[str, str]) -> int:
    try:
        return max(0, int(env.get("CCL_WORKER_COUNT", "1")))
    except ValueError:
        return 1


def threads_per_rank(cfg: DistConfig, local_world: int, n_cores: int, backend: str,
                     env: Mapping[str, str]) -> int:
    """auto: the cores of this node split between local ranks, minus oneCCL's worker threads."""
    if cfg.threads_per_rank != "auto":
        return int(cfg.threads_per_rank)
    share = max(1, n_cores // local_world)
    if backend == "ccl":
        # oneCCL's worker thread needs a core of its own, or it fights the compute threads.
        share = max(1, share - ccl_worker_count(env))
    return share


def core_block(cores: list[int], local_rank: int, local_world: int) -> list[int]:
    """This local rank's own contiguous block of cores (all cores when there are too few)."""
    size = len(cores) // local_world
    if size < 1:
        return cores
    return cores[local_rank * size:(local_rank + 1) * size]


def apply_cpu_layout(cfg: DistConfig, le: LaunchEnv, backend: str) -> tuple[int, list[int]]:
    cores = usable_cores()
    threads = threads_per_rank(cfg, le.local_world_size, node_cpus(le, os.environ), backend,
                               os.environ)
    pinned: list[int] = []
    if cfg.pin_cores:
        pinned = core_block(cores, le.local_rank, le.local_world_size)
        os.sched_setaffinity(0, pinned)
    torch.set_num_threads(threads)
    # Loader workers and libraries started later read these.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads, pinned
