"""The process group up and down (one rendezvous path for every launcher), the last collective
of a job, and rank-0-only steps whose result (or failure) every rank receives.
"""

from __future__ import annotations

import datetime
import gc
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..ccl.handlers import crash_handlers_kept
from ..errors import DdplabError, first_line
from ..launchers import LaunchEnv
from .choice import BackendChoice, BackendError

T = TypeVar("T")

def init_process_group(choice: BackendChoice, le: LaunchEnv, device: torch.device,
                       timeout_s: int, store: dist.Store | None = None) -> None:
    # A ccl group's libfabric may take SIGSEGV as it starts (ccl/handlers.py).
    with crash_handlers_kept():
        _init_process_group(choice, le, device, timeout_s, store)


def _init_process_group(choice: BackendChoice, le: LaunchEnv, device: torch.device,
                        timeout_s: int, store: dist.Store | None) -> None:
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
    t0 = time.monotonic()
    try:
        dist.init_process_group(choice.name, store=store, rank=le.rank, world_size=le.world_size,
                                timeout=timeout, **kwargs)
    except RuntimeError as e:  # oneCCL's transport, a peer gone during the backend's set-up
        raise BackendError(init_failure(e, le, timeout_s, time.monotonic() - t0)) from None


def rendezvous_store(le: LaunchEnv, timeout_s: int) -> dist.Store:
    """The store of ``env://``, as init_process_group would make it: torchrun's agent store
    when there is one; other launchers get the same variables from LaunchEnv, so every launcher
    takes the one path."""
    for key, value in (("MASTER_ADDR", le.master_addr), ("MASTER_PORT", str(le.master_port)),
                       ("RANK", str(le.rank)), ("WORLD_SIZE", str(le.world_size)),
                       ("LOCAL_RANK", str(le.local_rank))):
        os.environ.setdefault(key, value)
    timeout = datetime.timedelta(seconds=timeout_s)
    store: dist.Store
    t0 = time.monotonic()
    try:
        store, _, _ = next(dist.rendezvous("env://", le.rank, le.world_size, timeout=timeout))
    except RuntimeError as e:  # DistStoreError, DistNetworkError: a peer or the master is missing
        raise BackendError(init_failure(e, le, timeout_s, time.monotonic() - t0)) from None
    store.set_timeout(timeout)
    # torchrun --max-restarts keeps its agent store across attempts, and in it the last
    # attempt's keys: gloo's restarted ranks read a killed peer's address from them and failed
    # within seconds ("Connection refused"), as a plain torchrun script does. Each attempt its
    # own keys.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ddplab/attempt{attempt}/", store) if attempt != "0" else store


def init_failure(e: RuntimeError, le: LaunchEnv, timeout_s: int,
                 took_s: float = float("inf")) -> str:
    """One line: why this rank's process group did not start, ``took_s`` into trying (by
    default: the whole of dist.timeout_s)."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    if first.startswith("oneCCL:"):
        # ddplab's ccl failed in oneCCL itself (its transport, say), within seconds: no peer is
        # missing, so the waiting message below would send the user looking in the wrong place.
        return (f"rank {le.rank} of {le.world_size}: the ccl backend did not start ({first}); "
                "`ddplab doctor` shows oneCCL's transport and provider; dist.backend=gloo "
                "avoids oneCCL")
    if first.startswith("ccl (ddplab):"):  # the ranks met at the store; one never joined oneCCL
        return f"rank {le.rank} of {le.world_size}: {first}"
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    whom = (f"the other {le.world_size - 1} rank(s) to join its store at {where}" if le.is_rank0
            else f"rank 0's store at {where} (MASTER_ADDR:MASTER_PORT) and the other ranks")
    if took_s < 0.9 * timeout_s:  # refused, not timed out: say so, not "waited 300s"
        return (f"rank {le.rank} of {le.world_size} could not reach {whom} ({type(e).__name__}: "
                f"{first}), after {took_s:.0f}s of dist.timeout_s {timeout_s}s")
    return (f"rank {le.rank} of {le.world_size} waited {timeout_s}s (dist.timeout_s) for {whom}; "
            f"they never came ({type(e).__name__}: {first})")


FLIGHT_RECORDER_ENTRIES = "2000"


def record_collectives(environ: dict[str, str] | os._Environ[str]) -> None:
    """PyTorch's Flight Recorder on for the process groups to come: each rank keeps its last
    2,000 collectives (what it entered, what finished), read on a hang (``flight_records``).
    Before the first process group, which reads it; a size the user set (0: off) stays."""
    environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)


def flight_records() -> bytes:
    """This rank's Flight Recorder as JSON: NCCL's own on a CUDA job (it keeps it apart), else
    the one gloo writes into. Called from the heartbeat's thread while the main thread may be
    blocked in a collective."""
    from torch._C import _distributed_c10d as c10d  # (its stubs lack the dumps: getattr)

    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    dump = getattr(c10d, "_dump_nccl_trace_json" if nccl else "_dump_fr_trace_json")
    records: bytes = dump(includeCollectives=True, onlyActive=False)
    return records


def finish_together() -> None:
    """The last collective of a job: every rank waits here until all are done."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def destroy_process_group() -> None:
    """Collect what may still hold collectives (DDP's reducer, its buckets) first."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


RANK0_FAILED = "rank 0 failed: "  # a Rank0Error's message: this, then rank 0's error


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
            error, message = e, [None, f"{type(e).__name__}: {first_line(str(e))}"]
    if world_size > 1:
        dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[1]:
        raise Rank0Error(f"{RANK0_FAILED}{message[1]}")
    result: T = message[0]  # rank 0's produce(), broadcast (pickled) to the others
    return result
