"""Train step, epoch and distributed evaluation. Returns numbers; does no I/O.

The epoch is a generator that yields after every optimizer step, so the caller decides what
to log or checkpoint, and when. The only communication here is DDP's own gradient all-reduce
and the metric reductions, which every rank must reach at the same step.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function
from torch.utils.data import DataLoader

from ..forensics.heartbeat import beat
from ..workload import batches
from ..workload.losses import Loss, cross_entropy, is_classification, prediction
from . import marks

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainState:
    """Everything the loop mutates; checkpoint.py saves and restores it."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    device: torch.device
    amp: str = "none"
    grad_accum: int = 1
    grad_clip: float = 0.0
    channels_last: bool = False
    loss: Loss = cross_entropy
    """train.loss: (outputs, targets) -> the batch's mean loss."""
    scheduler_per_epoch: bool = False
    """optim.scheduler_interval: epoch (the caller steps the scheduler at each epoch's end)."""
    scheduler_replays: bool = False
    """A scheduler of the user's: a resume steps it to the checkpoint's position instead of
    loading its state (checkpoint._replay)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """train.metrics: name -> a metric object (update/compute/reset), evaluated with the rest."""
    shape: batches.Shape = field(default_factory=batches.Shape)
    """How a batch is read (pairs or dicts) and the model called (with labels= for its own loss)."""
    step: int = 0
    """Optimizer steps taken (the MLflow step of every metric)."""
    epoch: int = 0
    samples_in_epoch: int = 0
    """Samples this rank consumed in the current epoch (resume skips them)."""
    exact_step_times: bool = False
    """train.exact_step_times: a synchronize after every step (StepClock)."""
    sync_debug: str = "off"
    """train.sync_debug: torch's sync debug mode around the steady steps (StepClock.steady)."""
    steps_run: int = 0
    """Optimizer steps this process has taken (not saved: a resumed process starts again)."""
    lr: float = 0.0
    """The learning rate the last step trained with (the scheduler's last is the next step's)."""

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        dtype = AMP_DTYPES[self.amp]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def batch(self, raw: Any) -> batches.Batch:
        """A collated batch from the loader, split and on this rank's device."""
        return batches.to_device(self.shape.split(raw), self.device, self.channels_last)

    def forward(self, model: nn.Module, batch: batches.Batch) -> Any:
        return self.shape.forward(model, batch)


@dataclass(frozen=True)
class StepResult:
    step: int
    epoch: int
    samples: int
    loss_sum: torch.Tensor
    """Sum of per-sample losses over this step's samples on this rank (not yet synced)."""
    step_time_s: float
    data_time_s: float
    busy_s: float = 0.0
    """This rank's own work before the step's gradient all-reduce (data loading and forward):
    the part of a step no other rank waits in, so a slow rank shows here. (On CUDA the forward's
    kernels run asynchronously: its share is what launching them took.)"""
    span: tuple[Any, Any] | None = None
    """On a GPU (without train.exact_step_times): CUDA events at the step's start and end, read
    at the next log point (Meter.elapsed); ``step_time_s`` is then the host's share."""


