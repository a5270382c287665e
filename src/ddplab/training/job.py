"""One job's parts, built once: data, model and training state; and what the run records of
them when training starts (tags, params, config, environment).

``build`` runs on every rank (collectives inside); ``record_start`` writes through the run,
which is a no-op object on every rank but global rank 0.
"""

from __future__ import annotations

import json
import math
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from .. import config
from ..distributed import host
from ..distributed.layout import Layout
from ..tracking import NullTracker, capsule, schema
from ..workload import batches, data, losses, models, optim, userparts
from ..workload.userparts import Parts
from . import checkpoint, loop, mfu, strategy
from .profiling import NoProfile
from .summary import Console, RunStats


@dataclass
class Job:
    """Everything the epoch loop and the ending need, built once."""

    cfg: config.ExperimentConfig
    layout: Layout
    run: NullTracker
    resume: checkpoint.Resume
    console: Console
    loaders: data.Loaders
    state: loop.TrainState
    ipex: strategy.IpexStatus
    hosts: list[str]
    t_start: float
    ckpt: checkpoint.Checkpointer
    info: data.DataInfo
    """What the data told the model (sizes, and whether it is image or token data)."""
    parts: Parts
    """The user's own parts, if any (their provenance goes into the run)."""
    git_dirty: str = "unknown"
    """Whether the checkout had uncommitted changes when the job started: true|false|unknown."""
    git_diff: str = ""
    stats: RunStats = field(default_factory=RunStats)
    profiler: NoProfile = field(default_factory=NoProfile)
    """Stepped after every optimizer step; a real one only inside ``profiling(job)``."""
    meter: loop.Meter = field(default_factory=loop.Meter)
    rank_hosts: list[str] = field(default_factory=list)
    """Each rank's host, by rank (``hosts``: the distinct ones)."""
    mfu_basis: mfu.Basis | None = None
    """What perf/mfu divides by what (None: train.mfu off)."""

    @property
    def total_steps(self) -> int:
        return total_steps(self.cfg.train, self.loaders)


def total_steps(train: config.TrainConfig, loaders: data.Loaders) -> int:
    """Optimizer steps in the job; the last accumulation group of an epoch may be short."""
    per_epoch = math.ceil(loaders.micro_batches_per_epoch / train.grad_accum_steps)
    total = train.epochs * per_epoch
    return min(total, train.max_steps) if train.max_steps else total


def build(cfg: config.ExperimentConfig, layout: Layout, resume: checkpoint.Resume,
          run: NullTracker, parts: Parts, summary_out: str, t_start: float) -> Job:
    le = layout.le
    rank_hosts = _hosts(le.world_size)
    loaders, info = _data(cfg, layout, parts)
    state, ipex, basis = _model(cfg, layout.device, loaders, info, parts, resume.payload,
                                le.world_size)
    ckpt = checkpoint.Checkpointer(Path(cfg.checkpoint.dir) / cfg.name, cfg.checkpoint.keep,
                                   le.is_rank0)
    dirty, diff = capsule.git_dirty() if le.is_rank0 else ("unknown", "")
    return Job(cfg, layout, run, resume, Console(le.is_rank0, summary_out), loaders, state, ipex,
               sorted(set(rank_hosts)), t_start, ckpt, info, parts, dirty, diff,
               rank_hosts=rank_hosts, mfu_basis=basis)


def _hosts(world_size: int) -> list[str]:
    """Each rank's host, by rank."""
    names: list[Any] = [None] * world_size
    dist.all_gather_object(names, socket.gethostname())
    return names


