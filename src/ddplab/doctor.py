"""``ddplab doctor``: preflight checks, printed as a report; exit 1 when any would break or
slow a run, with a one-line reason for each.

    ddplab doctor                                   # this process, default settings
    ddplab doctor experiments/quickstart.yaml       # against an experiment's settings
    torchrun --nproc-per-node 2 -m ddplab doctor    # what each rank of a launch sees
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from .config import ExperimentConfig, load
from .launchers import LaunchEnv, LaunchError

SHM_MIN_BYTES = 256 * 2**20


def shm_needed(cfg: ExperimentConfig, local_world: int) -> int:
    """A generous bound on /dev/shm for the loader workers of every rank on this node."""
    if cfg.data.num_workers == 0:
        return 0
    d = cfg.data
    sample = 4 * (3 if d.dataset == "cifar10" else d.channels) * (
        32 if d.dataset == "cifar10" else d.image_size) ** 2
    # Each worker keeps prefetch_factor (2) batches in flight; x4 for collation copies.
    per_rank = d.num_workers * 2 * d.batch_size * sample * 4
    return max(SHM_MIN_BYTES, local_world * per_rank)


def oversubscription(threads: int, local_world: int, cores: int, ccl_workers: int) -> str | None:
    used = local_world * (threads + ccl_workers)
    if used > cores:
        return (f"threads oversubscribed: {local_world} local rank(s) x ({threads} compute + "
                f"{ccl_workers} oneCCL worker) threads = {used} > {cores} usable cores; lower "
                "dist.threads_per_rank or the ranks per node")
    return None


def ssh_hosts(env: Mapping[str, str]) -> list[str]:
    """The hosts mpirun will ssh to: $DDPLAB_SSH_HOSTS (a,b,c), else the hostfile Open MPI reads
    ($OMPI_MCA_orte_default_hostfile; the MPI operator mounts /etc/mpi/hostfile)."""
    if env.get("DDPLAB_SSH_HOSTS"):
        return [h.split(":")[0] for h in env["DDPLAB_SSH_HOSTS"].split(",") if h.strip()]
    hostfile = Path(env.get("OMPI_MCA_orte_default_hostfile") or "/etc/mpi/hostfile")
    if not hostfile.is_file():
        return []
    from .launchers.mpi import read_hostfile

    return [host for host, _ in read_hostfile(hostfile)]


def ssh_options(hosts: list[str], env: Mapping[str, str]) -> list[str]:
    """The ssh options mpirun will use: under the MPI operator ($DDPLAB_SSH_AUTH, its
    sshAuthMountPath) those of ``ddplab mpi launch``, else $OMPI_MCA_plm_rsh_args."""
    import shlex

    if env.get("DDPLAB_SSH_AUTH"):
        from .launchers.mpi import operator_ssh_options

        return operator_ssh_options(Path(env["DDPLAB_SSH_AUTH"]), hosts,
                                    int(env.get("DDPLAB_SSH_PORT", "2222")), env)
    return shlex.split(env.get("OMPI_MCA_plm_rsh_args", ""))


def ssh_problem(host: str, options: list[str]) -> str | None:
    """None when `ssh host true` works with the options mpirun would use, else why not."""
    import subprocess

    cmd = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", *options, host, "true"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"ssh to {host}: {e}"
    if out.returncode:
        lines = out.stderr.strip().splitlines() or [f"exit code {out.returncode}"]
        return f"ssh to {host} fails: {lines[-1]}"
    return None


def _layout(env: Mapping[str, str], problems: list[str]) -> LaunchEnv | None:
    try:
        le = LaunchEnv.from_environ(env)
    except LaunchError as e:
        problems.append(f"launcher: {e}")
        return None
    print(f"launcher     {le.launcher}: rank {le.rank}/{le.world_size}, local rank "
          f"{le.local_rank}/{le.local_world_size}, node {le.node_rank}/{le.nnodes}, master "
          f"{le.master_addr}:{le.master_port}")
    return le


def ccl_transport(le: LaunchEnv, env: Mapping[str, str]) -> str:
    """The oneCCL transport a run would use: the user's variables over ddplab's defaults."""
    from . import ccl
    from .distributed.choice import import_ccl
    from .distributed.oneccl import ccl_env_defaults

    impl = import_ccl()
    merged = {**ccl_env_defaults(le, impl.pkg_dir, env), **env}
    transport = merged.get("CCL_ATL_TRANSPORT", "ofi")
    if transport != "ofi":
        return f"{impl.name}, transport {transport} (CCL_ATL_TRANSPORT)"
    fabric = merged.get("CCL_OFI_LIBRARY_PATH") or ccl.libfabric() or "libfabric.so.1 NOT FOUND"
    provider = merged.get("FI_PROVIDER", "libfabric's choice")
    return f"{impl.name}, transport ofi over {fabric}, provider {provider}"


def _check_shm(cfg: ExperimentConfig, le: LaunchEnv, problems: list[str]) -> None:
    from . import ccl

    shm = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").exists() else 0
    need = shm_needed(cfg, le.local_world_size)
    print(f"/dev/shm     {shm / 2**20:.0f} MiB (loader workers need about {need / 2**20:.0f} MiB)")
    if shm < need:
        problems.append(f"/dev/shm is {shm / 2**20:.0f} MiB but {cfg.data.num_workers} loader "
                        f"worker(s) x {le.local_world_size} rank(s) need about {need / 2**20:.0f} "
                        "MiB: raise it (docker --shm-size 2g, compose shm_size) or set "
                        "data.num_workers=0")
    stale, used = ccl.stale_shm()
    if stale:
        print(f"warning      /dev/shm holds {stale} oneCCL shm region(s) of ranks that are gone "
              f"({used / 2**20:.0f} MiB of RAM): remove them (docs/troubleshooting.md)")


def doctor(experiment: str | None, overrides: list[str]) -> int:
    from . import tracking
    from .distributed import cpu as cpu_layout
    from .distributed.choice import BackendError, available, import_ccl, resolve
    from .tracking import capsule

    cfg = load(experiment, overrides)
    problems: list[str] = []
    v = capsule.versions()
    print("versions     " + ", ".join(f"{k} {val}" for k, val in v.items()))
    le = _layout(os.environ, problems) or LaunchEnv.from_environ({})

    import torch

    device = "cuda" if torch.cuda.is_available() and cfg.dist.device != "cpu" else "cpu"
    table = available(device)
    for name, (ok, why) in table.items():
        print(f"backend      {name:5s} {'yes' if ok else 'no '}  {why}")
    try:
        choice = resolve(cfg.dist.backend, device, cfg.dist.allow_backend_fallback, table,
                         cpu_layout.cores_per_rank(le, os.environ), import_ccl().name,
                         le.world_size)
        agreed = (" (on several nodes: ccl only if every node chooses it)"
                  if cfg.dist.backend == "auto" and le.nnodes > 1 and device == "cpu" else "")
        print(f"backend      -> {choice.name} ({choice.reason}){agreed}")
    except BackendError as e:
        choice = None
        problems.append(str(e))

    cores = cpu_layout.usable_cpu_count()
    ccl = choice is not None and choice.name == "ccl"
    if ccl:
        print("ccl          " + ccl_transport(le, os.environ))
    threads = cpu_layout.threads_per_rank(cfg.dist, le.local_world_size, cores,
                                          choice.name if choice else "gloo", os.environ)
    workers = cpu_layout.ccl_worker_count(os.environ) if ccl else 0
    quota = cpu_layout.cpu_quota()
    print(f"cpu          {capsule.cpu_model()}; {cores} usable cores "
          f"({'cgroup quota ' + format(quota, '.2f') if quota else 'no cgroup quota'}), "
          f"{os.cpu_count()} logical; "
          f"{threads} thread(s) per rank x {le.local_world_size} local rank(s)")
    over = oversubscription(threads, le.local_world_size, cores, workers)
    if over:
        problems.append(over)
    if ccl and import_ccl().name == "intel-bindings" and cores // le.local_world_size < 2:
        print("warning      oneCCL's worker thread needs a core of its own: with fewer than 2 "
              "cores per rank Intel's ccl is slower than gloo here")

    _check_shm(cfg, le, problems)

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    print(f"cuda         {len(gpus)} device(s){': ' + ', '.join(gpus) if gpus else ''}")
    print(f"peak         {_peak(device)}")

    try:
        hosts = ssh_hosts(os.environ)
        options = ssh_options(hosts, os.environ) if hosts else []
    except LaunchError as e:
        hosts = []
        problems.append(f"ssh: {e}")
    for host in hosts:
        reason = ssh_problem(host, options)
        print(f"ssh          {host}: {'reachable' if reason is None else reason}")
        if reason:
            problems.append(reason)
    if not hosts:
        print("ssh          no MPI hosts configured (DDPLAB_SSH_HOSTS or a hostfile)")

    if cfg.tracking.enabled:
        uri = tracking.resolve_uri(cfg.tracking)
        reason = tracking.check_reachable(uri)
        print(f"mlflow       {uri}: {'answers' if reason is None else reason}")
        if reason:
            problems.append(reason)

    _train_checks(cfg, le, experiment, problems)
    for p in problems:
        print(f"problem: {p}")
    print("doctor: ok" if not problems else f"doctor: {len(problems)} problem(s)")
    return 1 if problems else 0


def _peak(device: str) -> str:
    """What perf/mfu divides by on this machine: a GPU's datasheet figure beside a measured
    matmul (a large gap: clocks held down, or another job on the GPU); on CPU, measured."""
    import torch

    from .training import mfu

    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        got = [f"{p} matmul measured {mfu.measure_matmul(torch.device('cuda', 0), t) / 1e12:,.0f}"
               for p, t in (("bf16", torch.bfloat16), ("fp32", torch.float32))]
        table = [f"{p} {mfu.table_peak(name, p == 'bf16') / 1e12:,.0f}" for p in ("bf16", "fp32")]
        known = "datasheet (dense) " + ", ".join(table) if mfu.table_peak(name, True) else \
            "not in ddplab's table: perf/mfu uses the measured figure"
        return f"{name}: {known}; {', '.join(got)} TFLOP/s"
    per = mfu.measure_matmul(torch.device("cpu"), torch.float32)
    return (f"cpu fp32 matmul measured {per / 1e9:,.0f} GFLOP/s with {torch.get_num_threads()} "
            "thread(s) (each rank measures its own at the start of a job, for perf/mfu)")


def _train_checks(cfg: ExperimentConfig, le: LaunchEnv, experiment: str | None,
                  problems: list[str]) -> None:
    """The checks `ddplab train` runs before its process group (config x this machine, the
    data, the user's parts, paths, the tracking server's credentials): what train would refuse,
    doctor reports."""
    import torch

    from .config import ConfigError
    from .training import checks

    try:
        checks.before_start(cfg, le, "", torch.cuda.is_available(), experiment)
        print("train checks ok (the config against this machine, data, parts, paths)")
    except ConfigError as e:
        print(f"train checks {e}")
        problems.append(str(e))
