"""Losses: ``train.loss`` -> callable(outputs, targets) -> a scalar tensor (the batch mean)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.nn import functional as F

from . import batches

Loss = Callable[[Any, torch.Tensor], torch.Tensor]


def prediction(outputs: Any) -> torch.Tensor:
    """What the built-in losses and the metrics read of a model's output: the tensor itself, a
    Hugging Face ``ModelOutput``'s or a dict's ``logits``, or a tuple's first element. (A loss of
    your own gets the output as the model returned it.)"""
    if isinstance(outputs, torch.Tensor):
        return outputs
    found = getattr(outputs, "logits", None)
    if found is None and isinstance(outputs, Mapping):
        found = outputs.get("logits")
    if found is None and isinstance(outputs, (tuple, list)) and outputs:
        found = outputs[0]
    if not isinstance(found, torch.Tensor):
        raise TypeError(f"the model returned {type(outputs).__name__}: ddplab's losses and metrics "
                        "read a tensor, a .logits, a dict's 'logits' or a tuple's first element")
    return found


def cross_entropy(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Class logits (batch, classes), or per-position logits (batch, seq, vocab) for tokens."""
    outputs = prediction(outputs)
    if outputs.dim() > 2:
        outputs, targets = outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1)
    return F.cross_entropy(outputs, targets)


def mse(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    outputs = prediction(outputs)
    return F.mse_loss(outputs, targets.to(outputs.dtype).reshape(outputs.shape))


BUILT_IN: dict[str, Loss] = {"cross_entropy": cross_entropy, "mse": mse,
                             "model": batches.model_loss}


def get(name: str, own: Loss | None = None) -> Loss:
    return own if own is not None else BUILT_IN[name]


def is_classification(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """Outputs that score classes for integer targets: accuracy means something for them."""
    return (outputs.dim() == targets.dim() + 1 and not targets.is_floating_point()
            and not targets.is_complex())
