"""Every error that can be known before training, raised before any process group or MLflow
run exists: config x layout, paths, the tracking URI. One line each (ConfigError, exit 2).

Checks that depend only on the config and the layout give the same answer on every rank, so
all ranks stop together. Path checks run where the writes will happen (global rank 0); the
launcher then stops the other ranks, which are still before their first collective.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import ConfigError, ExperimentConfig
from .launch import LaunchEnv

# What MLflow's client can open (mlflow.tracking._tracking_service.utils, store registry).
TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "file",
                    "databricks", "databricks-uc", "uc")


def before_start(cfg: ExperimentConfig, le: LaunchEnv, summary_out: str,
                 cuda_available: bool) -> None:
    cfg.global_batch(le.world_size)
    _layout(cfg, cuda_available)
    if cfg.tracking.enabled:
        _tracking_uri(cfg.tracking.uri)
    if le.is_rank0:
        _writable_dir(Path(cfg.checkpoint.dir), "checkpoint.dir")
        if summary_out:
            _summary_path(Path(summary_out))


def _layout(cfg: ExperimentConfig, cuda_available: bool) -> None:
    on_cuda = cfg.dist.device == "cuda" or (cfg.dist.device == "auto" and cuda_available)
    if cfg.train.amp == "fp16" and not on_cuda:
        raise ConfigError("train.amp: got 'fp16'; fp16 needs a CUDA device (dist.device), use "
                          "'bf16' on CPU")
    if cfg.dist.device == "cuda" and not cuda_available:
        raise ConfigError("dist.device: got 'cuda'; torch sees no CUDA device here (use 'auto' "
                          "or 'cpu')")
    if cfg.dist.backend == "nccl" and not on_cuda and not cfg.dist.allow_backend_fallback:
        raise ConfigError("dist.backend: got 'nccl'; nccl needs a CUDA device, use gloo or ccl "
                          "on CPU")
    channels = 3 if cfg.data.dataset == "cifar10" else cfg.data.channels
    if cfg.model.name != "cnn" and channels != 3:
        raise ConfigError(f"data.channels: got {channels}; model.name {cfg.model.name!r} takes "
                          "3-channel images (the book's cnn takes any)")
    if cfg.data.dataset == "cifar10" and not cfg.data.download:
        folder = Path(cfg.data.root) / "cifar-10-batches-py"
        if not folder.is_dir():
            raise ConfigError(f"data.root: got {cfg.data.root!r}; CIFAR-10 is not in "
                              f"{folder.resolve()}: put the extracted cifar-10-python.tar.gz "
                              "there, or set data.download=true where the internet is reachable")


def _tracking_uri(uri: str) -> None:
    source, value = ("tracking.uri", uri) if uri else (
        "MLFLOW_TRACKING_URI", os.environ.get("MLFLOW_TRACKING_URI", ""))
    if not value:
        return  # the embedded default store
    scheme = value.split(":", 1)[0].lower() if ":" in value else ""
    if scheme not in TRACKING_SCHEMES:
        raise ConfigError(f"{source}: got {value!r}; use a tracking server (http://host:5000) or a "
                          f"store URI with one of the schemes {', '.join(TRACKING_SCHEMES)}")


def _writable_dir(path: Path, key: str, given: str = "") -> None:
    """``path`` exists as a writable directory, or can be made: its nearest existing ancestor
    is one. ``given`` is what the user wrote, when that is not ``path`` itself."""
    given = given or str(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise ConfigError(f"{key}: got {given!r}; {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: got {given!r}; {existing} is not writable by this user")


def _summary_path(path: Path) -> None:
    if path.is_dir() or str(path).endswith(os.sep):
        raise ConfigError(f"--summary-out: got {str(path)!r}; a directory, give a file path such "
                          "as summary.json")
    _writable_dir(path.parent, "--summary-out", str(path))
