"""The script observer's clock on a GPU: its phases are the device's, read late, never waited for.

No GPU runs here, so the device is a fake one (named so): a clock the test moves, and marks
that behave as CUDA events do (``query()`` is True once the device has passed them,
``elapsed_time`` in milliseconds). The Observer is driven by the calls its hooks make (forward
pre-hook, backward, optimizer step) on a real model; on a CPU, the script-mode tests
(test_script_mode.py) check the same figures against what real scripts print.
"""

from __future__ import annotations

import time
import types
import weakref

import pytest
import torch
from torch import nn

from ddplab.training.scriptmode import observe


class FakeGpuMark:
    """A CUDA event on the fake device: stamped with the device time at which the device
    reaches it; readable (query) once the device has got that far."""

    def __init__(self, device: FakeGpu) -> None:
        self.device, self.at = device, device.queued

    def query(self) -> bool:
        if self.device.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.device.queries += 1
        return self.at <= self.device.done

    def elapsed_time(self, end: FakeGpuMark) -> float:
        assert self.query() and end.query(), "read before the device passed it (a host wait)"
        return (end.at - self.at) * 1000


class FakeGpu:
    """A device whose timeline the test writes: ``queued`` is the device time at which the
    next mark will be stamped, ``done`` how far the device has got."""

    def __init__(self) -> None:
        self.queued, self.done, self.queries, self.broken = 0.0, -1.0, 0, False
        self.model_on_it = True

    def marker_for(self, device: torch.device):
        return (lambda: FakeGpuMark(self)) if self.model_on_it else None


class HostWait:
    """A loss whose read would wait for the device."""

    def item(self) -> float:
        raise AssertionError("the loss was read: a host wait on the device")


def observer(gpu: FakeGpu) -> tuple[observe.Observer, list[dict]]:
    written: list[dict] = []
    obs = observe.Observer(0, 2, 1.0e6, written.append, lambda record: None,
                           lambda phase, step: None, marker_for=gpu.marker_for)
    return obs, written


def step(obs: observe.Observer, gpu: FakeGpu, model: nn.Module, start: float,
         wait: float, forward: float, rest: float) -> None:
    """One training step as the hooks see it, the device spending ``wait`` idle for input,
    then ``forward`` and ``rest`` (backward and optimizer) from device time ``start``."""
    x = torch.randn(8, 4)
    gpu.queued = start + wait
    obs.forward(model, (x,), {})
    loss = model(x).square().mean()
    gpu.queued = start + wait + forward
    obs.backward(loss)
    loss.backward()
    gpu.queued = start + wait + forward + rest
    obs.optimizer_step()


def test_on_a_fake_gpu_the_phases_are_the_devices_read_once_passed_and_never_waited_for():
    gpu, model = FakeGpu(), nn.Linear(4, 2)
    obs, _ = observer(gpu)
    # Step 1 (the warm-up, then the FLOP count), ending at device time 1.0.
    step(obs, gpu, model, 0.0, 0.0, 0.5, 0.5)
    # Steps 2..10, each 2 s on the device: 0.5 idle for input, 0.5 forward, 1.0 the rest
    # (step j ends at device time 2j - 1). The device is three steps behind the host: as
    # step k ends, it has passed step k - 3's end, and nothing it has not passed is read.
    for k in range(2, 11):
        start = 1.0 + 2 * (k - 2)
        gpu.done = 2 * (k - 3) - 1
        step(obs, gpu, model, start, 0.5, 0.5, 1.0)
        t = obs.totals
        assert t.steps == k
        assert len(t.busy) == max(0, k - 4), k  # steps 2..k-3 read (step 1: the warm-up)
    # At the log point (step 10), the window held only what was read: 6 steps of 2 s each.
    record = obs.pending
    assert record is not None and record["step"] == 10
    m = record["metrics"]
    assert m["train/step_time_s"] == pytest.approx(2.0)
    assert m["train/data_wait_frac"] == pytest.approx(0.25)
    # rank 0's 8 samples a step over 2 s, x 2 ranks
    assert m["train/samples_per_s"] == pytest.approx(8 / 2.0 * 2)
    assert obs.totals.busy == [pytest.approx(1.0)] * 6  # data wait + forward, the device's
    assert len(obs.unread) == 3
    # The script ends: its last steps are read once the device gets there.
    gpu.done = 1e9
    obs.finish()
    t = obs.totals
    assert not obs.unread and len(t.busy) == 9
    assert t.steady_s == pytest.approx(18.0) and t.steady_samples == 72  # steps 2..10
    assert observer_report(obs)["clock"] == "cuda events"
    assert t.wait_s == pytest.approx(4.5) and t.forward_s == pytest.approx(4.5)
    assert t.backward_s == pytest.approx(9.0)
    report = t.report()
    assert report["samples_per_s"] == pytest.approx(72 / 18.0)


def observer_report(obs: observe.Observer) -> dict:
    written: list[dict] = []
    obs._write = written.append
    obs.save()
    return written[-1]["observe"]


def test_on_a_fake_gpu_that_fails_captures_or_never_catches_up_the_observer_neither_raises_nor_waits(
        monkeypatch):
    monkeypatch.setattr(observe, "FINISH_PATIENCE_S", 0.2)
    gpu, model = FakeGpu(), nn.Linear(4, 2)
    obs, _ = observer(gpu)
    for k in range(1, 5):
        step(obs, gpu, model, 2.0 * k, 0.5, 0.5, 1.0)
    assert len(obs.unread) == 4  # nothing has passed
    obs.loss = HostWait()
    obs.finish()  # the device never got there: its marks waited 0.2 s for, its loss not read
    assert obs.totals.busy == [] and obs.totals.steps == 4 and not obs.unread

    gpu, model = FakeGpu(), nn.Linear(4, 2)
    obs, _ = observer(gpu)
    for k in range(1, 5):
        step(obs, gpu, model, 2.0 * k, 0.5, 0.5, 1.0)
    gpu.broken = True  # a CUDA error: every mark's read raises from now on
    obs.finish()  # left out of the steady figures, without raising
    assert not obs.unread and obs.totals.busy == [] and obs.marker is None
    assert observer_report(obs)["clock"].startswith("host (the GPU failed")

    # The script captures a CUDA graph: no mark is asked about, no loss read, until it ends.
    gpu, model = FakeGpu(), nn.Linear(4, 2)
    obs, _ = observer(gpu)
    step(obs, gpu, model, 0.0, 0.5, 0.5, 1.0)
    monkeypatch.setattr(observe.marks, "capturing", lambda: True)
    asked = gpu.queries
    obs.loss = HostWait()
    obs.log_point()
    assert gpu.queries == asked and len(obs.unread) == 1


def test_on_a_cpu_the_observer_keeps_the_host_clock_until_the_model_is_on_a_fake_gpu():
    obs = observe.Observer(0, 1, 1.0e6, lambda r: None, lambda r: None, lambda p, s: None)
    model = nn.Linear(4, 2)
    for _ in range(3):
        x = torch.randn(8, 4)
        obs.forward(model, (x,), {})
        loss = model(x).sum()
        obs.backward(loss)
        loss.backward()
        obs.optimizer_step()
    assert obs.marker is None and not obs.unread  # the real chooser, on a CPU model
    assert len(obs.totals.busy) == 2 and obs.totals.steady_samples == 16
    assert observer_report(obs)["clock"] == "host"
    # A script that warms up on the CPU, then moves its model to the GPU: found at that step.
    gpu = FakeGpu()
    gpu.model_on_it, obs.marker_for = False, gpu.marker_for
    step(obs, gpu, model, 10.0, 0.5, 0.5, 1.0)
    assert obs.marker is None and len(obs.totals.busy) == 3
    gpu.model_on_it, gpu.done = True, 1e9
    for k in range(2):
        step(obs, gpu, model, 20.0 + 2 * k, 0.5, 0.5, 1.0)
    assert obs.marker is not None and len(obs.totals.busy) == 5
    assert obs.totals.busy[-1] == pytest.approx(1.0)  # the device's wait + forward
    assert observer_report(obs)["clock"] == "cuda events"


