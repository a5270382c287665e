"""Datasets -> per-rank loaders.

Built in: synthetic images, CIFAR-10, an ImageFolder tree, byte tokens (textdata.py); a user's
own datasets come from userparts.py. ddplab owns what follows in every case: sharding,
loaders, workers and the batch arithmetic.

Training uses a DistributedSampler with one seed shared by every rank and ``set_epoch`` each
epoch, so ranks see disjoint shards of one shuffled order. Evaluation shards are strided and
unpadded, so every sample is counted exactly once when the totals are all-reduced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, default_collate

from ..config import DataConfig
from ..errors import DdplabError
from . import textdata

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class DataError(DdplabError, RuntimeError):
    """The dataset cannot be loaded; the message says where to put it or how to fetch it."""


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """A deterministic, learnable image classification set.

    Each class has a fixed random prototype image; a sample is its class's prototype plus
    Gaussian noise. Sample ``i`` is generated from ``(seed, i)`` alone, so every rank, worker
    and rerun sees the same data without storing it. Higher ``noise`` makes it harder.
    """

    def __init__(self, size: int, image_size: int, channels: int, num_classes: int,
                 noise: float, seed: int) -> None:
        self.size, self.num_classes, self.noise, self.seed = size, num_classes, noise, seed
        g = torch.Generator().manual_seed(seed)
        self.shape = (channels, image_size, image_size)
        self.prototypes = torch.randn((num_classes, *self.shape), generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        # Modulo 2**63: any valid seed (train.seed < 2**63) stays a valid generator seed.
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + i) % 2**63)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        x = self.prototypes[label] + self.noise * torch.randn(self.shape, generator=g)
        return x, label


def cifar10(cfg: DataConfig, train: bool) -> Dataset[Any]:
    import torchvision
    from torchvision import transforms

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    root = Path(cfg.root)
    try:
        found: Dataset[Any] = torchvision.datasets.CIFAR10(str(root), train=train, transform=tf,
                                                           download=cfg.download)
        return found
    except OSError as e:  # urllib's URLError and socket errors are OSErrors
        raise DataError(
            f"data.download: CIFAR-10 could not be downloaded into {root.resolve()} "
            f"({type(e).__name__}: {getattr(e, 'reason', e)}). Put the extracted "
            "cifar-10-python.tar.gz there, or run where https://www.cs.toronto.edu is reachable"
        ) from None
    except RuntimeError as e:
        if "not found" not in str(e).lower() and "corrupted" not in str(e).lower():
            raise
        raise DataError(
            f"data.root: CIFAR-10 not found under {root.resolve()}/cifar-10-batches-py. Put the "
            "extracted cifar-10-python.tar.gz there, or set data.download=true "
            "(e.g. --set data.download=true) on a machine that can reach the internet"
        ) from None


IMAGEFOLDER_SPLITS = ("train", "val")


def imagefolder(cfg: DataConfig) -> tuple[Dataset[Any], Dataset[Any]]:
    """torchvision's ImageFolder over ``root/train`` and ``root/val``, resized to image_size."""
    import torchvision
    from torchvision import transforms

    steps = [transforms.Resize((cfg.image_size, cfg.image_size))]
    if cfg.channels == 1:
        steps.append(transforms.Grayscale(1))
    tf = transforms.Compose([*steps, transforms.ToTensor()])
    train, evals = (torchvision.datasets.ImageFolder(str(Path(cfg.root) / split), transform=tf)
                    for split in IMAGEFOLDER_SPLITS)
    return train, evals


