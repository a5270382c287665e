"""The reproducibility capsule: versions, build config, launcher variables, hardware.

Logged as ``environment.json`` in every run; ``ddplab doctor`` prints the same facts.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..distributed.host import cpu_model  # also read as capsule.cpu_model (doctor)
from . import schema

ENV_PREFIXES = ("CCL_", "NCCL_", "GLOO_", "OMP_", "KMP_", "MASTER_", "FI_", "I_MPI_", "PET_",
                "TORCHELASTIC_", "OMPI_COMM_WORLD_", "SLURM_", "PMI_", "MLFLOW_TRACKING_URI",
                "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "DDPLAB_")
DISTRIBUTIONS = {"torch": "torch", "torchvision": "torchvision", "mlflow": "mlflow",
                 "ipex": "intel-extension-for-pytorch", "oneccl_bindings": "oneccl-bind-pt",
                 "psutil": "psutil", "pyyaml": "PyYAML", "ddplab": "ddplab"}


def versions() -> dict[str, str]:
    """Installed versions by distribution metadata: no import, so a broken IPEX cannot crash it."""
    out = {"python": platform.python_version()}
    for key, dist in DISTRIBUTIONS.items():
        try:
            out[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[key] = "absent"
    out["ddplab_ccl"] = _ddplab_ccl()
    return out


def _ddplab_ccl() -> str:
    """ddplab's own oneCCL backend as built (by make setup-ccl), from its build record."""
    from .. import ccl

    info = ccl.build_info()
    return f"oneccl {info['oneccl']} for torch {info['torch']}" if info else "absent"


def launcher_env(env: os._Environ[str] | dict[str, str] = os.environ) -> dict[str, str]:
    from ..log import LEVEL_SAID
    from ..logins import mask

    return {k: mask(v) for k, v in sorted(env.items())
            if k.startswith(ENV_PREFIXES) and k != LEVEL_SAID}


def scheduler_tags(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The batch scheduler's own name for the job, so a run can be traced to ``sacct``."""
    tags = {}
    if "SLURM_JOB_ID" in env:
        tags[schema.slurm_tag("job_id")] = env["SLURM_JOB_ID"]
        for key, name in (("SLURM_JOB_NAME", "job_name"), ("SLURM_JOB_NODELIST", "nodelist"),
                          ("SLURM_CLUSTER_NAME", "cluster"), ("SLURM_JOB_PARTITION", "partition")):
            if key in env:
                tags[schema.slurm_tag(name)] = env[key]
    return tags


def git_sha() -> str:
    """$DDPLAB_GIT_SHA (set in the images), else the HEAD of the checkout this code runs from
    (not of the working directory: a job started elsewhere ran this code), else 'unknown'."""
    if os.environ.get("DDPLAB_GIT_SHA"):
        return os.environ["DDPLAB_GIT_SHA"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


MAX_DIFF_BYTES = 4 * 2**20
# Where the hashed lock lies: in a checkout (installed editable: <root>/src/ddplab) at the
# repository's root, two levels above the package, whichever room this module is in; in an image
# (ddplab installed into site-packages) where its Dockerfile copies it (docker/*/Dockerfile).
PACKAGE_DIR = Path(__file__).resolve().parents[1]
LOCK_FILES = (PACKAGE_DIR.parent.parent / "requirements.lock",
              Path("/opt/ddplab/lock/requirements.lock"))


def lock_digest() -> str:
    """The inputs digest the lock opens with (make lock): equal digests, equal environments."""
    for path in LOCK_FILES:
        try:
            first = path.read_text(encoding="utf-8").split("\n", 1)[0]
        except OSError:
            continue
        if first.startswith("# inputs-sha256: "):
            return first.removeprefix("# inputs-sha256: ")[:16]
    return "unknown"


def torch_build() -> str:
    """Which build of torch ran, e.g. 2.14.1+cu130 (PyPI's) or 2.14.1+cpu (PyTorch's CPU index);
    a version without its own label gets one from the build."""
    if "+" in torch.__version__:
        return torch.__version__
    cuda = torch.version.cuda
    return f"{torch.__version__}+{'cu' + cuda.replace('.', '') if cuda else 'cpu'}"


HERE = Path(__file__).resolve().parent


def _git(*args: str, where: Path = HERE) -> subprocess.CompletedProcess[str] | None:
    """git in the checkout this code runs from; None where there is no git or no checkout."""
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=30,
                              check=False, cwd=where)
    except (OSError, subprocess.TimeoutExpired):
        return None


def git_dirty(where: Path = HERE) -> tuple[str, str]:
    """("true" with the uncommitted diff | "false" | "unknown", diff) for the checkout this code
    runs from: edited or untracked files in the repository mean the sha alone does not say
    what ran. An installed copy (an image, a wheel) is "unknown" unless $DDPLAB_GIT_DIRTY says."""
    if os.environ.get("DDPLAB_GIT_SHA"):
        return os.environ.get("DDPLAB_GIT_DIRTY", "unknown"), ""
    status = _git("status", "--porcelain", "--untracked-files=normal", where=where)
    if status is None or status.returncode != 0:
        return "unknown", ""
    if not status.stdout.strip():
        return "false", ""
    diff = _git("diff", "HEAD", where=where)
    text = diff.stdout if diff is not None else ""
    untracked = [line[3:] for line in status.stdout.splitlines() if line.startswith("??")]
    if untracked:
        text += "\n# untracked files (not in the diff):\n" + "\n".join(f"#   {u}" for u in untracked)
    return "true", text[:MAX_DIFF_BYTES]


def container_image() -> str:
    """The image this process runs in ($DDPLAB_IMAGE from our Dockerfiles), or ''."""
    image = os.environ.get("DDPLAB_IMAGE", "")
    if image:
        return image
    return "unknown-container" if Path("/.dockerenv").exists() else ""


def _quota() -> float | None:
    from ..distributed.cpu import cpu_quota

    return cpu_quota()


def hardware() -> dict[str, Any]:
    import psutil

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "cgroup_cpu_quota": _quota(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": gpus,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
    }


def build(extra: dict[str, Any]) -> dict[str, Any]:
    """Everything needed to tell two runs' environments apart; ``extra`` adds job facts. Every
    string in it through the one credential filter (logins.masked): a URL's password in any
    variable, launcher fact or job fact is recorded as ``***``."""
    from ..logins import masked

    recorded: dict[str, Any] = masked({
        "versions": versions(),
        "torch_config": torch.__config__.show(),
        "torch_parallel_info": torch.__config__.parallel_info(),
        "env": launcher_env(),
        "hardware": hardware(),
        "git_sha": git_sha(),
        "image": container_image(),
        **extra,
    })
    return recorded