def test_a_straggler_is_named_only_over_enough_steps():
    """A 3-step run named rank 1 a straggler from the median of two steps' data wait."""
    from ddplab.training.scriptmode.figures import STRAGGLER_MIN_STEPS, figures

    def outcomes(steps: int) -> dict:
        return {r: {"host": "h", "observed": {"observe": {
            "steps": steps, "samples": 8 * steps, "samples_per_s": 100.0, "busy_s": busy}}}
            for r, busy in ((0, 0.01), (1, 0.08))}

    assert figures(outcomes(3), 1.0).straggler == ""
    assert figures(outcomes(STRAGGLER_MIN_STEPS), 1.0).straggler.startswith("rank 1 (host h)")


@pytest.mark.parametrize("source, mfu", [("torch.utils.flop_counter", 0.3),
                                          ("script.flops_per_sample", 0.1)])
def test_mfu_counts_the_rows_the_model_took_unless_the_script_gave_its_flops_per_sample(
        source, mfu):
    """A GAN's discriminator takes 3 rows a sample: its counted FLOPs are per row."""
    from ddplab.training.scriptmode.figures import MFU, figures

    seen = {"steps": 20, "samples": 160, "samples_per_s": 100.0, "rows_per_s": 300.0,
            "busy_s": 0.01, "flops_per_sample": 1e6, "flops_source": source,
            "peak_flops_s": 1e9, "peak_where": "rank0"}
    fig = figures({0: {"host": "h", "observed": {"observe": seen}}}, 1.0)
    assert fig.metrics[MFU] == pytest.approx(mfu)
    assert fig.metrics["perf/samples_per_s"] == pytest.approx(100.0)


@pytest.mark.parametrize("loader_s, phase", [(0.9, "data loading"),
                                               (0.1, "between steps, outside its data loader")])
def test_a_stragglers_wait_is_data_loading_only_when_its_loader_took_it(loader_s, phase):
    """Rank 0's own 4 ms of bookkeeping after each step was named "data loading", though its
    loader's next() took 0.15 ms."""
    from ddplab.training.scriptmode.figures import figures

    def seen(busy: float, wait: float, loader: float) -> dict:
        return {"steps": 20, "samples": 160, "samples_per_s": 100.0, "busy_s": busy,
                "data_wait_s": wait, "forward_s": 0.01, "loader_s": loader, "loaders": True}

    ranks = {0: seen(0.05, 1.0, loader_s), 1: seen(0.005, 0.05, 0.04)}
    fig = figures({r: {"host": "h", "observed": {"observe": o}} for r, o in ranks.items()}, 1.0)
    assert fig.straggler.startswith("rank 0 (host h)") and f"ms: {phase}) " in fig.straggler


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(ids * mask)


def test_flops_are_counted_once_the_script_has_ended_from_several_positional_tensors():
    """The count and a CPU's peak measure (~0.3 s) ran after step 1, inside the script's own
    first-epoch timer (Trainer's train_samples_per_second -30% on a short run); model(ids,
    mask) was "no batch seen"."""
    model = TwoInputs()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
    obs.outer = model
    for _ in range(3):
        ids, mask = torch.randn(8, 4), torch.ones(8, 4)
        obs.forward(model, (ids, mask), {})
        loss = model(ids, mask).sum()
        obs.backward(loss)
        loss.backward()
        opt.step()
        obs.optimizer_step()
    assert not obs.flops  # nothing counted while it trains
    obs.finish()
    assert obs.flops["flops_per_sample"] == pytest.approx(3 * 2 * 4 * 2)
    assert obs.flops["flops_source"].startswith("torch.utils.flop_counter")


def _observer() -> observe.Observer:
    return observe.Observer(0, 1, 1.0e6, lambda r: None, lambda r: None, lambda p, s: None)


def _train_step(obs: observe.Observer, model: nn.Module, opt: torch.optim.Optimizer, n: int
                ) -> torch.Tensor:
    x = torch.randn(n, 4)
    obs.forward(model, (x,), {})
    loss = model(x).pow(2).mean()
    obs.backward(loss)
    loss.backward()
    opt.step()
    obs.optimizer_step()
    return loss


class Wrapper(nn.Module):
    """DDP's place: the outermost module, around the model."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


@pytest.mark.parametrize("autocast, cast, precision", [
    (None, None, "CPU fp32"), (torch.bfloat16, None, "CPU bf16"), (None, torch.bfloat16, "CPU bf16"),
    ("inside", None, "CPU bf16")],
    ids=["fp32", "autocast-bf16", "model-cast-bf16", "autocast-inside-the-wrapper"])
def test_the_mfu_peak_is_in_what_the_script_computes_in(autocast, cast, precision):
    """A bf16 autocast script's MFU was taken against the fp32 peak: 271% on this CPU (bf16
    matmuls 4.4x fp32's), and ~15x too high on an H100 (989.5 against 66.9 TFLOP/s); so was
    one whose autocast Accelerate (or HF Trainer) puts around the model's forward, inside DDP."""
    obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
    inner = nn.Sequential(nn.Linear(4, 1)).to(cast or torch.float32)
    if autocast == "inside":  # as accelerate's prepare_model does
        inner.forward = torch.autocast("cpu", dtype=torch.bfloat16)(inner.forward)
        autocast = None
    model = Wrapper(inner)
    obs.outer = model  # (as its DDP's hook finds it)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            x = torch.randn(8, 4, dtype=cast or torch.float32)
            obs.forward(model, (x,), {})
            loss = model(x).float().pow(2).mean()
        obs.backward(loss)
        loss.backward()
        opt.step()
        obs.optimizer_step()
    obs._count_flops()
    assert obs.flops["peak_source"].startswith(f"{precision} matmul"), obs.flops
    assert obs.flops["flops_per_sample"] > 0 and obs.flops["peak_flops_s"] > 0, obs.flops


