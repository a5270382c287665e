"""Optimizer and learning-rate schedule, stepped once per optimizer step."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, OptimConfig

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
    cls, kwargs = spec(cfg)
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as e:  # a wrong argument name or value in optim.args
        raise ConfigError(f"optim.args: got {cfg.args!r}; {cls.__name__} refused them "
                          f"({type(e).__name__}: {str(e)[:200]})") from None


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


def scheduler(opt: torch.optim.Optimizer, cfg: OptimConfig,
              total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(cfg, s, total_steps))
