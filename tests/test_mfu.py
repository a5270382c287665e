"""Unit: perf/mfu's arithmetic against hand-computed cases, and where its numbers come from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddplab.training import mfu
from ddplab.workload.gpt import GPT


def test_mfu_is_the_models_flops_per_second_over_the_peak():
    basis = mfu.Basis(2e9, "given", 1e12, "table")
    # 100 samples/s x 2 GFLOP a sample = 200 GFLOP/s of a 1 TFLOP/s peak
    assert basis.mfu(100.0) == pytest.approx(0.2)
    assert mfu.Basis(2e9, "given", 0.0, "none").mfu(100.0) == 0.0


def test_the_gpt_is_counted_as_nanogpt_counts_it():
    # vocab 16, seq 8, width 4, one layer. Parameters without the position table (8 x 4):
    # token table 16x4 = 64 (tied to the head), layer norms 3 x (4+4) = 24, qkv 4x12+12 = 60,
    # attention proj 4x4+4 = 20, MLP 4x16+16 = 80 and 16x4+4 = 68: N = 316.
    # Per sequence: 8 x (6 x 316 + 12 x 1 layer x 4 wide x 8 tokens) = 8 x 2,280 = 18,240.
    model = GPT(16, 8, n_layer=1, n_head=1, n_embd=4)
    assert mfu.gpt_flops_per_sequence(model) == 18_240
    flops, source = mfu.flops_per_sample(model, 0.0, None)
    assert (flops, "GPT formula" in source) == (18_240, True)


def test_any_other_model_is_counted_by_torchs_flop_counter_forward_times_three():
    model = nn.Linear(10, 5, bias=False)  # one sample: 2 x 10 x 5 = 100 FLOPs forward
    flops, source = mfu.flops_per_sample(model, 0.0, torch.zeros(1, 10))
    assert (flops, "flop_counter" in source) == (300.0, True)
    assert model.weight.grad is None  # counted without touching the training state


def test_the_count_shows_nothing_and_calls_no_train_of_the_users(capsys):
    """A hostile pass: after a script's end, the count's forward printed the model's debug line
    (a line plain python never printed), and set the modes through ``train()``, which
    mnist_forward_forward's layers override to train (``Layer.train(x_pos, x_neg)``)."""
    class Layer(nn.Linear):
        def train(self, x_pos, x_neg):  # noqa: ARG002 - its own training, not a mode switch
            raise AssertionError("the user's training ran")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Layer(4, 2)

        def forward(self, x):
            print("forward call")
            return self.layer(x)

    net = Net()
    net.layer.training = True
    assert mfu.counted_flops_per_sample(net, torch.randn(1, 4)) == 3 * 2 * 4 * 2
    assert capsys.readouterr().out == "" and net.training and net.layer.training


def test_a_frozen_backbone_counts_the_backward_the_step_runs_not_forward_times_three():
    """A linear probe: only the head trains, so the backward is its weight gradient alone;
    x 3 made its MFU 3x too high."""
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    for p in net[:4].parameters():
        p.requires_grad = False
    flops, source = mfu.flops_per_sample(net, 0.0, torch.randn(1, 64))
    forward = 2 * 64 * 64 * 2 + 2 * 64 * 2
    assert flops == forward + 2 * 64 * 2  # + the head's weight gradient
    assert "4 of 6 parameter tensors frozen" in source
    assert all(p.grad is None for p in net.parameters()) and net.training


def test_a_transformers_models_attention_is_counted_on_cpu_as_in_training():
    """BERT (built from a config) in eval mode ran the CPU's fused attention kernel, which
    torch's counter scored 0: its MFU read 11 % low at 128 tokens."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import BertConfig, BertForSequenceClassification

    bert = BertForSequenceClassification(BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        vocab_size=1000))
    sample = {"input_ids": torch.randint(0, 1000, (1, 128)),
              "attention_mask": torch.ones(1, 128, dtype=torch.long)}
    with FlopCounterMode(display=False) as training:  # the math attention, counted
        bert(**sample)
    flops, _ = mfu.flops_per_sample(bert, 0.0, sample)
    assert flops == 3 * training.get_total_flops()


def test_a_given_count_wins_and_an_uncountable_sample_says_why():
    given = mfu.flops_per_sample(nn.Linear(10, 5), 123.0, torch.zeros(1, 10))
    assert given == (123.0, "model.flops_per_sample")
    flops, why = mfu.flops_per_sample(nn.Linear(10, 5), 0.0, [torch.zeros(1, 10)])
    assert flops == 0.0 and "model.flops_per_sample" in why


@pytest.mark.parametrize("name, low, tflops", [
    ("NVIDIA H100 80GB HBM3", True, 989.5), ("NVIDIA H100 80GB HBM3", False, 66.9),
    ("NVIDIA H100 PCIe", True, 756.5), ("NVIDIA H200", True, 989.5), ("NVIDIA A100-SXM4-80GB", True, 312.0),
    ("NVIDIA L4", False, 30.3), ("Tesla T4", True, 0.0)])
def test_a_gpus_peak_comes_from_its_datasheet_by_name(name, low, tflops):
    assert mfu.table_peak(name, low) == pytest.approx(tflops * 1e12)


def test_a_cpu_peak_is_measured_with_the_processes_own_threads():
    peak, source = mfu.job_peak(torch.device("cpu"), False, world_size=1)
    assert peak > 1e8 and "measured" in source  # a 2-core machine does ~150 GFLOP/s fp32


def test_a_jobs_mfu_above_the_peak_is_said_on_its_console(capsys):
    """A quickstart on a busy CPU logged perf/mfu 2.94 in silence (its peak measured at the
    start was 0.031 TFLOP/s)."""
    import types

    from ddplab.training.fit import _mfu
    from ddplab.training.summary import Console

    job = types.SimpleNamespace(console=Console(True), mfu_basis=mfu.Basis(
        4.623e7, "torch.utils.flop_counter (forward x 3)", 3.131e10, "CPU fp32 matmul"))
    assert _mfu(job, 1988.0) == pytest.approx(2.935, abs=1e-3)
    assert "ddplab: warning: perf/mfu 294% is above the peak (CPU fp32 matmul: 0.0313 TFLOP/s)" \
        in capsys.readouterr().err
    assert _mfu(job, 100.0) == pytest.approx(0.1477, abs=1e-3)
    assert capsys.readouterr().err == ""
