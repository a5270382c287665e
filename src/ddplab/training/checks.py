"""Every error that can be known before training, raised before any process group or MLflow
run exists: config x layout, paths, the tracking URI. One line each (ConfigError, exit 2).

Checks that depend only on the config and the layout give the same answer on every rank, so
all ranks stop together. Path checks run where the writes will happen (global rank 0); the
launcher then stops the other ranks, which are still before their first collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import ConfigError, ExperimentConfig, is_import_path
from ..files import folder_problem
from ..launchers import LaunchEnv
from ..tracking import check_uri, resolve_uri
from ..workload import batches, data, models, textdata, userparts
from ..workload.userparts import Parts


def before_start(cfg: ExperimentConfig, le: LaunchEnv, summary_out: str,
                 cuda_available: bool, experiment: str | Path | None = None) -> Parts:
    """Every check; returns the user's resolved parts (``experiment``: the file, whose folder
    goes on the import path)."""
    cfg.global_batch(le.world_size)
    _layout(cfg, cuda_available)
    _strategy(cfg, cuda_available, le.world_size)
    _data(cfg)
    _optimizer(cfg)
    parts = _user_parts(cfg, experiment)
    _store_and_folders(cfg, le, summary_out)
    return parts


def preflight(cfg: ExperimentConfig, le: LaunchEnv, summary_out: str,
              cuda_available: bool, experiment: str | Path | None = None) -> None:
    """``ddplab run``'s checks in one process for the ranks it will start: before_start's,
    except building the user's parts (each rank does, with its own imports and data): they
    are imported, so a path that does not import is one line before the ranks start."""
    cfg.global_batch(le.world_size)
    _layout(cfg, cuda_available)
    _strategy(cfg, cuda_available, le.world_size)
    _data(cfg)
    _optimizer(cfg, trains_here=False)
    _importable(cfg, experiment)
    _store_and_folders(cfg, le, summary_out)


def _importable(cfg: ExperimentConfig, experiment: str | Path | None) -> None:
    """The user's parts by import path import and name a callable (built by each rank)."""
    userparts.add_search_path(experiment)
    for key, path in (("model.name", cfg.model.name), ("train.loss", cfg.train.loss),
                      ("data.dataset", cfg.data.dataset),
                      *((f"train.metrics[{i}].fn", m.fn) for i, m in enumerate(cfg.train.metrics))):
        if is_import_path(path):
            userparts.load_callable(key, path)


def for_variant(cfg: ExperimentConfig, world_size: int, on_this_host: bool,
                cuda_available: bool, experiment: str | Path) -> None:
    """What a study checks of each variant before any run exists: the batch arithmetic, and,
    for jobs that run on this host, the same machine, data and user-part checks as train."""
    cfg.global_batch(world_size)
    if on_this_host:
        _layout(cfg, cuda_available)
        _strategy(cfg, cuda_available, world_size)
        _data(cfg)
        _optimizer(cfg, trains_here=False)
        _user_parts(cfg, experiment)


def _optimizer(cfg: ExperimentConfig, trains_here: bool = True) -> None:
    """optim.name and optim.args build an optimizer (on one stand-in parameter), optim.scheduler
    and its args a schedule on it: a class that does not import or an argument it refuses is one
    line here, not on every rank later.

    ``trains_here=False``: a process that only checks (``ddplab run`` before it starts the
    ranks, a study before its jobs). Torch's first optimizer imports torch._dynamo (its
    ``add_param_group`` is wrapped to be skipped by torch.compile), 1.6 s of CPU measured, on
    the path to every job's first step; such a process never compiles, so the wrapper is told
    it has nothing to skip."""
    import torch

    from ..workload import optim

    if not trains_here:
        _no_dynamo_for(torch.optim.Optimizer.add_param_group)
    opt = optim.optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.optim)
    optim.scheduler(opt, cfg.optim, total_steps=1000, epochs=cfg.train.epochs)  # its args, too


def _no_dynamo_for(method: Any) -> None:
    """torch._compile._disable_dynamo's wrapper keeps, on the function it wraps, the
    dynamo-disabled version it builds (importing torch._dynamo) on its first call: given the
    plain function there, the call runs it as is. Torch versions without that cache: no-op."""
    plain = getattr(method, "__wrapped__", None)
    if plain is not None and getattr(plain, "__dynamo_disable", None) is None:
        setattr(plain, "__dynamo_disable", plain)


