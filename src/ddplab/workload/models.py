"""Model registry; building a model and placing it on its device (channels_last).

Built-in models are built from the data's sizes (data.DataInfo); a user's own model callable
goes through userparts.py instead and meets the same prepare step here. Spreading it over the
ranks (DDP, its hooks, IPEX, compile) is training/strategy.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import MODEL_NAMES, ConfigError, ModelConfig
from . import userparts
from .data import DataInfo


class BookCNN(nn.Module):
    """The book's CIFAR-10 CNN: two conv+ReLU+maxpool blocks (32, 64 channels), 512 units."""

    def __init__(self, channels: int, size: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * (size // 4) ** 2, 512), nn.ReLU(),
            nn.Linear(512, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(self.features(x))
        return logits


Builder = Callable[[DataInfo, dict[str, Any]], nn.Module]


def _torchvision(name: str) -> Builder:
    def build(info: DataInfo, args: dict[str, Any]) -> nn.Module:
        import torchvision

        if info.channels != 3:
            raise ConfigError(f"model.name: {name} takes 3-channel images, data has {info.channels}")
        model: nn.Module = getattr(torchvision.models, name)(weights=None,
                                                             num_classes=info.num_classes)
        return model
    return build


def _cnn(info: DataInfo, args: dict[str, Any]) -> nn.Module:
    return BookCNN(info.channels, info.image_size, info.num_classes)


def _gpt(info: DataInfo, args: dict[str, Any]) -> nn.Module:
    from .gpt import GPT

    return GPT(vocab_size=info.vocab_size, seq_len=info.seq_len, **args)


REGISTRY: dict[str, Builder] = {
    "cnn": _cnn, "gpt": _gpt,
    **{name: _torchvision(name) for name in MODEL_NAMES if name not in ("cnn", "gpt")},
}


def needs(name: str) -> str:
    """The data kind a built-in model takes: tokens for gpt, images for the rest."""
    return "tokens" if name == "gpt" else "image"


def build(cfg: ModelConfig, info: DataInfo, own: Callable[..., Any] | None = None) -> nn.Module:
    """A built-in model from the data's sizes, or the user's callable (``own``) with model.args
    and whichever sizes its signature names."""
    if own is None:
        if cfg.name not in REGISTRY:
            raise ConfigError(f"model.name: unknown model {cfg.name!r}; choose one of: "
                             f"{', '.join(REGISTRY)}")
        return REGISTRY[cfg.name](info, cfg.args)
    args = userparts.instantiate("model.args", cfg.args)
    model = userparts.call("model.name", cfg.name, own,
                           userparts.offered(own, args, info.model_kwargs(),
                                             userparts.THROUGH_KWARGS))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name: got {cfg.name!r}; it returned {type(model).__name__}, "
                          "expected a torch.nn.Module")
    return model


def prepare(model: nn.Module, cfg: ModelConfig, device: torch.device) -> nn.Module:
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model
