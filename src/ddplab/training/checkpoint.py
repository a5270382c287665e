"""Atomic checkpoints written by global rank 0; newest-valid resume.

Layout: ``<checkpoint.dir>/<experiment name>/<run id>/step-00000120.pt``. A checkpoint is
written to a temporary file, fsynced, then renamed, so a crash leaves either the old set or
the new file, never half of one. ``resume: auto`` takes the newest checkpoint that loads and
has every field; a partial or corrupt one is skipped with a warning. When that newest one is
the final checkpoint of a finished job, a new job starts instead (and gets a new run).
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..agent.protocol import refuse_a_running_job
from ..distributed.group import share_from_rank0
from ..errors import DdplabError, in_chain
from ..files import named_or_id
from . import strategy
from .jobend import Terminated
from .loop import TrainState

if TYPE_CHECKING:
    from ..config import ExperimentConfig

# What a resume may change: how long to train, how often to log and save, where to track, how
# steps are timed and checked. Everything else (model, data, optimizer, batch, seed, backend)
# changes what the run computes.
RESUMABLE_KEYS = ("description", "train.epochs", "train.max_steps", "train.log_every",
                  "train.eval_every_epochs", "dist.timeout_s", "train.exact_step_times",
                  "train.sync_debug")
RESUMABLE_SECTIONS = ("tracking.", "checkpoint.")
# How the work is split may change too (checkpoints hold the full state, see strategy.py), as
# long as the global batch holds: another strategy, world size, per-rank batch or accumulation.
LAYOUT_KEYS = ("dist.strategy", "data.batch_size", "train.grad_accum_steps",
               "train.global_batch_size")
LAYOUT_SECTIONS = ("dist.fsdp.",)

REQUIRED = ("model", "optimizer", "scheduler", "scaler", "step", "epoch", "samples_in_epoch",
            "world_size", "rng", "config", "run_id", "final")


def capture(state: TrainState, world_size: int, config: dict[str, Any], run_id: str,
            final: bool, global_batch: int = 0) -> dict[str, Any]:
    """Collective (every rank calls it; the full state is gathered to global rank 0, the rank
    that writes): the whole training state, whatever dist.strategy sharded."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if state.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(state.device)
    model_sd, optim_sd = strategy.state_dicts(state.model, state.optimizer)
    return {
        "model": model_sd,
        "optimizer": optim_sd,
        "global_batch": global_batch,
        "scheduler": state.scheduler.state_dict(),
        "scaler": state.scaler.state_dict(),
        "step": state.step,
        "epoch": state.epoch,
        "samples_in_epoch": state.samples_in_epoch,
        "world_size": world_size,
        "rng": rng,
        "config": config,
        "run_id": run_id,
        "final": final,
    }


def _replay(state: TrainState) -> None:
    """A scheduler of the user's, built for THIS job's steps, stepped to where the checkpoint
    stood: its saved state holds the earlier job's size (OneCycleLR's total_steps), which a
    longer job would step past (ValueError at the first step beyond it). So the same job goes on
    along the same curve, and a longer one along its stretched curve, as ddplab's own schedules
    (rebuilt from the config, only their position restored) always did."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": on purpose
        for _ in range(state.epoch if state.scheduler_per_epoch else state.step):
            state.scheduler.step()


def restore(state: TrainState, payload: dict[str, Any], world_size: int) -> None:
    """Every rank: the checkpoint into this job's state, under any strategy and world size."""
    _load_weights_and_optimizer(state, payload)
    state.scaler.load_state_dict(payload["scaler"])
    state.step, state.epoch = payload["step"], payload["epoch"]
    if state.scheduler_replays:
        _replay(state)
    else:
        state.scheduler.load_state_dict(payload["scheduler"])
    state.samples_in_epoch = payload["samples_in_epoch"]
    if payload["world_size"] != world_size and state.samples_in_epoch:
        # Shards depend on the world size: the saved position means nothing in the new layout.
        warnings.warn(f"checkpoint was written with world size {payload['world_size']}, this job "
                      f"has {world_size}: epoch {state.epoch} restarts from its beginning",
                      stacklevel=2)
        state.samples_in_epoch = 0
    torch.set_rng_state(payload["rng"]["torch"])
    random.setstate(payload["rng"]["python"])
    if "cuda" in payload["rng"] and state.device.type == "cuda":
        torch.cuda.set_rng_state(payload["rng"]["cuda"], state.device)


