"""Unit: datasets, the samplers, the missing-dataset message."""

import pytest
import torch

from ddplab.config import DataConfig
from ddplab.workload.data import DataError, ResumableSampler, ShardSampler, SyntheticImages, cifar10


def test_synthetic_is_deterministic_and_shaped():
    a = SyntheticImages(50, 16, 3, 4, 1.0, seed=1)
    b = SyntheticImages(50, 16, 3, 4, 1.0, seed=1)
    x, y = a[7]
    assert x.shape == (3, 16, 16) and 0 <= y < 4
    assert torch.equal(x, b[7][0]) and y == b[7][1]
    assert not torch.equal(a[7][0], SyntheticImages(50, 16, 3, 4, 1.0, seed=2)[7][0])


def test_synthetic_is_learnable_by_nearest_prototype():
    """Signal, not noise: classifying by the nearest prototype beats chance by far."""
    ds = SyntheticImages(400, 8, 3, 10, 4.0, seed=0)
    correct = sum(int(((ds.prototypes - ds[i][0]) ** 2).sum((1, 2, 3)).argmin()) == ds[i][1]
                  for i in range(len(ds)))
    assert correct / len(ds) > 0.5  # chance is 0.1


@pytest.mark.parametrize("size, world", [(100, 4), (101, 3), (7, 2)])
def test_train_sampler_shards_one_shared_order(size, world):
    samplers = [ResumableSampler(range(size), world, r, seed=3) for r in range(world)]
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        shards = [list(s) for s in samplers]
        assert len({len(sh) for sh in shards}) == 1  # equal steps on every rank
        seen = sorted(i for sh in shards for i in sh)
        assert set(seen) == set(range(size))  # every sample, every epoch
        assert len(seen) - size == (-size) % world  # only the padding repeats
        if size % world == 0:
            assert seen == list(range(size))  # exactly once
    s0 = ResumableSampler(range(size), world, 0, seed=3)
    s0.set_epoch(0)
    e0 = list(s0)
    s0.set_epoch(1)
    assert list(s0) != e0  # reshuffled each epoch


def test_resume_skips_what_the_epoch_consumed():
    s = ResumableSampler(range(64), 2, 1, seed=0)
    s.set_epoch(3)
    full = list(s)
    s.set_position(3, 10)
    assert list(s) == full[10:] and len(s) == 22


@pytest.mark.parametrize("size, world", [(101, 3), (10, 4), (3, 5)])
def test_eval_shards_cover_every_sample_exactly_once(size, world):
    seen = sorted(i for r in range(world) for i in ShardSampler(size, world, r))
    assert seen == list(range(size))


def test_missing_cifar_says_where_and_how(tmp_path):
    with pytest.raises(DataError, match=r"data.root: CIFAR-10 not found under .*cifar-10-batches-py"
                       r".*data.download=true"):
        cifar10(DataConfig(dataset="cifar10", root=str(tmp_path)), train=True)


def test_the_data_fingerprint_ignores_augmentation_draws_and_leaves_the_generators_as_they_were():
    """data.digest: a random augmentation draws alike whatever the generators' state (ranks
    compare it), a different sample changes it, and the caller's generators are left as found."""
    import random

    import numpy as np

    from ddplab.workload import data

    class Augmented(torch.utils.data.Dataset):
        def __init__(self, offset: float) -> None:
            self.offset = offset

        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int):
            noise = torch.rand(3) + float(np.random.rand()) + random.random()
            return torch.full((3,), float(i) + self.offset) + noise, i % 2

    torch.manual_seed(1)
    first = data.digest((Augmented(0.0), Augmented(0.0)))
    torch.manual_seed(1)
    np.random.seed(7)
    random.seed(7)
    torch.rand(5)  # another state
    assert data.digest((Augmented(0.0), Augmented(0.0))) == first
    assert data.digest((Augmented(0.5), Augmented(0.0))) != first
    torch.manual_seed(1)
    np.random.seed(3)
    random.seed(3)
    data.digest((Augmented(0.0), Augmented(0.0)))
    after = (torch.rand(1), np.random.rand(), random.random())
    torch.manual_seed(1)
    np.random.seed(3)
    random.seed(3)
    assert after == (torch.rand(1), np.random.rand(), random.random())


