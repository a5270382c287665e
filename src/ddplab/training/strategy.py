"""How the model is spread over the ranks (``dist.strategy``), and what each rank holds of it.

- ``ddp``: a full replica per rank, gradients all-reduced (DistributedDataParallel).
- ``zero``: DDP, with the optimizer state sharded over the ranks (ZeroRedundancyOptimizer,
  ZeRO-1): each rank updates its share of the parameters and broadcasts them.
- ``fsdp``: parameters, gradients and optimizer state sharded (FSDP2, ``fully_shard``): each
  block is all-gathered for its forward and backward, gradients reduce-scattered.
- ``dp``: DataParallel, one process driving every GPU of its node (CUDA only).

Checkpoints hold the FULL state whatever the strategy (torch.distributed.checkpoint's
state_dict API gathers it): parameters by name, optimizer state by parameter name. A checkpoint
written by 2 fsdp ranks therefore resumes under ddp on 1 rank, and ``ddplab checkpoint export``
gives a plain ``state_dict``. The full state goes through rank 0 into one atomic file, as
before, so nodes still need no shared file system.
"""

from __future__ import annotations

import importlib
import resource
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import DistConfig, ExperimentConfig, ModelConfig
from ..workload import optim

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

# Each built-in model's blocks, the units FSDP shards and gathers one at a time.
BLOCKS = {"gpt": ("Block",), "resnet18": ("BasicBlock",), "resnet50": ("Bottleneck",),
          **{f"efficientnet_b{i}": ("MBConv", "FusedMBConv") for i in range(8)}}


@dataclass(frozen=True)
class IpexStatus:
    used: bool
    version: str
    reason: str


def import_ipex() -> tuple[ModuleType | None, str]:
    """IPEX refuses a torch of another major.minor at import, with an AttributeError among
    others, so any failure counts as "absent"; a version mismatch is reported, not raised."""
    try:
        ipex = importlib.import_module("intel_extension_for_pytorch")
    except Exception as e:  # noqa: BLE001 - see docstring
        return None, f"not usable ({type(e).__name__}: {str(e)[:120]})"
    version = str(getattr(ipex, "__version__", "?"))
    if version.split(".")[:2] != torch.__version__.split("+")[0].split(".")[:2]:
        return None, f"version {version} does not match torch {torch.__version__}"
    return ipex, version


def maybe_ipex(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: ModelConfig,
               device: torch.device, amp: str) -> tuple[nn.Module, torch.optim.Optimizer, IpexStatus]:
    if device.type != "cpu" or not cfg.ipex:
        return model, optimizer, IpexStatus(False, "", "off (not CPU or model.ipex=false)")
    ipex, why = import_ipex()
    if ipex is None:
        warnings.warn(f"IPEX not used: intel_extension_for_pytorch {why}", stacklevel=2)
        return model, optimizer, IpexStatus(False, "", why)
    dtype = torch.bfloat16 if amp == "bf16" else torch.float32
    model, optimizer = ipex.optimize(model, optimizer=optimizer, dtype=dtype)
    return model, optimizer, IpexStatus(True, why, f"ipex.optimize(dtype={dtype})")


def wrap(model: nn.Module, cfg: ModelConfig, device: torch.device,
         dist_cfg: DistConfig | None = None) -> nn.Module:
    """DDP (device_ids only on CUDA) with dist's knobs and gradient hook, then torch.compile
    over it when asked."""
    d = dist_cfg or DistConfig()
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, bucket_cap_mb=d.bucket_cap_mb,
              gradient_as_bucket_view=d.gradient_as_bucket_view, static_graph=d.static_graph,
              find_unused_parameters=d.find_unused_parameters)
    _register_hook(ddp, d.comm_hook)
    # a module compiles to a module (OptimizedModule); torch.compile's annotation says Callable
    return cast(nn.Module, torch.compile(ddp, mode=cfg.compile_mode)) if cfg.compile else ddp


def _register_hook(ddp: DDP, name: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name in ("fp16", "bf16"):
        # torch's cast-sum-cast hooks; gloo sums fp16 and bf16 on CPU (checked with torch 2.7.1
        # and 2.14.1), so they work there too, not only on NCCL.
        ddp.register_comm_hook(None, getattr(default_hooks, f"{name}_compress_hook"))
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under compile and DDP: what checkpoints hold."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def spread(model: nn.Module, cfg: ExperimentConfig, device: torch.device
           ) -> tuple[nn.Module, torch.optim.Optimizer, IpexStatus]:
    """The model wrapped for ``dist.strategy`` and its optimizer (built after the wrapping
    where the strategy replaces the parameters: FSDP's are sharded DTensors)."""
    strategy = cfg.dist.strategy
    if strategy in ("ddp", "dp"):
        opt = optim.optimizer(model.parameters(), cfg.optim)
        model, opt, ipex = maybe_ipex(model, opt, cfg.model, device, cfg.train.amp)
        if strategy == "dp":
            return nn.DataParallel(model), opt, ipex
        return wrap(model, cfg.model, device, cfg.dist), opt, ipex
    ipex = IpexStatus(False, "", f"not used with dist.strategy {strategy} (ipex.optimize "
                                        "rewrites the model and optimizer a sharding wraps)")
    if strategy == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        wrapped = wrap(model, cfg.model, device, cfg.dist)
        cls, kwargs = optim.spec(cfg.optim)
        return wrapped, ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=cls,
                                                **kwargs), ipex
    shard(model, cfg)
    return model, optim.optimizer(model.parameters(), cfg.optim), ipex