def _data(cfg: config.ExperimentConfig, layout: Layout,
          parts: Parts) -> tuple[data.Loaders, data.DataInfo]:
    d, le = cfg.data, layout.le
    # Only one process per node may download; the others wait for it, then read the files.
    first = le.is_node_leader or not (d.dataset == "cifar10" and d.download)
    sets, failed = _datasets_or_error(cfg, parts) if first else (None, "")
    # Instead of a barrier: a rank that failed says so, and no rank waits for it in vain.
    said: list[Any] = [None] * le.world_size
    dist.all_gather_object(said, failed)
    why = next((f"rank {r}: {w}" if r != le.rank else w for r, w in enumerate(said) if w), "")
    if why:
        raise data.DataError(why)
    if sets is None:
        sets = data.datasets(d, cfg.train.seed)
    if parts.datasets is not None:
        _same_data_everywhere(sets, le.rank, le.world_size)
    loaders = data.loaders(d, sets, cfg.train.seed, le.rank, le.world_size,
                           pin=layout.device.type == "cuda", whole_batches=cfg.model.compile)
    return loaders, data.describe(d, sets[0])


def _same_data_everywhere(sets: tuple[Dataset[Any], Dataset[Any]], rank: int,
                          world_size: int) -> None:
    """A user's datasets built differently on some rank would train each rank on other data
    without a word (DDP averages gradients of whatever it is given): the ranks compare a
    fingerprint of them (data.digest), and a mismatch stops every rank in one line."""
    if world_size == 1:
        return
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, data.digest(sets))
    odd = [r for r, d in enumerate(every) if d != every[0]]
    if odd:
        raise data.DataError(
            f"data.dataset: rank {odd[0]} built other data than rank 0 (their sizes or first "
            f"samples differ{'; so did ranks ' + ','.join(map(str, odd[1:])) if odd[1:] else ''}): "
            "build it the same on every rank (draw randomness from a seeded generator, the "
            "`seed` ddplab passes; no path or content that depends on the rank); ddplab shards it")


def _datasets_or_error(cfg: config.ExperimentConfig, parts: Parts) -> tuple[Any, str]:
    if parts.datasets is not None:  # the user's own, built by the checks step
        return parts.datasets, ""
    try:
        return data.datasets(cfg.data, cfg.train.seed), ""
    except data.DataError as e:
        return None, str(e)


def _model(cfg: config.ExperimentConfig, device: torch.device, loaders: data.Loaders,
           info: data.DataInfo, parts: Parts, payload: dict[str, Any] | None,
           world_size: int) -> tuple[loop.TrainState, strategy.IpexStatus, mfu.Basis | None]:
    model = models.prepare(models.build(cfg.model, info, parts.model), cfg.model, device)
    basis = _mfu_basis(cfg, model, loaders, device, world_size) if cfg.train.mfu else None
    model, opt, ipex = strategy.spread(model, cfg, device)  # ddp | zero | fsdp | dp
    state = loop.TrainState(
        model=model, optimizer=opt,
        scheduler=optim.scheduler(opt, cfg.optim, total_steps(cfg.train, loaders), cfg.train.epochs),
        scheduler_per_epoch=cfg.optim.scheduler_interval == "epoch",
        scheduler_replays=config.is_import_path(cfg.optim.scheduler),
        scaler=torch.amp.GradScaler(device.type, enabled=cfg.train.amp == "fp16"),
        device=device, amp=cfg.train.amp, grad_accum=cfg.train.grad_accum_steps,
        grad_clip=cfg.train.grad_clip, channels_last=cfg.model.channels_last,
        loss=losses.get(cfg.train.loss, parts.loss),
        metrics=userparts.build_metrics(cfg, info.model_kwargs(), device),
        shape=batches.Shape.of(cfg), exact_step_times=cfg.train.exact_step_times,
        sync_debug=cfg.train.sync_debug)
    if payload is not None:
        checkpoint.restore(state, payload, world_size)
    return state, ipex, basis


def _mfu_basis(cfg: config.ExperimentConfig, model: torch.nn.Module, loaders: data.Loaders,
               device: torch.device, world_size: int) -> mfu.Basis:
    """Counted on the bare model, before DDP or FSDP wraps (and shards) it."""
    one = loaders.train.collate_fn([loaders.train.dataset[0]])
    sample = batches.Shape.of(cfg).split(one).inputs
    low = cfg.train.amp != "none" or (cfg.dist.strategy == "fsdp"
                                      and cfg.dist.fsdp.mixed_precision == "bf16")
    dp = cfg.dist.strategy == "dp" and device.type == "cuda"
    return mfu.basis(model, cfg.model.flops_per_sample, sample, device, low, world_size,
                     torch.cuda.device_count() if dp else 1)