def imagefolder_problem(root: str) -> str:
    """Why ``root`` is not a usable ImageFolder tree, or '' (checked before any run exists)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    classes: dict[str, list[str]] = {}
    for split in IMAGEFOLDER_SPLITS:
        folder = Path(root) / split
        if not folder.is_dir():
            return f"{folder.resolve()} is missing (an ImageFolder tree has {root}/train/<class>/* " \
                   f"and {root}/val/<class>/*)"
        loop = _symlink_loop(folder)
        if loop:
            return loop
        classes[split] = sorted(d.name for d in folder.iterdir() if d.is_dir())
        empty = [c for c in classes[split] if not any(
            p.suffix.lower() in IMG_EXTENSIONS for p in (folder / c).rglob("*"))]
        if len(empty) == len(classes[split]):  # no class folders, or none with images
            return f"{folder.resolve()} holds no images in class folders"
        if empty:
            return (f"{(folder / empty[0]).resolve()}: the class folder holds no images (a class "
                    "with no samples cannot be learned; remove the folder or add its images)")
    if len(classes["train"]) < 2:
        return f"{Path(root, 'train').resolve()} has {len(classes['train'])} class folder(s); need >= 2"
    if classes["train"] != classes["val"]:
        return (f"the class folders of train ({', '.join(classes['train'])}) and val "
                f"({', '.join(classes['val'])}) differ")
    for split in IMAGEFOLDER_SPLITS:  # the tree is sound: now each image, by its header
        for p in (Path(root) / split).rglob("*"):
            what = _unreadable_image(p) if p.suffix.lower() in IMG_EXTENSIONS else ""
            if what:
                return (f"{p}: {what} among the images (it would fail mid-training, on every "
                        "rank): remove it or put the image back")
    return ""


def _unreadable_image(p: Path) -> str:
    """Why PIL could not open this image, from its header alone (fast: the pixels are not
    decoded), or ""."""
    if not p.exists():
        return "a broken symbolic link"
    if p.stat().st_size == 0:
        return "an empty file"
    from PIL import Image

    try:
        with Image.open(p):
            return ""
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds for a file it cannot read
        return f"not an image PIL can read ({type(e).__name__}: {str(e)[:120]})"


def per_class(dataset: Any) -> str:
    """"cat 120, dog 118": how many images an ImageFolder read per class (the run records it,
    so a tree read twice, or half of it, shows); "" for other datasets."""
    classes, targets = getattr(dataset, "classes", None), getattr(dataset, "targets", None)
    if not classes or targets is None:
        return ""
    counts = [0] * len(classes)
    for t in targets:
        counts[int(t)] += 1
    return ", ".join(f"{c} {n}" for c, n in zip(classes, counts, strict=True))


def _symlink_loop(folder: Path) -> str:
    """A folder under ``folder`` that links back to one already walked: torchvision's
    ImageFolder follows links, so a loop (``train/a/loop -> ..``) reads the same images again
    and again, under the wrong classes (12 images became 492 samples)."""
    import os

    seen: set[str] = set()
    for here, _, _ in os.walk(folder, followlinks=True):
        real = os.path.realpath(here)
        if real in seen:
            return (f"{here} links back to {real}, a folder already in the tree (a symlink "
                    "loop: its images would be read again, under other classes); remove the link")
        seen.add(real)
    return ""


def datasets(cfg: DataConfig, seed: int) -> tuple[Dataset[Any], Dataset[Any]]:
    """The built-in datasets (a user's own come from userparts)."""
    if cfg.dataset == "cifar10":
        return cifar10(cfg, train=True), cifar10(cfg, train=False)
    if cfg.dataset == "imagefolder":
        return imagefolder(cfg)
    if cfg.dataset == "tokens":
        return textdata.datasets(cfg.root, cfg.seq_len, cfg.train_samples, cfg.eval_samples, seed)
    args = (cfg.image_size, cfg.channels, cfg.num_classes, cfg.noise)
    # Same prototypes (same seed), different noise streams for train and eval.
    train = SyntheticImages(cfg.train_samples, *args, seed=seed)
    evals = SyntheticImages(cfg.eval_samples, *args, seed=seed)
    evals.seed = seed + 7_919
    return train, evals


@dataclass(frozen=True)
class DataInfo:
    """What the data says about the model it needs (0 = does not apply)."""

    kind: str
    """image (C x H x W samples, class targets), tokens (token ids), or other."""
    channels: int = 0
    image_size: int = 0
    num_classes: int = 0
    vocab_size: int = 0
    seq_len: int = 0

    def model_kwargs(self) -> dict[str, int]:
        """The names a model callable may declare, with the data's values."""
        names = ("channels", "image_size", "num_classes", "vocab_size", "seq_len")
        return {n: getattr(self, n) for n in names if getattr(self, n)}


def describe(cfg: DataConfig, train_set: Dataset[Any]) -> DataInfo:
    """The model's input and output sizes, from the config and the data itself."""
    if cfg.dataset == "cifar10":
        return DataInfo("image", 3, 32, 10)
    if cfg.dataset == "synthetic":
        return DataInfo("image", cfg.channels, cfg.image_size, cfg.num_classes)
    if cfg.dataset == "imagefolder":
        # an ImageFolder (imagefolder()): Dataset itself declares no classes
        return DataInfo("image", cfg.channels, cfg.image_size, len(cast(Any, train_set).classes))
    if cfg.dataset == "tokens":
        return DataInfo("tokens", vocab_size=textdata.VOCAB_SIZE, seq_len=cfg.seq_len)
    return _describe_own(cfg, train_set)


def _describe_own(cfg: DataConfig, train_set: Dataset[Any]) -> DataInfo:
    """A user's dataset: its attributes (classes, num_classes, vocab_size, ...) win; else the
    first sample's shape; else data.* from the config. A dict sample is read by its inputs:
    ``input_ids`` (Hugging Face's name), else the first input key."""
    first = train_set[0]
    if isinstance(first, dict):
        keys = cfg.input_keys or [k for k in first if k != cfg.target_key]
        x = first.get("input_ids", first[keys[0]]) if keys else None
    else:
        x = first[0]

    def attr(name: str, default: int) -> int:
        return int(getattr(train_set, name, default))

    classes = len(train_set.classes) if hasattr(train_set, "classes") else attr("num_classes",
                                                                                 cfg.num_classes)
    if isinstance(x, torch.Tensor) and x.dim() == 3:
        return DataInfo("image", attr("channels", x.shape[0]), attr("image_size", x.shape[-1]),
                        classes)
    if isinstance(x, torch.Tensor) and x.dim() == 1 and not x.is_floating_point():
        return DataInfo("tokens", num_classes=0, vocab_size=attr("vocab_size", 256),
                        seq_len=attr("seq_len", x.shape[0]))
    return DataInfo("other", num_classes=classes)


def digest(sets: tuple[Dataset[Any], Any], first: int = 4) -> str:
    """A fingerprint of the datasets: each one's length and its first samples, read with
    Python's, numpy's and torch's generators seeded alike (so a random augmentation draws the
    same on every rank) and restored after. Ranks compare it: a dataset built differently on
    one rank (unseeded randomness at construction, a path that depends on the rank) differs."""
    import hashlib
    import random

    import numpy as np

    h = hashlib.sha256()
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            random.seed(0)
            np.random.seed(0)
            torch.manual_seed(0)
            for ds in sets:
                size = len(ds) if isinstance(ds, Sized) else -1
                h.update(f"len {size};".encode())
                for i in range(min(first, max(size, 0))):
                    _feed(h, ds[i])
        except Exception as e:  # noqa: BLE001 - a sample that cannot be read: the loop will say so
            h.update(f"unreadable: {type(e).__name__}".encode())
        finally:
            random.setstate(py)
            np.random.set_state(npy)
    return h.hexdigest()[:16]


def _feed(h: Any, item: Any) -> None:
    if isinstance(item, torch.Tensor):
        flat = item.detach().cpu().contiguous().reshape(-1)
        h.update(f"{flat.dtype}{tuple(item.shape)}".encode())
        h.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(item, (tuple, list)):
        for part in item:
            _feed(h, part)
    elif isinstance(item, dict):
        for key in sorted(item, key=str):
            h.update(str(key).encode())
            _feed(h, item[key])
    elif callable(getattr(item, "tobytes", None)):  # numpy arrays, PIL images
        h.update(item.tobytes())
    else:  # numbers, strings
        h.update(repr(item).encode())


# Elements one copy may have and still run on its calling thread: half ATen's parallel grain
# (32,768), whatever the dtype.
SERIAL_COPY = 16_384


def pinning(collate: Callable[[list[Any]], Any],
            alloc: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Callable[[list[Any]], Any]:
    """``collate``, then the batch copied into page-locked memory on the rank's own thread.

    DataLoader's pinning copies a batch with torch's parallel copy, on every intra-op thread,
    and OpenMP's idle threads then spin for milliseconds: on an H200 the quickstart's 98k-float
    batch kept 15 cores spinning through every 4 ms step. Copied in chunks under ATen's grain,
    the copy stays on the calling thread, and no thread setting is touched. ``alloc`` makes the
    page-locked copy's storage (tests: an ordinary tensor; there is no GPU here)."""
    def collate_pinned(samples: list[Any]) -> Any:
        return pin_serially(collate(samples), alloc or _page_locked)
    return collate_pinned


def _page_locked(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def pin_serially(obj: Any, alloc: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """What DataLoader's pin_memory=True pins (tensors in mappings, named tuples and sequences,
    objects with ``pin_memory``), each dense tensor copied chunk by chunk."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or not obj.is_contiguous():
            return obj.pin_memory()  # rare in a collated batch: torch's own copy
        out = alloc(obj)
        for dst, src in zip(out.view(-1).split(SERIAL_COPY), obj.view(-1).split(SERIAL_COPY),
                            strict=True):
            dst.copy_(src)
        return out
    if isinstance(obj, (str, bytes)):
        return obj
    if isinstance(obj, Mapping):
        pinned = {k: pin_serially(v, alloc) for k, v in obj.items()}
        try:
            return type(obj)(pinned)  # type: ignore[call-arg]  # OrderedDict, BatchEncoding
        except TypeError:
            return pinned
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(pin_serially(x, alloc) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(pin_serially(x, alloc) for x in obj)
    if callable(getattr(obj, "pin_memory", None)):
        return obj.pin_memory()
    return obj


def first_batch(sets: tuple[Dataset[Any], Any], n: int = 2) -> Any:
    """A tiny batch from the training set, collated as the loader will (for checks)."""
    return default_collate([sets[0][i] for i in range(min(n, len(cast(Sized, sets[0]))))])


class ResumableSampler(DistributedSampler[Any]):
    """DistributedSampler that can skip the batches an interrupted epoch already consumed."""

    def __init__(self, dataset: Dataset[Any], num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed,
                         drop_last=False)
        self.skip = 0

    def set_position(self, epoch: int, samples_seen: int) -> None:
        self.set_epoch(epoch)
        self.skip = samples_seen

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip:])

    def __len__(self) -> int:
        return self.num_samples - self.skip


class ShardSampler(Sampler[int]):
    """Strided, unpadded shard for evaluation: ranks together cover each sample exactly once."""

    def __init__(self, size: int, num_replicas: int, rank: int) -> None:
        self.indices = range(rank, size, num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


@dataclass
class Loaders:
    train: DataLoader[Any]
    eval: DataLoader[Any]
    sampler: ResumableSampler

    @property
    def micro_batches_per_epoch(self) -> int:
        """Micro-batches per rank in a whole epoch (equal on every rank: the sampler pads);
        whole batches only where the loader drops the last short one."""
        batch = self.train.batch_size
        assert batch is not None  # loaders() passes one; only a batch_sampler leaves it None
        whole, short = divmod(self.sampler.num_samples, batch)
        return whole + (1 if short and not self.train.drop_last else 0)

    def epoch_over(self, samples_in_epoch: int) -> bool:
        """This rank's shard is trained through (what is left is less than the one batch the
        loader drops, for a compiled model), not cut short by max_steps."""
        left = self.sampler.num_samples - samples_in_epoch
        return left <= 0 or bool(self.train.drop_last) and left < (self.train.batch_size or 1)


def loaders(cfg: DataConfig, sets: tuple[Dataset[Any], Dataset[Any]], seed: int, rank: int, world: int,
            pin: bool, whole_batches: bool = False) -> Loaders:
    """Per-rank loaders over ``sets`` (from ``datasets``, built once per rank).
    ``whole_batches`` (a compiled model): the training loader drops each epoch's last, shorter
    batch, whose new shape would compile the model again (27 s of a GPT's job on an H200)."""
    train_set, eval_set = sets
    sampler = ResumableSampler(train_set, world, rank, seed)
    if whole_batches and sampler.num_samples < cfg.batch_size:
        raise DataError(f"data.batch_size: got {cfg.batch_size}; each rank's share of the training "
                        f"set is {sampler.num_samples} samples, and a compiled model (model.compile) "
                        "trains on whole batches only: a smaller batch, or more data")
    pinned = pin and cfg.pin_memory
    # Loader workers hand batches to DataLoader's pinning thread, which runs on one intra-op
    # thread; without workers DataLoader pins in the rank's own thread, on all of them.
    in_rank = pinned and cfg.num_workers == 0
    common: dict[str, Any] = {"num_workers": cfg.num_workers, "pin_memory": pinned and not in_rank,
                              "persistent_workers": cfg.persistent_workers,
                              "collate_fn": pinning(default_collate) if in_rank else None}
    train = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler, drop_last=whole_batches,
                       **common)
    evals = DataLoader(eval_set, batch_size=cfg.eval_batch_size,
                       sampler=ShardSampler(len(cast(Sized, eval_set)), world, rank), **common)
    return Loaders(train, evals, sampler)