def _sync(device: torch.device) -> None:
    """The one host wait on the device: at log points, and per step only when asked for."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """When a step starts and ends, without the host waiting on the device inside the step
    (torchtitan's and TraceML's practice): the host clock on a CPU, which never runs ahead;
    on a GPU also a CUDA event at each end, resolved once the device has passed it (at log
    points); ``exact`` (train.exact_step_times) waits for the device after every step instead.
    The first step is waited for, so the time to the first step is the device's too."""

    def __init__(self, device: torch.device, exact: bool = False, sync_debug: str = "off"
                 ) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        self.exact, self.waited = exact, False
        self.sync_debug = sync_debug

    @contextlib.contextmanager
    def steady(self, steps_run: int) -> Iterator[None]:
        """train.sync_debug around a step after the epoch's first (whose lazy initialisation
        waits) and the process's second (DDP rebuilds its buckets there, reading their order
        back to the host): a host wait inside it warns or raises where it is made."""
        if not (self.cuda and self.sync_debug != "off" and self.waited and steps_run >= 2):
            yield
            return
        before = torch.cuda.get_sync_debug_mode()  # a mode the user set stays theirs
        torch.cuda.set_sync_debug_mode(self.sync_debug)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(before)

    def start(self) -> tuple[float, Any]:
        return time.perf_counter(), self._event()

    def stop(self, started: tuple[float, Any]) -> tuple[float, tuple[Any, Any] | None]:
        """(host seconds since ``started``, the events to resolve later or None)."""
        if self.cuda and (self.exact or not self.waited):
            _sync(self.device)
            self.waited = True
            return time.perf_counter() - started[0], None
        end = self._event()
        span = (started[1], end) if started[1] is not None and end is not None else None
        return time.perf_counter() - started[0], span

    def _event(self) -> Any:
        return None if self.exact else marks.record(self.device)


def micro_step(state: TrainState, batch: batches.Batch, group_size: int,
               sync_grads: bool, forward_s: list[float] | None = None) -> torch.Tensor:
    """Forward and backward of one micro-batch; gradients are communicated (DDP's all-reduce,
    FSDP's reduce-scatter) only when ``sync_grads``. The forward's seconds go to ``forward_s``."""
    from .strategy import grad_sync

    with grad_sync(state.model, sync_grads):
        beat("forward")
        t0 = time.perf_counter()
        with state.autocast():
            loss = state.loss(state.forward(state.model, batch), batch.target)
        if forward_s is not None:
            forward_s.append(time.perf_counter() - t0)
        beat("backward")  # where DDP's gradient all-reduce waits for the other ranks
        state.scaler.scale(loss / group_size).backward()
    return loss.detach() * batch.size


def optimizer_step(state: TrainState) -> None:
    beat("optimizer")
    if state.grad_clip > 0:
        state.scaler.unscale_(state.optimizer)
        nn.utils.clip_grad_norm_(state.model.parameters(), state.grad_clip)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    state.lr = state.optimizer.param_groups[0]["lr"]  # (ddplab's lr is a float: no device read)
    if not state.scheduler_per_epoch:
        state.scheduler.step()
    state.step += 1


def train_epoch(state: TrainState, loader: DataLoader[Any], max_steps: int = 0) -> Iterator[StepResult]:
    """One pass over this rank's shard, yielding after every optimizer step."""
    state.model.train()
    n_micro = len(loader)
    fetched = iter(loader)
    clock = StepClock(state.device, state.exact_step_times, state.sync_debug)
    for start in range(0, n_micro, state.grad_accum):
        if max_steps and state.step >= max_steps:
            return
        group = min(state.grad_accum, n_micro - start)
        started = clock.start()
        loss_sum, samples, data_time = torch.zeros((), device=state.device), 0, 0.0
        forward_s: list[float] = []
        with clock.steady(state.steps_run):
            for i in range(group):
                beat("data loading", state.step + 1)  # the step in the making, as its metrics say
                t_fetch = time.perf_counter()
                # record_function: the data wait, as profiles show it
                with record_function("ddplab/data"), _naming_the_sample(loader):
                    batch = state.batch(next(fetched))
                data_time += time.perf_counter() - t_fetch
                loss_sum += micro_step(state, batch, group, sync_grads=i == group - 1,
                                       forward_s=forward_s)
                samples += batch.size
            optimizer_step(state)
        state.steps_run += 1
        step_s, span = clock.stop(started)
        state.samples_in_epoch += samples
        yield StepResult(state.step, state.epoch, samples, loss_sum, step_s, data_time,
                         data_time + sum(forward_s), span)


SAMPLE_NOTE = "ddplab: in sample "