def _layout(cfg: ExperimentConfig, cuda_available: bool) -> None:
    from ..distributed.cpu import nodes_on_host

    nodes_on_host(os.environ)
    on_cuda = cfg.dist.device == "cuda" or (cfg.dist.device == "auto" and cuda_available)
    if cfg.train.amp == "fp16" and not on_cuda:
        raise ConfigError("train.amp: got 'fp16'; fp16 needs a CUDA device (dist.device), use "
                          "'bf16' on CPU")
    if cfg.dist.device == "cuda" and not cuda_available:
        raise ConfigError("dist.device: got 'cuda'; torch sees no CUDA device here (use 'auto' "
                          "or 'cpu')")
    if cfg.dist.backend == "nccl" and not on_cuda and not cfg.dist.allow_backend_fallback:
        raise ConfigError("dist.backend: got 'nccl'; nccl needs a CUDA device, use gloo or ccl "
                          "on CPU")
    channels = 3 if cfg.data.dataset == "cifar10" else cfg.data.channels
    if cfg.model.name not in ("cnn", "gpt") and not is_import_path(cfg.model.name) and channels != 3:
        raise ConfigError(f"data.channels: got {channels}; model.name {cfg.model.name!r} takes "
                          "3-channel images (the book's cnn takes any)")
    if cfg.data.dataset == "cifar10" and not cfg.data.download:
        folder = Path(cfg.data.root) / "cifar-10-batches-py"
        if not folder.is_dir():
            raise ConfigError(f"data.root: got {cfg.data.root!r}; CIFAR-10 is not in "
                              f"{folder.resolve()}: put the extracted cifar-10-python.tar.gz "
                              "there, or set data.download=true where the internet is reachable")


# DDP's own knobs and their defaults: under fsdp they would silently do nothing.
DDP_KNOBS = {"bucket_cap_mb": 25.0, "gradient_as_bucket_view": False, "static_graph": False,
             "find_unused_parameters": False, "comm_hook": "none"}


def _strategy(cfg: ExperimentConfig, cuda_available: bool, world_size: int) -> None:
    """dist.strategy against the device, the world and the knobs that belong to another one."""
    from ..config import FsdpConfig

    d = cfg.dist
    on_cuda = d.device == "cuda" or (d.device == "auto" and cuda_available)
    if d.strategy == "dp" and not on_cuda:
        raise ConfigError("dist.strategy: got 'dp'; DataParallel splits each batch over the "
                          "GPUs of one process and needs CUDA: on CPU use ddp, zero or fsdp")
    if d.strategy == "dp" and world_size > 1:
        raise ConfigError(f"dist.strategy: got 'dp' with {world_size} processes; DataParallel "
                          "is one process per node driving its GPUs: launch 1 (NPROC=1)")
    if d.strategy == "fsdp":
        for knob, default in DDP_KNOBS.items():
            if getattr(d, knob) != default:
                raise ConfigError(
                    f"dist.{knob}: got {getattr(d, knob)!r}; a DDP knob, and dist.strategy is "
                    "'fsdp' (FSDP2 reduce-scatters its own gradients; smaller messages: "
                    "dist.fsdp.mixed_precision=bf16)")
        if cfg.model.compile:
            raise ConfigError("model.compile: got True; not combined with dist.strategy 'fsdp' "
                              "here (ddplab compiles the wrapped model): use ddp or zero")
        if d.fsdp.cpu_offload and not on_cuda:
            raise ConfigError("dist.fsdp.cpu_offload: got True; it moves GPU memory to the host, "
                              "and on CPU the state is in host memory already")
        return
    for f in dataclasses.fields(FsdpConfig):
        value = getattr(d.fsdp, f.name)
        if value != f.default:
            raise ConfigError(f"dist.fsdp.{f.name}: got {value!r}; it applies to dist.strategy "
                              f"'fsdp', and this job's is {d.strategy!r}")
    if d.strategy == "dp" and d.comm_hook != "none":
        raise ConfigError(f"dist.comm_hook: got {d.comm_hook!r}; a DDP gradient hook, and "
                          "dist.strategy 'dp' has no all-reduce to hook")


