"""Optimizer and learning-rate schedule (stepped once per optimizer step, or per epoch for a
scheduler of your own with optim.scheduler_interval: epoch)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, OptimConfig, is_import_path

BUILT_IN = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def spec(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """optim.name's class and its arguments (ZeroRedundancyOptimizer builds its own from these):
    lr, weight_decay and momentum where the class takes them, then optim.args."""
    cls = BUILT_IN.get(cfg.name) or _own(cfg.name)
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    known = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "momentum": cfg.momentum}
    return cls, {**{k: v for k, v in known.items() if k in params}, **cfg.args}


def _own(path: str) -> type[torch.optim.Optimizer]:
    from .userparts import load_callable

    cls = load_callable("optim.name", path)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optim.name: got {path!r}; it is {cls!r}, not a torch.optim.Optimizer "
                          "class")
    return cls


def optimizer(params: Iterable[nn.Parameter] | nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    if isinstance(params, nn.Module):
        params = params.parameters()
    params = list(params)
    cls, kwargs = spec(cfg)
    if _fused(cls, cfg, params):
        kwargs["fused"] = True
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as e:  # a wrong argument name or value in optim.args
        raise ConfigError(f"optim.args: got {cfg.args!r}; {cls.__name__} refused them "
                          f"({type(e).__name__}: {str(e)[:200]})") from None


def _fused(cls: type[torch.optim.Optimizer], cfg: OptimConfig, params: list[Any]) -> bool:
    """optim.fused: the class takes ``fused`` and every parameter is on a GPU."""
    if not cfg.fused or "fused" in cfg.args or not params:
        return False
    try:
        takes = "fused" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return takes and all(isinstance(p, torch.Tensor) and p.is_cuda for p in tensors)


def lr_factor(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.scheduler == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup_steps) / span)))
    if cfg.scheduler == "step":
        return cfg.gamma ** ((step - cfg.warmup_steps) // cfg.step_size)
    return 1.0


def scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int,
              epochs: int = 1) -> torch.optim.lr_scheduler.LRScheduler:
    """ddplab's schedule (a LambdaLR over lr_factor), or the user's class by import path."""
    if not is_import_path(cfg.scheduler):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s, total_steps))
    cls = _own_scheduler(cfg.scheduler)
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a signature Python cannot read: scheduler_args only
        params = {}
    span = epochs if cfg.scheduler_interval == "epoch" else total_steps
    sizes = {"max_lr": cfg.lr, "total_steps": span, "T_max": span}
    kwargs = {**{k: v for k, v in sizes.items() if k in params}, **cfg.scheduler_args}
    try:
        return cls(opt, **kwargs)
    except (TypeError, ValueError) as e:  # a wrong argument name or value in scheduler_args
        raise ConfigError(f"optim.scheduler_args: got {cfg.scheduler_args!r}; {cls.__name__} "
                          f"refused them ({type(e).__name__}: {str(e)[:200]})") from None


def _own_scheduler(path: str) -> type[torch.optim.lr_scheduler.LRScheduler]:
    from .userparts import load_callable

    cls = load_callable("optim.scheduler", path)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
        raise ConfigError(f"optim.scheduler: got {path!r}; it is {cls!r}, not a "
                          "torch.optim.lr_scheduler.LRScheduler class")
    return cls
