"""What a batch is to the loop, and how the model is called with it. A sample is
``(input, target)``, or a dict as Hugging Face's datasets and collators make them
(``{"input_ids": ..., "attention_mask": ..., "labels": ...}``): the target is
``data.target_key``, the model gets ``data.input_keys`` (default: every other key) as keyword
arguments. With ``train.loss: model`` the model computes its own loss: the target goes into its
forward as ``labels`` and its output's ``loss`` is the step's (Hugging Face's models shift a
causal LM's labels themselves, which a loss of ddplab's cannot know).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..config import ConfigError, ExperimentConfig

Inputs = torch.Tensor | dict[str, torch.Tensor]


@dataclass
class Batch:
    inputs: Inputs
    target: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.target.shape[0])


@dataclass(frozen=True)
class Shape:
    """How samples are read: from data.input_keys, data.target_key and train.loss."""

    input_keys: tuple[str, ...] = ()
    target_key: str = "labels"
    own_loss: bool = False

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> Shape:
        return cls(tuple(cfg.data.input_keys), cfg.data.target_key, cfg.train.loss == "model")

    def split(self, raw: Any) -> Batch:
        """A collated batch as (inputs, target)."""
        if isinstance(raw, dict):
            if self.target_key not in raw:
                raise ConfigError(f"data.target_key: got {self.target_key!r}; the samples' keys are "
                                  f"{', '.join(map(str, raw))}")
            keys = self.input_keys or tuple(k for k in raw if k != self.target_key)
            missing = [k for k in keys if k not in raw]
            if missing:
                raise ConfigError(f"data.input_keys: got {list(keys)}; the samples have no "
                                  f"{', '.join(missing)} (their keys: {', '.join(map(str, raw))})")
            return Batch({k: raw[k] for k in keys}, raw[self.target_key])
        x, y = raw
        return Batch(x, y)

    def forward(self, model: nn.Module, batch: Batch) -> Any:
        extra = {"labels": batch.target} if self.own_loss else {}
        if isinstance(batch.inputs, dict):
            return model(**batch.inputs, **extra)
        return model(batch.inputs, **extra)


def to_device(batch: Batch, device: torch.device, channels_last: bool) -> Batch:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    if isinstance(batch.inputs, dict):
        inputs: Inputs = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                          for k, v in batch.inputs.items()}
    elif channels_last and batch.inputs.dim() == 4:
        inputs = batch.inputs.to(device, non_blocking=True, memory_format=fmt)
    else:
        inputs = batch.inputs.to(device, non_blocking=True)
    return Batch(inputs, batch.target.to(device, non_blocking=True))


def model_loss(outputs: Any, _targets: Any = None) -> torch.Tensor:
    """train.loss: model. The loss the model computed from the labels it was given."""
    found = getattr(outputs, "loss", None)
    if found is None and isinstance(outputs, dict):
        found = outputs.get("loss")
    if not isinstance(found, torch.Tensor):
        raise TypeError(f"train.loss model: the model's output ({type(outputs).__name__}) has no "
                        "`loss`: the model must compute one when called with labels= (Hugging "
                        "Face's *ForCausalLM and *ForSequenceClassification do)")
    return found