def test_an_evaluation_in_eval_mode_with_gradients_on_is_not_training_but_training_in_it_is():
    """model.eval() without torch.no_grad(): the evaluation's batches counted as the next
    step's samples (an MFU above 1 for a script evaluating each epoch)."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs = _observer()
    obs.outer = model  # (as the hooks find it: the module its forward pre-hook is on)
    for _ in range(3):
        _train_step(obs, model, opt, 8)
    model.eval()
    for _ in range(5):  # the evaluation: gradients on, no backward
        obs.forward(model, (torch.randn(100, 4),), {})
    model.train()
    _train_step(obs, model, opt, 8)
    assert obs.totals.samples == 4 * 8 and obs.totals.steps == 4
    # A script that trains with its model in eval mode (dropout off) is still seen training,
    # each of its micro-batches (gradient accumulation) counted.
    model.eval()
    _train_step(obs, model, opt, 6)
    assert obs.totals.samples == 4 * 8 + 6 and obs.totals.steps == 5
    for n in (3, 5):
        x = torch.randn(n, 4)
        obs.forward(model, (x,), {})
        loss = model(x).pow(2).mean()
        obs.backward(loss)
        loss.backward()
    opt.step()
    obs.optimizer_step()
    assert obs.totals.samples == 4 * 8 + 6 + 8 and obs.totals.steps == 6


def test_on_a_fake_gpu_an_evaluation_between_steps_is_not_the_next_steps_data_wait():
    """An epoch's evaluation (under no_grad, or model.eval() without it) counted as the data
    wait of the step after it: a data wait fraction of 0.5 and a halved samples/s for a
    script whose input never waited."""
    gpu, model = FakeGpu(), nn.Linear(4, 2)
    obs, _ = observer(gpu)
    obs.outer = model  # (as the hooks find it: the module its forward pre-hook is on)
    gpu.done = 1e9
    step(obs, gpu, model, 0.0, 0.0, 0.5, 0.5)  # the warm-up, ending at device time 1.0
    step(obs, gpu, model, 1.0, 0.5, 0.5, 1.0)  # ends at 3.0
    for k, (grad, start) in enumerate(((False, 3.0), (True, 15.0))):
        # 10 evaluation batches, 1 s each on the device; the next step 0.5 s idle after
        # the last one's forward began
        model.eval()
        for b in range(10):
            gpu.queued = start + b + 1
            with torch.set_grad_enabled(grad):
                obs.forward(model, (torch.randn(8, 4),), {})
        model.train()
        step(obs, gpu, model, start + 10, 0.5, 0.5, 1.0)
        assert obs.totals.steps == 3 + k
    obs.finish()
    t = obs.totals
    assert t.wait_s == pytest.approx(1.5) and t.steady_s == pytest.approx(6.0)
    assert t.steady_samples == 3 * 8  # the evaluations' batches are not training samples


class LoaderIter:
    """A data loader's iterator, as the hooks see one: an object its batches come from, over
    its loader's dataset (``_dataset``, as torch's iterators keep it)."""

    def __init__(self, dataset: object = None) -> None:
        self._dataset = dataset


def _host_clock(monkeypatch) -> list[float]:
    clock = [0.0]
    monkeypatch.setattr(observe, "time", types.SimpleNamespace(
        perf_counter=lambda: clock[0], time=time.time, sleep=time.sleep))
    return clock


def test_an_epoch_runs_to_its_training_loader_running_out_not_to_another_loaders(monkeypatch):
    """A loader with workers shuts them down as it runs out, after the last step: epoch/time_s
    was 4-6% under the script's own epoch timer. Another loader's pass after it (an
    evaluation the hooks do not see, update_bn) is not the epoch's."""
    clock = _host_clock(monkeypatch)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs = _observer()
    obs.outer = model
    for epoch, (shutdown, other_pass) in enumerate(((0.5, 0.0), (0.0, 3.0), (0.0, 0.0))):
        obs.set_epoch(epoch)
        it = LoaderIter()
        for _ in range(4):
            clock[0] += 1.0
            obs.batch(it, torch.zeros(8, 4))
            _train_step(obs, model, opt, 8)
        clock[0] += shutdown
        obs.loader_done(it)
        if other_pass:
            other = LoaderIter()
            obs.batch(other, torch.zeros(64, 4))
            clock[0] += other_pass
            obs.loader_done(other)
    obs.finish()
    assert [e["time_s"] for e in obs.totals.epochs] == [4.5, 4.0, 4.0]


def test_without_set_epoch_an_epoch_is_a_pass_of_the_loader_that_feeds_the_steps(monkeypatch):
    """Hugging Face's Trainer, Accelerate and an IterableDataset call no set_epoch: such a run
    had no epoch/time_s and no log point at an epoch's end. Two loaders zipped (labelled and
    unlabelled) alternate in every step: not an epoch each."""
    clock = _host_clock(monkeypatch)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs = _observer()
    obs.outer = model
    for steps in (3, 2):
        it, other = LoaderIter(), LoaderIter()
        for _ in range(steps):
            clock[0] += 1.0
            obs.batch(other, torch.zeros(8, 4), 0.1)
            obs.batch(it, torch.zeros(8, 4), 0.1)
            _train_step(obs, model, opt, 8)
        obs.loader_done(it)
        model.eval()  # its own evaluation: not the epoch's
        clock[0] += 1.0
        with torch.no_grad():
            obs.forward(model, (torch.randn(8, 4),), {})
        model.train()
        clock[0] += 4.0
    obs.finish()
    assert [(e["epoch"], e["steps"], e["time_s"]) for e in obs.totals.epochs] == \
        [(1, 3, pytest.approx(2.1)), (2, 2, pytest.approx(1.1))]


def test_micro_batches_left_over_at_an_epochs_end_make_the_next_epochs_first_step(monkeypatch):
    """A step every 3 of 5 batches: the 2 left over at the loader's end are the next epoch's
    first step's, as the script counts (1 step each epoch). That step counted in the epoch its
    micro-batches began: 2 steps and 0, the epoch's end a step late, its loss the next epoch's."""
    clock = _host_clock(monkeypatch)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs = _observer()
    obs.outer = model
    data, losses = object(), []
    for _ in range(2):
        it = LoaderIter(data)
        for i in range(5):
            clock[0] += 1.0
            obs.batch(it, torch.zeros(8, 4), 0.1)
            x = torch.randn(8, 4)
            obs.forward(model, (x,), {})
            loss = model(x).pow(2).mean()
            obs.backward(loss)
            loss.backward()
            if (i + 1) % 3 == 0:
                opt.step()
                obs.optimizer_step()
                losses.append(loss.item())
        obs.loader_done(it)
        clock[0] += 0.5
    obs.finish()
    assert [(e["epoch"], e["steps"], e["time_s"]) for e in obs.totals.epochs] == \
        [(1, 1, pytest.approx(4.1)), (2, 1, pytest.approx(4.1))]
    assert obs.totals.loss == pytest.approx(losses[-1])


def test_a_no_grad_forward_in_train_mode_before_the_step_is_the_steps_not_an_evaluation(
        monkeypatch):
    """A script that scores its batch under no_grad first (OHEM, a label guess): its data
    wait was taken for an evaluation's, and the job's loading time vanished."""
    clock = _host_clock(monkeypatch)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs = _observer()
    obs.outer = model
    for _ in range(4):
        clock[0] += 0.5  # the loader
        with torch.no_grad():
            obs.forward(model, (torch.randn(8, 4),), {})
        clock[0] += 0.1
        _train_step(obs, model, opt, 8)
    assert obs.totals.wait_s == pytest.approx(3 * 0.6)


def test_samples_bounded_by_the_loaders_keep_a_prefetched_batch_and_their_own_units():
    """A loader one batch ahead (Accelerate's, Lightning's fetcher) with batches of 32 and 16,
    each step in two micro-batches: counted 16 for each 32. A loader of ready-made batches ([1, B, T], one a
    step) or of a list of dicts counts in other units than the model's rows."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs = _observer()
    obs.outer = model
    it, sizes = LoaderIter(), [32, 16, 32, 16, 32, 16]
    obs.batch(it, torch.zeros(sizes[0], 4))
    for k, n in enumerate(sizes):
        if k + 1 < len(sizes):
            obs.batch(it, (torch.zeros(sizes[k + 1], 4), torch.zeros(sizes[k + 1])))
        for _ in range(2):  # in two micro-batches
            x = torch.randn(n // 2, 4)
            obs.forward(model, (x,), {})
            model(x).sum().backward()
        opt.step()
        obs.optimizer_step()
    assert obs.totals.samples == sum(sizes)
    obs = _observer()
    obs.outer = model
    for batch in ([torch.zeros(1, 8, 4)], [{"input_ids": torch.zeros(1, 4)}] * 8):
        obs.batch(it, batch[0] if isinstance(batch[0], torch.Tensor) else batch)
        _train_step(obs, model, opt, 8)
    assert obs.totals.samples == 16


def test_a_batch_no_rule_can_read_never_fails_the_script(tmp_path):
    """A collate_fn returning a nested tensor: its size raised inside the loader's hook, and
    the script died of ``next(loader)``."""
    code = """