BUILT_IN_KINDS = {"synthetic": "image", "cifar10": "image", "imagefolder": "image",
                  "tokens": "tokens"}


def _data(cfg: ExperimentConfig) -> None:
    """The built-in datasets' files, and built-in models against the data kind they take."""
    d = cfg.data
    if d.dataset == "imagefolder":
        why = data.imagefolder_problem(d.root)
        if why:
            raise ConfigError(f"data.root: got {d.root!r}; {why}")
    if d.dataset == "tokens":
        why = textdata.problem(d.root, d.seq_len)
        if why:
            raise ConfigError(f"data.root: got {d.root!r}; {why}")
    kind = BUILT_IN_KINDS.get(d.dataset)
    if kind:
        _model_fits(cfg, kind)
    if cfg.model.channels_last and kind == "tokens":
        raise ConfigError("model.channels_last: got True; channels_last is for image batches, "
                          "data.dataset 'tokens' gives token ids")


def _model_fits(cfg: ExperimentConfig, kind: str) -> None:
    name = cfg.model.name
    if is_import_path(name) or models.needs(name) == kind:
        return
    if name == "gpt":
        raise ConfigError(f"model.name: got 'gpt'; gpt takes token data (data.dataset: tokens), "
                          f"data.dataset {cfg.data.dataset!r} gives {kind} data")
    raise ConfigError(f"model.name: got {name!r}; it takes images, data.dataset "
                      f"{cfg.data.dataset!r} gives {kind} data (use model.name gpt, or your own)")


def _user_parts(cfg: ExperimentConfig, experiment: str | Path | None) -> Parts:
    """Import the user's parts; when there are any, build the model and run one tiny batch
    through it and the loss, so a wrong return type fails here, not on every rank later."""
    parts = userparts.resolve(cfg, experiment)
    if parts.paths:
        _probe(cfg, parts)
    _fsdp_wrap(cfg, parts)
    return parts


def _fsdp_wrap(cfg: ExperimentConfig, parts: Parts) -> None:
    """dist.fsdp.wrap names module classes of the built model: a typo is refused here, before
    any run (the model is built on the meta device: no memory, no initialisation)."""
    if cfg.dist.strategy != "fsdp" or not cfg.dist.fsdp.wrap.strip():
        return
    if parts.datasets is None and cfg.data.dataset == "cifar10" and cfg.data.download:
        return  # no data on disk to describe yet: the job refuses it once built
    import torch

    from .strategy import block_names

    sets = parts.datasets or data.datasets(cfg.data, cfg.train.seed)
    info = data.describe(cfg.data, sets[0])
    with torch.device("meta"):
        model = models.build(cfg.model, info, parts.model)
    block_names(cfg, model)


def _probe(cfg: ExperimentConfig, parts: Parts) -> None:
    import torch

    from ..workload import losses

    if parts.datasets is None and cfg.data.dataset == "cifar10" and cfg.data.download:
        return  # nothing on disk yet to probe with; the job's own data step downloads it
    sets = parts.datasets or data.datasets(cfg.data, cfg.train.seed)
    info = data.describe(cfg.data, sets[0])
    if parts.model is None:
        _model_fits(cfg, info.kind)
    model = models.build(cfg.model, info, parts.model)
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model.name: got {cfg.model.name!r}; the model has no trainable "
                          "parameters: nothing to train, nor for DDP to all-reduce")
    shape = batches.Shape.of(cfg)
    batch = _sample(cfg, sets, shape)
    y = batch.target
    _copying_targets(cfg, batch)
    was_training = model.training
    with torch.enable_grad():  # a loss computed outside autograd must show here
        model.eval()
        outputs = _run(f"model.name: got {cfg.model.name!r}; its forward on a batch of "
                       f"{len(y)} samples raised", lambda: shape.forward(model, batch))
        loss = _run(f"train.loss: got {cfg.train.loss!r}; on the model's outputs it raised",
                    lambda: losses.get(cfg.train.loss, parts.loss)(outputs, y))
        pred = _run(f"model.name: got {cfg.model.name!r}; evaluation cannot read its output",
                    lambda: losses.prediction(outputs))
    _probe_metrics(cfg, info, pred.detach().float(), y)
    width = pred.shape[-1] if pred.dim() == 2 else 0
    if cfg.train.loss == "cross_entropy" and info.num_classes and width and width != info.num_classes:
        raise ConfigError(f"model.name: got {cfg.model.name!r}; it scores {width} classes, the data "
                          f"has {info.num_classes}: set model.args.num_classes={info.num_classes} "
                          "(or the model's own name for its output width)")
    model.train(was_training)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) \
            else type(loss).__name__
        raise ConfigError(f"train.loss: got {cfg.train.loss!r}; it returned {what}, expected a "
                          "scalar floating-point tensor")
    if not loss.requires_grad:
        raise ConfigError(f"train.loss: got {cfg.train.loss!r}; its result carries no gradient "
                          "(computed outside autograd: .item(), .detach(), numpy, or under "
                          "no_grad), so nothing would train")


