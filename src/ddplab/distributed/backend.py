"""Backend resolution, CPU thread layout, oneCCL environment, process group up and down.

``auto`` = nccl on CUDA, ccl on CPU when oneCCL is usable, else gloo. ``ccl`` is Intel's
``oneccl_bindings_for_pytorch`` when they import, else ddplab's own backend (``make setup-ccl``,
:mod:`ddplab.ccl`); the run records which (``ddplab.ccl_impl``).
An explicit backend that is missing fails, unless ``dist.allow_backend_fallback`` is true:
then gloo runs with a warning. The choice and its reason are recorded in the run
(``ddplab.backend``, ``ddplab.backend_requested``, ``ddplab.backend_reason``).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import json
import os
import socket
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..config import DistConfig
from ..errors import DdplabError
from ..launchers import LaunchEnv

T = TypeVar("T")


class BackendError(DdplabError, RuntimeError):
    """The requested backend cannot run here."""


@dataclass(frozen=True)
class BackendChoice:
    name: str
    requested: str
    reason: str
    fell_back: bool = False


@dataclass
class Layout:
    """What the launch steps decided, before any data or model exists."""

    le: LaunchEnv
    device: torch.device
    choice: BackendChoice
    threads: int
    pinned: list[int]
    ccl_env: dict[str, str]
    ccl_impl: str | None = None
    store: dist.Store | None = None  # the rendezvous store, when the backend was agreed on it


def plan_layout(cfg: DistConfig, le: LaunchEnv) -> Layout:
    """Device, backend (with its recorded reason), oneCCL variables, CPU threads and pinning."""
    device = resolve_device(cfg.device, le.local_rank)
    impl = import_ccl() if device.type == "cpu" else None
    choice = resolve(cfg.backend, device.type, cfg.allow_backend_fallback,
                     cores_per_rank=cores_per_rank(le, os.environ),
                     ccl_impl=impl.name if impl else None, world_size=le.world_size)
    store = None
    if cfg.backend == "auto" and device.type == "cpu" and le.nnodes > 1:
        store = rendezvous_store(le, cfg.timeout_s)  # the process group's own, made early
        try:
            choice = agree(choice, le, store)
        except RuntimeError as e:  # DistStoreError: a rank never voted within dist.timeout_s
            raise BackendError(_init_failure(e, le, cfg.timeout_s)) from None
    if choice.fell_back:
        import warnings

        warnings.warn(choice.reason, stacklevel=2)
    impl = impl if choice.name == "ccl" else None
    ccl_env = apply_ccl_env(le, os.environ, impl) if impl else {}
    threads = torch.get_num_threads()
    pinned: list[int] = []
    if device.type == "cpu":
        threads, pinned = apply_cpu_layout(cfg, le, choice.name)
    else:
        torch.cuda.set_device(device)
    return Layout(le, device, choice, threads, pinned, ccl_env, impl.name if impl else None,
                  store)


@dataclass(frozen=True)
class CclImpl:
    """Which oneCCL backend registers ``ccl``: "intel-bindings", "ddplab", or None (neither)."""

    name: str | None
    why: str
    pkg_dir: str | None = None  # the bindings' own directory (their libfabric lives there)


def import_ccl() -> CclImpl:
    """Register ``ccl``: Intel's bindings when they import, else ddplab's own build; never raises.

    The bindings refuse a torch of another version in many ways (ImportError, OSError for
    an ABI mismatch, AttributeError), so anything that goes wrong means "not available".
    """
    try:
        module = importlib.import_module("oneccl_bindings_for_pytorch")
        return CclImpl("intel-bindings", f"Intel's bindings {_version(module)}",
                       getattr(module, "cwd", None))
    except Exception as e:  # noqa: BLE001 - see docstring
        intel = f"oneccl_bindings_for_pytorch does not import ({type(e).__name__}: {e})"
    from .. import ccl

    ok, why = ccl.register()
    return CclImpl("ddplab", why) if ok else CclImpl(None, f"{why}; {intel}")


def available(device_type: str) -> dict[str, tuple[bool, str]]:
    """Each backend -> (usable here, why). ccl is imported as a side effect when present."""
    ccl = import_ccl()
    cuda = device_type == "cuda"
    return {
        "gloo": (dist.is_gloo_available(), "built into torch"),
        "nccl": (cuda and dist.is_nccl_available(),
                 "needs a CUDA device and torch built with NCCL" if not cuda
                 else ("built into torch" if dist.is_nccl_available() else "torch lacks NCCL")),
        "ccl": (ccl.name is not None, ccl.why),
        "mpi": (dist.is_mpi_available(), "torch built with MPI" if dist.is_mpi_available()
                else "this torch build has no MPI backend (build torch from source with MPI)"),
    }


def _version(module: ModuleType) -> str:
    return str(getattr(module, "__version__", "unknown"))


def resolve(requested: str, device_type: str, allow_fallback: bool,
            table: Mapping[str, tuple[bool, str]] | None = None,
            cores_per_rank: int | None = None, ccl_impl: str | None = None,
            world_size: int = 2) -> BackendChoice:
    """``auto`` on CPU takes ccl (Intel's bindings, else ddplab's own build) only where it is
    known to win: several ranks, each with a core for oneCCL's worker thread besides its compute
    (``cores_per_rank``, None: enough). Without one, Intel's trained at 0.79x gloo, and
    ddplab's at 0.32x on 2 nodes x 2 ranks sharing 2 cores (docs/results/ccl-nodes.md); one
    node's 2 ranks on 2 cores still beat gloo (docs/results/ccl-one-node.md), but the rule stays
    the one that holds across nodes. On several nodes every rank must run the same backend:
    see :func:`agree`."""
    table = table if table is not None else available(device_type)
    if requested == "auto":
        return _auto(device_type, table, cores_per_rank, ccl_impl, world_size)
    ok, why = table[requested]
    if requested == "nccl" and device_type != "cuda":
        ok, why = False, "nccl needs dist.device cuda"
    if ok:
        return BackendChoice(requested, requested, f"requested; {why}")
    if allow_fallback:
        return BackendChoice("gloo", requested, f"fallback to gloo: {requested} unavailable ({why})",
                             fell_back=True)
    hint = (" Run 'make setup-ccl' (docs/launchers-and-backends.md) or set dist.allow_backend_fallback=true"
            if requested == "ccl" else " Set dist.allow_backend_fallback=true to use gloo instead")
    raise BackendError(f"dist.backend: {requested!r} is not available: {why}.{hint}")


def _auto(device_type: str, table: Mapping[str, tuple[bool, str]], cores_per_rank: int | None,
          ccl_impl: str | None, world_size: int) -> BackendChoice:
    if device_type == "cuda" and table["nccl"][0]:
        return BackendChoice("nccl", "auto", "auto: CUDA device, NCCL available")
    if device_type == "cuda":
        return BackendChoice("gloo", "auto", f"auto: gloo, because {table['nccl'][1]}")
    if not table["ccl"][0]:
        return BackendChoice("gloo", "auto", f"auto: gloo, because {table['ccl'][1]}")
    if world_size < 2:
        return BackendChoice("gloo", "auto", "auto: gloo, because one rank exchanges nothing and "
                             "oneCCL's worker thread would take a core from the compute")
    if cores_per_rank is not None and cores_per_rank < 2:
        return BackendChoice("gloo", "auto", f"auto: gloo, because each rank has {cores_per_rank} "
                             "core(s) and oneCCL's worker thread needs one of its own "
                             "(set dist.backend=ccl to use it anyway)")
    which = "ddplab's own oneCCL backend" if ccl_impl == "ddplab" else table["ccl"][1]
    cores = f"{cores_per_rank} cores" if cores_per_rank is not None else "enough cores"
    return BackendChoice("ccl", "auto", f"auto: ccl on CPU ({which}), each rank has {cores}: "
                         "one for oneCCL's worker thread")


def agree(choice: BackendChoice, le: LaunchEnv, store: dist.Store) -> BackendChoice:
    """On several nodes each rank chose ``auto``'s backend from its own node (its cores, its
    build); ranks on different backends would wait for each other until dist.timeout_s. So ccl
    runs only if every rank chose it; otherwise every rank runs gloo and says which rank did."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job votes anew
    keys = [f"ddplab/auto-backend/{attempt}/{r}" for r in range(le.world_size)]
    store.set(keys[le.rank], json.dumps([choice.name, choice.reason, socket.gethostname()]))
    store.wait(keys)
    if choice.name != "ccl":
        return choice
    for rank, key in enumerate(keys):
        name, reason, host = json.loads(store.get(key))
        if name != "ccl":
            return BackendChoice("gloo", "auto", f"auto: gloo on every rank, because rank {rank} "
                                 f"(host {host}) chose it: {reason.removeprefix('auto: ')}")
    return BackendChoice("ccl", "auto", f"{choice.reason}; all {le.world_size} ranks agree")


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise BackendError("dist.device: 'cuda' requested but torch sees no CUDA device")
    n = torch.cuda.device_count()
    if local_rank >= n:
        raise BackendError(f"local rank {local_rank} has no GPU: only {n} visible")
    return torch.device("cuda", local_rank)