def block_names(cfg: ExperimentConfig, model: nn.Module) -> set[str]:
    """dist.fsdp.wrap, else the built-in model's blocks, else the classes in the model's first
    nn.ModuleList (a user's transformer), else none (the model is one unit)."""
    named = {n.strip() for n in cfg.dist.fsdp.wrap.split(",") if n.strip()}
    if named:
        present = {type(m).__name__ for m in model.modules()}
        if named - present:
            from ..config import ConfigError

            raise ConfigError(f"dist.fsdp.wrap: got {cfg.dist.fsdp.wrap!r}; the model has no "
                              f"module class {', '.join(sorted(named - present))}: choose among "
                              f"{', '.join(sorted(present - {type(model).__name__}))[:600]}")
        return named
    if cfg.model.name in BLOCKS:
        return set(BLOCKS[cfg.model.name])
    first = next((m for m in model.modules() if isinstance(m, nn.ModuleList)), None)
    return {type(m).__name__ for m in first} if first is not None else set()


def shard(model: nn.Module, cfg: ExperimentConfig) -> None:
    """FSDP2 over each block, then the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    f = cfg.dist.fsdp
    kwargs: dict[str, Any] = {"reshard_after_forward": f.reshard_after_forward}
    if f.mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.bfloat16)
    if f.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    names = block_names(cfg, model)
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)


def grad_sync(model: nn.Module, sync: bool) -> Any:
    """A context in which the backward pass communicates gradients only when ``sync``
    (gradient accumulation): DDP's no_sync, FSDP2's set_requires_gradient_sync."""
    import contextlib

    inner: Any = getattr(model, "_orig_mod", model)  # DDP, FSDP2 or DataParallel: probed below
    if sync:
        return contextlib.nullcontext()
    if hasattr(inner, "no_sync"):
        return inner.no_sync()
    if hasattr(inner, "set_requires_gradient_sync"):
        @contextlib.contextmanager
        def paused() -> Any:
            inner.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                inner.set_requires_gradient_sync(True)
        return paused()
    return contextlib.nullcontext()  # DataParallel: gradients land on the one device anyway


def _names(model: nn.Module) -> list[str]:
    """Parameter names in the order the optimizer holds them (tied weights once)."""
    return [n for n, _ in unwrap(model).named_parameters()]


def _is_zero(opt: torch.optim.Optimizer) -> TypeGuard[ZeroRedundancyOptimizer]:
    return type(opt).__name__ == "ZeroRedundancyOptimizer"


def by_name(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter index -> keyed by parameter name."""
    state = {names[i]: v for i, v in osd["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def by_index(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The reverse of ``by_name``: what torch.optim.Optimizer.load_state_dict takes."""
    index = {n: i for i, n in enumerate(names)}
    state = {index[n]: v for n, v in osd["state"].items()}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def state_dicts(model: nn.Module, opt: torch.optim.Optimizer
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collective: the full model and optimizer state, on global rank 0 (empty elsewhere)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    module = unwrap(model)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if _is_zero(opt):
        opt.consolidate_state_dict(to=0)
        msd = get_model_state_dict(module, options=full)
        return msd, by_name(opt.state_dict(), _names(model)) if dist.get_rank() == 0 else {}
    return get_state_dict(module, opt, options=full)


def load_model_state(model: nn.Module, msd: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(unwrap(model), msd, options=StateDictOptions(full_state_dict=True))


def load_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer,
                         osd: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _names(model)
    if osd["state"] and isinstance(next(iter(osd["state"])), int):  # written before names
        osd = by_name(osd, names)
    if _is_zero(opt):
        opt.load_state_dict(by_index(osd, names))
        return
    set_optimizer_state_dict(unwrap(model), opt, osd,
                             options=StateDictOptions(full_state_dict=True))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def model_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """What this rank holds of the model state: its parameters, one gradient per parameter
    (as during the backward pass; set to None between steps), and its optimizer state."""
    params = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    local = getattr(opt, "optim", opt) if _is_zero(opt) else opt  # ZeRO: this rank's share
    state = sum(_local(v).numel() * v.element_size() for s in local.state.values()
                for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return 2 * params + state


def memory(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> dict[str, float]:
    """Collective: memory/* metrics, this rank's model state and the maxima over ranks."""
    mb = 1024 * 1024
    mine = model_state_bytes(model, opt) / mb
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    peak_cuda = torch.cuda.max_memory_allocated(device) / mb if device.type == "cuda" else 0.0
    t = torch.tensor([mine, peak_rss, peak_cuda], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out = {"memory/model_state_mb": mine, "memory/model_state_mb_max": t[0].item(),
           "memory/peak_rss_mb": t[1].item()}
    if device.type == "cuda":
        out["memory/peak_allocated_mb"] = t[2].item()
    return out
