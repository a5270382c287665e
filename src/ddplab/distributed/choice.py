"""Which backend a job runs: ``auto`` = nccl on CUDA, ccl on CPU where it is known to win, else
gloo; ``ccl`` is Intel's ``oneccl_bindings_for_pytorch`` when they import, else ddplab's own
backend (``make setup-ccl``, :mod:`ddplab.ccl`); the run records which (``ddplab.ccl_impl``).
An explicit backend that is missing fails, unless ``dist.allow_backend_fallback`` is true: then
gloo runs with a warning. The choice and its reason are recorded in the run
(``ddplab.backend``, ``ddplab.backend_requested``, ``ddplab.backend_reason``).
"""

from __future__ import annotations

import importlib
import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.distributed as dist

from ..ccl.handlers import crash_handlers_kept
from ..errors import DdplabError
from ..launchers import LaunchEnv


class BackendError(DdplabError, RuntimeError):
    """The requested backend cannot run here."""


@dataclass(frozen=True)
class BackendChoice:
    name: str
    requested: str
    reason: str
    fell_back: bool = False


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
        with crash_handlers_kept():  # their libfabric's providers may take SIGSEGV (ccl/)
            module = importlib.import_module("oneccl_bindings_for_pytorch")
        return CclImpl("intel-bindings", f"Intel's bindings {_version(module)}",
                       getattr(module, "cwd", None))
    except Exception as e:  # noqa: BLE001 - see docstring
        intel = f"oneccl_bindings_for_pytorch does not import ({type(e).__name__}: {e})"
    from .. import ccl

    ok, why = ccl.register()
    return CclImpl("ddplab", why) if ok else CclImpl(None, f"{why}; {intel}")


def available(device_type: str, ccl_asked: bool = True) -> dict[str, tuple[bool, str]]:
    """Each backend -> (usable here, why). ccl is imported as a side effect when present and
    ``ccl_asked`` (else it is "not asked for": loading oneCCL costs a process 0.2-0.3 s)."""
    ccl = import_ccl() if ccl_asked else CclImpl(None, "not asked for")
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
    if table is None:
        table = available(device_type, may_take_ccl(requested, device_type, cores_per_rank, world_size))
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


def may_take_ccl(requested: str, device_type: str, cores_per_rank: int | None,
                 world_size: int) -> bool:
    """Whether ccl can be the answer: only then is oneCCL loaded to see if it is usable."""
    if device_type != "cpu" or requested not in ("ccl", "auto"):
        return False
    return requested == "ccl" or (world_size >= 2 and (cores_per_rank is None or cores_per_rank >= 2))


def _auto(device_type: str, table: Mapping[str, tuple[bool, str]], cores_per_rank: int | None,
          ccl_impl: str | None, world_size: int) -> BackendChoice:
    if device_type == "cuda" and table["nccl"][0]:
        return BackendChoice("nccl", "auto", "auto: CUDA device, NCCL available")
    if device_type == "cuda":
        return BackendChoice("gloo", "auto", f"auto: gloo, because {table['nccl'][1]}")
    # (the layout's reasons before the build's: where they hold, oneCCL is not even loaded)
    if world_size < 2:
        return BackendChoice("gloo", "auto", "auto: gloo, because one rank exchanges nothing and "
                             "oneCCL's worker thread would take a core from the compute")
    if cores_per_rank is not None and cores_per_rank < 2:
        return BackendChoice("gloo", "auto", f"auto: gloo, because each rank has {cores_per_rank} "
                             "core(s) and oneCCL's worker thread needs one of its own "
                             "(set dist.backend=ccl to use it anyway)")
    if not table["ccl"][0]:
        return BackendChoice("gloo", "auto", f"auto: gloo, because {table['ccl'][1]}")
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


def resolve_device(requested: str, local_rank: int, backend: str = "nccl") -> torch.device:
    """A rank's device: local rank k on GPU k. More local ranks than GPUs may share them round
    robin over gloo (or mpi), as the book's processes share a CPU; NCCL refuses two ranks on
    one device, so with nccl (or auto, which picks it) that is one line instead of a hang."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise BackendError("dist.device: 'cuda' requested but torch sees no CUDA device")
    n = torch.cuda.device_count()
    if local_rank >= n and backend in ("nccl", "auto"):
        raise BackendError(f"local rank {local_rank} has no GPU of its own: only {n} visible, and "
                           "NCCL cannot put two ranks on one GPU; fewer ranks per node, or "
                           "dist.backend gloo to share the GPUs")
    return torch.device("cuda", local_rank % n)