import torch
from torch.utils.data import DataLoader
from ddplab.training.scriptmode import observe
obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(obs)
data = [torch.zeros(n) for n in (2, 3, 4)]
loader = DataLoader(data, batch_size=3, collate_fn=lambda b: torch.nested.nested_tensor(b))
print([b.size(0) for b in loader])
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[3]", out.stderr[-2000:]


def test_an_optimizer_stepped_inside_anothers_step_is_not_the_step(tmp_path):
    """ZeroRedundancyOptimizer steps its local Adam, then broadcasts the parameters: the inner
    Adam's step ended the training step, and the broadcast read as the next step's data wait
    (0.58-0.71 of each step against the script's 3% in its loader). A Lookahead-style wrapper
    (its own slow part, 30 ms, after the inner step) and a real ZeRO on a 1-rank group."""
    code = f"""
import time, torch, torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from ddplab.training.scriptmode import observe
obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(obs)
class Lookahead(torch.optim.Optimizer):
    def __init__(self, inner):
        self.inner = inner
        super().__init__(inner.param_groups, {{}})
    def step(self, closure=None):
        self.inner.step()
        time.sleep(0.03)
model = torch.nn.Linear(4, 1)
opt = Lookahead(torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(5):
    model(torch.randn(8, 4)).sum().backward(); opt.step()
print(obs.totals.steps, round(obs.totals.wait_s, 3), obs.lead() is opt)
dist.init_process_group("gloo", init_method="file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
for _ in range(3):
    model(torch.randn(8, 4)).sum().backward(); zero.step()
print(obs.totals.steps, obs.lead() is zero)
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    wrapped, zero = out.stdout.split("\n")[:2]
    steps, wait, lead = wrapped.split()
    # (the first step has no wait: it starts the clock; 4 waits of 30 ms when it was wrong)
    assert steps == "5" and float(wait) < 0.02 and lead == "True", out.stdout
    # (a new optimizer leads from its second step on, as a script that replaced its own)
    assert zero == "7 True", out.stdout


def test_a_script_updating_its_parameters_itself_has_its_steps_seen_and_sams_are_not_doubled():
    """No torch.optim optimizer: the loop of PyTorch's "What is torch.nn really?" (``p -= lr *
    p.grad`` under no_grad, then ``model.zero_grad()``) had no step, no loss, no epoch: its run
    no training figure. A step is a backward, then the parameters changed in place, ended when
    the data loader's next() begins (its batch's 30 ms are the next step's data wait); two
    micro-batches' backwards without a change between are one step. A script that made an
    optimizer keeps its steps only: SAM perturbs the parameters before its second forward."""
    code = """
import time, torch
from torch.utils.data import DataLoader
from ddplab.training.scriptmode import observe
obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(obs)
torch.manual_seed(0)
data = [(torch.randn(4), torch.randn(1)) for _ in range(16)]
def slow(batch):
    time.sleep(0.03)
    return torch.utils.data.default_collate(batch)
model = torch.nn.Linear(4, 1)
losses = []
for epoch in range(3):
    for i, (x, y) in enumerate(DataLoader(data, batch_size=2, collate_fn=slow)):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if i % 2 == 1:  # two micro-batches a step
            losses.append(loss.item())
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            model.zero_grad()
obs.finish()
t = obs.totals
steady = len(t.busy)
print(t.steps, [e["steps"] for e in t.epochs], round(t.loss, 6), round(losses[-1], 6),
      t.samples, round(t.wait_s / steady, 3), round(t.backward_s / steady, 3))
sam = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(sam)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in DataLoader(data, batch_size=4):
    torch.nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():  # SAM's first step: climb to the worst point nearby
        for p in model.parameters():
            p += 0.05 * p.grad
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
print(sam.totals.steps)
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    manual, sam = out.stdout.split("\n")[:2]
    steps, epochs, *rest = manual.split(" ", 1)[0], *manual.split(" ", 1)[1].rsplit("] ", 1)
    loss, printed, samples, wait, backward = rest[0].split()
    assert steps == "12" and epochs == "[4, 4, 4" and loss == printed and samples == "48", manual
    # each step's first batch (30 ms) is its data wait, not the step before's backward (its
    # second micro-batch's is in its own backward phase: from the step's first backward on)
    assert float(wait) >= 0.025 and float(backward) < 0.05, manual
    assert sam == "4", out.stdout


def test_a_torch_fx_model_saves_whole_and_scripts_without_our_hooks():
    """torch.fx's GraphModule pickles through its own ``__reduce__``, its ``__dict__`` (our
    hooks in it) among its reconstructor's arguments: it still failed to save (a review).
    ``torch.jit.script`` of a trained model failed on our hooks (a hostile pass: TorchScript
    compiles a module's hooks, and refuses ours); the model keeps them after it."""
    code = """
import copy, io, torch, torch.fx
from ddplab.training.scriptmode import observe
obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(obs)
observe._unhooked(obs)
model = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(3):
    loss = model(torch.randn(5, 4)).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()
buffer = io.BytesIO()
torch.save(model, buffer)
buffer.seek(0)
saved = torch.load(buffer, weights_only=False)
scripted = torch.jit.script(model)  # (it compiles a module's hooks: ours it refused)
print(len(model._forward_pre_hooks), len(saved._forward_pre_hooks), obs.totals.steps,
      len(scripted._forward_pre_hooks))
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["1", "0", "3", "0"], (
        out.stdout + out.stderr[-2000:])


def test_updates_through_p_data_are_steps_ended_by_the_models_zero_grad_in_train_mode_only():
    """pytorch/examples' word_language_model updates its parameters through ``p.data`` (their
    version counters do not move) and calls ``model.zero_grad()`` before each batch: its run
    had no step, no loss ("no training seen"). Where no optimizer was made, the model in train
    mode clearing its gradients after a backward ends a step, the script's last one at its end,
    and one before an evaluation at its first forward (the evaluation was the step's backward,
    a review found); an adversarial example's input gradient (the model in eval mode, FGSM)
    trains nothing."""
    code = """
import time, torch
from ddplab.training.scriptmode import observe
obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(obs)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
x, y = torch.randn(6, 4), torch.randn(6, 1)
losses = []
for epoch in range(2):
    model.train()
    for i in range(5):
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        model(x)
        time.sleep(0.4)  # a long evaluation: not the last step's backward
obs.finish()
print(obs.totals.steps, obs.totals.samples, round(obs.totals.loss, 6), round(losses[-1], 6),
      round(obs.totals.backward_s, 3))
fgsm = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(fgsm)
attacked = torch.nn.Linear(4, 1).eval()
for _ in range(3):
    image = x.clone().requires_grad_(True)
    loss = attacked(image).sum()
    attacked.zero_grad()
    loss.backward()
fgsm.finish()
print(fgsm.totals.steps)
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    steps, samples, loss, printed, backward, fgsm = out.stdout.split()
    assert (steps, samples, loss) == ("10", "60", printed) and float(backward) < 0.3, out.stdout
    assert fgsm == "0", out.stdout


