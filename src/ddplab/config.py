"""Typed experiment schema: load a YAML file, apply ``--set`` overrides, validate.

One precedence rule, applied by ``load`` alone: field defaults < experiment file <
``$DDPLAB_SET`` < ``--set key.sub=value``. ``DDPLAB_SET`` holds whitespace-separated
``key=value`` items, for containers and manifests whose command line is fixed
(``DDPLAB_SET="train.epochs=2 data.batch_size=64"``); ``load`` reads it from the environment
it is given, so a launcher passes on only the user's own ``--set`` and each rank reads
``DDPLAB_SET`` from the environment it inherited. Every error names where the bad value came
from (the file, ``--set`` or ``DDPLAB_SET``), the dotted key, the value and what is allowed.
Imports nothing heavy: ``ddplab --help`` and config errors must be instant.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Union

import yaml

from .errors import BadInput

# Names the model registry (models.py) must provide; a unit test keeps the two in step.
MODEL_NAMES = ("cnn", "resnet18", "resnet50") + tuple(f"efficientnet_b{i}" for i in range(8)) + ("gpt",)
DATASETS = ("synthetic", "cifar10", "imagefolder", "tokens")
LOSSES = ("cross_entropy", "mse", "model")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULERS = ("none", "cosine", "step")
EVAL_METRICS = ("eval/loss", "eval/accuracy", "eval/perplexity")
# gpt's model.args and their types; the rest of a model's args go to the user's callable as given.
GPT_ARGS: dict[str, type] = {"n_layer": int, "n_head": int, "n_embd": int, "dropout": float}
# "package.module:callable" (the callable may be a dotted attribute, e.g. "mod:Class.create").
IMPORT_PATH_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_import_path(value: str) -> bool:
    """A user part ("pkg.module:callable") rather than a built-in name."""
    return ":" in value


def _check_part(key: str, value: str, builtins: tuple[str, ...]) -> None:
    """A built-in name, or a well-formed import path (whether it imports is the checks step's)."""
    if is_import_path(value):
        if not IMPORT_PATH_RE.fullmatch(value):
            fail(key, value, "an import path is 'package.module:callable' (Python names, one ':')")
    elif value not in builtins:
        fail(key, value, f"choose one of: {', '.join(builtins)}, or 'package.module:callable'")


class ConfigError(BadInput, ValueError):
    """A bad experiment: names the source, the key, the value and what is allowed."""


def fail(key: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{key}: got {value!r}; {allowed}")


def check_range(obj: Any, name: str, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> None:
    """A numeric field within [low, high] (open ends where asked); floats must be finite."""
    v = getattr(obj, name)
    if isinstance(v, float) and not math.isfinite(v):
        fail(name, v, "must be a finite number")
    too_low = low is not None and (v <= low if low_open else v < low)
    too_high = high is not None and (v >= high if high_open else v > high)
    if too_low or too_high:
        left = "(" if low_open or low is None else "["
        right = ")" if high_open or high is None else "]"
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else str(high) if isinstance(high, int) else f"{high:g}"
        fail(name, v, f"must be in {left}{lo}, {hi}{right}")


# Seeds feed torch.manual_seed and the samplers' generators (seed + epoch): a signed 64-bit range.
MAX_SEED = 2**63 - 2**32
MAX_TIMEOUT_S = 7 * 24 * 3600
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass
class DataConfig:
    dataset: str = "synthetic"
    """synthetic (a generated, learnable image set), cifar10, imagefolder
    (``root/train/<class>/*`` and ``root/val/<class>/*``), tokens (byte-level next-token data from
    the text file or folder at ``root``; generated when ``root`` is ''), or your own
    ``package.module:callable`` returning ``(train_dataset, eval_dataset)``."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for your own dataset callable (only with an import path)."""
    root: str = "data"
    """Where the data lives: CIFAR-10's folder (``cifar-10-batches-py`` goes inside), the
    ImageFolder tree, or the text (a file or a folder, every text file under it) for
    ``tokens``. A relative path is from the directory the job runs in, not the experiment
    file's."""
    download: bool = False
    """Let torchvision download CIFAR-10 into ``root`` (local rank 0 only, then a barrier)."""
    train_samples: int = 8192
    """Synthetic: training-set size."""
    eval_samples: int = 2048
    """Synthetic: evaluation-set size."""
    image_size: int = 32
    """Synthetic: height and width in pixels (CIFAR-10 is always 32)."""
    channels: int = 3
    """Synthetic: image channels (CIFAR-10 is always 3)."""
    num_classes: int = 10
    """Synthetic: number of classes (CIFAR-10 is always 10; ImageFolder counts its folders)."""
    seq_len: int = 128
    """tokens: tokens per sample, the model's context length."""
    noise: float = 1.5
    """Synthetic: noise standard deviation around each class's prototype; higher is harder."""
    batch_size: int = 32
    """Samples per rank per micro-step. Global batch = batch_size x world x grad_accum_steps."""
    eval_batch_size: int = 256
    """Samples per rank per evaluation step."""
    num_workers: int = 0
    """DataLoader worker processes per rank (each uses /dev/shm; see ``ddplab doctor``)."""
    pin_memory: bool = True
    """Page-locked host memory, so the batch's copy to the GPU (non-blocking) overlaps the
    step instead of waiting on the host; a CPU job ignores it. Without loader workers ddplab
    copies the batch there on the rank's own thread (torch's parallel copy left the rank's
    idle OpenMP threads spinning through every step)."""
    persistent_workers: bool = False
    """Keep loader workers alive between epochs (needs num_workers > 0)."""
    input_keys: list[str] = field(default_factory=list)
    """Dict samples (Hugging Face's style): the keys the model gets as keyword arguments; [] =
    every key but data.target_key. (Samples of (input, target) ignore it.)"""
    target_key: str = "labels"
    """Dict samples: the key that holds the target."""

    def __post_init__(self) -> None:
        _check_part("dataset", self.dataset, DATASETS)
        if self.args and not is_import_path(self.dataset):
            fail("args", self.args, f"only your own dataset callable takes args, not {self.dataset!r}")
        if self.dataset == "imagefolder" and self.channels not in (1, 3):
            fail("channels", self.channels, "ImageFolder images are read as 1 (grayscale) or 3 (RGB)")
        for name in ("train_samples", "eval_samples", "image_size", "channels", "batch_size",
                     "eval_batch_size", "seq_len"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        if self.num_classes < 2:
            fail("num_classes", self.num_classes, "must be >= 2")
        if not self.target_key:
            fail("target_key", self.target_key, "must name the samples' target key (e.g. labels)")
        if self.target_key in self.input_keys or "" in self.input_keys:
            fail("input_keys", self.input_keys, f"must be keys other than data.target_key "
                 f"({self.target_key!r}) and not empty")
        if self.num_workers < 0:
            fail("num_workers", self.num_workers, "must be >= 0")
        check_range(self, "noise", 0)
        if self.persistent_workers and self.num_workers == 0:
            fail("persistent_workers", True, "needs data.num_workers > 0")
        if self.dataset in ("synthetic", "imagefolder") and self.image_size < 4:
            fail("image_size", self.image_size, "must be >= 4 (the CNN pools twice)")


@dataclass
class ModelConfig:
    name: str = "cnn"
    """Built in: cnn (the book's CIFAR CNN), resnet18/50, efficientnet_b0..b7 (images); gpt (a
    small decoder-only transformer, for ``data.dataset: tokens``). Or your own
    ``package.module:callable`` returning an ``nn.Module``; where its signature names
    num_classes, channels, image_size, vocab_size or seq_len, ddplab passes them from the data."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the model: gpt takes n_layer, n_head, n_embd, dropout; your own
    callable takes whatever it declares."""
    channels_last: bool = False
    """Use the channels_last memory format (faster convolutions on recent CPUs and GPUs)."""
    compile: bool = False
    """Wrap the DDP model in torch.compile. Training then takes whole batches only: each
    epoch's last, shorter batch is left out (its new shape compiled the model again: 27 s of
    the GPT's job on an H200)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune",
                          "max-autotune-no-cudagraphs"] = "default"
    """torch.compile's ``mode`` (with model.compile): reduce-overhead adds CUDA graphs (fewer
    launches for small steps), max-autotune also benchmarks kernel choices while it compiles
    (minutes, inside the first step: raise dist.hang_after_s above that, or the hang watch stops
    the job). Which is fastest depends on the model and the GPU: measure it."""
    ipex: bool = True
    """On CPU, run ipex.optimize when intel_extension_for_pytorch imports and matches torch."""
    flops_per_sample: float = 0.0
    """Training FLOPs (forward and backward) of one sample, for perf/mfu; 0 = counted: the
    built-in gpt by nanoGPT's formula, any other model by torch.utils.flop_counter on one
    sample's forward x 3 (frozen parameters: its forward and backward, counted)."""

    def __post_init__(self) -> None:
        _check_part("name", self.name, MODEL_NAMES)
        check_range(self, "flops_per_sample", 0)
        if self.compile_mode != "default" and not self.compile:
            fail("compile_mode", self.compile_mode, "only with model.compile: true (it is "
                 "torch.compile's mode)")
        if self.name == "gpt":
            _check_gpt_args(self.args)
        elif self.args and not is_import_path(self.name):
            fail("args", self.args, f"model {self.name!r} takes no args (gpt and your own "
                  "callables do)")


def _check_gpt_args(args: dict[str, Any]) -> None:
    for key, value in args.items():
        tp = GPT_ARGS.get(key)
        if tp is None:
            fail(f"args.{key}", value, f"unknown gpt argument; allowed: {', '.join(GPT_ARGS)}")
        ok = isinstance(value, (int, float) if tp is float else int) and not isinstance(value, bool)
        if not ok:
            fail(f"args.{key}", value, f"expected {tp.__name__}, not {type(value).__name__}")
        if tp is int and value < 1:
            fail(f"args.{key}", value, "must be >= 1")
    dropout = args.get("dropout", 0.0)
    if not (isinstance(dropout, (int, float)) and 0 <= dropout < 1):
        fail("args.dropout", dropout, "must be in [0, 1)")
    n_embd, n_head = args.get("n_embd", 128), args.get("n_head", 4)
    if n_embd % n_head:
        fail("args.n_embd", n_embd, f"must be a multiple of model.args.n_head ({n_head})")


@dataclass
class OptimConfig:
    name: str = "sgd"
    """sgd, adam, adamw, or any ``torch.optim.Optimizer`` subclass by import path
    (``torch.optim:RMSprop``, ``mypkg.optim:Lion``): it gets lr, weight_decay and momentum
    where its signature takes them, then ``optim.args``."""
    args: dict[str, Any] = field(default_factory=dict)
    """More keyword arguments for the optimizer (AdamW's betas, eps, RMSprop's alpha...)."""
    lr: float = 0.01
    """Peak learning rate."""
    weight_decay: float = 0.0
    """L2 penalty (decoupled for adamw)."""
    momentum: float = 0.9
    """SGD momentum (ignored by adam/adamw)."""
    scheduler: str = "none"
    """Learning-rate schedule: none, cosine, step, or any ``torch.optim.lr_scheduler`` class by
    import path (``torch.optim.lr_scheduler:OneCycleLR``): it gets ``optim.scheduler_args``, and
    where its signature names them and you did not, ``max_lr`` (optim.lr), ``total_steps`` and
    ``T_max`` (the job's steps, or epochs with ``scheduler_interval: epoch``)."""
    scheduler_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a scheduler given by import path (OneCycleLR's pct_start...)."""
    scheduler_interval: Literal["step", "epoch"] = "step"
    """A scheduler by import path steps after every optimizer step, or after every epoch."""
    warmup_steps: int = 0
    """Linear warm-up steps before ddplab's own schedules (cosine, step, none)."""
    step_size: int = 1000
    """``step`` scheduler: optimizer steps between decays."""
    gamma: float = 0.1
    """``step`` scheduler: decay factor."""
    fused: bool = True
    """The optimizer's fused kernel (``fused=True``: one launch for every parameter) where its
    class has one and the parameters are on a GPU (torch's Adam, AdamW, SGD); ignored on a
    CPU and where ``optim.args`` says ``fused`` itself."""

    def __post_init__(self) -> None:
        _check_part("name", self.name, OPTIMIZERS)
        _check_part("scheduler", self.scheduler, SCHEDULERS)
        if is_import_path(self.scheduler) and self.warmup_steps:
            fail("warmup_steps", self.warmup_steps, "0 with a scheduler of your own (warm-up is "
                  "ddplab's schedules'; OneCycleLR has pct_start, torch's SequentialLR chains one)")
        if self.scheduler_args and not is_import_path(self.scheduler):
            fail("scheduler_args", self.scheduler_args, "only with a scheduler by import path "
                  "(ddplab's cosine and step take warmup_steps, step_size, gamma)")
        check_range(self, "lr", 0, low_open=True)
        check_range(self, "weight_decay", 0)
        check_range(self, "momentum", 0, 1, high_open=True)
        check_range(self, "gamma", 0, low_open=True)
        if self.warmup_steps < 0:
            fail("warmup_steps", self.warmup_steps, "must be >= 0")
        if self.step_size < 1:
            fail("step_size", self.step_size, "must be >= 1")


@dataclass
class EarlyStoppingConfig:
    """Stop training when an evaluation metric stops improving (checked after each evaluation:
    train.eval_every_steps or eval_every_epochs sets how often)."""

    metric: str = ""
    """The metric watched: eval/loss, eval/accuracy, eval/perplexity or eval/<name> of one of
    train.metrics ("" = off)."""
    mode: Literal["min", "max"] = "min"
    """min: lower is better (a loss); max: higher is better (an accuracy)."""
    patience: int = 3
    """Evaluations in a row without an improvement before the job stops."""
    min_delta: float = 0.0
    """How much better than the best so far counts as an improvement."""

    def __post_init__(self) -> None:
        if self.metric not in ("", *EVAL_METRICS) and not self.metric.startswith("eval/"):
            fail("metric", self.metric, f"one of {', '.join(EVAL_METRICS)}, eval/<name> of one "
                 "of train.metrics, or '' (off)")
        if self.patience < 1:
            fail("patience", self.patience, "must be >= 1")
        check_range(self, "min_delta", 0)


METRIC_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")


@dataclass
class MetricConfig:
    """An evaluation metric of your own, computed over every rank's evaluation samples (not an
    average of the ranks' values) and logged as ``eval/<name>``: a torchmetrics metric, or any
    class with ``update(preds, target)`` and ``compute()`` that syncs its state across ranks."""

    WHAT: ClassVar[str] = "a metric: a mapping with a name and a class (fn)"
    name: str = ""
    """Logged as eval/<name>; a letter, then letters, digits or '_'."""
    fn: str = ""
    """The class by import path, e.g. ``torchmetrics.classification:MulticlassF1Score``."""
    args: dict[str, Any] = field(default_factory=dict)
    """Its arguments, e.g. ``{average: macro}``; ``num_classes`` comes from the data when the
    class takes it and it is not given."""

    def __post_init__(self) -> None:
        if not METRIC_NAME_RE.fullmatch(self.name):
            fail("name", self.name, "a letter, then up to 63 letters, digits or '_'")
        if f"eval/{self.name}" in EVAL_METRICS:
            fail("name", self.name, f"eval/{self.name} is ddplab's own: choose another name")
        if not IMPORT_PATH_RE.fullmatch(self.fn):
            fail("fn", self.fn, "the metric's class as 'package.module:Class', e.g. "
                 "torchmetrics.classification:MulticlassF1Score")


@dataclass
class TrainConfig:
    epochs: int = 1
    """Passes over the training set."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = no limit)."""
    grad_accum_steps: int = 1
    """Micro-steps per optimizer step; gradients are all-reduced only on the last (no_sync)."""
    global_batch_size: int = 0
    """Optional check: when > 0 it must equal batch_size x world x grad_accum_steps."""
    amp: Literal["none", "bf16", "fp16"] = "none"
    """Autocast: bf16 on CPU or CUDA, fp16 on CUDA only (with a gradient scaler)."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this value (0 = off)."""
    seed: int = 0
    """One seed for every rank: identical initial weights and one shared sampler order."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True): reproducible to the bit, usually slower."""
    log_every: int = 10
    """Optimizer steps between metric points (the loss is averaged over ranks each time)."""
    exact_step_times: bool = False
    """Wait for the device after every step (``torch.cuda.synchronize``), so each step's time is
    its own wall time. Off: the step never waits on the device; a GPU's step times come from
    CUDA events read at log points (the same window figures, no host wait; a synchronize per
    step cost 12% on an H100). No effect on a CPU, which never waits."""
    sync_debug: Literal["off", "warn", "error"] = "off"
    """A GPU's steady steps (the second of each epoch on, never the process's first two: DDP
    rebuilds its gradient buckets at its second step, a wait by design) run under
    ``torch.cuda.set_sync_debug_mode``: a call in the step that makes the host wait on the device
    and that torch detects (``.item()``, ``.cpu()``, ``.tolist()`` in your loss, a blocking copy;
    not an explicit ``synchronize``) warns, or raises with the line that made it. Log points,
    evaluation and checkpoints are outside the step and may wait. With train.amp fp16 and an
    unfused optimizer, GradScaler's step reads its inf check (a wait by design). No effect on a
    CPU."""
    eval_every_epochs: int = 1
    """Evaluate after every N epochs, and always after the last."""
    eval_every_steps: int = 0
    """Also evaluate every N optimizer steps (0 = off): finer eval curves for long epochs."""
    loss: str = "cross_entropy"
    """cross_entropy (class logits, or (batch, seq, vocab) logits for tokens), mse, model (the
    model's own: the target goes into its forward as ``labels=`` and its output's ``loss`` is
    used; Hugging Face's models shift a causal LM's labels themselves), or your own
    ``package.module:callable`` (outputs, targets) -> a scalar tensor."""
    metrics: list[MetricConfig] = field(default_factory=list)
    """Evaluation metrics of your own besides eval/loss and eval/accuracy (torchmetrics, by
    import path), e.g. ``[{name: f1, fn: "torchmetrics.classification:MulticlassF1Score",
    args: {average: macro}}]``."""
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    nonfinite_loss: Literal["stop", "warn"] = "stop"
    """A NaN or infinite train/loss (checked where it is logged, every log_every steps): stop
    the job FAILED, naming the step, or warn and go on."""
    mfu: bool = True
    """Log perf/mfu (model FLOPs per second over the devices' peak): a GPU's peak from a
    datasheet table; on CPU each rank measures a matmul for 0.3 s at the start."""

    def __post_init__(self) -> None:
        _check_part("loss", self.loss, LOSSES)
        for name in ("epochs", "grad_accum_steps", "log_every", "eval_every_epochs"):
            if getattr(self, name) < 1:
                fail(name, getattr(self, name), "must be >= 1")
        for name in ("max_steps", "global_batch_size", "seed", "eval_every_steps"):
            if getattr(self, name) < 0:
                fail(name, getattr(self, name), "must be >= 0")
        check_range(self, "grad_clip", 0)
        check_range(self, "seed", 0, MAX_SEED)
        if self.loss == "model" and self.metrics:
            fail("metrics", [m.name for m in self.metrics], "not with train.loss model: the model "
                 "aligns its labels itself (a causal LM shifts them), which a metric cannot know; "
                 "use a loss of ddplab's or your own")
        names = [m.name for m in self.metrics]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            fail("metrics", dup, "metric names must be unique")
        watched = self.early_stopping.metric
        if watched.startswith("eval/") and watched not in EVAL_METRICS \
                and watched.removeprefix("eval/") not in names:
            fail("early_stopping.metric", watched, f"one of {', '.join(EVAL_METRICS)} or "
                 f"eval/<name> of one of train.metrics ({', '.join(names) or 'none given'})")


@dataclass
class FsdpConfig:
    """FSDP2's knobs (torch.distributed.fsdp.fully_shard), used when dist.strategy is fsdp."""

    wrap: str = ""
    """Comma-separated class names of the blocks each sharded on its own (e.g. "Block"); empty =
    the model's own choice (a built-in model's blocks, else the modules of its first
    nn.ModuleList, else the model as one unit)."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (ZeRO-3's memory; one more
    all-gather in the backward); false keeps them (ZeRO-2-like: faster, more memory)."""
    mixed_precision: Literal["none", "bf16"] = "none"
    """bf16: parameters gathered and gradients reduced in bf16, the sharded master weights stay
    fp32 (MixedPrecisionPolicy)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in host memory (CUDA only: on
    CPU they are there already)."""

    def __post_init__(self) -> None:
        names = [n.strip() for n in self.wrap.split(",") if n.strip()]
        bad = [n for n in names if not n.isidentifier()]
        if bad:
            fail("wrap", self.wrap, "comma-separated Python class names, e.g. 'Block,Layer'")


@dataclass
class DistConfig:
    strategy: Literal["ddp", "fsdp", "zero", "dp"] = "ddp"
    """How the model is spread over ranks: ddp (a full replica per rank, gradients
    all-reduced), zero (DDP with the optimizer state sharded: ZeroRedundancyOptimizer, ZeRO-1),
    fsdp (parameters, gradients and optimizer state sharded: FSDP2), dp (DataParallel: one
    process over the node's GPUs; CUDA only)."""
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    backend: Literal["auto", "gloo", "ccl", "nccl", "mpi"] = "auto"
    """auto = nccl on CUDA; ccl on CPU when oneCCL is there (Intel's bindings or ddplab's own
    build), with 2+ ranks of 2+ cores each (on several nodes: only if every rank agrees); else
    gloo. The run records why (ddplab.backend_reason)."""
    allow_backend_fallback: bool = False
    """If the requested backend is unavailable, use gloo (CPU) with a warning instead of failing."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when a GPU is visible, else cpu."""
    threads_per_rank: int | Literal["auto"] = "auto"
    """CPU threads per rank; auto = usable cores / local ranks (less oneCCL's worker cores)."""
    pin_cores: bool = False
    """Pin each local rank to its own block of cores (the book's explicit core lists)."""
    timeout_s: int = 600
    """Collective and rendezvous timeout in seconds."""
    hang_after_s: float = 300.0
    """A rank whose heartbeat stops this long (three times this in set-up, evaluation and
    checkpoints) is hung: its node's delivery process takes every rank's stack, ends the job
    and the run FAILED with one line naming the rank, host, phase and step (forensics/ in the
    run). Below ``timeout_s`` to act before the collectives time out; 0 = off. Tracked jobs."""
    # DDP's own knobs (torch.nn.parallel.DistributedDataParallel), recorded with the run.
    bucket_cap_mb: float = 25.0
    """Gradients are all-reduced in buckets of this size: smaller starts communication sooner
    (more overlap with the backward pass), larger sends fewer, bigger messages."""
    gradient_as_bucket_view: bool = False
    """Gradients are views into the buckets: one copy less per step, less memory."""
    static_graph: bool = False
    """The set of used parameters never changes between steps: DDP can skip re-checking it."""
    find_unused_parameters: bool = False
    """Some parameters get no gradient in a step (branching models); costs a graph walk."""
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    """Gradient compression before the all-reduce: fp16/bf16 halve the bytes sent (cast, sum,
    cast back); powersgd sends a rank-1 approximation with error feedback (after 2 steps)."""

    def __post_init__(self) -> None:
        if self.threads_per_rank != "auto" and self.threads_per_rank < 1:
            fail("threads_per_rank", self.threads_per_rank, "must be >= 1 or 'auto'")
        check_range(self, "timeout_s", 1, MAX_TIMEOUT_S)
        check_range(self, "hang_after_s", 0, MAX_TIMEOUT_S)
        check_range(self, "bucket_cap_mb", 0, 4096, low_open=True)


@dataclass
class TrackingConfig:
    enabled: bool = True
    """Track the job in MLflow (one run per job)."""
    uri: str = ""
    """Tracking URI; empty = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working dir."""
    experiment: str = ""
    """MLflow experiment name; empty = the experiment's ``name``."""
    run_name: str = ""
    """MLflow run name; empty = "<name> <backend> <nodes>n x <ranks per node>r x <threads per
    rank>t <launcher>", e.g. "quickstart gloo 1n x 2r x 1t torchrun"."""
    system_metrics: bool = True
    """Local rank 0 of every node logs CPU/memory/network (and GPU) metrics into the run."""
    system_metrics_interval_s: float = 5.0
    """Seconds between system-metric samples."""
    delivery_timeout_s: float = 60.0
    """When the job ends, how long each node keeps trying to deliver what the tracking server
    has not taken yet; what is left stays in the spool next to the checkpoints, for
    ``ddplab sync``. Training itself never waits on the server."""
    wait_s: float = 0.0
    """Wait up to this long for an http(s) tracking server to answer before failing (for
    clusters that start the server together with the job); 0 = fail at once."""

    def __post_init__(self) -> None:
        # A login in the URI leaves it here (credentials.py): the config is recorded as params
        # and config.yaml, and the URI printed; the login travels as MLflow's own variables.
        from .logins import take_login

        self.uri = take_login(self.uri)
        check_range(self, "wait_s", 0, MAX_TIMEOUT_S)
        check_range(self, "delivery_timeout_s", 0, MAX_TIMEOUT_S)
        check_range(self, "system_metrics_interval_s", 0, 3600, low_open=True)


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"
    """Root folder; each run writes into ``<dir>/<experiment name>/<mlflow run id>/``."""
    every_steps: int = 0
    """Save every N optimizer steps (0 = off)."""
    every_epochs: int = 1
    """Save after every N epochs (0 = off); a final checkpoint is always written."""
    keep: int = 3
    """Newest checkpoints kept per run (older ones are deleted)."""
    resume: str = "auto"
    """auto = continue the newest valid unfinished checkpoint; never; a checkpoint file; or a
    run's checkpoint folder (``checkpoints/<experiment>/<run id>/``: its newest)."""
    resume_changes: Literal["refuse", "allow"] = "refuse"
    """A resume whose config differs from the checkpoint's beyond what a resume may change
    (checkpoint.RESUMABLE) is refused, naming each change; ``allow`` records them instead."""

    def __post_init__(self) -> None:
        for name in ("every_steps", "every_epochs"):
            if getattr(self, name) < 0:
                fail(name, getattr(self, name), "must be >= 0")
        if self.keep < 1:
            fail("keep", self.keep, "must be >= 1")
        if not self.resume:
            fail("resume", self.resume, "use 'auto', 'never', a checkpoint file or a run's folder")


@dataclass
class ProfileConfig:
    enabled: bool = False
    """Run torch.profiler on every rank over the steps below; each rank's Chrome trace becomes
    an artifact of the run (profile/<node>-rank<r>.pt.trace.json.gz), its time shares metrics."""
    wait: int = 1
    """Optimizer steps skipped first (start-up is not what a profile should show)."""
    warmup: int = 1
    """Steps traced but thrown away (the profiler's own start-up)."""
    active: int = 3
    """Steps recorded."""

    def __post_init__(self) -> None:
        for name, low in (("wait", 0), ("warmup", 0), ("active", 1)):
            if getattr(self, name) < low:
                fail(name, getattr(self, name), f"must be >= {low}")


@dataclass
class ScriptConfig:
    """Script mode: the user's own training script, run as it is in every rank's process
    (docs/your-own-script.md). The other sections of ddplab's loop (data, model, optim, train,
    profile) do not apply to a script; ``dist.threads_per_rank`` sets its OMP_NUM_THREADS and
    ``dist.timeout_s`` how long the ranks wait for each other around it."""

    path: str = ""
    """The script (``.py``), relative to the experiment file; empty = ddplab's own loop.
    ``ddplab train my_train.py -- ARGS`` sets it (and ``args``) from the command line."""
    module: str = ""
    """A packaged script instead of ``path``: ``pkg.train`` runs as ``python -m pkg.train``
    runs it, found from the current directory first (``ddplab train -m pkg.train`` sets it)."""
    args: list[str] = field(default_factory=list)
    """The script's command-line arguments, as given (``-- ARGS`` on the command line come after)."""
    flags: dict[str, Any] = field(default_factory=dict)
    """Flags given by name, appended as ``--NAME VALUE`` (a flag already in ``args`` is
    replaced; true = the bare ``--NAME``, false or null = left out, a flag in ``args``
    too): what a study varies,
    e.g. ``script.flags.lr: [0.01, 0.1]``."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the script: text or numbers (quote ``'true'``)."""
    log_tail_kb: int = 512
    """Each rank's stdout and stderr become artifacts of the run (``logs/``); the last this
    many KiB of each are kept."""
    observe: bool = True
    """Observe the script's training through public torch hooks, nothing edited: its steps
    (optimizer steps), loss (the tensor ``.backward()`` is called on), samples, epochs
    (``DistributedSampler.set_epoch``), per-rank phase times, FLOPs; recorded under the names
    ddplab's own loop uses (``train/loss``, ``perf/samples_per_s``, ``perf/mfu``...), and a
    hang named by rank, phase and step. ``false``: the script runs with no hook at all."""
    flops_per_sample: float = 0.0
    """The model's training FLOPs per sample for ``perf/mfu``; 0 = counted by
    ``torch.utils.flop_counter`` on one sample of an early step's batch, x 3 (frozen parameters:
    its forward and backward, counted)."""

    def __post_init__(self) -> None:
        if self.path.startswith("-m ") and not self.module:  # as ddplab.script names a module
            module = self.path.removeprefix("-m ").strip()
            if not module:
                fail("path", self.path, "a script's file, or -m and a module's dotted name")
            self.path, self.module = "", module
        if self.path and self.module:
            fail("module", self.module, f"a script is path or module, not both (path "
                 f"{self.path!r})")
        if self.module and not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", self.module):
            fail("module", self.module, "a module's dotted name, e.g. pkg.train")
        for name in self.flags:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
                fail(f"flags.{name}", self.flags[name], "a flag name is letters, digits, '_', "
                      "'-' or '.', without the leading dashes")
        for name, value in self.env.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                fail(f"env.{name}", value, "an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        check_range(self, "log_tail_kb", 1, 1 << 20)
        if self.flops_per_sample < 0:
            fail("flops_per_sample", self.flops_per_sample, "FLOPs per sample >= 0 (0 = counted)")

    @property
    def named(self) -> str:
        """The script as the run names it (``ddplab.script``): its path, or ``-m pkg.train``;
        "" for ddplab's own loop."""
        return f"-m {self.module}" if self.module else self.path

    def file(self, cwd: Path | None = None) -> Path:
        """The script's file: ``path``, or the file ``python -m MODULE`` runs (the module's, or
        its package's ``__main__.py``), looked up as python -m does, the current directory
        first, without importing anything (a package's ``__init__`` runs in the script's
        process only). A module that is not there is one ConfigError line."""
        name = self.module
        if not name:
            return Path(self.path)
        import importlib.machinery
        import sys

        here = cwd or Path.cwd()
        search: list[str] | None = [str(here), *sys.path[1:]]
        spec = None
        for i in range(1, len(name.split(".")) + 1):
            full = ".".join(name.split(".")[:i])
            spec = importlib.machinery.PathFinder.find_spec(full, search) if search else None
            if spec is None:
                raise ConfigError(f"-m {name}: no module named {full!r} (from the current "
                                  f"directory {here} and the installed packages)")
            search = list(spec.submodule_search_locations or []) or None
        if search:  # a package: its __main__ runs
            spec = importlib.machinery.PathFinder.find_spec(f"{name}.__main__", search)
            if spec is None:
                raise ConfigError(f"-m {name}: a package without __main__.py cannot be run")
        origin = spec.origin if spec is not None else None
        if not origin or not origin.endswith(".py"):
            raise ConfigError(f"-m {name}: {origin or 'a namespace package'} is not a Python "
                              "source file")
        return Path(origin).resolve()

    def argv(self) -> list[str]:
        """The script's arguments: ``args``, then ``flags`` (replacing the same flag in args)."""
        out = list(self.args)
        for name, value in self.flags.items():
            flag = f"--{name}"
            out = _without_flag(out, flag)
            if value is True:
                out.append(flag)
            elif value is not False and value is not None:
                out += [flag, value if isinstance(value, str) else json.dumps(value)]
        return out


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` less ``flag`` (``--lr 0.1``, ``--lr=0.1`` or a bare ``--lr``)."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == flag:
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return out


@dataclass
class ExperimentConfig:
    name: str = "experiment"
    """Experiment name (also the default MLflow experiment)."""
    description: str = ""
    """Free text, logged as the run description."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    script: ScriptConfig = field(default_factory=ScriptConfig)

    def __post_init__(self) -> None:
        # The name is a directory under checkpoint.dir and the MLflow experiment: one safe
        # path component.
        if not NAME_RE.fullmatch(self.name):
            fail("name", self.name, "use 1-100 letters, digits, '.', '_' or '-', starting with a "
                  "letter or digit")

    @property
    def kind(self) -> str:
        """Which kind of job this is: "script" (the user's own script runs its own loop:
        scriptmode/) or "loop" (ddplab's loop). The one place it is decided; the run records it
        (``ddplab.mode``), and a script job refuses the loop's own sections (LOOP_ONLY)."""
        return "script" if self.script.named else "loop"

    def to_dict(self) -> dict[str, Any]:
        """As recorded and printed: a database URI's password masked (credentials.mask)."""
        from .logins import mask

        d = dataclasses.asdict(self)
        d["tracking"]["uri"] = mask(d["tracking"]["uri"])
        return d

    def flat(self) -> dict[str, Any]:
        """``{"data.batch_size": 32, ...}``: the resolved config as MLflow params."""
        return flatten(self.to_dict())

    def to_yaml(self) -> str:
        """As ``ddplab config`` prints it, loadable again: a script job's without the loop's
        own sections, which a script job refuses."""
        d = self.to_dict()
        if self.kind == "script":
            d = {k: v for k, v in d.items() if k not in LOOP_ONLY}
        text: str = yaml.safe_dump(d, sort_keys=False)
        return text

    def global_batch(self, world_size: int) -> int:
        """The batch arithmetic: per-rank batch x world size x accumulation steps."""
        gb = self.data.batch_size * world_size * self.train.grad_accum_steps
        if self.train.global_batch_size and self.train.global_batch_size != gb:
            raise ConfigError(
                f"train.global_batch_size: got {self.train.global_batch_size}; the layout gives "
                f"data.batch_size {self.data.batch_size} x world {world_size} x "
                f"train.grad_accum_steps {self.train.grad_accum_steps} = {gb}"
            )
        return gb


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---- building dataclasses from plain dicts, with type checks that name the key ----

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):  # an optional key: None is "left out", not a type
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if tp is bool:
        return "true or false"  # as YAML and --set write it
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(arg, value, key)
            except ConfigError:
                continue
        fail(key, value, f"expected {_type_name(tp)}")
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        fail(key, value, f"expected {_type_name(tp)}")
    if tp is type(None) and value is None:  # an optional key left empty
        return None
    if origin is list and _is_section(typing.get_args(tp)[0]):  # a list of sections (variants)
        if not isinstance(value, list):
            fail(key, value, f"expected a list, each item {_what(typing.get_args(tp)[0])}")
        return [_coerce(typing.get_args(tp)[0], v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is list:
        # A script's arguments: YAML may read `3` or `0.1` as numbers; the script gets text.
        if not isinstance(value, list) or not all(
                isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in value):
            fail(key, value, "expected a list of strings, e.g. [--epochs, '3']")
        return [str(a) for a in value]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            fail(key, value, "expected a mapping of names to values")
        if typing.get_args(tp)[1] is str:  # environment variables: text, as a shell sets them
            for k, v in value.items():
                if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                    fail(f"{key}.{k}", v, "text or a number (an environment variable's value; "
                         "quote a true, false or null: 'true')")
            return {k: str(v) for k, v in value.items()}
        return dict(value)
    if _is_section(tp):  # a nested section's class
        if not isinstance(value, dict):
            fail(key, value, f"expected {_what(tp)}")
        return from_mapping(tp, value, key + ".")
    # bool is a subclass of int: never let `true` pass as a number, nor 1 as a flag.
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, str):
        return value
    fail(key, value, f"expected {_type_name(tp)}, not {type(value).__name__}")


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _what(section: type) -> str:
    """How an error names a section: its ``WHAT`` when it says (a study's "variant"), else
    "a mapping of <class> keys"."""
    return str(getattr(section, "WHAT", f"a mapping of {section.__name__} keys"))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A section's annotations, resolved once (a study resolves every variant's config)."""
    return typing.get_type_hints(cls)


def from_mapping(cls: type, raw: dict[str, Any], prefix: str = "") -> Any:
    """The one schema engine (experiments and study files): a dataclass from a plain mapping,
    each value checked against its annotation (bool is never a number, a number never a flag),
    an unknown key named with the allowed ones, and the class's own ``__post_init__`` checks;
    every error one ConfigError line "key: got value; what is allowed"."""
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in raw:
        if k not in names:
            raise ConfigError(f"{prefix}{k}: unknown key; allowed keys: {', '.join(names)}")
    kwargs = {k: _coerce(hints[k], v, prefix + k) for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix and not str(e).startswith(prefix):
            raise ConfigError(prefix + str(e)) from None
        raise


MAX_YAML_NODES = 100_000
"""What one YAML document ddplab reads from a user (an experiment, a study, a ``--set`` value)
may expand to, counted as it is composed: every scalar, list and mapping, and each alias as
the whole node it repeats. An experiment is ~100 nodes, a study of 1,000 variants ~10,000; a
1 KB "billion laughs" (aliases of aliases) would be 10^9 and keep everything after it busy
for hours. ``DDPLAB_MAX_YAML_NODES`` raises it."""
MAX_YAML_NODES_VAR = "DDPLAB_MAX_YAML_NODES"
MAX_YAML_DEPTH = 100
"""Lists and mappings within each other, at most (an experiment nests 3 or 4 deep); deeper, a
pure-Python parser's time grows with the square of the depth, then its recursion fails."""


class YAMLTooBig(yaml.YAMLError, BadInput):
    """A YAML document over the node bound, or an alias inside the node it names: one line."""

    def __init__(self, what: str, allowed: str, mark: Any = None) -> None:
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        super().__init__(what.format(where=where) + f"; allowed: {allowed}")


def max_yaml_nodes() -> int:
    """The bound: $DDPLAB_MAX_YAML_NODES, else MAX_YAML_NODES."""
    import os

    text = os.environ.get(MAX_YAML_NODES_VAR, "").strip()
    if not text:
        return MAX_YAML_NODES
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"environment: {MAX_YAML_NODES_VAR}: got {text!r}; a whole number "
                          f">= 1 (nodes a YAML document may expand to; default {MAX_YAML_NODES})")
    return int(text)


class _Loader(yaml.SafeLoader):
    """YAML 1.2's core schema (below), not PyYAML's YAML 1.1: ``1e-3`` is a float (1.1 reads a
    float without a dot as a string), ``no``, ``off`` and ``yes`` are words (1.1's booleans: a
    flag ``ans: no`` vanished from a script's command line), ``010`` is ten (1.1's octal
    eight) and ``12:30`` a word (1.1's base-60 750); ``0o17`` and ``0x1F`` are numbers in both.
    And bounded: the document's nodes are counted while it is
    composed, an alias counting as the whole node it names, and a document over
    :func:`max_yaml_nodes` is refused at once (PyYAML's SafeLoader bounds no alias), as is an
    alias inside the node it names (a structure without end)."""

    limit = MAX_YAML_NODES
    yaml_implicit_resolvers: dict[Any, Any] = {}  # (its own table: none of YAML 1.1's; filled below)

    def construct_yaml_int(self, node: Any) -> int:
        """Decimal (digits grouped by _ too), 0o octal or 0x hexadecimal (PyYAML's reads a
        leading 0 as octal)."""
        text = str(self.construct_scalar(node)).replace("_", "")  # (1_000: grouped, as 1.1 allows)
        sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
        base = {"0o": 8, "0x": 16}.get(digits[:2].lower(), 10)
        return sign * int(digits[2:] if base != 10 else digits, base)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """A key given twice in one mapping is refused (YAML says keys are unique; PyYAML keeps
        the last silently: a second ``metric_mode`` flipped a study's direction)."""
        seen: set[tuple[str, str]] = set()
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                continue
            if (key.tag, key.value) in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"the key {key.value!r} is given twice", key.start_mark)
            seen.add((key.tag, key.value))
        return super().construct_mapping(node, deep)

    def compose_document(self) -> Any:
        self.nodes, self.depth = 0, 0
        return super().compose_document()

    def _count(self, n: int, mark: Any) -> None:
        self.nodes = getattr(self, "nodes", 0) + n
        if self.nodes > self.limit:
            raise YAMLTooBig(f"the YAML expands to over {self.limit} nodes{{where}} (an alias "
                             "counts as all it names)", f"at most {self.limit} nodes a document; "
                             f"{MAX_YAML_NODES_VAR}=N allows more", mark)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            named = self.anchors.get(event.anchor)
            if named is not None:  # an undefined alias is PyYAML's own error
                size = getattr(named, "ddplab_size", None)
                if size is None:
                    raise YAMLTooBig(f"the alias *{event.anchor}{{where}} is inside the node it "
                                     "names (a structure without end)", "aliases of nodes complete "
                                     "before them", event.start_mark)
                self._count(size, event.start_mark)
            return super().compose_node(parent, index)
        before, mark = getattr(self, "nodes", 0), self.peek_event().start_mark
        self._count(1, mark)
        self.depth = getattr(self, "depth", 0) + 1
        if self.depth > MAX_YAML_DEPTH:
            raise YAMLTooBig("the YAML nests lists or mappings deeper than "
                             f"{MAX_YAML_DEPTH} levels{{where}}", f"at most {MAX_YAML_DEPTH} levels",
                             mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        node.ddplab_size = self.nodes - before
        return node


# YAML 1.2's core schema (yaml.org/spec/1.2.2, 10.3.2), PyYAML's merge key `<<` kept.
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool",
                              re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:int",
                              re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                              list("-+0123456789"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^(?:~|null|Null|NULL|)$"),
                              ["~", "n", "N", ""])
_Loader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def _read_yaml(text: str) -> Any:
    """YAML from a user, bounded (_Loader); YAMLTooBig when over the bound, nested too deep
    for the parser included."""
    loader = _Loader(text)
    loader.limit = max_yaml_nodes()
    try:
        return loader.get_single_data()
    except RecursionError:
        raise YAMLTooBig("the YAML nests lists or mappings too deeply for the parser",
                         f"at most {MAX_YAML_DEPTH} levels") from None
    finally:
        loader.dispose()


def _yaml_problem(e: yaml.YAMLError) -> str:
    """One line: what is wrong and where (PyYAML's own message spans several)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{getattr(e, 'problem', None) or type(e).__name__}{where}"


Override = str | tuple[str, str]
"""``"key=value"`` from ``--set``, or ``(source, "key=value")`` from elsewhere (``DDPLAB_SET``)."""


def _source(item: Override) -> tuple[str, str]:
    return item if isinstance(item, tuple) else ("--set", item)


def _short(text: str, most: int = 120) -> str:
    """A long value named in a refusal: its start and its length (a 1 KB alias bomb is no line)."""
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


def parse_override(item: Override) -> tuple[list[str], Any]:
    """``"train.epochs=3"`` -> (["train", "epochs"], 3); the value is read as YAML."""
    source, text_item = _source(item)
    key, sep, text = text_item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"{source} {text_item!r}: expected key.sub=value, e.g. train.epochs=3")
    try:
        value = _read_yaml(text) if text.strip() else ""
    except YAMLTooBig as e:
        raise ConfigError(f"{source} {_short(text_item)!r}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} {text_item!r}: value is not valid YAML ({_yaml_problem(e)})") \
            from None
    return key.strip().split("."), value


def _apply(raw: dict[str, Any], path: list[str], value: Any, origin: str) -> None:
    node = raw
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{origin}: {part} is not a section")
        node = child
    node[path[-1]] = _merged(node.get(path[-1]), value, path)


#: A section's free-form arguments and the key naming what takes them: arguments of the callable
#: a mapping replaces are not the new one's (``model={name: cnn}`` over a GPT's ``args``).
ARGS_OF = {"args": ("name", "dataset"), "scheduler_args": ("scheduler",)}


def _merged(old: Any, new: Any, path: list[str]) -> Any:
    """What a ``--set`` (or a study's ``set``) of ``new`` at ``path`` leaves there: a mapping
    given to a section of ddplab's sets those keys and keeps the others (``optim={lr: 0.5}``
    is ``optim.lr=0.5``: it silently reset the section's scheduler and warm-up, and a study's
    nested ``set: {train: {epochs: 1}}`` every job's train keys), but not the arguments of a
    callable it names anew (ARGS_OF); anything else, a free-form mapping (``model.args``)
    included, replaces what was there."""
    if not (isinstance(old, dict) and isinstance(new, dict) and _section_at(path)):
        return new
    kept = {k: v for k, v in old.items() if not any(
        n in new and new[n] != old.get(n) for n in ARGS_OF.get(k, ()))}
    return {**kept, **{k: _merged(old.get(k), v, [*path, k]) for k, v in new.items()}}


def _section_at(path: list[str]) -> bool:
    """Whether ``path`` names a section (a dataclass) of the experiment's schema."""
    cls: Any = ExperimentConfig
    for part in path:
        if not _is_section(cls) or part not in _hints(cls):
            return False
        hint = _hints(cls)[part]
        cls = next((a for a in typing.get_args(hint) if _is_section(a)), hint)
    return _is_section(cls)


def env_overrides(env: Mapping[str, str] | None = None) -> list[Override]:
    """The ``DDPLAB_SET`` items of ``env`` (this process's environment when None), each tagged
    with its source; ``load`` applies them before (so they lose to) command-line ``--set``."""
    import os
    import shlex

    text = (env if env is not None else os.environ).get("DDPLAB_SET") or ""
    # Shell words: a value with spaces, a list or a mapping travels quoted (study/runner.py).
    try:
        items = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"DDPLAB_SET: got {text!r}; {e} (quote a value with spaces as "
                          "'key=value with spaces')") from None
    return [("DDPLAB_SET", item) for item in items]


def _looks_like_python(p: Path) -> bool:
    """A file that is Python, whatever its name: its #! line names python, or it compiles."""
    try:
        text = p.read_text(encoding="utf-8")
        if text.startswith("#!") and "python" in text.splitlines()[0]:
            return True
        compile(text, str(p), "exec")
        return bool(re.search(r"^\s*(import|from|def|class)\s", text, re.M))
    except (OSError, ValueError, SyntaxError):
        return False


def read_yaml_file(p: Path, kind: str = "experiment") -> dict[str, Any]:
    """A YAML mapping from a file (an experiment, a study), or one ConfigError line."""
    a = "an" if kind[:1] in "aeiou" else "a"
    if p.is_dir():
        main = p / "__main__.py"
        also = f" (its __main__.py runs as a script: give {main})" if main.is_file() else ""
        raise ConfigError(f"{p}: a directory; {a} {kind} is a YAML file{also}")
    if not p.is_file():
        raise ConfigError(f"{p}: {kind} file not found")
    try:
        loaded = _read_yaml_once(p.read_text(encoding="utf-8"), max_yaml_nodes())
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text file ({a} {kind} is UTF-8 YAML)") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read ({e.strerror})") from None
    except YAMLTooBig as e:
        raise ConfigError(f"{p}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({_yaml_problem(e)})") from None
    if loaded is not None and not isinstance(loaded, dict):
        also = " (a Python script? script mode runs a .py file: name it so, or link it as one)" \
            if _looks_like_python(p) else ""
        raise ConfigError(f"{p}: the top level must be a mapping of keys{also}")
    return loaded or {}  # (an empty experiment: everything from --set, DDPLAB_SET)


def _read_yaml_once(text: str, limit: int) -> Any:
    """A file's YAML, parsed once per text (and bound), a fresh copy each call: a study resolves
    its experiment once per variant, and 1,000 parses of pure-Python YAML were 15 s before the
    plan's first line."""
    return copy.deepcopy(_parsed(text, limit))


@functools.lru_cache(maxsize=16)
def _parsed(text: str, limit: int) -> Any:
    return _read_yaml(text)


def load(path: str | Path | None, sets: Sequence[Override] = (),
         script_args: list[str] | None = None, *,
         environ: Mapping[str, str] | None = None, script_job: bool = False) -> ExperimentConfig:
    """The one precedence rule: field defaults < the file < ``DDPLAB_SET`` of ``environ`` (this
    process's environment when None) < ``sets`` (``--set``, in order: later wins), validated.
    Callers pass the command line's ``--set`` values, and ``DDPLAB_SET`` only by ``environ`` (a
    study alone re-applies its items, above its variants' own sets: study/spec.py).
    Errors are one ConfigError line naming the source (the file, ``--set`` or ``DDPLAB_SET``),
    the key, the value and what is allowed. A script job (a script path, or ``script_job``: a
    ``-m MODULE`` the caller adds) refuses the keys only ddplab's loop reads (_loop_only)."""
    overrides = [*env_overrides(environ), *sets]
    raw = _read_experiment(Path(path)) if path is not None else {}
    source = str(path) if path is not None else "defaults"
    overridden = {}
    for item in overrides:
        keys, value = parse_override(item)
        origin = "{} {!r}".format(*_source(item))
        _apply(raw, keys, value, origin)
        overridden[".".join(keys)] = origin
    try:
        cfg = from_mapping(ExperimentConfig, raw)
    except ConfigError as e:
        key = re.sub(r"\[\d+\]", "", str(e).split(":", 1)[0])  # train.metrics[0].fn: of train.metrics
        origin = next((v for k, v in overridden.items()
                       if key == k or f"{key}.".startswith(f"{k}.")
                       or f"{k}.".startswith(f"{key}.")), source)
        raise ConfigError(f"{origin}: {e}") from None
    if cfg.kind == "script" or script_job:
        _loop_only(raw, overridden, source)
    return _with_script(cfg, path, script_args)


#: The sections only ddplab's own loop reads: a script job runs the script's own loop.
LOOP_ONLY = ("data", "model", "optim", "train", "profile")
#: What of ``dist`` a script job reads; the backend, device, strategy and DDP's knobs are the
#: script's own (its init_process_group and DDP(...)).
SCRIPT_DIST = ("threads_per_rank", "timeout_s", "hang_after_s")


def _loop_only(raw: Mapping[str, Any], overridden: Mapping[str, str], source: str) -> None:
    """A key of a loop-only section given to a script job is one line, not silently ignored
    (a script's epochs, lr, batch size are its own arguments)."""
    for section in LOOP_ONLY:
        given = flatten({section: raw.get(section) or {}})
        if not given:
            continue
        key, value = next(iter(given.items()))
        origin = next((v for k, v in overridden.items() if k == key or key.startswith(f"{k}.")),
                      source)
        leaf = key.rsplit(".", 1)[-1]
        raise ConfigError(
            f"{origin}: {key}: got {value!r}; a script job runs your script's own loop, and "
            f"{', '.join(LOOP_ONLY)} are ddplab's loop's settings: give the script its own "
            f"argument instead (script.args, or script.flags.{leaf})")


def is_script(path: str | Path | None) -> bool:
    """A Python script (script mode) rather than an experiment YAML."""
    return path is not None and str(path).endswith(".py")


def runs_a_script(path: Path) -> bool:
    """Whether an experiment runs a script (script mode): a ``.py`` file, or an experiment file
    with a ``script`` section. False for a file that cannot be read: loading it says why."""
    if is_script(path):
        return True
    try:
        return "script" in (read_yaml_file(path) or {})
    except ConfigError:
        return False


def _read_experiment(p: Path) -> dict[str, Any]:
    """An experiment file, or a script as the experiment of script mode (named after it)."""
    if not is_script(p):
        return read_yaml_file(p)
    stem = p.absolute().parent.name if p.name == "__main__.py" else p.stem  # (a folder's own)
    name = re.sub(r"[^A-Za-z0-9._-]", "-", stem).lstrip("._-")[:100] or "script"
    # absolute, its symbolic links kept: the script's __file__ is the path it was given, as
    # under python (files it reads beside itself are beside the link)
    return {"name": name, "script": {"path": str(p.absolute())}}


def check_compiles(file: Path, what: str) -> None:
    """A script that does not compile, or cannot be read, is one line (``what``: its name in
    it), before any process or run exists."""
    try:
        compile(file.read_bytes(), str(file), "exec")
    except SyntaxError as e:
        at = f" at line {e.lineno}" if e.lineno else ""
        raise ConfigError(f"{what} does not compile: {e.msg}{at}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} cannot be read ({e})") from None


def _with_script(cfg: ExperimentConfig, path: str | Path | None,
                 script_args: list[str] | None) -> ExperimentConfig:
    """The script's path made absolute (relative to the experiment file), the command line's
    script arguments after the file's, and what a script cannot be refused here."""
    s = cfg.script
    if script_args and not s.named:
        raise ConfigError(f"{path}: arguments after `--` are for a script, and this experiment "
                          "has none (give a .py file, or a script: section)")
    if not s.named:
        return cfg
    if s.module:  # found as python -m finds it, from the current directory, or one line
        check_compiles(s.file(), f"-m {s.module}: {s.file()}")
        return dataclasses.replace(cfg, script=dataclasses.replace(
            s, args=[*s.args, *(script_args or [])]))
    base = Path(path).parent if path is not None else Path.cwd()
    script = Path(s.path) if Path(s.path).is_absolute() else (base / s.path)
    source = str(path) if path is not None else "script.path"
    if not script.name.endswith(".py"):
        raise ConfigError(f"{source}: script.path: got {s.path!r}; a Python file (.py)")
    if not script.is_file():
        if path is not None and is_script(path) and script.absolute() == Path(path).absolute():
            raise ConfigError(f"{path}: script not found")  # the script itself given
        raise ConfigError(f"{source}: script.path: {str(script)!r} not found (relative paths "
                          "are relative to the experiment file)")
    check_compiles(script, f"{source}: script {script}")
    return dataclasses.replace(cfg, script=dataclasses.replace(
        s, path=str(script.absolute()), args=[*s.args, *(script_args or [])]))