def record_start(job: Job) -> None:
    """Tags, params, config and environment into the run; one line on the console."""
    cfg, layout, le = job.cfg, job.layout, job.layout.le
    job.run.set_tags(_tags(job))
    _record_config(job)
    env = capsule.build({"hosts": job.hosts, "launch": le.__dict__,
                         "backend": layout.choice.__dict__,
                         "ccl_env_set_by_ddplab": layout.ccl_env, "ipex": job.ipex.__dict__})
    job.run.log_text(json.dumps(env, indent=2, default=str), "environment.json")
    if job.git_diff:  # the sha alone does not say what ran
        job.run.log_text(job.git_diff, "git.diff")
    what = "resuming " + job.resume.path if job.resume.path else "starting"
    job.console.say(
        f"{what}: run {job.run.run_id or '(tracking off)'}, {le.launcher} x{le.world_size} on "
        f"{len(job.hosts)} host(s), backend {layout.choice.name} ({layout.choice.reason}), "
        f"{layout.threads} thread(s)/rank, {job.total_steps} steps of global batch "
        f"{cfg.global_batch(le.world_size)}")


def _tags(job: Job) -> dict[str, Any]:
    layout, le = job.layout, job.layout.le
    return {
        **schema.identity_tags(
            le, kind=job.cfg.kind, resumed_from=job.resume.path, rank0_host=socket.gethostname(),
            machine=host.summary(), git_sha=capsule.git_sha(), lock=capsule.lock_digest(),
            torch_build=capsule.torch_build(), image=capsule.container_image(),
            versions=capsule.versions(), scheduler=capsule.scheduler_tags()),
        schema.STRATEGY: job.cfg.dist.strategy,
        schema.BACKEND: layout.choice.name,
        schema.BACKEND_REQUESTED: layout.choice.requested,
        schema.BACKEND_REASON: layout.choice.reason,
        schema.CCL_IMPL: layout.ccl_impl or "none",
        schema.DEVICE: layout.device.type, schema.HOSTS: ",".join(job.hosts),
        schema.GIT_DIRTY: job.git_dirty,
        schema.THREADS_PER_RANK: layout.threads,
        schema.PINNED_CORES: ",".join(map(str, layout.pinned)) or "none",
        schema.IPEX: "used" if job.ipex.used else f"not used: {job.ipex.reason}",
        schema.GLOBAL_BATCH: job.cfg.global_batch(le.world_size),
        **({schema.DATA_PER_CLASS: f"train: {counts}; eval: "
            f"{data.per_class(job.loaders.eval.dataset)}"}
           if (counts := data.per_class(job.loaders.train.dataset)) else {}),
        **({schema.CONTINUES_RUN: job.resume.payload["run_id"]}
           if job.resume.payload and job.resume.finished else {}),  # finished implies a payload
        **job.parts.tags(),
        **(job.mfu_basis.tags() if job.mfu_basis else {}),
    }


def _record_config(job: Job) -> None:
    """Params and config.yaml are the first attempt's and always agree (MLflow cannot change a
    param); a resume that changed allowed keys records them beside, with its own config."""
    job.run.log_params(job.cfg.flat())
    if not job.resume.path or job.resume.finished:  # a run of its own
        job.run.log_text(job.cfg.to_yaml(), "config.yaml")
        return
    step = job.resume.step
    job.run.log_text(job.cfg.to_yaml(), f"resumes/config-step{step:08d}.yaml")
    listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in job.resume.changes
                       if k != "checkpoint.resume")
    job.run.set_tags({schema.resume_changes_tag(step): listed or "none"})