# ---- CPU threads and cores: oversubscription ruins CPU DDP ----

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


# ---- oneCCL environment ----

def ccl_env_defaults(le: LaunchEnv, pkg_dir: str | None, env: Mapping[str, str]) -> dict[str, str]:
    """The oneCCL variables ddplab sets when the user has not (oneCCL's
    "Environment Variables" reference, oneapi-src.github.io/oneCCL/env-variables.html)."""
    out = {
        # Also under Open MPI, which the bindings may mistake for an Intel MPI launch.
        "CCL_ATL_TRANSPORT": "ofi",
        "CCL_WORKER_COUNT": "1",
        "CCL_ATL_SHM": "1",
        # ddplab starts the ranks; oneCCL must not look for an MPI/PMI launcher of its own.
        "CCL_PROCESS_LAUNCHER": "none",
        # oneCCL's count of the ranks on this host (with launcher none it cannot find out).
        # On several nodes with several ranks each, the true count makes its collectives over
        # tcp crawl, then hang (2 containers x 2 ranks: a 64 KB broadcast 350 ms, 1 MB never
        # done; CCL_ATL_SHM=0 the same), while telling each rank it is alone on its host runs
        # them (1 MB in 46 ms); libfabric still finds the ranks of a host by hostname.
        # (docs/launchers-and-backends.md, "ccl on several nodes"; tests/test_ccl.py)
        "CCL_LOCAL_RANK": str(le.local_rank) if le.nnodes == 1 else "0",
        "CCL_LOCAL_SIZE": str(le.local_world_size) if le.nnodes == 1 else "1",
        # oneCCL warns about every variable set (and that OpenMP collectives need MPI): noise.
        "CCL_LOG_LEVEL": "error",
    }
    if le.nnodes > 1:
        out["FI_PROVIDER"] = "tcp"
    if pkg_dir:
        # Without the package's own libfabric the first collective fails with "could not
        # initialize any transport library" unless setvars.sh was sourced.
        lib = Path(pkg_dir, "opt", "mpi", "libfabric", "lib")
        if (lib / "libfabric.so").exists():
            out["FI_PROVIDER_PATH"] = str(lib / "prov")
            out["CCL_OFI_LIBRARY_PATH"] = str(lib / "libfabric.so")
    return {k: v for k, v in out.items() if k not in env}