@contextlib.contextmanager
def _naming_the_sample(loader: DataLoader[Any]) -> Iterator[None]:
    """A dataset that raises on one sample: the exception gets a note naming its index (and
    file, for a dataset of files such as ImageFolder), which the run's verdict repeats. Read
    from the fetching frame (torch's fetcher names it ``idx``): in-process loading only (a
    DataLoader worker's error comes back as text)."""
    try:
        yield
    except Exception as e:
        index = _failing_index(e)
        if index is not None:
            samples = getattr(loader.dataset, "samples", None)
            path = samples[index][0] if isinstance(samples, list) and index < len(samples) else None
            if hasattr(e, "add_note"):  # (Python 3.11+)
                e.add_note(f"{SAMPLE_NOTE}{index} of the training set" + (f" ({path})" if path else ""))
        raise


def _failing_index(e: BaseException) -> int | None:
    tb = e.__traceback__
    found = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_filename.endswith(os.path.join("_utils", "fetch.py")):
            idx = frame.f_locals.get("idx")
            found = idx if isinstance(idx, int) else found
        tb = tb.tb_next
    return found


@dataclass
class Meter:
    """Accumulates StepResults between two metric points (local to this rank)."""

    loss_sum: float | torch.Tensor = 0.0
    samples: int = 0
    step_times: list[float] = field(default_factory=list)
    data_time: float = 0.0
    busy_time: float = 0.0
    spans: list[tuple[Any, Any] | None] = field(default_factory=list)

    def add(self, r: StepResult) -> None:
        self.loss_sum = self.loss_sum + r.loss_sum
        self.samples += r.samples
        self.step_times.append(r.step_time_s)
        self.spans.append(r.span)
        self.data_time += r.data_time_s
        self.busy_time += r.busy_s

    def elapsed(self, device: torch.device) -> float:
        """The interval's step time: each step's device span (CUDA events, read now: a log
        point, after one wait) where it has one, else its host time."""
        if any(s is not None for s in self.spans):
            _sync(device)
            self.step_times = [marks.seconds(*s) if s is not None else host
                               for s, host in zip(self.spans, self.step_times, strict=True)]
            self.spans = [None] * len(self.spans)
        return sum(self.step_times)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class Interval(TypedDict):
    """reduce_interval's figures, the same on every rank."""

    loss: float
    samples: float
    """All ranks' samples in the interval."""
    slowest_s: float
    """The slowest rank's step time in it."""
    samples_per_s: float
    per_rank_samples_per_s: list[float]
    per_rank_busy_s: list[float]
    """Each rank's own work per step (StepResult.busy_s), averaged over the interval."""
    step_time_s: float
    data_wait_frac: float


def reduce_interval(meter: Meter, device: torch.device) -> Interval:
    """Collective: the interval's loss averaged over all ranks' samples, global and per-rank
    throughput. Every rank must call it at the same step."""
    elapsed = meter.elapsed(device)
    local = torch.tensor([float(meter.loss_sum), meter.samples, elapsed,
                          meter.busy_time / max(len(meter.step_times), 1)], dtype=torch.float64,
                         device=device)
    world = dist.get_world_size()
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    rows = torch.stack(gathered).cpu()
    loss_sum, samples = rows[:, 0].sum().item(), rows[:, 1].sum().item()
    per_rank = [(r[1] / r[2]).item() if r[2] > 0 else 0.0 for r in rows]
    # The ranks step in lockstep, so global throughput is all samples over the slowest rank's time.
    slowest = rows[:, 2].max().item()
    return {
        "loss": loss_sum / max(samples, 1),
        "samples": samples,
        "slowest_s": slowest,
        "samples_per_s": samples / slowest if slowest > 0 else 0.0,
        "per_rank_samples_per_s": per_rank,
        "per_rank_busy_s": rows[:, 3].tolist(),
        "step_time_s": elapsed / max(len(meter.step_times), 1),
        "data_wait_frac": meter.data_time / elapsed if elapsed > 0 else 0.0,
    }


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float | None
    """Share of correct predictions (per token for token data); None when the outputs do not
    score classes (a regression loss, say)."""
    count: int
    """Samples evaluated."""
    correct: int
    predictions: int
    """Predictions scored: samples, or tokens for token data."""
    own: dict[str, float] = field(default_factory=dict)
    """train.metrics' values, each computed over every rank's samples."""


