"""Optimizer and learning-rate schedule, stepped once per optimizer step."""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import OptimConfig


def optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = model.parameters()
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


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