def test_a_model_saved_whole_or_copied_keeps_the_scripts_hooks_not_ours(tmp_path):
    """``torch.save(model)`` (pytorch/examples' word_language_model saves its best model so)
    failed under ddplab on our hooks ("Can't pickle local object"), and ``copy.deepcopy``'s
    copy (an EMA, a best model) carried them: its forwards ran them as the model's (a hostile
    pass). The saved and the copied module have the script's own hook only (also a torch RNN's,
    which writes its own ``__getstate__``); the model keeps ours: its later steps are seen,
    the copy's forwards are not samples."""
    code = f"""
import copy, torch
from ddplab.training.scriptmode import observe
obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(obs)
observe._unhooked(obs)
class Net(torch.nn.Module):  # sequence-first: ddplab hooks the GRU too (its own __getstate__)
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(8, 8)
        self.out = torch.nn.Linear(8, 1)
    def forward(self, x):
        return self.out(self.rnn(x)[0])
def mine(module, args, output):  # the script's own hook (a module-level function pickles)
    return None
model = Net()
model.register_forward_hook(mine)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
def step():
    loss = model(torch.randn(5, 4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
for _ in range(3):
    step()
torch.save(model, "{tmp_path / 'whole.pt'}")
saved = torch.load("{tmp_path / 'whole.pt'}", weights_only=False)
ema = copy.deepcopy(model)
with torch.no_grad():
    ema.train()(torch.randn(5, 4, 8))
for _ in range(2):
    step()
hooks = lambda m: sum(len(x._forward_pre_hooks) + len(x._forward_hooks) for x in m.modules())
obs.finish()
print(hooks(model), hooks(saved), hooks(ema), obs.totals.steps, obs.totals.samples)
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    ours, saved, copied, steps, samples = out.stdout.split()
    assert int(ours) > 1 and saved == copied == "1", out.stdout  # the script's own hook only
    assert (steps, samples) == ("5", "20"), out.stdout  # 4 sequences a step, the copy's unseen


def test_a_compiled_ddp_models_bf16_autocast_is_its_mfus_precision_after_the_flop_count(tmp_path):
    """torch.compile(DDP(model)) under CPU bf16 autocast: the hook reading the dtype inside the
    model first ran in the FLOP count's own eager forward, after the script, outside its
    autocast, and the peak was fp32's (MFU 5.5x too high against bf16's, a hostile pass)."""
    code = f"""
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from ddplab.training.scriptmode import observe
obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(obs)
dist.init_process_group("gloo", init_method="file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
model = torch.compile(DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(8, 16)).float().pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
obs.finish()
print(obs.dtype, obs.flops["peak_source"])
dist.destroy_process_group()
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0].startswith("torch.bfloat16 CPU bf16 matmul"), out.stdout


def test_an_lbfgs_closure_is_one_batch_and_an_accumulated_loss_is_the_scripts_undivided():
    """L-BFGS's step calls its closure up to max_iter times on one batch: each forward counted
    as a micro-batch (5x the samples/s), and the loss was the last call's, not the first one's
    the step returns. ``(loss / 4).backward()`` on each of 4 micro-batches recorded the loss
    4x lower than the script computes and prints (a hostile pass); not a loss halved once
    for a step of its own (``loss * 0.5``)."""
    code = """
import torch
from ddplab.training.scriptmode import observe
def watched():
    obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
    observe._hooks(obs)
    return obs
torch.manual_seed(0)
x, y = torch.randn(32, 4), torch.randn(32, 1)
model = torch.nn.Linear(4, 1)
obs = watched()
opt = torch.optim.LBFGS(model.parameters(), max_iter=4, history_size=4)
def closure():
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss
for _ in range(3):
    first = opt.step(closure)
obs.log_point()
print(obs.totals.steps, obs.totals.samples, round(obs.totals.loss, 6), round(first.item(), 6))
def halves():  # a closure looping over its batch's two halves: both are the step's samples
    opt.zero_grad()
    for part in (slice(0, 16), slice(16, 32)):
        loss = torch.nn.functional.mse_loss(model(x[part]), y[part]) / 2
        loss.backward()
    return loss
obs = watched()
opt = torch.optim.LBFGS(model.parameters(), max_iter=4, history_size=4)
for _ in range(2):
    opt.step(closure=halves)
print(obs.totals.steps, obs.totals.samples)
for divide in (lambda l: l / 4, lambda l: l * 0.5):
    obs = watched()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    micro = 4 if divide(torch.tensor(4.0)) == 1 else 1
    for i in range(14):  # 3 steps of 4 micro-batches, then one of 2 at the data's end
        raw = torch.nn.functional.mse_loss(model(x[i:i + 2]), y[i:i + 2])
        divide(raw).backward()
        if (i + 1) % micro == 0 or i == 13:
            opt.step(); opt.zero_grad()
            obs.log_point()
            print(obs.totals.steps, round(obs.totals.loss, 6), round(raw.item(), 6),
                  round(divide(raw).item(), 6))
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().split("\n")
    steps, samples, loss, first = lines[0].split()
    assert (steps, samples) == ("3", "96") and loss == first, lines[0]
    assert lines[1] == "2 64", lines[1]
    accumulated, halved = lines[2:6], lines[6:]
    assert [line.split()[0] for line in accumulated] == ["1", "2", "3", "4"], lines
    assert all(line.split()[1] == line.split()[2] for line in accumulated), accumulated
    assert len(halved) == 14 and all(line.split()[1] == line.split()[3] for line in halved), halved


SEQUENCE_FIRST = """
import sys, torch, torch.nn as nn
from ddplab.training import mfu
from ddplab.training.scriptmode import observe
class Words(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 1)
    def forward(self, src):  # src: (35 steps, 20 sequences)
        return self.enc(self.emb(src)).sum(-1)
class Steps(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(4, 8), nn.Linear(8, 1)
    def forward(self, x):  # x: (batch 32, 10 steps, 4), transposed here
        return self.head(self.lstm(x.transpose(0, 1))[0][-1])
class Classifier(nn.Module):  # batch first, a default (sequence-first) encoder inside
    def __init__(self):
        super().__init__()
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 1)
    def forward(self, x):  # x: (batch 8, 10 steps, 16)
        return self.enc(x.transpose(0, 1)).mean(0)
kind = sys.argv[1]
model, x = {"words": (Words(), torch.randint(0, 50, (35, 20))),
            "steps": (Steps(), torch.randn(32, 10, 4)),
            "classifier": (Classifier(), torch.randn(8, 10, 16))}[kind]
obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(obs)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(3):
    model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
obs.finish()
one = {"words": lambda: mfu.counted_flops_per_sample(model, x[:, :1]), "steps": lambda: 0,
       "classifier": lambda: mfu.counted_flops_per_sample(model, x[:1])}[kind]()
print(obs.totals.samples, obs.flops["flops_per_sample"] == one, obs.flops["flops_source"])
"""


@pytest.mark.parametrize("model, said", [
    ("words", "60 True torch.utils.flop_counter (forward x 3)"),
    ("steps", "96 True no count: torch's FLOP counter does not count nn.LSTM (give "
              "script.flops_per_sample)"),
    ("classifier", "24 True torch.utils.flop_counter (forward x 3)")])
def test_a_sequence_first_models_batch_is_its_inputs_second_dimension(model, said):
    """nn.LSTM and nn.Transformer take (sequence, batch, features) unless batch_first: the
    time steps were counted as samples (pytorch/examples' word language model: 35 for 20
    sequences, 1.75x too high; an LSTM over 10 steps of 32: 3.1x too low), one time step of
    every sequence was the FLOP count's sample, and an LSTM, which the counter does not count,
    had an MFU near 0."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SEQUENCE_FIRST, model], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == said, out.stdout