def apply_ccl_env(le: LaunchEnv, env: MutableMapping[str, str], impl: CclImpl) -> dict[str, str]:
    defaults = ccl_env_defaults(le, impl.pkg_dir, env)
    env.update(defaults)
    return defaults


# ---- the process group ----

def init_process_group(choice: BackendChoice, le: LaunchEnv, device: torch.device,
                       timeout_s: int, store: dist.Store | None = None) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    if choice.name == "mpi":
        dist.init_process_group("mpi", timeout=timeout)  # MPI knows rank and size itself
        return
    if le.launcher == "none":
        # A single process needs no rendezvous: an in-memory store avoids picking a port.
        dist.init_process_group(choice.name, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    store = store or rendezvous_store(le, timeout_s)
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    try:
        dist.init_process_group(choice.name, store=store, rank=le.rank, world_size=le.world_size,
                                timeout=timeout, **kwargs)
    except RuntimeError as e:  # oneCCL's transport, a peer gone during the backend's set-up
        raise BackendError(_init_failure(e, le, timeout_s)) from None


def rendezvous_store(le: LaunchEnv, timeout_s: int) -> dist.Store:
    """The store of ``env://``, as init_process_group would make it: torchrun's agent store
    when there is one; other launchers get the same variables from LaunchEnv, so every launcher
    takes the one path."""
    for key, value in (("MASTER_ADDR", le.master_addr), ("MASTER_PORT", str(le.master_port)),
                       ("RANK", str(le.rank)), ("WORLD_SIZE", str(le.world_size)),
                       ("LOCAL_RANK", str(le.local_rank))):
        os.environ.setdefault(key, value)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store, _, _ = next(dist.rendezvous("env://", le.rank, le.world_size, timeout=timeout))
    except RuntimeError as e:  # DistStoreError, DistNetworkError: a peer or the master is missing
        raise BackendError(_init_failure(e, le, timeout_s)) from None
    store.set_timeout(timeout)
    return store


def _init_failure(e: RuntimeError, le: LaunchEnv, timeout_s: int) -> str:
    """One line: why this rank's process group did not start."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    if first.startswith("oneCCL:"):
        # ddplab's ccl failed in oneCCL itself (its transport, say), within seconds: no peer is
        # missing, so the waiting message below would send the user looking in the wrong place.
        return (f"rank {le.rank} of {le.world_size}: the ccl backend did not start ({first}); "
                "`ddplab doctor` shows oneCCL's transport and provider; dist.backend=gloo "
                "avoids oneCCL")
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    whom = (f"the other {le.world_size - 1} rank(s) to join its store at {where}" if le.is_rank0
            else f"rank 0's store at {where} (MASTER_ADDR:MASTER_PORT) and the other ranks")
    return (f"rank {le.rank} of {le.world_size} waited {timeout_s}s (dist.timeout_s) for {whom}; "
            f"they never came ({type(e).__name__}: {first})")


@contextlib.contextmanager
def process_group(layout: Layout, timeout_s: int) -> Iterator[None]:
    init_process_group(layout.choice, layout.le, layout.device, timeout_s, layout.store)
    try:
        yield
    finally:
        destroy_process_group()


def finish_together() -> None:
    """The last collective of a job: every rank waits here until all are done."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def destroy_process_group() -> None:
    """Collect what may still hold collectives (DDP's reducer, its buckets) first."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


class Rank0Error(DdplabError, RuntimeError):
    """Raised on the other ranks when a rank-0-only step failed there."""


def share_from_rank0(produce: Callable[[], T], is_rank0: bool, world_size: int) -> T:
    """Collective: run ``produce`` on global rank 0 only and give its (picklable) result to
    every rank. A failure on rank 0 reaches every rank, so none waits in the next collective."""
    message: list[Any] = [None, None]
    error: Exception | None = None
    if is_rank0:
        try:
            message = [produce(), None]
        except Exception as e:  # noqa: BLE001 - sent to the other ranks, then re-raised
            error, message = e, [None, f"{type(e).__name__}: {e}"]
    if world_size > 1:
        dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[1]:
        raise Rank0Error(f"rank 0 failed: {message[1]}")
    return message[0]
