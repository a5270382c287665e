"""What an unedited training script does, seen through public torch hooks (``script.observe``).

Installed in the script's own process (child.py) before the script runs; nothing of the
script is edited and nothing waits on the device inside its step:

- a **step** is an optimizer step (``register_optimizer_step_post_hook``) after a backward,
  of the first optimizer that stepped (a GAN's second one is not another step: Observer.leads);
  without any torch.optim optimizer, a backward then the model's parameters changed in place
  (Observer._by_hand);
- the **loss** is the tensor a backward starts from (``loss.backward()`` or
  ``torch.autograd.backward(loss)``; under a ``GradScaler`` or FSDP's ``ShardedGradScaler``,
  the tensor it scaled, not the scaled one), the last before the step's optimizer step (a
  GAN's: its discriminator's last, also at an epoch's end; undivided where each of the step's N
  backwards divided it by N: Observer._accumulated; an L-BFGS closure's first), kept detached
  and read (``.item()``) only at log points;
- **samples** per step: the first dimension of the first tensor fed to the outermost
  DDP/FSDP module (of several, the one the leading optimizer steps; a forward pre-hook
  attached when the script builds it; its compiled wrapper's under
  ``torch.compile(DDP(model))``) at each call in the step, else to the model: the module
  given to torch.compile, or the first module a step calls with gradients that has parameters
  to train (not a transform of the data pipeline) (inside a Hugging Face dict or Lightning's
  ``(batch, batch_idx)``; a list of images counts its images), never more than the script's
  data loaders gave since the last step (a GAN's discriminator forwards fakes too); forwards
  without gradients are evaluation, not training, and so are forwards of a model in eval mode
  (``model.eval()`` without ``torch.no_grad()``) that no backward follows; nothing is seen inside code
  torch.compile traces;
- **epochs** from ``DistributedSampler.set_epoch`` (without it: a pass of the data loader that
  feeds the steps, from ``iter(loader)``), each to its last step's end or, later, that data
  loader's running out (``StopIteration``, once its workers have shut down);
- per rank, **data wait** (the previous step's end, or the last evaluation forward since,
  to this step's first forward), **forward**
  and **backward + optimizer**: on a CPU by the host clock; on a GPU by marks on the device's
  stream (CUDA events, marks.py) at those points, read once the device has passed them (a step
  or more later, never waited for), so they are the device's times, not the host's launches
  (its data wait is the time the device sat idle for input);
- **FLOPs** per sample by ``torch.utils.flop_counter`` on one sample of the first step's batch,
  x 3 (or ``script.flops_per_sample``), and the device's peak (mfu.py), once the script has
  ended (not inside its timings: a CPU's peak measure takes ~0.3 s);
- a **heartbeat** per phase (forensics/heartbeat.py), so the node's hang watch names the rank,
  the phase and the step for a script as for ddplab's loop.

Rank 0 writes the live figures (``train/loss``, ``train/samples_per_s``...) into the node's
spool as ``ddplab.track`` does; every rank writes its totals into its report file, from which
rank 0's supervisor records the per-rank figures, the job's throughput, MFU, stragglers and
``summary.json`` once the script has ended (supervisor.py). Names the script logs itself
(through ``ddplab.track`` or MLflow's fluent API) are never written by the observation.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import resource
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import torch

from ...forensics.heartbeat import AFTER_TRAINING, BETWEEN_STEPS, OUTSIDE_LOADER
from .. import marks
from .env import FORENSICS_ENV, OBSERVE_ENV, STEP_OFFSET_ENV
from .imports import after_import

LOG_EVERY_STEPS = 10
"""A log point every this many steps (as ddplab's loop's ``train.log_every``), and at every
epoch's end: the only places the loss is read from the device. Steps, not seconds: a seeded
script's rerun logs at the same steps, so ``ddplab reproduce`` compares like with like."""
WARMUP_STEPS = 1
"""Steps left out of the steady figures (the first: lazy initialisation, allocator warm-up)."""
MAX_UNREAD = 256
"""Steps whose device marks are kept waiting to be read. A step whose marks cannot be read
(past this many: a device hundreds of steps behind; a failed device; the script's end, after
FINISH_PATIENCE_S) is left out of the steady figures, as the warm-up is: the host clock on a
GPU times launches, not the step."""
CREATED = "_ddplab_created"
"""A data loader iterator's attribute: when ``iter(loader)`` made it (an epoch without
set_epoch starts there, its workers' start included)."""
FINISH_PATIENCE_S = 10.0
"""At the script's end, how long its last steps' marks are waited for."""
UNSEEN, UNREACHED = -1, 0
"""A forward's ``Forward.reached``: no output of it could be watched (not a tensor that
requires grad); none of its outputs got a gradient yet. Above 0: the number of the backward
that reached it."""
OUTPUTS_WATCHED = 8
"""At most this many of a forward's output tensors get a gradient hook (the loss may use
any: Hugging Face's ``loss`` or ``logits``, a detector's several heads)."""


@dataclass
class Forward:
    """One of the step's forwards of the model (gradients on, train mode)."""

    rows: int
    at: float
    mark: Any
    loaded: int
    """what the data loaders had given since the last step, this forward's batch included"""
    reached: int = UNSEEN


@dataclass
class Step:
    """One optimizer step: its phases by the host clock and, on a GPU, its device marks
    (the previous step's end, the first forward, the backward, this step's end)."""

    number: int
    samples: int
    host: tuple[float, float, float]
    """data wait, forward, backward + optimizer (seconds)"""
    marks: tuple[Any, Any, Any, Any] | None = None
    rows: int = 0
    """the rows the model's forwards took (a GAN's fakes, SAM's second pass too): MFU's"""
    loader_s: float = 0.0
    """host time inside the data loaders' ``next()`` since the last step"""
    start_up: bool = False
    """the script's first MLflow call ran in it (its client opening the store, ~0.9 s on a
    SQLite file): a one-time start-up cost, left out of the steady figures as the first step"""


@dataclass
class Window:
    """Per-step figures since the last log point."""

    steps: int = 0
    samples: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0
    busy: list[float] = field(default_factory=list)

    def add(self, samples: int, step_s: float, wait_s: float, busy_s: float) -> None:
        self.steps += 1
        self.samples += samples
        self.step_s += step_s
        self.wait_s += wait_s
        self.busy.append(busy_s)


@dataclass
class Totals:
    """This rank's whole job: what its report carries to rank 0's supervisor."""

    steps: int = 0
    samples: int = 0
    steady_samples: int = 0
    steady_rows: int = 0
    steady_s: float = 0.0
    wait_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    loader_s: float = 0.0
    """Of the steady steps, host time inside the data loaders' ``next()``: how much of the
    data wait was loading, not other work between steps (a rank's own logging)."""
    loaders: bool = False
    busy: list[float] = field(default_factory=list)
    epochs: list[dict[str, float]] = field(default_factory=list)
    loss: float | None = None
    observe_s: float = 0.0
    """Time spent in the observation's own hooks during the steady steps: what it costs."""
    backwards: int = 0
    """Backwards seen: a script with some and no step trained without a step ddplab sees."""

    def report(self) -> dict[str, Any]:
        steady = self.steady_samples / self.steady_s if self.steady_s > 0 else 0.0
        rows = self.steady_rows / self.steady_s if self.steady_s > 0 else 0.0
        busy = statistics.median(self.busy) if self.busy else 0.0
        return {"steps": self.steps, "samples": self.samples,
                "samples_per_s": round(steady, 3), "rows_per_s": round(rows, 3),
                "busy_s": round(busy, 6),
                "data_wait_s": round(self.wait_s, 4), "forward_s": round(self.forward_s, 4),
                "backward_s": round(self.backward_s, 4), "epochs": self.epochs,
                "observe_s": round(self.observe_s, 6), "steady_s": round(self.steady_s, 4),
                "steady_steps": len(self.busy), "loader_s": round(self.loader_s, 4),
                "loaders": self.loaders, "backwards": self.backwards,
                "loss": self.loss}


