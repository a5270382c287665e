"""The launch steps in one call: device, backend (agreed across nodes), oneCCL's variables, CPU
threads and pinning, decided before any data or model exists; then the process group they
planned, up for the job and down after it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import DistConfig
from ..launchers import LaunchEnv
from .choice import BackendChoice, BackendError, agree, import_ccl, may_take_ccl, resolve, resolve_device
from .cpu import apply_cpu_layout, cores_per_rank
from .group import (
    destroy_process_group,
    init_failure,
    init_process_group,
    record_collectives,
    rendezvous_store,
)
from .oneccl import apply_ccl_env


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
    device = resolve_device(cfg.device, le.local_rank, cfg.backend)
    cores = cores_per_rank(le, os.environ)
    impl = import_ccl() if may_take_ccl(cfg.backend, device.type, cores, le.world_size) else None
    choice = resolve(cfg.backend, device.type, cfg.allow_backend_fallback, cores_per_rank=cores,
                     ccl_impl=impl.name if impl else None, world_size=le.world_size)
    store = None
    if cfg.backend == "auto" and device.type == "cpu" and le.nnodes > 1:
        store = rendezvous_store(le, cfg.timeout_s)  # the process group's own, made early
        t0 = time.monotonic()
        try:
            choice = agree(choice, le, store)
        except RuntimeError as e:  # DistStoreError: a rank never voted within dist.timeout_s
            raise BackendError(init_failure(e, le, cfg.timeout_s, time.monotonic() - t0)) from None
    if choice.fell_back:
        import warnings

        warnings.warn(choice.reason, stacklevel=2)
    impl = impl if choice.name == "ccl" else None
    ccl_env = apply_ccl_env(le, os.environ, impl) if impl else {}
    threads = torch.get_num_threads()
    pinned: list[int] = []
    if cfg.hang_after_s > 0:  # the hang watch reads it (forensics/)
        record_collectives(os.environ)
    if device.type == "cpu":
        threads, pinned = apply_cpu_layout(cfg, le, choice.name)
    else:
        torch.cuda.set_device(device)
    return Layout(le, device, choice, threads, pinned, ccl_env, impl.name if impl else None,
                  store)


@contextlib.contextmanager
def process_group(layout: Layout, timeout_s: int) -> Iterator[None]:
    init_process_group(layout.choice, layout.le, layout.device, timeout_s, layout.store)
    try:
        yield
    finally:
        destroy_process_group()