def _lockstep_batches(model: nn.Module, loader: DataLoader[Any], state: TrainState) -> list[batches.Batch]:
    """A sharded model (FSDP) all-gathers each block in every forward, so all ranks must run
    as many forwards; the unpadded shards may differ by a batch. A rank with fewer batches
    repeats a batch of its own that many times, uncounted. Empty for an unsharded model."""
    if not hasattr(model, "set_requires_gradient_sync"):  # FSDP2's FSDPModule
        return []
    most = torch.tensor([len(loader)], device=state.device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    missing = int(most.item()) - len(loader)
    if not missing:
        return []
    return [state.batch(loader.collate_fn([loader.dataset[0]]))] * missing


def evaluate(model: nn.Module, loader: DataLoader[Any], state: TrainState) -> EvalResult:
    """Each rank evaluates its unpadded shard; the sums are all-reduced, so the totals are exact.
    The model goes back to the mode it was in: an evaluation in the middle of an epoch
    (train.eval_every_steps) leaves dropout and batch norm training for the rest of it.

    ``model`` is the plain module: DDP's forward may broadcast buffers, a collective that would
    hang when shards differ in length by a batch.
    """
    training = model.training
    try:
        return _evaluate(model, loader, state)
    finally:
        model.train(training)


@torch.no_grad()
def _evaluate(model: nn.Module, loader: DataLoader[Any], state: TrainState) -> EvalResult:
    model.eval()
    beat("evaluation")
    # loss sum, correct, samples, scored predictions, batches that were not classification
    totals = torch.zeros(5, dtype=torch.float64, device=state.device)
    spare = _lockstep_batches(model, loader, state)
    for metric in state.metrics.values():  # an evaluation cut short (a signal) left state behind
        getattr(metric, "reset", lambda: None)()
    for raw in loader:
        batch = state.batch(raw)
        y = batch.target
        with state.autocast():
            outputs = state.forward(model, batch)
        pred = prediction(outputs).float()  # a ModelOutput's .logits, a tuple's first, ...
        # A tensor output in float32 (autocast's half precision loses the loss' digits); any
        # other output as the model returned it, for a loss of your own that reads more of it.
        loss = state.loss(pred if isinstance(outputs, torch.Tensor) else outputs, y)
        totals[0] += loss.double() * batch.size
        totals[2] += batch.size
        for metric in state.metrics.values():
            metric.update(pred, y)
        if state.shape.own_loss:
            totals[4] += 1  # the model aligns its labels itself (a causal LM shifts them)
        elif is_classification(pred, y):
            totals[1] += (pred.argmax(dim=-1) == y).sum()
            totals[3] += y.numel()
        else:
            totals[4] += 1
    for b in spare:  # not counted: only so that every rank joins each all-gather
        with state.autocast():
            state.forward(model, b)
    dist.all_reduce(totals)
    loss_sum, correct, count, scored, other = totals.tolist()
    accuracy = correct / max(scored, 1) if not other else None
    return EvalResult(loss_sum / max(count, 1), accuracy, int(count), int(correct), int(scored),
                      _own_metrics(state.metrics))


def _own_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Each metric over every rank's samples: torchmetrics' compute() gathers the ranks' states
    (a collective: every rank calls it, in the same order); reset for the next evaluation."""
    out = {}
    for name, metric in metrics.items():
        out[name] = float(metric.compute())
        reset = getattr(metric, "reset", None)
        if callable(reset):
            reset()
    return out
