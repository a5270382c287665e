"""Losses: ``train.loss`` -> callable(outputs, targets) -> a scalar tensor (the batch mean)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Class logits (batch, classes), or per-position logits (batch, seq, vocab) for tokens."""
    if outputs.dim() > 2:
        outputs, targets = outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1)
    return F.cross_entropy(outputs, targets)


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs, targets.to(outputs.dtype).reshape(outputs.shape))


BUILT_IN: dict[str, Loss] = {"cross_entropy": cross_entropy, "mse": mse}


def get(name: str, own: Loss | None = None) -> Loss:
    return own if own is not None else BUILT_IN[name]


def is_classification(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """Outputs that score classes for integer targets: accuracy means something for them."""
    return (outputs.dim() == targets.dim() + 1 and not targets.is_floating_point()
            and not targets.is_complex())