class Observer:
    """The hooks' state in this process; one per script."""

    def __init__(self, rank: int, world: int, flops_given: float,
                 write: Callable[[dict[str, Any]], None], spool: Callable[[dict[str, Any]], None],
                 beat: Callable[[str, int | None], None],
                 marker_for: Callable[[torch.device], Callable[[], Any] | None] | None = None
                 ) -> None:
        self.rank, self.world, self.flops_given = rank, world, flops_given
        self._write, self._spool, self._beat = write, spool, beat
        # the model's device -> a function marking its stream (None: the host clock), looked
        # for at each step's first forward until a GPU is found (a script may warm up on the
        # CPU, then move its model); dropped for good if the device fails
        self.marker_for = marker_for or _marker_for
        self.marker: Callable[[], Any] | None = None
        self.marks_failed = False
        self.m_forward: Any = None
        self.m_backward: Any = None
        self.m_end: Any = None  # the previous step's end mark
        self.unread: collections.deque[Step] = collections.deque()
        self.totals, self.window = Totals(), Window()
        self.step_end = 0.0  # the previous step's end (0: none yet)
        self.t_forward = self.t_backward = 0.0
        self.samples = 0
        # the step's forwards, whose outputs' gradient hooks say which ones a backward reached:
        # one none reached is no training (an evaluation with gradients on, in train mode)
        self.forwards: list[Forward] = []
        self.backwards = 0  # backwards seen (their number: which forwards each one reached)
        # samples the script's data loaders gave since the last step: a bound on the step's
        # forwards' count (a GAN's discriminator sees each real batch and two fake ones)
        self.loaded = 0
        self.in_loader = 0.0  # host time inside the loaders' next() since the last step
        self.credit = 0  # what the loaders gave one step ahead (a prefetching loader's next batch)
        self.fewest = 0  # the smallest batch a forward of this step took (0: none yet)
        self.feeding: weakref.ref[Any] | None = None  # the loader iterator that fed training
        self.last_iter: weakref.ref[Any] | None = None  # the one that gave the last batch
        self.fed_from = 0  # the feeding iterator's data (_data_of), which outlives it
        self.loss: torch.Tensor | None = None  # the last backward's
        # the loss the model's last forward returned (Lightning's training_step's, a Hugging
        # Face model's given labels) and the one given to Accelerate's backward: what a
        # backward from it divided by a constant (gradient accumulation's 1/N) stands for
        self.returned: torch.Tensor | None = None
        self.given: torch.Tensor | None = None
        self.step_loss: torch.Tensor | None = None  # the last backward's before the last step
        # Each backward's loss's constant divisor in this step (``(loss / N).backward()``: N;
        # else 1), the step loss's (N where each of the step's N backwards divided by N: the
        # loss the script computed, not its Nth), and the N of the last step that had one
        self.divisors: list[float] = []
        self.step_scale = 1.0
        self.accumulates = 1.0
        # the optimizer step's closure: its calls in this step, and which one runs now (0:
        # none): from its second call on it evaluates the step's batch again (L-BFGS)
        self.closure_calls = self.closure_now = 0
        # A Hugging Face model given num_items_in_batch (its Trainer's gradient accumulation)
        # divides each micro-batch's summed loss by the whole step's item count: each backward's
        # loss is a share of the step's, which the Trainer logs as their sum (``summed``).
        self.per_item = False
        self.summed: torch.Tensor | None = None
        # a forward of the model in eval mode with gradients on (model.eval() without
        # torch.no_grad()): its time, device mark and samples, a training step's start only if
        # a backward follows it (a script that trains in eval mode), else an evaluation's
        # (the first's time and mark, the samples, the last's time and mark)
        self.held: tuple[float, Any, int, float, Any] | None = None
        # the time and device mark of the last evaluation forward since the last step: the
        # next step's data wait starts there, not at the step's end (an epoch's evaluation is
        # not the next step's data wait)
        self.evaluated: tuple[float, Any] | None = None
        # (a scaled tensor, what a GradScaler scaled) of the last scale(): the loss a backward
        # from it stands for (a list of losses scaled at once gives one pair each)
        self.scaled: list[tuple[weakref.ref[torch.Tensor], torch.Tensor]] = []
        self.sample: Any = None  # one sample of the first step, for the FLOP count
        # what the first step's matmuls computed in (autocast's, the model's): the MFU's peak
        self.dtype = torch.float32
        self.outer: torch.nn.Module | None = None
        self.found: Any = None  # the hook on a model found by its first call (no DDP/FSDP)
        self.hooked: Any = None  # the forward pre-hook on the model (self.outer)
        self.done: Any = None  # its forward hook (forward_done)
        # the pre-hook on the model's first sequence-first module (an LSTM, a Transformer
        # layer without batch_first): its input's second dimension is the batch
        self.seq_hook: Any = None
        self.own_hooks: set[int] = set()  # the ids of the hooks on the script's modules: _unhooked
        # this forward's rows by its first dimension (and its arguments, at the first forward,
        # for the FLOP count's sample), until the sequence-first module says the batch
        self.seq_pending: tuple[int, Any] | None = None
        self.wrappers: list[weakref.ref[torch.nn.Module]] = []  # every DDP/FSDP the script built
        self.choose: Callable[[torch.nn.Module], Any] | None = None  # hooks another model
        self.wrapped = False  # inside the call of the compiled wrapper of the model
        self.lead: weakref.ref[torch.optim.Optimizer] | None = None  # whose step ends a step
        # Without an optimizer: the model's parameters' versions at the last backward (a step
        # ends once they change: _by_hand)
        self.versions: int | None = None
        self.unused_at: float | None = None  # the first forward since that backward
        self.cleared = False  # steps by hand seen by the model's zero_grad: grads_cleared
        # a torch.optim optimizer was made: its steps are the steps, never an in-place change
        # (SAM's first step perturbs the parameters before its second forward)
        self.optimizer_made = False
        self.other: torch.optim.Optimizer | None = None  # another that stepped since the lead's
        self.other_steps = 0
        self.epoch, self.epoch_start, self.epoch_steps = -1, 0.0, 0
        self.epoch_end = 0.0  # when the epoch's data loader ran out after its last step (0: not)
        # Without DistributedSampler.set_epoch (Hugging Face's Trainer, Accelerate, an
        # IterableDataset), an epoch is a pass of the loader that feeds the steps: a new
        # iterator of it after the last one ran out.
        self.sampler_epochs = False  # set_epoch was called: its epochs, not the loader's
        self.ran_out = False  # the iterator feeding the steps has run out
        self.reset = False  # ... and was reset since (a loader with persistent workers)
        self.iter_start = 0.0  # when the last batch's iterator gave its first
        self.logged_step = 0
        self.sent: set[str] = set()  # the names this rank's log points put in the spool
        self.pending: dict[str, Any] | None = None  # rank 0's last log point, written at the next
        self.flops: dict[str, Any] = {}
        self.unreplayable = False  # a forward's arguments the FLOP count cannot replay
        self.own_s = 0.0  # time in these hooks since the last step's end (_hooks' timed)
        self.start_up = False  # the script's first MLflow call came since the last step's end
        self.step_offset = 0  # the run's step of this attempt's step 0 (STEP_OFFSET_ENV)
        # the script has ended: the hooks see nothing more (the FLOP count's own forward and
        # backward of the model are not a step, nor an evaluation after the heartbeat's "done")
        self.ended = False
        self.past_training = False  # the script destroyed its process group after its steps

    # ---- the hooks ----

    def forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> None:
        """A forward pre-hook: the outermost module's, or (no DDP/FSDP) every module's."""
        if self.outer is not None and module is not self.outer or self.wrapped:
            return
        if self.versions is not None:
            self._by_hand(time.perf_counter())
            if self.versions is not None and self.cleared and not torch.is_grad_enabled():
                # a script whose zero_grad ends its steps, evaluating after a backward: that
                # step is over (else the evaluation read as its backward, and no evaluation)
                self.optimizer_step(time.perf_counter())
            elif self.versions is not None and self.unused_at is None:
                self.unused_at = time.perf_counter()  # (grads_cleared's last step: finish)
        if not torch.is_grad_enabled():
            if self.outer is not None or not self.t_forward:
                self._beat("evaluation", None)
            # An evaluation, in eval mode: a no_grad forward in train mode between steps is a
            # step's own (scoring its batch first: OHEM, a label guess), not an evaluation.
            if self.outer is not None and not self.t_forward and self.step_end \
                    and _in_eval_mode(module):
                self.evaluated = (time.perf_counter(), self._mark())
                self.loaded = self.credit = 0  # (the evaluation's batches)
                self.in_loader = 0.0
            return
        if self.t_forward and self.outer is None:
            return  # a module inside the step's first one
        now = time.perf_counter()
        if self.marker is None and not self.marks_failed and not self.t_forward:
            self.marker = self.marker_for(_step_device(module, args, kwargs))
        call = None
        if self.sample is None and not self.flops:
            self.sample = _one_sample(args, kwargs)
            self.unreplayable = self.sample is None and bool(args or kwargs)
            device = _step_device(module, args, kwargs)
            self.dtype = _compute_dtype(module, device)
            self._dtype_inside(module, device)
            call = (args, kwargs)
        if _in_eval_mode(module):  # (a step's later micro-batches too, training in eval mode)
            mark = None if self.t_forward else self._mark()
            at, first, samples, _, _ = self.held or (now, mark, 0, now, mark)
            self.held = (at, first, samples + _batch_size(args, kwargs), now, mark)
            if not self.t_forward:
                self._beat("evaluation", None)
            return
        if kwargs.get("num_items_in_batch") is not None:
            self.per_item = True
        if self.held is not None:  # an evaluation's forwards: no backward came
            if not self.t_forward and self.step_end:
                self.evaluated = self.held[3:]
            self.held = None
        if not self.t_forward:
            self._begin(now, self._mark())
            self._beat("forward", None)
            mark = self.m_forward
        else:  # (a mark only before the step's first backward: where an evaluation may end)
            mark = self._mark() if not self.t_backward else None
        if self.closure_now > 1:
            return  # the step's closure again (L-BFGS's up to max_iter calls): the same batch
        rows = _batch_size(args, kwargs)
        self._rows(rows)
        self.forwards.append(Forward(rows, now, mark, self.loaded))
        if self.seq_hook is not None:
            self.seq_pending = (rows, call)

    def forward_done(self, module: torch.nn.Module, output: Any) -> None:
        """A forward hook of the model: gradient hooks on its output tensors, which say whether
        a backward reaches this forward (``Forward.reached``)."""
        if module is not self.outer or not self.forwards or not torch.is_grad_enabled():
            return
        forward = self.forwards[-1]
        if forward.reached != UNSEEN:
            return  # (the step's forward was a model inside it)
        for t in _grad_tensors(output, OUTPUTS_WATCHED):
            t.register_hook(functools.partial(self._reached, forward))
            forward.reached = max(forward.reached, UNREACHED)  # (watched, once a hook is on)
        self.returned = _returned_loss(output)

    def _reached(self, forward: Forward, grad: torch.Tensor) -> None:
        """A backward reached an output of ``forward`` (in the autograd engine's thread)."""
        if forward.reached <= 0:
            forward.reached = max(self.backwards, 1)

    def _dtype_inside(self, model: torch.nn.Module, device: torch.device) -> None:
        """Autocast entered inside the model (Accelerate's and Hugging Face Trainer's wrapped
        forward, an ``@autocast`` forward), past the outermost module's hook: read once more at
        its first matmul layer's first call. Not in a compiled model (a hook added to it would
        make torch compile it again), nor while torch.compile traces the model from outside
        (``torch.compile(DDP(model))``: the hook's ``remove`` cannot be traced, and Dynamo ran
        the model's frame eagerly)."""
        layers = [m for m in model.modules() if isinstance(m, MATMUL_LAYERS)]
        if not layers or torch.compiler.is_compiling() or any(
                hasattr(m, "_orig_mod") for m in model.modules()):
            return

        def once(layer: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if torch.compiler.is_compiling():
                return  # compiled after the first forward: read again in its next eager call
            handle.remove()
            if self.ended:  # the FLOP count's own forward, outside the script's autocast: a
                return  # compiled model's layer is first called eagerly there (bf16 read fp32)
            with contextlib.suppress(Exception):  # (never the script's failure)
                self.dtype = _compute_dtype(layer, device)

        handle = layers[0].register_forward_pre_hook(once)
        self.own_hooks.add(handle.id)

    def sequence_batch(self, args: tuple[Any, ...]) -> None:
        """The pre-hook of the model's sequence-first module (its input: sequence, batch,
        features): the model's forward took that many samples, not its input's first
        dimension (35 time steps of pytorch/examples' word language model, not 20 sequences)."""
        if self.seq_pending is None:
            return
        (rows, call), self.seq_pending = self.seq_pending, None
        batch = _sequence_rows(args[0]) if args else 0
        if not batch or batch == rows:  # (a batch-first input, transposed inside: as it was)
            return
        self.samples += batch - rows
        if self.forwards:
            self.forwards[-1].rows = batch
        self.fewest = batch if self.fewest in (0, rows) else min(self.fewest, batch)
        if call is not None:  # one sample is a slice of the second dimension
            first_args, first_kwargs = call
            self.sample = _one_sample(first_args, first_kwargs, along=1, size=batch)

    def backward(self, loss: torch.Tensor | None) -> None:
        """A backward from ``loss`` (None: from several tensors at once)."""
        if self.held is not None:  # it trained, in eval mode
            at, mark, samples, _, _ = self.held
            if not self.t_forward:
                self._begin(at, mark)
            self._rows(samples)
            self.held = None
        self.backwards += 1
        self.totals.backwards += 1
        if not self.optimizer_made and self.outer is not None:
            self.versions, self.unused_at = _versions(self.outer), None
        if not self.t_backward:
            self.t_backward = time.perf_counter()
            self.m_backward = self._mark()
            self._beat("backward", None)
        known, self.returned, self.given = (self.given, self.returned), None, None
        if loss is None or loss.numel() != 1 or self.closure_now > 1:
            return  # (a closure's later backwards: L-BFGS's step returns its first one's loss)
        for ref, unscaled in self.scaled:
            if ref() is loss:  # GradScaler.scale(loss).backward(): the loss, not x 65536
                loss = unscaled
                break
        loss = _undivided(loss, [t for t in known if t is not None])
        if len(self.divisors) < MAX_DIVISORS:  # (bounded: a script whose steps go unseen)
            self.divisors.append(1.0 if self.per_item else _divisor(loss))
        loss = loss.detach()
        if self.per_item:  # (a share of the step's loss: the step's is their sum)
            loss = self.summed = loss if self.summed is None else self.summed + loss
        self.loss = loss

    def _begin(self, at: float, mark: Any) -> None:
        """A training step's first forward, at ``at``: its data wait starts at the last
        evaluation forward since the last step, if any (the evaluation's batches and forwards
        are not this step's input; what follows that forward still is)."""
        if self.loaded or self.credit:
            self._loader_epoch(self.last_iter)  # (first: an epoch ends at its last step)
            self.feeding = self.last_iter  # (its end is the epoch's: loader_done)
            self.fed_from = _data_of(self.last_iter() if self.last_iter is not None else None)
            self.totals.loaders = True
        if self.evaluated is not None and self.evaluated[0] <= at:
            self.step_end = self.evaluated[0]
            self.m_end = self.evaluated[1] if self.evaluated[1] is not None else self.m_end
        self.evaluated = None
        self.past_training = False
        self.t_forward, self.m_forward = at, mark

    def _rows(self, n: int) -> None:
        self.samples += n
        if n:
            self.fewest = min(self.fewest, n) if self.fewest else n

    def scale(self, scaled: Any, outputs: Any) -> None:
        """After ``GradScaler.scale(outputs)`` (a tensor, or a list or tuple of them): remember
        what each scaled tensor stands for, until the next ``scale`` (a tensor backed twice,
        ``retain_graph``, is still the same loss)."""
        pairs = zip(scaled, outputs, strict=False) if isinstance(outputs, (list, tuple)) \
            and isinstance(scaled, (list, tuple)) else [(scaled, outputs)]
        self.scaled = [(weakref.ref(s), o) for s, o in pairs
                       if isinstance(s, torch.Tensor) and isinstance(o, torch.Tensor)
                       and s is not o]

    def leads(self, opt: torch.optim.Optimizer) -> bool:
        """Whether this optimizer's step ends a training step: the first optimizer that
        stepped, not a second one (a GAN's generator, also after new forwards: DCGAN's order);
        one that steps twice in a row while the first does not took its place (a script that
        replaced its optimizer)."""
        lead = self.lead() if self.lead is not None else None
        if lead is None or lead is opt or self.other_steps >= 1 and self.other is opt:
            self.lead, self.other, self.other_steps = weakref.ref(opt), None, 0
            return True
        if self.other is not opt:
            self.other, self.other_steps = opt, 0
        self.other_steps += 1
        return False

    def _by_hand(self, now: float) -> None:
        """No torch.optim optimizer was made, and the model's parameters changed in place since
        the last backward (``p -= lr * p.grad`` under ``torch.no_grad()``, as PyTorch's "What
        is torch.nn really?" trains): the script updates them itself, and that was a step, ended
        ``now``: at the data loader's next ``next()`` (its batch is the next step's data wait),
        else the next forward. Gradient accumulation's micro-batches change no parameter between
        their backwards."""
        if self.optimizer_made or self.outer is None or self.versions is None \
                or _versions(self.outer) == self.versions:
            return
        self.optimizer_step(now)

    def grads_cleared(self, module: torch.nn.Module) -> None:
        """``module.zero_grad()``: where no torch.optim optimizer was made, the model in train
        mode cleared its gradients after a backward, so the script used them: a step by hand
        that ended now, also one through ``p.data`` (pytorch/examples' word_language_model:
        ``p.data.add_(p.grad, alpha=-lr)``, unseen in ``p``'s version counter). A model in
        eval mode (an adversarial example's input gradient) is not trained."""
        outer = self.outer
        if self.optimizer_made or outer is None or self.versions is None or not outer.training:
            return
        if module is outer or any(m is outer for m in module.modules()) \
                or any(m is module for m in outer.modules()):
            self.cleared = True
            self.optimizer_step(time.perf_counter())

    def optimizer_step(self, at: float | None = None) -> None:
        """After an optimizer's step: the step's end, if a forward or backward came since the
        last one (a backward through ``torch.autograd.grad`` is not seen: the step's end
        stands in for its start); ``at``: when a step without an optimizer ended (_by_hand)."""
        self.versions = None
        if not (self.t_backward or self.t_forward):
            return
        now = at if at is not None else time.perf_counter()
        end = self._mark()
        self.t_backward = self.t_backward or now
        self._trained_forwards()
        t = self.totals
        if not t.steps:
            self._lead_model()
        first_forward = self.t_forward or self.t_backward
        start = self.step_end or first_forward
        t.steps += 1
        rows, samples = self.samples, self._bounded()
        t.samples += samples
        self.epoch_steps += 1
        if t.steps > WARMUP_STEPS:
            t.observe_s += self.own_s
        step = Step(t.steps, samples, (first_forward - start, self.t_backward - first_forward,
                                       now - self.t_backward), rows=rows,
                    loader_s=self.in_loader, start_up=self.start_up)
        m_forward = self.m_forward or self.m_backward or end
        m_backward = self.m_backward or end
        m_start = self.m_end or m_forward
        if end is not None and None not in (m_start, m_forward, m_backward):
            step.marks = (m_start, m_forward, m_backward, end)
            self.unread.append(step)
        else:
            self._count(step, *step.host)
        self._read()
        self.step_end, self.t_forward, self.t_backward, self.samples = now, 0.0, 0.0, 0
        self.forwards = []
        self.seq_pending = None
        self.loaded = self.fewest = 0
        self.in_loader = 0.0
        # The loss of the step's leading optimizer, at every log point: a GAN's generator
        # backward after it (DCGAN's order) is not the step's loss at the epoch's end only.
        self.step_loss, self.held, self.evaluated = self.loss, None, None
        self.step_scale = self._accumulated()
        self.per_item, self.summed = False, None
        self.m_end, self.m_forward, self.m_backward = end, None, None
        self.own_s, self.start_up = 0.0, False
        if not self.ended:  # (the script's last step by hand, seen at its end: it is "done")
            self._beat(OUTSIDE_LOADER if t.loaders else BETWEEN_STEPS, t.steps + 1)
        if (self.step_offset + t.steps) % LOG_EVERY_STEPS == 0:  # the run's steps 10, 20, ...
            self.log_point()  # (a resumed attempt's too), whatever epochs ended between

    def counted(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """An optimizer step's closure, its calls counted: the first is the step's (Lightning's
        closure, a step's only call: the last micro-batch's under gradient accumulation; a
        closure looping over micro-batches counts them all), the later ones (L-BFGS's, up to
        ``max_iter``) evaluate the same batch again."""
        @functools.wraps(closure)
        def call() -> Any:
            self.closure_calls += 1
            outer, self.closure_now = self.closure_now, self.closure_calls
            try:
                return closure()
            finally:
                self.closure_now = outer
        call.__dict__[COUNTED] = True
        return call

    def _accumulated(self) -> float:
        """N, where each of the step's N backwards was from its loss divided by N (gradient
        accumulation's ``(loss / N).backward()``; fewer at an epoch's end, after steps of N):
        the step's loss is then the last micro-batch's undivided, as the script computes and
        prints it, not its Nth (a study over N compared N's, not losses); else 1."""
        divisors, self.divisors = self.divisors, []
        n = divisors[0] if divisors else 1.0
        if n <= 1 or any(d != n for d in divisors) or len(divisors) > n or \
                len(divisors) < n and self.accumulates != n:
            return 1.0
        self.accumulates = n
        return n

    def _trained_forwards(self) -> None:
        """The step's samples and start from the forwards a backward reached. One none reached
        is not training: its rows are not the step's (an evaluation with gradients on, in train
        mode, counted ~7x the samples of a script evaluating each epoch), and when such forwards
        came first, the step starts at its first forward a backward reached, its data wait after
        the last of them (as after an evaluation in eval mode). Without a data loader to bound
        them (_bounded), the forwards one backward reached count as the largest of them: one
        batch seen twice (two augmented views, a GAN's real and fake) is one batch's samples;
        each micro-batch's own backward still counts it."""
        seen = [f for f in self.forwards if f.reached != UNSEEN]
        reached = [f for f in seen if f.reached > 0]
        if not reached:
            return  # (nothing to tell by: every forward counts, as before)
        before = self.forwards[:self.forwards.index(reached[0])]
        if before and all(f.reached == UNREACHED for f in before):
            self.step_end, self.t_forward = before[-1].at, reached[0].at
            if before[-1].mark is not None and reached[0].mark is not None:
                self.m_end, self.m_forward = before[-1].mark, reached[0].mark
            # (the evaluation's batches are not this step's, nor a bound on the next one's)
            self.loaded, self.credit = max(0, self.loaded - before[-1].loaded), 0
        self.samples -= sum(f.rows for f in seen if f.reached == UNREACHED)
        if not (self.loaded or self.credit):
            largest: dict[int, int] = {}
            for f in reached:
                largest[f.reached] = max(largest.get(f.reached, 0), f.rows)
            self.samples -= sum(f.rows for f in reached) - sum(largest.values())

    def _lead_model(self) -> None:
        """At the first step: the model is the DDP/FSDP whose parameters the leading optimizer
        steps, not the first one built (a GAN that wraps its generator first: its
        discriminator's forward, backward and the generator's step read as data wait)."""
        opt = self.lead() if self.lead is not None else None
        if opt is None or self.outer is None or self.choose is None:
            return
        stepped = {id(p) for group in opt.param_groups for p in group["params"]}
        if any(id(p) in stepped for p in self.outer.parameters()):
            return
        for ref in self.wrappers:
            module = ref()
            if module is not None and any(id(p) in stepped for p in module.parameters()):
                self.choose(module)
                self.sample, self.unreplayable = None, False  # (the other model's input)
                return

    def _mark(self) -> Any:
        if self.marker is None:
            return None
        try:
            return self.marker()
        except RuntimeError:  # the device failed: the script's own next call says so, not ours
            self.marker, self.marks_failed = None, True
            self._drop_unread()
            return None

    def _count(self, step: Step, wait: float, forward: float, rest: float) -> None:
        """A step's phases into the window and the totals (the warm-up's left out)."""
        if step.number <= WARMUP_STEPS or step.start_up:
            return
        t, took = self.totals, wait + forward + rest
        t.steady_samples += step.samples
        t.steady_rows += step.rows or step.samples
        t.loader_s += step.loader_s
        t.steady_s += took
        t.wait_s, t.forward_s, t.backward_s = t.wait_s + wait, t.forward_s + forward, \
            t.backward_s + rest
        t.busy.append(wait + forward)
        self.window.add(step.samples, took, wait, wait + forward)

    def _read(self, patience_s: float = 0.0) -> None:
        """Count the steps whose marks the device has passed, oldest first; wait for the rest
        only up to ``patience_s`` (the script's end)."""
        if self.unread and marks.capturing():
            return  # asking about a mark would break the script's CUDA graph capture
        deadline = time.perf_counter() + patience_s
        while self.unread:
            step = self.unread[0]
            try:
                # all four: the script may have switched streams within the step
                done = all(marks.passed(m) for m in step.marks or ())
                phases = self._device_phases(step) if done else None
            except RuntimeError:  # a failed device: no mark can be read any more
                self.marker, self.marks_failed = None, True
                self._drop_unread()
                return
            if phases is not None:
                self.unread.popleft()
                self._count(step, *phases)
            elif len(self.unread) > MAX_UNREAD:
                self.unread.popleft()
            elif time.perf_counter() < deadline:
                time.sleep(0.001)
            else:
                return

    def _drop_unread(self) -> None:
        """Steps whose marks cannot be read: left out of the steady figures (MAX_UNREAD)."""
        self.unread.clear()

    @staticmethod
    def _device_phases(step: Step) -> tuple[float, float, float]:
        assert step.marks is not None
        start, forward, backward, end = step.marks
        return (marks.seconds(start, forward), marks.seconds(forward, backward),
                marks.seconds(backward, end))

    def set_epoch(self, epoch: int) -> None:
        if self.versions is not None:
            self._by_hand(time.perf_counter())
        self.sampler_epochs = True
        if epoch == self.epoch:
            return  # the other samplers of the same epoch (validation's)
        self.end_epoch()
        self._start_epoch(epoch, time.perf_counter())

    def _start_epoch(self, epoch: int, at: float) -> None:
        self.epoch, self.epoch_start, self.epoch_steps, self.epoch_end = epoch, at, 0, 0.0

    def _loader_epoch(self, feeding: weakref.ref[Any] | None) -> None:
        """The steps' first batch from ``feeding``: a new pass of the loader (the first, or
        the one after the last ran out) starts an epoch, when no sampler's set_epoch does."""
        new = feeding() if feeding is not None else None
        old = self.feeding() if self.feeding is not None else None
        # The same iterator is a new pass once reset after it ran out (a loader with persistent
        # workers resets its one iterator); not before: a loader read one batch ahead
        # (Accelerate's, so Hugging Face Trainer's) runs out before its last batch's step.
        if self.sampler_epochs or new is None or (new is old and not (self.ran_out and self.reset)):
            return
        if self.feeding is None:
            self._start_epoch(0, self.iter_start)
        elif self.ran_out:
            self.end_epoch()
            self._start_epoch(self.epoch + 1, self.iter_start)
        self.ran_out = self.reset = False

    def _bounded(self) -> int:
        """The step's samples: its forwards' rows, but no more than the data loaders gave
        (with what they gave a step ahead): a model's forwards of what a model made (a GAN's
        fakes) or of one batch twice (SAM) are not new samples; a batch split into
        micro-batches, or a loader one batch ahead, still counts once. A loader's count under
        the step's smallest forward is in other units (a loader of ready-made batches, a
        token stream reshaped): the forwards count."""
        rows, have = self.samples, self.credit + self.loaded
        samples = rows
        if have and (not rows or have >= self.fewest):
            samples = min(rows, have) if rows else have
        # what this step's loaders gave beyond its samples: the next step's, at most
        self.credit = min(max(0, have - samples), self.loaded)
        return samples

    def batch(self, it: Any, batch: Any, took_s: float = 0.0) -> None:
        """The data loader iterator ``it`` gave ``batch`` in ``took_s``: its samples (the first
        dimension of its first tensor; a list of dicts, or of detection images: their number; 0
        where none is found)."""
        if self.last_iter is None or self.last_iter() is not it:
            self.iter_start = getattr(it, CREATED, time.perf_counter() - took_s)
            if self.t_forward and self.ran_out and _data_of(it) == self.fed_from:
                # Micro-batches left over at the loader's end (a step every N batches) make
                # the next epoch's first step: this epoch ended with its last whole step.
                self._loader_epoch(weakref.ref(it))
        self.last_iter = weakref.ref(it)
        self.in_loader += took_s
        if isinstance(batch, (list, tuple)) and batch and \
                (_images(batch) or isinstance(batch[0], Mapping)):
            self.loaded += len(batch)
        elif isinstance(batch, (list, tuple)):
            self.loaded += _batch_size(tuple(batch[:8]), {})
        else:
            self.loaded += _batch_size((batch,), {})

    def loading(self, inside: bool) -> None:
        """A data loader's ``next()`` begins (``inside``) or has returned, between training
        steps: the heartbeat says "data loading" only while it runs (not for the first step's,
        still set-up's; not in an evaluation)."""
        if inside and self.versions is not None:
            self._by_hand(time.perf_counter())
        if self.totals.steps and not (self.t_forward or self.t_backward or self.past_training) \
                and self.evaluated is None and self.held is None:
            self._beat("data loading" if inside else OUTSIDE_LOADER, self.totals.steps + 1)

    def loading_failed(self) -> None:
        """A data loader's ``next()`` raised (a dataset's ``__getitem__``): the rank fails in
        data loading, the first step's too (whose wait was set-up's while it lasted)."""
        if not self.totals.steps and not self.past_training and self.evaluated is None \
                and self.held is None:
            self._beat("data loading", 1)

    def loader_reset(self, it: Any) -> None:
        """``iter(loader)`` gave ``it`` again (a loader with persistent workers resets its one
        iterator each pass): its next batch starts a pass, as a new iterator's does."""
        if self.last_iter is not None and self.last_iter() is it:
            self.last_iter = None
        self.reset = self.reset or (self.feeding is not None and self.feeding() is it)

    def loader_done(self, it: Any) -> None:
        """The data loader iterator ``it`` ran out (its workers shut down first). The one
        that fed the training steps, after a step and no evaluation since: the epoch's
        training ends here, as a script's own epoch timer has it (a loader with workers takes
        ~5% of a short epoch to shut them down); not another loader's pass (an evaluation
        the hooks do not see, ``update_bn``)."""
        feeding = self.feeding() if self.feeding is not None else None
        self.ran_out = self.ran_out or feeding is it
        if feeding is it and self.epoch_steps and self.evaluated is None and self.held is None:
            self.epoch_end = time.perf_counter()

    def trained(self) -> None:
        """The script destroyed its process group: what fails or hangs now (its own evaluation,
        saving) is past its training, not in the "data loading" of a step that never comes."""
        if self.totals.steps:
            self._beat(AFTER_TRAINING, self.totals.steps)
            self.past_training = True  # (its loaders' next() say nothing: until a new step)

    # ---- log points ----

    def end_epoch(self) -> None:
        if self.epoch < 0 or not self.epoch_steps:
            return
        end = self.epoch_end if self.epoch_end > self.step_end else self.step_end
        took = (end or time.perf_counter()) - self.epoch_start
        self.totals.epochs.append({"epoch": self.epoch + 1, "time_s": round(took, 4),
                                   "steps": self.epoch_steps})
        self.log_point({"epoch/time_s": took, "epoch/epoch": float(self.epoch + 1)})

    def log_point(self, extra: dict[str, float] | None = None) -> None:
        """Read the loss, write rank 0's live figures and this rank's totals."""
        step = self.totals.steps
        # Not while the script captures a CUDA graph (a read breaks the capture).
        loss = self.step_loss if self.step_loss is not None else self.loss
        if loss is not None and not marks.capturing():
            with contextlib.suppress(RuntimeError):  # a failed device: the last loss read stays
                self.totals.loss = float(loss.item()) * (
                    self.step_scale if loss is self.step_loss else 1.0)
        self._read()  # after the loss's read, which the device's work up to it had to pass
        w, self.window = self.window, Window()
        metrics: dict[str, float] = dict(extra or {})
        if self.totals.loss is not None:
            metrics["train/loss"] = self.totals.loss
        if w.steps and w.step_s > 0:
            metrics.update({"train/step_time_s": w.step_s / w.steps,
                            "train/data_wait_frac": w.wait_s / w.step_s})
        if w.steps and w.step_s > 0 and w.samples:  # (no batch seen: no rate, not a rate of 0:
            # gcn's sparse inputs, a forward called directly). Every rank feeds as many
            # samples per step (DistributedSampler): rank 0's x world.
            metrics["train/samples_per_s"] = w.samples / w.step_s * self.world
        self.logged_step = step
        at = self.step_offset + step
        if self.rank == 0 and metrics and step:
            if self.pending is not None and self.pending["step"] == at:
                # an epoch's end at a log point's step: one record (MLflow kept both values)
                self.pending["metrics"].update(metrics)
            else:
                self.flush()
                # (its time now, kept: a rank stopped between the spool's write of it and the
                # state's says it pending still, and its supervisor's copy must land once)
                self.pending = {"op": "log", "ts": int(time.time() * 1000), "step": at,
                                "metrics": metrics}
        self.save()

    def flush(self) -> None:
        """The previous log point's figures into the spool, one log point late: by then a
        script that logs the same names itself has done so (its own call comes after the
        optimizer step that made the log point), and they are left out."""
        record, self.pending = self.pending, None
        if record is not None:
            record["metrics"] = _not_the_scripts(record["metrics"])
            if record["metrics"]:
                self.sent.update(record["metrics"])
                self._spool(record)

    def save(self) -> None:
        clock = "cuda events" if self.marker is not None else \
            "host (the GPU failed: its CUDA events could not be read)" if self.marks_failed else "host"
        # (with the log point not yet in the spool: a rank 0 stopped before its next one, by
        # the hang watch or a peer's failure, never writes it; its supervisor does)
        self._write({"observe": {**self.totals.report(), **self.flops, **_memory(),
                                 "clock": clock, "own_names": sorted(_script_names()),
                                 "sent_names": sorted(self.sent),
                                 "pending": self.pending}})

    def finish(self, ended_well: bool = True) -> None:
        """The script has ended (any way): the last steps' marks and log point; and, when it
        ended well, its last epoch and its FLOPs per sample (a failed script's epoch did not
        end, and no MFU is said of it)."""
        self.ended = True
        if self.versions is not None:
            self._by_hand(time.perf_counter())  # (the last step by hand: no forward after it)
        if ended_well and self.versions is not None and self.cleared:
            # the last step of a script whose steps its zero_grad ended: none came after it
            self.optimizer_step(self.unused_at)
        self._read(FINISH_PATIENCE_S)
        if self.unread:  # the device never passed the last steps: their loss is not read (it
            self.loss = self.step_loss = None  # may never be); the last one read stays
        self._drop_unread()
        # The last log point before the FLOP count (~0.3 s on a CPU): its records at the time
        # the training ended, not after the count (each curve ended on a flat stretch).
        if ended_well and self.epoch >= 0 and self.epoch_steps:
            self.end_epoch()
            self.epoch_steps = 0
        elif self.totals.steps > self.logged_step:
            self.log_point()
        if ended_well and not self.flops and self.totals.steps:
            with contextlib.suppress(Exception):  # (a failed device: no MFU, nothing else lost)
                self._count_flops()
        self.flush()
        self.save()  # (nothing pending any more)

    # ---- once, at the script's end ----

    def _count_flops(self) -> None:
        """FLOPs per sample and this rank's peak (the device's datasheet, or a CPU matmul)."""
        from .. import mfu

        sample, self.sample = self.sample, None
        model = self.outer
        for _ in range(2):  # torch.compile(DDP(model)), DDP(torch.compile(model)): the model
            model = getattr(model, "_orig_mod", model)  # (counted as itself: uncompiled)
            model = getattr(model, "module", model)  # DDP's, FSDP's
        if self.flops_given > 0:
            flops, source = self.flops_given, "script.flops_per_sample"
        elif model is None or sample is None and not self.unreplayable:
            flops, source = 0.0, "no count: no batch seen at the model's outermost module"
        elif sample is None:
            flops, source = 0.0, ("no count: the model's calls take arguments the count cannot "
                                  "replay (Lightning's (batch, batch_idx), or not tensors); give "
                                  "script.flops_per_sample")
        elif type(self.outer).__name__ == "FullyShardedDataParallel":
            # Its module's parameters are views of shards outside its forward; its own forward
            # would gather them: a collective the script's other ranks are not making.
            flops, source = 0.0, ("no count: FSDP's parameters are sharded outside its forward "
                                  "(give script.flops_per_sample)")
        elif uncounted := _uncounted(model):
            # (oneDNN and cuDNN run it as one native op, which torch's counter does not know:
            # a count without it would make such a model's MFU near 0)
            flops, source = 0.0, (f"no count: torch's FLOP counter does not count {uncounted} "
                                  "(give script.flops_per_sample)")
        else:
            flops, source = mfu.flops_per_sample(model, 0.0, sample, "script.flops_per_sample")
        device = _device(model)
        low = self.dtype in (torch.bfloat16, torch.float16)
        precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "fp32")
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            tf32 = not low and model is not None and _tf32(model)
            precision = "tf32" if tf32 else precision
            # (TF32's dense peak is half of bf16's on every chip of the table)
            peak = mfu.table_peak(name, low_precision=low or tf32) / (2 if tf32 else 1)
            peak_source = f"{name} {precision} dense, from the datasheet table"
            where = f"{os.uname().nodename}:{device.index}"
            if not peak:
                peak = mfu.measure_matmul(device, self.dtype if low else torch.float32)
                peak_source = f"{name} {precision} matmul, measured"
        else:
            peak = mfu.measure_matmul(device, self.dtype if low else torch.float32) \
                if flops else 0.0
            peak_source = f"CPU {precision} matmul measured on every rank"
            where = f"rank{self.rank}"
        self.flops = {"flops_per_sample": flops, "flops_source": source, "peak_flops_s": peak,
                      "peak_source": peak_source, "peak_where": where}


def _step_code() -> Any:
    """The code of torch's wrapper around every optimizer's ``step`` (the one that runs the
    step hooks): a frame of it is an optimizer's step in progress (None: a torch without it)."""
    wrap = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    try:
        return wrap(lambda *args, **kwargs: None).__code__ if wrap is not None else None
    except Exception:  # noqa: BLE001 - another torch's wrapper: no nesting seen
        return None


def _inside_another_step(code: Any) -> bool:
    """Whether the optimizer step whose post-hook runs now was called by another one's step
    (two frames of the step wrapper on the stack: its own and the outer one's)."""
    return _steps_on_stack(code) > 1


COUNTED = "__ddplab_counted__"
"""Set on a closure Observer.counted wraps."""


def _steps_on_stack(code: Any) -> int:
    """Frames of the optimizers' step wrapper (``code``) on the stack, up to 2."""
    if code is None:
        return 0
    frame: FrameType | None = sys._getframe(1)
    seen = 0
    while frame is not None and seen < 2:
        if frame.f_code is code:
            seen += 1
        frame = frame.f_back
    return seen




MAX_DIVISORS = 4096
"""Backwards a step's divisors are kept for (more: no step has more micro-batches)."""


def _divisor(loss: torch.Tensor) -> float:
    """N where ``loss`` is a loss divided by the constant N right before its backward
    (``loss / N``, ``loss * (1 / N)``; N a whole number >= 2), else 1. Read from its autograd
    node's saved operand, a host scalar: no device read."""
    fn = loss.grad_fn
    kind = type(fn).__name__
    if kind not in ("DivBackward0", "MulBackward0"):
        return 1.0
    try:
        other = fn._saved_other  # type: ignore[union-attr]
    except RuntimeError:  # (freed: a graph backed before)
        return 1.0
    if not isinstance(other, torch.Tensor) or other.dim() or other.device.type != "cpu" \
            or other.requires_grad or other.dtype == torch.bool:
        return 1.0
    value = float(other)
    n = value if kind == "DivBackward0" else 1 / value if value else 0.0
    return float(round(n)) if n >= 2 and abs(n - round(n)) < 1e-6 else 1.0


def _versions(model: torch.nn.Module) -> int:
    """The sum of the model's parameters' version counters: each in-place change adds one
    (``p -= lr * p.grad``; not ``p.data -= ...``, whose tensor counts its own: grads_cleared)."""
    return sum(p._version for p in model.parameters())


def _in_eval_mode(module: torch.nn.Module) -> bool:
    """``model.eval()`` was called on the model, or on the module DDP/FSDP wraps."""
    inner = getattr(module, "module", None)
    return not module.training or isinstance(inner, torch.nn.Module) and not inner.training


def _trains(module: torch.nn.Module) -> bool:
    """Whether the module has a parameter to train."""
    return any(p.requires_grad for p in module.parameters())


def _the_loss(tensors: Any) -> torch.Tensor | None:
    """The one tensor a backward starts from (None for several)."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    if isinstance(tensors, (list, tuple)) and len(tensors) == 1 \
            and isinstance(tensors[0], torch.Tensor):
        return tensors[0]
    return None


def _returned_loss(output: Any) -> torch.Tensor | None:
    """The loss a forward returned: a one-value tensor that requires grad, itself, under a
    mapping's "loss" (Hugging Face's ModelOutput, Lightning's training_step dict), or the one
    such tensor of a tuple (nanoGPT's ``logits, loss``)."""
    def one(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.requires_grad and t.numel() == 1

    if isinstance(output, Mapping):
        output = output.get("loss")
    if isinstance(output, (list, tuple)):
        found = [t for t in output[:OUTPUTS_WATCHED] if one(t)]
        output = found[0] if len(found) == 1 else None
    return output if one(output) else None


def _undivided(loss: torch.Tensor, known: list[torch.Tensor]) -> torch.Tensor:
    """``loss``, or the loss it was divided from just before the backward, when that is one
    of ``known`` (the model's returned loss, Accelerate's argument): gradient accumulation's
    ``loss / N`` by Lightning, Accelerate or the script (nanoGPT's) stands for the loss the
    step computed, which they log and print, not its Nth."""
    while known and type(loss.grad_fn).__name__ == "DivBackward0":
        parent = loss.grad_fn.next_functions[0][0]  # type: ignore[union-attr]
        found = next((t for t in known if t.grad_fn is parent), None)
        if found is None:
            break
        loss = found
        known = [t for t in known if t is not found]
    return loss


def _grad_tensors(value: Any, most: int, depth: int = 3) -> list[torch.Tensor]:
    """Up to ``most`` tensors that require grad in a forward's output (a tensor; a tuple, list
    or dict of them, Hugging Face's ModelOutput; nested ``depth`` deep)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if isinstance(value, Mapping):
        value = list(value.values())
    if depth <= 0 or not isinstance(value, (list, tuple)):
        return []
    found: list[torch.Tensor] = []
    for v in value[:most]:
        found += _grad_tensors(v, most - len(found), depth - 1)
        if len(found) >= most:
            break
    return found


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Samples in a forward's arguments: the first dimension of the first tensor, looking into
    a Hugging Face batch passed whole (a dict) and Lightning's ``(batch, batch_idx)`` (a list or
    tuple); a list of 3-d tensors is torchvision's detection input, one image each."""
    if len(args) >= 2 and isinstance(args[0], (list, tuple, dict)) and isinstance(args[1], int):
        batch = args[0]  # Lightning's training_step(batch, batch_idx) through DDP
        return _batch_size((), batch) if isinstance(batch, dict) else _batch_size(tuple(batch), {})
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() > 0 else 0
        if isinstance(value, Mapping):  # a Hugging Face batch passed whole
            found = _batch_size((), dict(value))
            if found:
                return found
        if isinstance(value, list) and _images(value):
            return len(value)
    return 0


def _images(value: list[Any] | tuple[Any, ...]) -> bool:
    """A list of 3-d tensors: torchvision's detection input, one image each."""
    return bool(value) and all(isinstance(v, torch.Tensor) and v.dim() == 3 for v in value)


def _one_sample(args: tuple[Any, ...], kwargs: dict[str, Any], along: int = 0, size: int = 0
                ) -> Any:
    """The first sample as a batch of 1, as mfu.counted_flops_per_sample takes it: the one
    tensor argument, several positional tensors of one batch (a tuple), or the keyword
    tensors; None for other call shapes (no count). ``along=1``: a sequence-first model's
    batch of ``size`` is the tensors' second dimension (those of another size are kept whole:
    an attention mask)."""
    def first(t: torch.Tensor) -> torch.Tensor:
        if along and (t.dim() <= along or t.shape[along] != size):
            return t.detach().clone()
        return t.narrow(along, 0, 1).detach().clone()

    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    if len(args) == 1 and len(tensors) == 1:
        return first(tensors[0])
    if len(args) > 1 and len(tensors) == len(args) and not kwargs \
            and (along or len({t.shape[0] for t in tensors}) == 1):  # model(ids, mask)
        return tuple(first(t) for t in tensors)
    if not args and kwargs:
        return {k: first(v) if isinstance(v, torch.Tensor) and v.dim() else v
                for k, v in kwargs.items()}
    return None


MATMUL_LAYERS = (torch.nn.Linear, torch.nn.modules.conv._ConvNd)


def _tf32(model: torch.nn.Module) -> bool:
    """Whether a GPU computes the model's fp32 matmuls in TF32: allowed for matmuls (the old
    or the new flags: reading the old raises once the new is set), or for convolutions, which
    cuDNN does by default, in a model that has them."""
    matmul = conv = False
    with contextlib.suppress(Exception):
        matmul = torch.get_float32_matmul_precision() != "highest"
    with contextlib.suppress(Exception):
        matmul = matmul or torch.backends.cuda.matmul.fp32_precision == "tf32"
    with contextlib.suppress(Exception):
        conv = bool(torch.backends.cudnn.allow_tf32)
    with contextlib.suppress(Exception):
        conv = conv or getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision",
                               "") == "tf32"
    return matmul or conv and any(isinstance(m, torch.nn.modules.conv._ConvNd)
                                  for m in model.modules())


def _uncounted(model: torch.nn.Module) -> str:
    """The recurrent layer of the model that torch's FLOP counter does not see ("nn.LSTM"):
    an LSTM (one oneDNN op on a CPU), any of them on a GPU (one cuDNN op); "" for none."""
    cuda = _device(model).type == "cuda"
    for m in model.modules():
        if isinstance(m, torch.nn.RNNBase) and (cuda or isinstance(m, torch.nn.LSTM)
                                                and not m.proj_size):
            return f"nn.{type(m).__name__}"
    return ""


def _sequence_first(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's first module that takes (sequence, batch, features): a recurrent layer or a
    multi-head attention (in a Transformer layer too) without ``batch_first``, torch's
    default for them."""
    for module in model.modules():
        if isinstance(module, (torch.nn.RNNBase, torch.nn.MultiheadAttention)) \
                and not module.batch_first:
            return module
    return None


def _sequence_rows(value: Any) -> int:
    """The batch of a sequence-first module's input: its second dimension (a packed
    sequence's: its first step's size); 0 for an unbatched input."""
    if isinstance(value, torch.nn.utils.rnn.PackedSequence):
        return int(value.batch_sizes[0])
    if isinstance(value, torch.Tensor) and value.dim() >= 3:
        return int(value.shape[1])
    return 0


def _marker_for(device: torch.device) -> Callable[[], Any] | None:
    return functools.partial(marks.record, device) if device.type == "cuda" else None


def _step_device(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> torch.device:
    """Where the step runs: a GPU if the model's parameters are on one (DDP moves a CPU batch
    there itself) or the first tensor fed to it is (FSDP offloading its parameters to the
    CPU), else the CPU."""
    with contextlib.suppress(StopIteration):
        device = next(module.parameters()).device
        if device.type == "cuda":
            return device
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _data_of(it: Any) -> int:
    """What a loader iterator iterates, as a number: its dataset's identity (an iterator does
    not keep its DataLoader; 0: not a DataLoader's)."""
    data = getattr(it, "_dataset", None)
    return id(data) if data is not None else 0


def _compute_dtype(module: torch.nn.Module, device: torch.device) -> torch.dtype:
    """What the model's matmuls compute in: autocast's type where it is on for the device (a
    mixed-precision script), else the model's parameters' (a model cast to bf16)."""
    with contextlib.suppress(Exception):  # (a torch without the device_type arguments)
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
    with contextlib.suppress(StopIteration):
        return next(module.parameters()).dtype
    return torch.float32


def _device(model: torch.nn.Module | None) -> torch.device:
    with contextlib.suppress(StopIteration, AttributeError):
        return next(model.parameters()).device  # type: ignore[union-attr]
    return torch.device("cpu")


def _memory() -> dict[str, float]:
    out = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


_mlflow_names: set[str] = set()


def _script_names() -> set[str]:
    from ... import track

    return track.logged | _mlflow_names


def _not_the_scripts(metrics: dict[str, float]) -> dict[str, float]:
    own = _script_names()
    return {k: float(v) for k, v in metrics.items() if k not in own}


def _watch_mlflow(obs: Observer, _: ModuleType) -> None:
    """Right after the script imports MLflow (imports.py): every metric logged into the job's
    run adds its name to the script's own, whether through MLflow's fluent calls or its client
    (both end in MlflowClient's: Lightning's MLFlowLogger, autolog, a client of the script's).
    The step its first call runs in is start-up (Step.start_up): a hostile pass measured a
    script logging at each epoch's end at 2,000 samples/s, 31,441 without its two log_metric
    lines, the first call's 0.9 s (MLflow opening its store, as under plain python) inside
    one step of a 0.1 s job."""
    from mlflow.tracking.client import MlflowClient

    first = [True]

    job = os.environ.get("MLFLOW_RUN_ID", "")

    def argument(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, name: str) -> Any:
        return args[at] if len(args) > at else kwargs.get(name)

    for method, names_of in (
            ("log_metric", lambda a, k: [argument(a, k, 2, "key")]),
            ("log_batch", lambda a, k: [m.key for m in argument(a, k, 2, "metrics") or ()])):
        original = getattr(MlflowClient, method, None)
        if original is None:
            continue

        def wrapped(*args: Any, _original: Any = original, _names: Any = names_of,
                    **kwargs: Any) -> Any:
            with contextlib.suppress(Exception):
                if argument(args, kwargs, 1, "run_id") == job:
                    _mlflow_names.update(str(n) for n in _names(args, kwargs) if n)
            if first[0]:
                first[0], obs.start_up = False, True
            return _original(*args, **kwargs)

        setattr(MlflowClient, method, functools.wraps(original)(wrapped))


# ---- installing the hooks ----

def install(rank: int, world: int, report: Callable[[dict[str, Any]], None]) -> Observer | None:
    """The hooks, when the supervisor asked for them (``DDPLAB_OBSERVE``); else None."""
    given = os.environ.get(OBSERVE_ENV)
    if given is None:
        return None
    from ... import track

    spool = track._append  # the node's spool, as the script's own ddplab.track records
    obs = Observer(rank, world, float(given or 0), report, spool, _heartbeat(rank, world))
    with contextlib.suppress(ValueError):
        obs.step_offset = int(os.environ.get(STEP_OFFSET_ENV) or 0)
    _hooks(obs)
    _unhooked(obs)
    after_import("mlflow", functools.partial(_watch_mlflow, obs))
    return obs


#: Where nn.Module keeps its forward hooks (and their flags), by the hooks' ids.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _own(obs: Observer, handle: Any) -> Any:
    """``handle``, a hook of ours on one of the script's modules: left out of its copies."""
    obs.own_hooks.add(handle.id)
    return handle


def _unhooked(obs: Observer) -> None:
    """The script's modules pickle and copy without our hooks, as under plain torchrun:
    ``torch.save(model)`` (pytorch/examples' word_language_model saves its best model so)
    failed on them (local functions: "Can't pickle local object"), and the copy of
    ``copy.deepcopy(model)`` (an EMA's, a best model's) ran them, its forwards seen as the
    model's. ``__reduce_ex__`` is what pickle, torch.save and deepcopy all call; its state is
    ``__getstate__``'s, which some modules write themselves (torch's RNNs, DDP)."""
    reduce_ex = torch.nn.Module.__reduce_ex__

    def unhooked(self: torch.nn.Module, protocol: Any) -> Any:
        reduced = reduce_ex(self, protocol)
        if not obs.own_hooks or not isinstance(reduced, tuple):
            return reduced
        if len(reduced) == 2 and isinstance(reduced[1], tuple):  # (torch.fx's GraphModule:
            return (reduced[0], tuple(  # its __dict__ among its reconstructor's arguments)
                _without_ours(a, obs.own_hooks) if isinstance(a, dict) else a
                for a in reduced[1]))
        if len(reduced) < 3:
            return reduced
        state = reduced[2]
        if isinstance(state, tuple) and state and isinstance(state[0], dict):  # (__slots__)
            return (*reduced[:2], (_without_ours(state[0], obs.own_hooks), *state[1:]),
                    *reduced[3:])
        if isinstance(state, dict):
            return (*reduced[:2], _without_ours(state, obs.own_hooks), *reduced[3:])
        return reduced

    torch.nn.Module.__reduce_ex__ = unhooked  # type: ignore[method-assign,assignment]
    script = torch.jit.script

    @functools.wraps(script)
    def scripted(obj: Any, *args: Any, **kwargs: Any) -> Any:
        # TorchScript compiles a module's forward hooks with it, and refuses ours ("Compiled
        # functions can't take variable number of arguments"): a model scripted after
        # training failed to save, as under plain python it does not
        with _lifted(obj, obs.own_hooks):
            return script(obj, *args, **kwargs)

    torch.jit.script = scripted


@contextlib.contextmanager
def _lifted(obj: Any, ours: set[int]) -> Any:
    """``obj``'s modules without our hooks for a while (put back as they were after it)."""
    held: list[tuple[dict[int, Any], dict[int, Any]]] = []
    if isinstance(obj, torch.nn.Module) and ours:
        for module in obj.modules():
            for key in _HOOK_DICTS:
                hooks = getattr(module, key, None)
                if isinstance(hooks, dict) and not ours.isdisjoint(hooks):
                    held.append((hooks, dict(hooks)))
                    for k in ours.intersection(hooks):
                        del hooks[k]
    try:
        yield
    finally:
        for hooks, was in held:
            hooks.clear()
            hooks.update(was)


def _without_ours(state: dict[str, Any], ours: set[int]) -> dict[str, Any]:
    """A module's state (a copy where it held any of ``ours``) without those hooks."""
    for key in _HOOK_DICTS:
        hooks = state.get(key)
        if isinstance(hooks, dict) and not ours.isdisjoint(hooks):
            state = {**state, key: collections.OrderedDict(
                (k, v) for k, v in hooks.items() if k not in ours)}
    return state


def _heartbeat(rank: int, world: int) -> Callable[[str, int | None], None]:
    """This rank's heartbeat in the node's forensics folder (its stacks on STACK_SIGNAL are the
    script's, child.py); nothing without one (untracked jobs)."""
    from ...forensics import heartbeat

    folder = os.environ.get(FORENSICS_ENV)
    if not folder:
        return lambda phase, step: None
    try:
        hb = heartbeat.Heartbeat(Path(folder), rank, world)
        hb.record_crashes()  # (its stacks on request: child.py's own handler, for any script)
    except (OSError, ValueError):
        return lambda phase, step: None
    heartbeat._current = hb  # heartbeat.failed/stop at the script's end (child.py)
    hb.beat("setup", 1)
    return hb.beat


def _hooks(obs: Observer) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    from torch.utils.data.distributed import DistributedSampler

    def timed(hook: Callable[..., None]) -> Callable[..., None]:
        """``hook``, its time added to what the observation costs (Totals.observe_s). Nothing
        inside code that torch.compile traces (a compiled model's modules, their hooks): a clock
        there is a graph break, and an error under ``fullgraph=True``; the compiled model's own
        call is seen outside it."""
        def run(*args: Any, **kwargs: Any) -> None:
            if obs.ended or torch.compiler.is_compiling():
                return
            t0 = time.perf_counter()
            try:
                hook(*args, **kwargs)
            except Exception:  # noqa: BLE001, S110 - the script never fails of ours
                pass  # (a batch of a kind no rule reads, a nested tensor's size): unseen
            finally:
                obs.own_s += time.perf_counter() - t0
        return run

    forward, backward_hook = timed(obs.forward), timed(obs.backward)
    forward_done = timed(lambda module, args, output: obs.forward_done(module, output))
    sequence_batch = timed(lambda module, args: obs.sequence_batch(args))
    scale_hook, loaded, loader_done = timed(obs.scale), timed(obs.batch), timed(obs.loader_done)
    inside, outside = timed(lambda: obs.loading(True)), timed(lambda: obs.loading(False))
    stepping = _step_code()

    @timed
    def stepped(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # An optimizer stepped by another's step (ZeroRedundancyOptimizer's local Adam, a
        # Lookahead's inner one) is not the step: the outer one's end is (ZeRO's parameter
        # broadcast after the inner step read as the next step's data wait: 0.58-0.71 of it).
        if not _inside_another_step(stepping) and obs.leads(opt):
            obs.optimizer_step()

    register_optimizer_step_post_hook(stepped)

    def closure_in(opt: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """A step given a closure: it is called through Observer.counted (not twice, by an
        optimizer stepped inside another's: ZeRO's, a Lookahead's)."""
        if obs.ended or torch.compiler.is_compiling():
            return None
        # (``args`` holds the optimizer first: the step's own arguments follow it)
        given = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if not callable(given) or getattr(given, COUNTED, False):
            return None
        obs.closure_calls = 0
        wrapped = obs.counted(given)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    register_optimizer_step_pre_hook(closure_in)
    made_optimizer = torch.optim.Optimizer.__init__

    @functools.wraps(made_optimizer)
    def optimizer_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if obs.versions is not None and not obs.ended:  # (a last step by hand before it)
            with contextlib.suppress(Exception):  # (never the script's failure)
                obs._by_hand(time.perf_counter())
        obs.optimizer_made = True  # (its steps end the steps: Observer._by_hand is off)
        made_optimizer(self, *args, **kwargs)

    torch.optim.Optimizer.__init__ = optimizer_init  # type: ignore[method-assign]
    zero_grad = torch.nn.Module.zero_grad

    @functools.wraps(zero_grad)
    def observed_zero_grad(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if obs.versions is not None and not obs.ended:  # (a backward since the last step)
            with contextlib.suppress(Exception):  # (never the script's failure)
                obs.grads_cleared(self)
        zero_grad(self, *args, **kwargs)

    torch.nn.Module.zero_grad = observed_zero_grad  # type: ignore[method-assign]

    def model(module: torch.nn.Module) -> Any:
        """The script's model from now on: the samples, the forward's start and the FLOPs are
        its calls' (with their keyword arguments: ``model(**batch)``)."""
        anywhere.remove()
        for hook in (obs.found, obs.hooked, obs.done):  # found by its first call, then wrapped
            if hook is not None:  # in DDP; or the first DDP built, not the one the lead
                hook.remove()  # optimizer steps
        obs.outer = module
        obs.hooked = _own(obs, module.register_forward_pre_hook(forward, with_kwargs=True))
        obs.done = _own(obs, module.register_forward_hook(forward_done))
        if obs.seq_hook is not None:
            obs.seq_hook.remove()
        seq = _sequence_first(module)
        obs.seq_hook = _own(obs, seq.register_forward_pre_hook(sequence_batch)) \
            if seq is not None else None
        return obs.hooked

    obs.choose = model

    @timed
    def first_call(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        # Without DDP/FSDP, the model is the first module a step calls with gradients that
        # has parameters to train: not a transform of the data pipeline (torchvision's are
        # modules), nor an evaluation before training.
        if obs.outer is None and torch.is_grad_enabled():
            if not _trains(module):
                return  # (its time is the step's data wait)
            obs.found = model(module)
        obs.forward(module, args, {})

    anywhere = torch.nn.modules.module.register_module_forward_pre_hook(first_call)

    # Tensor.backward calls torch.autograd.backward: one hook sees both forms. A call made
    # inside a backward (a reentrant checkpoint recomputing its segment) is not a new one.
    backward = torch.autograd.backward

    @functools.wraps(backward)
    def observed_backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() == -1:
            backward_hook(_the_loss(tensors))
        return backward(tensors, *args, **kwargs)

    torch.autograd.backward = observed_backward

    def observe_scale(cls: Any) -> None:
        scale = cls.scale

        @functools.wraps(scale)
        def observed_scale(self: Any, outputs: Any) -> Any:
            scaled = scale(self, outputs)
            scale_hook(scaled, outputs)
            return scaled

        cls.scale = observed_scale

    observe_scale(torch.amp.GradScaler)  # torch.cuda.amp's and Accelerate's inherit its scale()

    set_epoch = DistributedSampler.set_epoch

    @functools.wraps(set_epoch)
    def observed_set_epoch(self: Any, epoch: int) -> None:
        obs.set_epoch(int(epoch))
        set_epoch(self, epoch)

    DistributedSampler.set_epoch = observed_set_epoch  # type: ignore[method-assign]

    from torch.utils.data.dataloader import _BaseDataLoaderIter

    loader_next = _BaseDataLoaderIter.__next__

    @functools.wraps(loader_next)
    def observed_next(self: Any) -> Any:
        inside()
        t0 = time.perf_counter()
        try:
            batch = loader_next(self)
        except StopIteration:
            loader_done(self)
            outside()
            raise
        except Exception:  # a dataset's __getitem__'s: the phase stays "data loading"
            obs.loading_failed()
            raise
        outside()
        loaded(self, batch, time.perf_counter() - t0)
        return batch

    _BaseDataLoaderIter.__next__ = observed_next  # type: ignore[method-assign]
    loader_iter = _BaseDataLoaderIter.__init__

    @functools.wraps(loader_iter)
    def observed_iter(self: Any, *args: Any, **kwargs: Any) -> None:
        with contextlib.suppress(Exception):  # (an iterator with __slots__: no start, no failure)
            setattr(self, CREATED, time.perf_counter())  # (before its workers start)
        loader_iter(self, *args, **kwargs)

    _BaseDataLoaderIter.__init__ = observed_iter  # type: ignore[method-assign]
    loader_reset = _BaseDataLoaderIter._reset

    @functools.wraps(loader_reset)
    def observed_reset(self: Any, *args: Any, **kwargs: Any) -> None:
        with contextlib.suppress(Exception):
            setattr(self, CREATED, time.perf_counter())  # (a persistent loader's next pass)
        loader_reset(self, *args, **kwargs)
        if not kwargs.get("first_iter", args[1] if len(args) > 1 else False):
            obs.loader_reset(self)

    _BaseDataLoaderIter._reset = observed_reset  # type: ignore[method-assign]

    import torch.distributed as dist

    destroy = dist.destroy_process_group

    @functools.wraps(destroy)
    def observed_destroy(group: Any = None, *args: Any, **kwargs: Any) -> None:
        destroy(group, *args, **kwargs)
        if group is None:
            obs.trained()

    dist.destroy_process_group = observed_destroy

    def outermost(cls: Any) -> None:
        init = cls.__init__

        @functools.wraps(init)
        def observed_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            obs.wrappers.append(weakref.ref(self))
            # The first DDP/FSDP built is the model (the loss is not), also over one found
            # by its first call before; until the first step's optimizer says another
            # (Observer._lead_model).
            if obs.outer is None or obs.found is not None:
                model(self)
                obs.found = None

        cls.__init__ = observed_init

    outermost(DDP)

    def compiled(eval_frame: ModuleType) -> None:
        """A model given to torch.compile before any DDP/FSDP (or without one) is the model:
        found now, not at its first call (the global hook that would find it then makes
        torch warn that global hooks fire twice on compiled modules)."""
        init = eval_frame.OptimizedModule.__init__

        @functools.wraps(init)
        def observed_init(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if obs.outer is None and _trains(self):
                obs.found = model(self)
            elif obs.outer is not None and getattr(self, "_orig_mod", None) is obs.outer:
                # torch.compile(DDP(model)): DDP's own hook runs inside the compiled code,
                # where it does nothing (timed); the compiled wrapper's call is the model's.
                _own(obs, self.register_forward_pre_hook(wrapper_call, with_kwargs=True))
                _own(obs, self.register_forward_hook(wrapper_done, always_call=True))

        eval_frame.OptimizedModule.__init__ = observed_init

    def wrapper_call(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        forward(obs.outer, args, kwargs)
        obs.wrapped = True  # (should DDP's own hook run outside the compiled code: once only)

    def wrapper_done(module: Any, args: Any, output: Any) -> None:
        obs.wrapped = False
        forward_done(obs.outer, args, output)

    after_import("torch._dynamo.eval_frame", compiled)
    # FSDP only once the script imports it: importing it here cost every script ~0.6 s and 600
    # modules (sympy among them) before its first line.
    after_import("torch.distributed.fsdp", lambda fsdp: outermost(fsdp.FullyShardedDataParallel))
    # FSDP's own scaler (Lightning's and Accelerate's under FSDP with fp16) has its own scale().
    after_import("torch.distributed.fsdp.sharded_grad_scaler",
                 lambda m: observe_scale(m.ShardedGradScaler))

    @timed
    def given(loss: Any) -> None:
        obs.given = loss if isinstance(loss, torch.Tensor) else None

    def accelerate(m: ModuleType) -> None:
        """Accelerate's backward divides the loss by its gradient_accumulation_steps: the loss
        given to it is the step's (_undivided)."""
        backward = m.Accelerator.backward

        @functools.wraps(backward)
        def observed(self: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
            given(loss)
            return backward(self, loss, *args, **kwargs)

        m.Accelerator.backward = observed

    after_import("accelerate.accelerator", accelerate)