def _load_weights_and_optimizer(state: TrainState, payload: dict[str, Any]) -> None:
    """The weights must fit this model (else one line: a resume never trains a model that
    silently lost its weights); an optimizer state that does not fit this optimizer (changed
    under checkpoint.resume_changes=allow, or another strategy's) is left fresh, said once."""
    try:
        strategy.load_model_state(state.model, payload["model"])
    except (KeyError, RuntimeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CheckpointError(
            f"checkpoint.resume: the checkpoint's weights do not fit this model ({first}); "
            "resume with the model it was trained with, or start fresh "
            "(checkpoint.resume=never)") from None
    try:
        strategy.load_optimizer_state(state.model, state.optimizer, payload["optimizer"])
    except (KeyError, RuntimeError, ValueError, IndexError) as e:
        state.optimizer.state.clear()  # a half-loaded state is worse than none
        warnings.warn(f"checkpoint.resume: the checkpoint's optimizer state does not fit this "
                      f"optimizer ({type(e).__name__}: {str(e)[:160]}); its state starts fresh "
                      "(the weights, step and schedule are resumed)", stacklevel=2)


def config_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, this job's value) for every key that differs. A key the
    checkpoint's config lacks (written before the key existed) had its default: a new key's
    default is what ddplab did before it."""
    from ..config import ExperimentConfig, flatten

    defaults = flatten(ExperimentConfig().to_dict())
    new = flatten(now)
    old = {**{k: v for k, v in defaults.items() if k in new}, **flatten(saved)}
    return [(k, old.get(k, "(absent)"), new.get(k, "(absent)"))
            for k in sorted(set(old) | set(new)) if old.get(k, "(absent)") != new.get(k, "(absent)")]


def check_resume(saved: dict[str, Any], cfg: ExperimentConfig, path: str, world_size: int = 0,
                 payload: dict[str, Any] | None = None) -> list[tuple[str, Any, Any]]:
    """The changes since the checkpoint; ConfigError when one of them may not be resumed, or
    when the global batch (what each optimizer step averages over) would change."""
    from ..config import ConfigError

    changes = config_changes(saved, cfg.to_dict())
    if payload is not None and world_size:
        _same_global_batch(payload, cfg, world_size, path)
    allowed = RESUMABLE_KEYS + LAYOUT_KEYS
    forbidden = [c for c in changes
                 if c[0] not in allowed and not c[0].startswith(RESUMABLE_SECTIONS + LAYOUT_SECTIONS)]
    if forbidden and cfg.checkpoint.resume_changes != "allow":
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in forbidden)
        raise ConfigError(
            f"checkpoint.resume: {path} was written with another config ({listed}). Resume with "
            "the same config, start fresh (checkpoint.resume=never), or set "
            "checkpoint.resume_changes=allow to record the changes in the run")
    return changes


def _same_global_batch(payload: dict[str, Any], cfg: ExperimentConfig, world_size: int, path: str) -> None:
    from ..config import ConfigError

    saved = payload["config"]
    was = payload.get("global_batch") or (saved["data"]["batch_size"] * payload["world_size"]
                                          * saved["train"]["grad_accum_steps"])
    now = cfg.global_batch(world_size)
    if was != now:
        per_rank, accum = cfg.data.batch_size, cfg.train.grad_accum_steps
        fits = was // (world_size * accum) if was % (world_size * accum) == 0 else 0
        hint = (f"set data.batch_size={fits} to keep it" if fits else
                f"no per-rank batch gives {was} on {world_size} rank(s) x {accum} accumulation "
                "step(s): change train.grad_accum_steps or the number of ranks")
        raise ConfigError(
            f"checkpoint.resume: {path} trained with a global batch of {was} (world size "
            f"{payload['world_size']}); this job's is {per_rank} x {world_size} rank(s) x {accum} "
            f"= {now}: {hint}, or start fresh (checkpoint.resume=never)")


class CheckpointError(DdplabError, RuntimeError):
    """A checkpoint could not be written (a full disk, a vanished folder): one line."""


class CorruptCheckpoint(CheckpointError, ValueError):
    """A partial or unreadable checkpoint file."""


def write_atomic(payload: dict[str, Any], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        tmp.unlink(missing_ok=True)  # a full disk must not also leave half a checkpoint behind
        stop = in_chain(e, (Terminated, KeyboardInterrupt))
        if stop is not None:
            # The launcher's SIGTERM cut the write (a peer died): that is why this rank ends,
            # not the zip writer's "unexpected pos" it left behind.
            raise stop from None
        # (torch.save reports a full disk as a RuntimeError from its zip writer, raised while
        # handling the OSError that says what happened: the OSError is the reason to give)
        cause = in_chain(e, OSError) or e
        why = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)[:200]
        raise CheckpointError(f"checkpoint.dir: could not write {path} ({why})") from e
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def read(path: Path, mmap: bool = False) -> dict[str, Any]:
    """Load and check one checkpoint; raises CorruptCheckpoint when it is partial or corrupt.
    ``mmap``: its tensors mapped, not read (a check of what it is, before the ranks start)."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - any unreadable file is "corrupt"
        said = str(e).split(". ", 1)[0][:200]  # (torch's weights_only refusal runs on for lines)
        raise CorruptCheckpoint(f"{path}: unreadable ({type(e).__name__}: {said})") from None
    missing = [k for k in REQUIRED if not isinstance(payload, dict) or k not in payload]
    if missing:
        raise CorruptCheckpoint(f"{path}: missing fields {missing}")
    checked: dict[str, Any] = payload
    return checked


class Checkpointer:
    """Writes on global rank 0 only; a no-op on every other rank."""

    def __init__(self, root: Path, keep: int, active: bool) -> None:
        self.root, self.keep, self.active = root, keep, active
        self.last: Path | None = None

    def save(self, payload: dict[str, Any]) -> None:
        if not self.active:
            return
        run_dir = self.root / (payload["run_id"] or "untracked")
        path = run_dir / f"step-{payload['step']:08d}.pt"
        write_atomic(payload, path)
        self.last = path
        for old in sorted(run_dir.glob("step-*.pt"))[:-self.keep]:
            old.unlink(missing_ok=True)


def newest_first(root: Path) -> list[Path]:
    """Every checkpoint under ``root`` (all runs), the newest first."""
    return sorted(root.glob("*/step-*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)


def newest_valid(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint under ``root`` (all runs) that loads; corrupt ones are skipped."""
    for path in newest_first(root):
        try:
            return path, read(path)
        except ValueError as e:
            warnings.warn(f"skipping checkpoint: {e}", stacklevel=2)
    return None


def not_running(resume: str, root: Path) -> None:
    """``ddplab run``'s preflight: the run a resume would take is not one a job still runs
    (refuse_a_running_job), asked before the ranks start, without reading a checkpoint: the
    newest one's run, or the one named. (find_resume asks again, on rank 0, of what it takes.)"""
    if resume == "auto":
        newest = newest_first(root)
        if newest:
            refuse_a_running_job(newest[0].parent, f"checkpoint.resume: auto found "
                                                   f"{newest[0].parent},")
    elif resume != "never":
        path = _named(resume, root)
        refuse_a_running_job(path.parent, f"checkpoint.resume: {resume!r} is")
        _read_named(path, resume, mmap=True)


def _read_named(path: Path, resume: str, mmap: bool = False) -> dict[str, Any]:
    """The checkpoint the user named; one that is not ddplab's is bad input (exit 2), not a
    failed job: a state_dict ``ddplab checkpoint export`` wrote, a YAML file, a partial copy."""
    from ..config import ConfigError

    try:
        return read(path, mmap=mmap)
    except CorruptCheckpoint as e:
        what = ("a file without its model, optimizer and step" if "missing fields" in str(e) else
                "torch.load cannot read it")
        raise ConfigError(f"checkpoint.resume: got {resume!r}; not a checkpoint ddplab wrote "
                          f"({what}): give a step-*.pt from checkpoints/<experiment>/<run id>/ (a "
                          "state_dict from `ddplab checkpoint export` loads into a model; it does "
                          "not resume)") from None


def _named(resume: str, root: Path) -> Path:
    """The checkpoint file ``checkpoint.resume`` names: the file itself, or in a run's folder
    (checkpoints/<experiment>/<run id>/, or the experiment's folder above it) the newest; a
    bare run id is its folder in this experiment's (``root``), as a script job takes one."""
    from ..config import ConfigError

    path = named_or_id(resume, root)
    if path.is_dir():
        newest = newest_file(path, "step-*.pt") or newest_file(path, "*/step-*.pt")
        if newest is None:
            raise ConfigError(f"checkpoint.resume: got {resume!r}, a folder with no step-*.pt "
                              "checkpoint in it; give a checkpoint file or a run's folder")
        return newest
    if not path.is_file():
        raise ConfigError(f"checkpoint.resume: got {resume!r}; no such checkpoint file or "
                          f"folder, nor a run with checkpoints in {root} (auto, never, a "
                          "checkpoint file, a run's folder or its run id)")
    return path


def newest_file(folder: Path, *patterns: str) -> Path | None:
    """The newest file matching any of ``patterns`` in ``folder`` (a dangling link is none)."""
    found: list[tuple[float, Path]] = []
    for p in (p for pattern in patterns for p in folder.glob(pattern)):
        with contextlib.suppress(OSError):  # (a running job's rotation may remove one meanwhile)
            if p.is_file():
                found.append((p.stat().st_mtime, p))
    return max(found)[1] if found else None


def find_resume(resume: str, root: Path) -> tuple[Path, dict[str, Any]] | None:
    """What ``checkpoint.resume`` asks for, or None for a fresh start."""
    if resume == "never":
        return None
    if resume != "auto":
        path = _named(resume, root)
        payload = _read_named(path, resume)
        # (a finished run's checkpoint starts a new run: two fine-tunes of it may run at once)
        refuse_a_running_job(path.parent, f"checkpoint.resume: {resume!r} is",
                             hold=not payload["final"])
        return path, payload
    found = newest_valid(root)
    if found is None or found[1]["final"]:
        return None  # nothing to resume, or the newest job finished: start a new one
    refuse_a_running_job(found[0].parent, f"checkpoint.resume: auto found {found[0].parent},",
                         hold=True)
    return found


@dataclass(frozen=True)
class Resume:
    """What this job continues: nothing (a fresh start), or a checkpoint and its changes."""

    path: str = ""
    payload: dict[str, Any] | None = None
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        """It is a finished job's final checkpoint: training on from it is a new run (the
        finished run's result stays as it was, whatever this attempt does)."""
        return bool(self.payload and self.payload["final"])

    @property
    def run_id(self) -> str:
        """The run this job continues ("": a new one)."""
        return self.payload["run_id"] if self.payload and not self.finished else ""

    @property
    def step(self) -> int:
        return self.payload["step"] if self.payload else 0


def find_and_share(cfg: ExperimentConfig, is_rank0: bool, world_size: int) -> Resume:
    """Collective: the checkpoint to continue, on every rank; refused (ConfigError, on every
    rank alike, before any run is touched) when its config differs in a way a resume may not."""
    from ..config import ConfigError

    root = Path(cfg.checkpoint.dir) / cfg.name
    path, payload = broadcast_resume(cfg.checkpoint.resume, root, is_rank0, world_size)
    if payload is None:
        return Resume()
    try:
        changes = check_resume(payload["config"], cfg, path, world_size, payload)
        if payload["final"]:  # (after the config's checks: a changed batch is said first)
            _left_to_train(payload, cfg, path, world_size)
        return Resume(path, payload, changes)
    except ConfigError as e:
        e.collective = True  # (each rank's the same)
        raise


def _left_to_train(payload: dict[str, Any], cfg: ExperimentConfig, path: str,
                   world_size: int) -> None:
    """A finished job's final checkpoint, continued in its own layout without a higher
    ``train.max_steps`` or ``train.epochs``: refused, not a new run that trains nothing (its
    step axis empty). In another layout (world size, strategy) it is a conversion: an fsdp
    job's state saved again as one rank's."""
    from ..config import ConfigError

    saved = payload.get("config", {}).get("dist", {}).get("strategy", cfg.dist.strategy)
    if payload.get("world_size") != world_size or saved != cfg.dist.strategy:
        return
    train, step, epochs = cfg.train, payload["step"], payload["epoch"]
    raise_ = ([f"train.max_steps above {step} (0: no cap)"]
              if train.max_steps and train.max_steps <= step else []) + \
        ([f"train.epochs above {epochs}"] if epochs >= train.epochs else [])
    if raise_:
        raise ConfigError(
            f"checkpoint.resume: {path} is the final checkpoint of a finished job (step {step}, "
            f"{epochs} epoch(s) done): with train.max_steps={train.max_steps} and train.epochs="
            f"{train.epochs} nothing is left to train; to train it longer, raise "
            f"{' and '.join(raise_)}")


def broadcast_resume(resume: str, root: Path, is_rank0: bool,
                     world_size: int) -> tuple[str, dict[str, Any] | None]:
    """Collective: rank 0 finds the checkpoint and sends it to every rank, so nodes need no
    shared file system. Returns (path or "", payload or None)."""
    def find() -> tuple[str, dict[str, Any] | None]:
        found = find_resume(resume, root)
        return (str(found[0]), found[1]) if found else ("", None)

    return share_from_rank0(find, is_rank0, world_size)


def export(src: str, out: str) -> str:
    """``ddplab checkpoint export SRC OUT.pt``: the model's plain ``state_dict`` (full tensors by
    parameter name, whatever strategy and world size wrote it), for use outside ddplab:
    ``model.load_state_dict(torch.load(OUT.pt))``. SRC is a checkpoint file, or a folder whose
    newest valid checkpoint is taken. Returns what was written, in one line."""
    from ..config import ConfigError

    path = Path(src)
    if path.is_dir():
        newest = newest_file(path, "step-*.pt", "*/step-*.pt", "*/*/step-*.pt")
        if newest is None:
            raise ConfigError(f"checkpoint export: got {src!r}; no step-*.pt checkpoint in it "
                              "(nor in its run folders)")
        path = newest
    elif not path.is_file():
        raise ConfigError(f"checkpoint export: got {src!r}; no such checkpoint file or folder")
    target = Path(out)
    if target.exists() and target.resolve() == path.resolve():
        raise ConfigError(f"checkpoint export: got {out!r} as the output; it is the checkpoint "
                          "itself, which the export would replace: give another file")
    try:
        payload = read(path)
    except ValueError as e:
        raise ConfigError(f"checkpoint export: {e}") from None
    write_atomic(payload["model"], target)
    model = payload["model"]
    numbers = sum(t.numel() for t in model.values() if isinstance(t, torch.Tensor))
    strategy_name = payload["config"].get("dist", {}).get("strategy", "ddp")
    return (f"wrote {target}: the model's state_dict ({len(model)} tensors, {numbers:,} numbers) "
            f"from {path} (step {payload['step']}, dist.strategy {strategy_name}, world size "
            f"{payload['world_size']})")
