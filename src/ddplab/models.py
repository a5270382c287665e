"""Model registry; build, move, optimise (IPEX, channels_last, compile), wrap in DDP.

Built-in models are built from the data's sizes (data.DataInfo); a user's own model callable
goes through userparts.py instead and meets the same prepare/wrap steps here.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import userparts
from .config import MODEL_NAMES, ConfigError, DistConfig, ModelConfig
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
        return self.classifier(self.features(x))


Builder = Callable[[DataInfo, dict], nn.Module]


def _torchvision(name: str) -> Builder:
    def build(info: DataInfo, args: dict) -> nn.Module:
        import torchvision

        if info.channels != 3:
            raise ValueError(f"model.name: {name} takes 3-channel images, data has {info.channels}")
        return getattr(torchvision.models, name)(weights=None, num_classes=info.num_classes)
    return build


def _cnn(info: DataInfo, args: dict) -> nn.Module:
    return BookCNN(info.channels, info.image_size, info.num_classes)


def _gpt(info: DataInfo, args: dict) -> nn.Module:
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
            raise ValueError(f"model.name: unknown model {cfg.name!r}; choose one of: "
                             f"{', '.join(REGISTRY)}")
        return REGISTRY[cfg.name](info, cfg.args)
    model = userparts.call("model.name", cfg.name, own,
                           userparts.offered(own, cfg.args, info.model_kwargs()))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name: got {cfg.name!r}; it returned {type(model).__name__}, "
                          "expected a torch.nn.Module")
    return model


@dataclass(frozen=True)
class IpexStatus:
    used: bool
    version: str
    reason: str


def import_ipex() -> tuple[object | None, str]:
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


def prepare(model: nn.Module, cfg: ModelConfig, device: torch.device) -> nn.Module:
    model = model.to(device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


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
    return torch.compile(ddp) if cfg.compile else ddp


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