def _probe_metrics(cfg: ExperimentConfig, info: Any, pred: Any, y: Any) -> None:
    """Each of train.metrics built, updated with the probe batch and computed, as evaluation
    will: a metric that cannot read the model's output fails here, not after training."""
    metrics = userparts.build_metrics(cfg, info.model_kwargs())
    for (name, metric), m in zip(metrics.items(), cfg.train.metrics, strict=True):
        where = f"train.metrics ({name}): got {m.fn!r};"
        _run(f"{where} update(the model's output, the targets) raised",
             functools.partial(metric.update, pred, y))
        value = _run(f"{where} compute() raised", metric.compute)
        try:
            float(value)
        except (TypeError, ValueError, RuntimeError):  # a tensor of several values, a dict
            raise ConfigError(f"{where} compute() returned {type(value).__name__}, expected a "
                              "number (a 0-d tensor)") from None


def _sample(cfg: ExperimentConfig, sets: Any, shape: batches.Shape) -> batches.Batch:
    import torch

    try:
        raw = data.first_batch(sets)
    except Exception as e:  # noqa: BLE001 - the user's samples may not collate
        raise ConfigError(f"data.dataset: got {cfg.data.dataset!r}; its samples do not form a "
                          f"batch ({userparts.why(e)})") from None
    batch = shape.split(raw)
    inputs = batch.inputs.values() if isinstance(batch.inputs, dict) else [batch.inputs]
    if not (all(isinstance(v, torch.Tensor) for v in inputs) and isinstance(batch.target, torch.Tensor)):
        what = ({k: type(v).__name__ for k, v in batch.inputs.items()}
                if isinstance(batch.inputs, dict) else type(batch.inputs).__name__)
        raise ConfigError(f"data.dataset: got {cfg.data.dataset!r}; a batch is ({what}, "
                          f"{type(batch.target).__name__}), expected tensors: samples of "
                          "(input, target), or dicts, of tensors or numbers")
    return batch


def _copying_targets(cfg: ExperimentConfig, batch: batches.Batch) -> None:
    """Targets equal to the input ids are Hugging Face's causal-LM labels, unshifted: the model
    shifts them when it computes its own loss. Under a loss of ddplab's each position would
    learn to copy its own input, the loss falling to zero while nothing is learned."""
    import torch

    ids = batch.inputs.get("input_ids") if isinstance(batch.inputs, dict) else batch.inputs
    if (cfg.train.loss in ("cross_entropy", "mse") and isinstance(ids, torch.Tensor)
            and not ids.is_floating_point() and ids.shape == batch.target.shape
            and torch.equal(ids, batch.target)):
        raise ConfigError(f"train.loss: got {cfg.train.loss!r}; the targets equal the input ids "
                          "(a causal LM's labels, unshifted), so every position would learn to copy "
                          "its input: set train.loss: model (the model shifts them, as Hugging "
                          "Face's do), or shift them yourself (target = next token)")