def test_a_gans_loss_is_its_discriminators_at_every_log_point_not_its_generators_at_epoch_end():
    """DCGAN's order: D on real, D on fake, D's step (the step's end), then G's backward and
    step. The epoch's end logged G's loss, the log points every 10 steps D's: one zigzag curve."""
    disc, gen = nn.Linear(4, 1), nn.Linear(4, 4)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    obs = _observer()
    obs.set_epoch(0)
    for _ in range(3):
        real = torch.randn(8, 4)
        obs.forward(disc, (real,), {})
        err_real = disc(real).pow(2).mean()
        obs.backward(err_real)
        err_real.backward()
        fake = gen(torch.randn(8, 4))
        err_fake = (disc(fake.detach()) + 5).pow(2).mean()
        obs.backward(err_fake)
        err_fake.backward()
        opt_d.step()
        if obs.leads(opt_d):
            obs.optimizer_step()
        err_g = (disc(fake) - 100).pow(2).mean()
        obs.backward(err_g)
        err_g.backward()
        opt_g.step()
        assert not obs.leads(opt_g)
    obs.set_epoch(1)  # the epoch's end: a log point
    assert obs.totals.loss == pytest.approx(float(err_fake))
    assert obs.totals.loss != pytest.approx(float(err_g))


def test_the_model_is_the_ddp_the_leading_optimizer_steps_not_the_first_one_built():
    """A GAN that wraps its generator in DDP first: only the generator's forward was seen, so
    the discriminator's forward and backward and the generator's step read as data wait (0.66
    of each step, against the script's 0.02)."""
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    obs = _observer()
    obs.outer, obs.wrappers = gen, [weakref.ref(gen), weakref.ref(disc)]
    obs.choose = lambda module: setattr(obs, "outer", module)
    obs.forward(gen, (torch.randn(8, 4),), {})
    loss = disc(gen(torch.randn(8, 4))).mean()
    obs.backward(loss)
    loss.backward()
    opt_d.step()
    assert obs.leads(opt_d)
    obs.optimizer_step()
    assert obs.outer is disc and obs.sample is None  # (its own input, for the FLOP count)


def test_a_gans_samples_are_its_loaders_not_every_forward_of_its_discriminator():
    """DCGAN: the discriminator (the model found) sees each real batch, then two fake ones: 3x
    the samples. A SAM-like script forwards one batch twice. A loader's batch split into
    micro-batches still counts once; without a loader, the forwards count."""
    disc, gen = nn.Linear(4, 1), nn.Linear(4, 4)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    obs = _observer()
    obs.outer, it = disc, LoaderIter()
    for _ in range(3):
        real = torch.randn(8, 4)
        obs.batch(it, [real, torch.zeros(8)])  # the loader's (images, labels)
        obs.forward(disc, (real,), {})
        disc(real).pow(2).mean().backward()
        fake = gen(torch.randn(8, 4))
        obs.forward(disc, (fake.detach(),), {})
        err_fake = disc(fake.detach()).pow(2).mean()
        obs.backward(err_fake)
        err_fake.backward()
        opt_d.step()
        if obs.leads(opt_d):
            obs.optimizer_step()
        obs.forward(disc, (fake,), {})  # the generator's step: in the next step's window
        disc(fake).mean().backward()
        opt_g.step()
        obs.leads(opt_g)
    assert obs.totals.steps == 3 and obs.totals.samples == 3 * 8
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs = _observer()
    obs.outer = model
    # a Hugging Face batch forwarded twice (SAM); one batch in two micro-batches of 4
    for batch, size in (({"input_ids": torch.zeros(8, 4)}, 8), ((torch.zeros(8, 4), torch.zeros(8)), 4)):
        obs.batch(it, batch)
        for _ in range(2):
            x = torch.randn(size, 4)
            obs.forward(model, (x,), {})
            model(x).sum().backward()
        opt.step()
        obs.optimizer_step()
    _train_step(obs, model, opt, 8)  # no loader: the forwards count
    assert obs.totals.samples == 8 + 8 + 8 and obs.totals.steps == 3


def test_the_closing_line_and_summary_keep_the_observed_figures_beside_the_scripts_own_names():
    """A script logging train/loss and perf/samples_per_s itself: the console printed ddplab's
    values under those names (the run holds the script's), summary.json a null throughput."""
    from ddplab.training.scriptmode.figures import figures

    def outcomes(own: list[str]) -> dict:
        return {r: {"host": "h", "observed": {"observe": {
            "steps": 32, "samples": 256, "samples_per_s": 1000.0, "busy_s": 0.01, "loss": 0.5,
            "steady_steps": 31, "data_wait_s": 0.1, "forward_s": 0.2, "own_names": own}}}
            for r in (0, 1)}

    fig = figures(outcomes([]), 3.0)
    assert "train/loss 0.5000, 2000 samples/s" in fig.line, fig.line
    zero = outcomes([])  # pytorch/examples' multigpu_torchrun: a one-class cross entropy, -0.0
    zero[0]["observed"]["observe"]["loss"] = -0.0
    assert "train/loss 0.0000," in figures(zero, 3.0).line
    fig = figures(outcomes(["train/loss", "perf/samples_per_s"]), 3.0)
    assert "train/loss" not in fig.line and "observed loss 0.5000" in fig.line, fig.line
    assert "2000 observed samples/s" in fig.line, fig.line
    assert "perf/samples_per_s" not in fig.metrics and fig.summary["samples_per_s_steady"] == 2000
    assert fig.mixed == [] and "ddplab.observed_mixed" not in fig.tags
    # A name only rank 1 logs is the script's too; one the observation sent to the spool before
    # the script logged it is said (its series holds both), as the late train/loss on rank 0.
    both = outcomes(["train/loss"])
    both[0]["observed"]["observe"]["sent_names"] = ["train/loss", "perf/samples_per_s",
                                                    "epoch/time_s"]
    both[1]["observed"]["observe"]["own_names"] = ["perf/samples_per_s"]
    fig = figures(both, 3.0)
    assert "perf/samples_per_s" not in fig.metrics and "observed samples/s" in fig.line, fig.line
    assert fig.mixed == ["perf/samples_per_s", "train/loss"]
    assert fig.tags["ddplab.observed_mixed"] == "perf/samples_per_s,train/loss"
    # A hostile pass: a script that failed at its first step (no step after it to time) logged
    # perf/samples_per_s 0.0 and each rank's 0.0, read as measurements.
    first = outcomes([])
    for r in (0, 1):
        first[r]["observed"]["observe"].update(steps=1, samples_per_s=None, steady_steps=0,
                                               flops_per_sample=1e6, peak_flops_s=1e12)
    fig = figures(first, 3.0)
    assert not {k for k in fig.metrics if "samples_per_s" in k or k == "perf/mfu"}, fig.metrics
    assert "samples/s" not in fig.line and fig.summary["samples_per_s_steady"] is None, fig.line


def test_a_model_the_flop_counter_cannot_count_says_why_in_whole_words_and_which_key_to_give():
    """The reason was cut mid-word at 120 characters ("... storage size of 1048576 ar)")."""
    from ddplab.training import mfu

    class Refuses(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("setStorage: sizes [256, 1024], strides [1, 256], storage offset "
                               "0, and itemsize 4 requiring a storage size of 1048576 are out "
                               "of bounds for storage of size 0\nsecond line")

    flops, why = mfu.flops_per_sample(Refuses(4, 4), 0.0, torch.randn(1, 4), "script.flops_per_sample")
    assert flops == 0.0 and why.endswith("1048576 ...; give script.flops_per_sample)"), why
    assert "second line" not in why


def test_a_loader_after_the_process_group_is_destroyed_keeps_the_phase_past_training():
    """After destroy_process_group, each next() of a loader (rank 0's own evaluation) beat
    "data loading", which the hang watch limits: the phase past training, which it does not,
    was lost."""
    from ddplab.forensics.heartbeat import AFTER_TRAINING

    beats: list[str] = []
    obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None,
                           lambda phase, step: beats.append(phase))
    model = nn.Linear(4, 2)
    obs.outer = model
    _train_step(obs, model, torch.optim.SGD(model.parameters(), lr=0.01), 8)
    obs.loading(True)
    assert beats[-1] == "data loading"
    obs.trained()
    obs.loading(True)
    obs.loading(False)
    assert beats[-1] == AFTER_TRAINING, beats


