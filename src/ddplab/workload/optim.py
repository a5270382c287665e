"""Optimizer and learning-rate schedule, stepped once per optimizer step."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..config import OptimConfig


def spec(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """optim.name's class and its arguments (ZeroRedundancyOptimizer builds its own from these)."""
    if cfg.name == "sgd":
        return torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.momentum,
                                 "weight_decay": cfg.weight_decay}
    cls = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
    return cls, {"lr": cfg.lr, "weight_decay": cfg.weight_decay}


def optimizer(params: Iterable[nn.Parameter] | nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    if isinstance(params, nn.Module):
        params = params.parameters()
    cls, kwargs = spec(cfg)
    return cls(params, **kwargs)


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