def _run(prefix: str, fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the user's code may raise anything
        raise ConfigError(f"{prefix} {userparts.why(e)}") from None


def _tracking_uri(uri: str) -> None:
    source, value = ("tracking.uri", uri) if uri else (
        "MLFLOW_TRACKING_URI", os.environ.get("MLFLOW_TRACKING_URI", ""))
    if value:  # (else the embedded default store)
        check_uri(value, source)  # (a URL's password masked in its line)


def _credentials(uri: str) -> None:
    """A server that refuses this job's credentials (HTTP 401) or its user or host name (403)
    stops the job here, before any process group, naming what to set. A server that does not
    answer is left to the tracker's own wait (tracking.wait_s): it may still be starting."""
    from ..tracking import auth_refusal

    why = auth_refusal(uri)
    if why:
        raise ConfigError(why)


def _run_to_attach(uri: str) -> None:
    """$MLFLOW_RUN_ID (a study's or a launcher's run for this job) must name a run there."""
    run_id = os.environ.get("MLFLOW_RUN_ID", "")
    if not run_id:
        return
    from ..tracking import check_reachable, open_client

    if check_reachable(uri):
        return  # the tracker's own wait and message (tracking.wait_s) handle a down server
    try:
        open_client(uri).get_run(run_id)
    except Exception as e:  # noqa: BLE001 - no such run, or a store that cannot say
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"MLFLOW_RUN_ID: got {run_id!r}; no such run in {uri} ({first}): unset "
                          "it to start a new run") from None


def _writable_dir(path: Path, key: str, given: str = "") -> None:
    """``path`` exists as a writable directory, or can be made: its nearest existing ancestor
    is one. ``given`` is what the user wrote, when that is not ``path`` itself."""
    problem = folder_problem(path)
    if problem:
        raise ConfigError(f"{key}: got {given or str(path)!r}; {problem}")


def _really_writable(path: Path, key: str) -> None:
    """Make the folder and a file in it, then take back what was made: permission bits do not
    tell (root passes os.access on /proc, read-only mounts, full disks), trying does."""
    import tempfile

    with _tried(path, key, "cannot write there"):
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".ddplab-probe-"):
            pass


@contextlib.contextmanager
def _tried(path: Path, key: str, what: str) -> Iterator[None]:
    """A write tried at ``path``: its OSError as the key's one line; the folders the try made
    (``path``'s missing ancestors, and ``path`` itself) taken back, deepest first."""
    made = [p for p in (path, *path.parents) if not p.exists()]
    try:
        yield
    except OSError as e:
        raise ConfigError(f"{key}: got {str(path)!r}; {what} ({e.strerror or e})") from None
    finally:
        for p in made:
            try:
                p.rmdir() if p.is_dir() else p.unlink()
            except OSError:
                break


def _summary_path(path: Path) -> None:
    try:
        directory = path.is_dir()
    except OSError as e:  # a name too long: is_dir raises, where it says False for most errors
        raise ConfigError(f"--summary-out: got {str(path)!r}; cannot write it "
                          f"({e.strerror or e})") from None
    if directory or str(path).endswith(os.sep):
        raise ConfigError(f"--summary-out: got {str(path)!r}; a directory, give a file path such "
                          "as summary.json")
    _writable_dir(path.parent, "--summary-out", str(path))
    _file_writable(path, "--summary-out")


def _file_writable(path: Path, key: str) -> None:
    """Open ``path`` as its writer will (its folder made), then take back what was made: a
    file under /proc, an immutable one, a name too long were found only once the job ended."""
    with _tried(path, key, "cannot write it"):
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a"):
            pass


def for_script(cfg: ExperimentConfig, le: LaunchEnv, summary_out: str) -> None:
    """Script mode's checks (the script itself was found and compiled by config.load): the
    tracking store and the folders the run writes, before any run exists."""
    _store_and_folders(cfg, le, summary_out)


def _store_and_folders(cfg: ExperimentConfig, le: LaunchEnv, summary_out: str) -> None:
    """The tracking URI; on rank 0 (where the writes happen) the store's login, the run to
    attach to, and the folders the job writes."""
    if cfg.tracking.enabled:
        _tracking_uri(cfg.tracking.uri)
    if not le.is_rank0:
        return
    if cfg.tracking.enabled:
        _credentials(resolve_uri(cfg.tracking))
        _run_to_attach(resolve_uri(cfg.tracking))
    _writable_dir(Path(cfg.checkpoint.dir), "checkpoint.dir")
    _really_writable(Path(cfg.checkpoint.dir), "checkpoint.dir")
    if summary_out:
        _summary_path(Path(summary_out))