def test_a_gpu_ranks_pinning_copies_on_its_own_thread_and_keeps_the_batch_fake_gpu():
    """Without loader workers the batch is pinned in the rank's thread: torch's parallel copy
    into page-locked memory left OpenMP's idle threads spinning through each step (15 cores on
    an H200). No GPU here, so ordinary tensors stand in for page-locked ones; what is measured
    is the copy's CPU time against the wall time between steps."""
    import collections
    import time

    from ddplab.workload.data import SERIAL_COPY, loaders, pin_serially, pinning

    Pair = collections.namedtuple("Pair", "x y")
    batch = {"inputs": torch.randn(32, 3, 32, 32), "parts": [Pair(torch.arange(5), "tag")],
             "ids": (torch.ones(2, SERIAL_COPY + 3, dtype=torch.uint8),)}
    pinned = pin_serially(batch, torch.empty_like)
    assert torch.equal(pinned["inputs"], batch["inputs"]) and pinned["inputs"] is not batch["inputs"]
    assert isinstance(pinned["parts"][0], Pair) and pinned["parts"][0].y == "tag"
    assert torch.equal(pinned["parts"][0].x, torch.arange(5))
    assert torch.equal(pinned["ids"][0], batch["ids"][0])

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        collate = pinning(lambda samples: samples[0], alloc=torch.empty_like)
        cpu, t0 = time.process_time(), time.perf_counter()
        for _ in range(100):
            collate([batch])
            time.sleep(0.004)  # the device's step, which the host does not wait for
        share = (time.process_time() - cpu) / (time.perf_counter() - t0)
        # a parallel copy kept the second thread spinning: CPU time about equal to wall time
        assert share < 0.5, f"{share:.2f} of a core busy between steps"
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

    sets = (SyntheticImages(8, 4, 1, 2, 1.0, seed=0), SyntheticImages(4, 4, 1, 2, 1.0, seed=1))
    gpu = loaders(DataConfig(batch_size=4), sets, seed=0, rank=0, world=1, pin=True)
    workers = loaders(DataConfig(batch_size=4, num_workers=1), sets, seed=0, rank=0, world=1, pin=True)
    cpu_job = loaders(DataConfig(batch_size=4), sets, seed=0, rank=0, world=1, pin=False)
    # in the rank: ddplab pins; with workers: DataLoader's own pinning thread (one intra-op thread)
    assert not gpu.train.pin_memory and gpu.train.collate_fn.__name__ == "collate_pinned"
    assert not gpu.eval.pin_memory and gpu.eval.collate_fn.__name__ == "collate_pinned"
    assert workers.train.pin_memory and workers.train.collate_fn is torch.utils.data.default_collate
    assert not cpu_job.train.pin_memory and cpu_job.train.collate_fn is torch.utils.data.default_collate


def test_a_compiled_models_loader_trains_whole_batches_and_says_when_its_epoch_is_over():
    """The epoch's last, shorter batch compiled a compiled model again (a new shape): 27 s of
    the GPT's job on an H200. Whole batches only, and the epoch still ends."""
    from ddplab.workload.data import loaders

    sets = (SyntheticImages(22, 4, 1, 2, 1.0, seed=0), SyntheticImages(4, 4, 1, 2, 1.0, seed=1))
    cfg = DataConfig(batch_size=4)
    whole = loaders(cfg, sets, seed=0, rank=0, world=2, pin=False, whole_batches=True)
    plain = loaders(cfg, sets, seed=0, rank=0, world=2, pin=False)
    # 11 samples a rank: 2 whole batches of 4 (3 left out), against 3 batches, the last of 3
    assert [len(x) for x, _ in whole.train] == [4, 4] and whole.micro_batches_per_epoch == 2
    assert [len(x) for x, _ in plain.train] == [4, 4, 3] and plain.micro_batches_per_epoch == 3
    assert whole.epoch_over(8) and not whole.epoch_over(4)
    assert not plain.epoch_over(8) and plain.epoch_over(11)
    with pytest.raises(DataError, match=r"data.batch_size: got 16; each rank's share of the "
                                        r"training set is 11 samples, and a compiled model"):
        loaders(DataConfig(batch_size=16), sets, seed=0, rank=0, world=2, pin=False, whole_batches=True)
