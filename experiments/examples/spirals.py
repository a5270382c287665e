"""An experiment of your own, in one module beside its experiment file (spirals.yaml).

ddplab imports it by the paths in the experiment (``spirals:make_data`` ...); the experiment's
folder is on the import path, so nothing needs installing. Three parts, each optional:
- data: a callable returning (train_dataset, eval_dataset), map-style; ddplab shards them,
  builds the loaders and keeps the batch arithmetic;
- model: a callable returning an nn.Module; ddplab passes num_classes because the signature
  names it (and would pass channels, image_size, vocab_size or seq_len the same way);
- loss: a callable (outputs, targets) -> a scalar tensor.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset


class Spirals(TensorDataset):
    """Points on ``arms`` interleaved spiral arms in the plane; the arm is the class."""

    def __init__(self, n: int, arms: int, noise: float, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(arms, (n,), generator=g)
        t = torch.rand(n, generator=g) * 3 * math.pi
        angle = t + labels * (2 * math.pi / arms)
        points = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1) / (3 * math.pi)
        super().__init__(points + noise * torch.randn(n, 2, generator=g), labels)
        self.classes = [f"arm{i}" for i in range(arms)]


def make_data(train_samples: int = 4096, eval_samples: int = 1024, arms: int = 3,
              noise: float = 0.02, seed: int = 0) -> tuple[Spirals, Spirals]:
    """``seed`` comes from train.seed (ddplab passes it because the signature names it)."""
    return (Spirals(train_samples, arms, noise, seed),
            Spirals(eval_samples, arms, noise, seed + 1))


def mlp(num_classes: int, hidden: int = 64, depth: int = 3) -> nn.Module:
    """num_classes comes from the data (Spirals.classes); hidden and depth from model.args."""
    layers: list[nn.Module] = []
    width = 2
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.SiLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


def smoothed_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy with label smoothing 0.05."""
    return F.cross_entropy(outputs, targets, label_smoothing=0.05)
