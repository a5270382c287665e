"""Model registry; build, move, optimise (IPEX, channels_last, compile), wrap in DDP."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .config import MODEL_NAMES, DistConfig, ModelConfig


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


def _torchvision(name: str) -> Callable[[int, int, int], nn.Module]:
    def build(channels: int, size: int, num_classes: int) -> nn.Module:
        import torchvision

        if channels != 3:
            raise ValueError(f"model.name: {name} takes 3-channel images, data has {channels}")
        return getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
    return build


REGISTRY: dict[str, Callable[[int, int, int], nn.Module]] = {
    "cnn": BookCNN,
    **{name: _torchvision(name) for name in MODEL_NAMES if name != "cnn"},
}


def build(name: str, channels: int, size: int, num_classes: int) -> nn.Module:
    if name not in REGISTRY:
        raise ValueError(f"model.name: unknown model {name!r}; choose one of: {', '.join(REGISTRY)}")
    return REGISTRY[name](channels, size, num_classes)


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