def test_tf32_is_seen_in_the_old_and_the_new_flags_and_in_cudnns_convolutions():
    """A GPU's fp32 matmuls in TF32 (set_float32_matmul_precision("high"), or torch's newer
    ``fp32_precision = "tf32"``, after which reading the old flag raises: the MFU was lost),
    and cuDNN's convolutions, TF32 by default (a fp32 ResNet read over 100% MFU)."""
    code = """
import torch
from ddplab.training.scriptmode.observe import _tf32
linear, conv = torch.nn.Linear(2, 2), torch.nn.Conv2d(1, 1, 1)
seen = [_tf32(linear), _tf32(conv)]
torch.set_float32_matmul_precision("high")
seen.append(_tf32(linear))
torch.set_float32_matmul_precision("highest")
torch.backends.cuda.matmul.fp32_precision = "tf32"
seen.append(_tf32(linear))
print(seen)
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[False, True, True, True]", out.stdout


def test_metrics_logged_through_mlflows_client_are_the_scripts_own_names(tmp_path):
    """Lightning's MLFlowLogger, autolog and a script's own MlflowClient log through the client,
    not mlflow.log_metric: their names were not seen, and train/loss held the script's values
    and the observed ones in one series. Names logged into another run are not the script's."""
    code = f"""
import os, time
from mlflow import MlflowClient
from mlflow.entities import Metric
from ddplab.training.scriptmode import observe
os.environ["MLFLOW_TRACKING_URI"] = "sqlite:///{tmp_path}/mlflow.db"
c = MlflowClient()
exp = c.create_experiment("x")
job, other = (c.create_run(exp).info.run_id for _ in range(2))
os.environ["MLFLOW_RUN_ID"] = job
observe._watch_mlflow(observe.Observer(0, 1, 0.0, print, print, print), None)
now = int(time.time() * 1000)
c.log_batch(job, metrics=[Metric("train/loss", 100.5, now, 3)])
c.log_metric(job, "epoch/time_s", 7.0)
c.log_metric(other, "perf/mfu", 0.5)
import mlflow
with mlflow.start_run(run_id=job):
    mlflow.log_metrics({{"lit/acc": 0.9}})
print(sorted(observe._not_the_scripts({{"train/loss": 0.1, "epoch/time_s": 1.0, "perf/mfu": 0.2,
                                        "lit/acc": 1.0}})))
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['perf/mfu']", out.stdout


def test_a_tiny_mfu_keeps_its_significant_digits_in_the_run():
    """A CPU's tiny model: 2.883e-05 was stored as 2.9e-05 (rounded to 6 decimals), and a study
    compared values cut to one digit."""
    from ddplab.training.scriptmode.figures import MFU, figures

    seen = {"steps": 20, "samples": 160, "samples_per_s": 100.0, "rows_per_s": 100.0,
            "busy_s": 0.01, "flops_per_sample": 2.883, "flops_source": "torch.utils.flop_counter",
            "peak_flops_s": 1e9, "peak_where": "rank0"}
    fig = figures({0: {"host": "h", "observed": {"observe": seen}}}, 1.0)
    assert fig.metrics[MFU] == pytest.approx(2.883e-7, rel=1e-4)
    assert fig.summary["mfu"] == pytest.approx(2.883e-7, rel=1e-4)


COMPILED_OUTSIDE_DDP = '''
import tempfile, torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
model = torch.compile(DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))),
                      backend="eager")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
print("trained", step + 1)
dist.destroy_process_group()
'''


@pytest.mark.e2e
def test_a_model_compiled_around_ddp_gets_no_graph_break_from_the_observation(tmp_path):
    """torch.compile(DDP(model)): the hook that reads autocast inside the model removed itself
    while Dynamo traced it, a graph break Dynamo could not handle ("Attempted to represent
    unregistered RemovableHandle ... falling back to eager"), one plain torchrun never had."""
    from .conftest import ddplab, job_env, runs

    script = tmp_path / "compiled.py"
    script.write_text(COMPILED_OUTSIDE_DDP)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    res = ddplab(["train", str(script)], tmp_path, job_env(store, TORCH_LOGS="graph_breaks"))
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "trained 6" in out, out[-3000:]
    assert "RemovableHandle" not in out and "scriptmode/observe.py" not in out, out[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.metrics["train/loss"] > 0


TINY_TRAINING = '''
import torch, torch.nn as nn
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(12):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
'''


@pytest.mark.e2e
def test_a_script_runs_mfu_above_the_peak_is_a_warning_on_its_console(tmp_path):
    """An MFU above 1 (a CPU peak measured while the machine was busy; here a FLOP count given
    too high) was printed as a figure like any other."""
    from .conftest import ddplab, job_env

    script = tmp_path / "tiny.py"
    script.write_text(TINY_TRAINING)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    res = ddplab(["train", str(script), "--set", "script.flops_per_sample=1e15"], tmp_path,
                 job_env(store))
    err = res.stderr
    assert res.returncode == 0, err[-3000:]
    assert "warning: perf/mfu" in err and "is above the peak (" in err and "says nothing" in err, \
        err[-3000:]


def test_a_loader_with_persistent_workers_makes_an_epoch_of_each_pass_of_its_one_iterator(
        monkeypatch):
    """Such a loader resets its one iterator each pass (``iter(loader)`` gives it again):
    without set_epoch, every pass after the first was counted in the first epoch (a hostile
    pass: epoch/epoch 1 where the same script without workers had 2)."""
    clock = _host_clock(monkeypatch)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs = _observer()
    obs.outer = model
    it = LoaderIter()
    for steps in (3, 2, 2):
        obs.loader_reset(it)  # (what the hooked _reset says on every pass but the first)
        clock[0] += 0.5
        for _ in range(steps):
            clock[0] += 1.0
            obs.batch(it, torch.zeros(8, 4), 0.1)
            _train_step(obs, model, opt, 8)
        obs.loader_done(it)
        clock[0] += 4.0
    obs.finish()
    assert [(e["epoch"], e["steps"]) for e in obs.totals.epochs] == [(1, 3), (2, 2), (3, 2)]


def test_only_forwards_a_backward_reaches_are_training_and_one_batch_seen_twice_counts_once():
    """Hostile pass: a script scoring its validation set each epoch without torch.no_grad() or
    model.eval() had those forwards counted as the next step's samples (7x the samples/s) and
    time; a two-view step without a DataLoader (``model(x + a)``, ``model(x - a)``, one loss)
    counted each sample twice. Real hooks, in a process of its own: which forwards a backward
    reached is what the outputs' gradient hooks say."""
    code = """
import time, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from ddplab.training.scriptmode import observe
obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(obs)

class Slow(nn.Module):  # the validation batches (of 128) take 50 ms each
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    def forward(self, x):
        if x.shape[0] == 128:
            time.sleep(0.05)
        return self.net(x)

torch.manual_seed(0)
model = Slow()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
train = DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=16)
val = DataLoader(TensorDataset(torch.randn(512, 4)), batch_size=128)
for epoch in range(3):
    for (x,) in train:
        loss = model(x).pow(2).mean(); opt.zero_grad(); loss.backward(); opt.step()
    score = sum(model(v).pow(2).mean().item() for (v,) in val)  # gradients on, train mode
t = obs.totals
print("evaluated", t.steps, t.samples, round(t.forward_s, 3), round(t.steady_s, 3))

X = torch.randn(96, 4)
for case in ("two views", "micro-batches"):
    obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
    observe._hooks(obs)
    for i in range(0, 96, 32):
        opt.zero_grad()
        if case == "two views":  # of one slice, one loss: 32 samples a step
            z1, z2 = model(X[i:i + 32] + 0.1), model(X[i:i + 32] - 0.1)
            ((z1 - z2).pow(2).mean() + z1.pow(2).mean()).backward()
        else:  # 4 micro-batches of 8, a backward each (gradient accumulation): 32 a step
            for j in range(i, i + 32, 8):
                model(X[j:j + 8]).pow(2).mean().backward()
        opt.step()
    print(case, obs.totals.steps, obs.totals.samples)
"""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    _, steps, samples, forward_s, steady_s = lines[0].split()
    assert (int(steps), int(samples)) == (12, 3 * 64), lines
    # Each epoch's first step starts at its training forward; its data wait after the last
    # validation forward: of the 0.6 s of validation, one forward (50 ms) an epoch, at most.
    assert float(forward_s) < 0.1 and float(steady_s) < 0.1 + 2 * 0.05 + 0.2, lines
    assert lines[1:] == ["two views 3 96", "micro-batches 3 96"], lines


@pytest.mark.parametrize("ended_well, epochs", [(True, [(1, 4), (2, 2)]), (False, [(1, 4)])])
def test_a_failed_scripts_unfinished_epoch_is_not_recorded_as_an_epoch(ended_well, epochs):
    """A hostile pass: Lightning stopped by a NaN (detect_anomaly) 5 steps into its first
    epoch of 10 left a FAILED run with epoch/epoch 1 and epoch_steps [5]. A script that ended
    well (a max_steps break mid-epoch) keeps its last epoch's steps."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs = _observer()
    obs.outer = model
    for epoch, steps in enumerate((4, 2)):
        obs.set_epoch(epoch)
        for _ in range(steps):
            _train_step(obs, model, opt, 8)
    obs.finish(ended_well=ended_well)
    assert [(e["epoch"], e["steps"]) for e in obs.totals.epochs] == epochs
    assert obs.totals.steps == 6 and obs.logged_step == 6  # its last steps' log point, either way


def test_the_step_of_the_scripts_first_mlflow_call_is_start_up_not_steady(tmp_path):
    """A hostile pass: a script logging with mlflow.log_metric at its epochs' ends had
    perf/samples_per_s 2,000, 31,441 without those two lines: MLflow's first call opens its
    store (~0.9 s, as under plain python) inside one step of a 0.1 s job. That step is left out
    of the steady figures as the first is; the later calls' steps are not."""
    code = """
import functools, json, time, torch, mlflow
from ddplab.training.scriptmode import observe
obs = observe.Observer(0, 1, 0.0, lambda r: None, lambda r: None, lambda p, s: None)
observe._hooks(obs)
observe.after_import("mlflow", functools.partial(observe._watch_mlflow, obs))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
took = []
for i in range(12):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if i in (5, 8):  # an epoch's end: its first call opens the store, the second does not
        t0 = time.perf_counter(); mlflow.log_metric("val/acc", 0.5, step=i)
        took.append(time.perf_counter() - t0)
obs.finish()
t = obs.totals
print(json.dumps({"steady_steps": len(t.busy), "steady_s": t.steady_s, "took": took}))
"""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db"}
    env.pop("MLFLOW_RUN_ID", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["steady_steps"] == 10, got  # 12, less the first and the first call's
    assert got["steady_s"] < got["took"][0], got  # (its 0.9 s is not in the steady time)


def test_the_last_log_point_is_stamped_when_training_ended_not_after_the_flop_count(
        monkeypatch):
    """A visual pass: every loss curve of a study's script jobs ended on a flat stretch, its last
    point stamped after the script's end and the FLOP count (~0.3 s on a CPU)."""
    import time as clock

    spooled: list[dict] = []
    obs = observe.Observer(0, 1, 0.0, lambda r: None, spooled.append, lambda p, s: None)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs.outer = model
    obs.set_epoch(0)
    for _ in range(7):  # (no log point at step 10: the epoch's end is the last one)
        _train_step(obs, model, opt, 8)
    counted: list[int] = []
    monkeypatch.setattr(obs, "_count_flops", lambda: (counted.append(int(clock.time() * 1000)),
                                                      clock.sleep(0.5)))
    obs.finish(ended_well=True)
    assert counted, "the FLOP count did not run"
    last = [r for r in spooled if r.get("op") == "log"][-1]
    assert "train/loss" in last["metrics"] and last["ts"] <= counted[0], (last, counted)


def test_steps_whose_batches_go_unseen_log_no_rate_not_a_rate_of_0():
    """A hostile pass: gcn (sparse inputs) and mnist_forward_forward (``forward`` called
    directly) had train/samples_per_s 0.0 at every log point, a flat zero in the UI: without a
    batch seen at the model there is no rate to log; the loss and step time still are."""
    code = """
import json, torch
from ddplab.training.scriptmode import observe
records = []
obs = observe.Observer(0, 1, 0.0, lambda r: None, records.append, lambda p, s: None)
observe._hooks(obs)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(12):
    loss = model.forward(torch.randn(8, 4)).pow(2).mean()  # (no module call: no hook runs)
    opt.zero_grad(); loss.backward(); opt.step()
obs.finish()
print(json.dumps(records, default=str))
"""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    logged = json.dumps(json.loads(out.stdout.splitlines()[-1]))
    assert "train/loss" in logged and "train/step_time_s" in logged, logged[:2000]
    assert "train/samples_per_s" not in logged, logged[:2000]


def test_log_points_fall_every_10_steps_as_the_loops_do_and_at_each_epochs_end():
    """A hostile pass: with 8 steps an epoch, the count to 10 restarted at each epoch's end, and
    train/loss came only at steps 8, 16, 24, never at 10 or 20 as ddplab's loop logs them."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    obs = _observer()
    obs.outer = model
    points = []
    real = obs.log_point
    obs.log_point = lambda extra=None: (points.append(obs.totals.steps), real(extra))  # type: ignore[method-assign]
    for epoch in range(3):
        obs.set_epoch(epoch)
        for _ in range(8):
            _train_step(obs, model, opt, 8)
    obs.finish(ended_well=True)
    assert sorted(set(points)) == [8, 10, 16, 20, 24], points
    # A resumed attempt whose step 0 is the run's step 5: the run's steps 10 and 20
    resumed, points[:] = _observer(), []
    resumed.outer, resumed.step_offset = model, 5
    resumed.log_point = lambda extra=None: points.append(resumed.totals.steps)  # type: ignore[method-assign]
    resumed.set_epoch(0)
    for _ in range(16):
        _train_step(resumed, model, opt, 8)
    assert points == [5, 15], points


def test_a_log_point_in_the_spool_and_still_pending_in_the_state_carries_one_time():
    """Rank 0 spools a log point as the next one comes, then saves its state: stopped between
    the two (torchrun's SIGTERM after a peer's SIGKILL), the state still holds it pending and
    the supervisor wrote it again, at its own time: step 40 twice in train/loss (the store keeps
    a record sent twice once only when its time is the same)."""
    import json

    written: list[dict] = []
    spooled: list[dict] = []
    obs = observe.Observer(0, 1, 1.0e6, lambda r: written.append(json.loads(json.dumps(r))),
                           spooled.append, lambda p, s: None)
    obs.loss, obs.totals.steps = torch.tensor(2.5), 40
    obs.log_point()
    replayed = written[-1]["observe"]["pending"]  # what the supervisor writes if stopped now
    obs.loss, obs.totals.steps = torch.tensor(2.0), 44
    obs.log_point()
    (record,) = spooled
    assert (record["step"], record["metrics"]["train/loss"]) == (40, 2.5)
    assert record["ts"] == replayed["ts"] and record["step"] == replayed["step"], (record, replayed)
