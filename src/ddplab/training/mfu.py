"""perf/mfu: how far a job is from the machine's physical limit. Model FLOPs utilisation is
the model's training FLOPs per second achieved over the peak the job's devices could do (PaLM's
definition, as torchtitan and nanoGPT count it: recomputation and padding are not "useful").

- FLOPs per sample: ``model.flops_per_sample`` when the user gives it; the built-in GPT by its
  formula (6 x parameters x tokens for the matmuls forward and backward, plus the attention
  term 12 x layers x width x tokens^2; nanoGPT's estimate_mfu, parameters without the position
  table); any other model by ``torch.utils.flop_counter`` on one sample's forward, x 3 (the
  backward costs about two forwards), counted in eval mode without gradients so the count
  changes no state (BatchNorm's running statistics, ``.grad``).
- Peak: a CUDA device by its name from PEAK_TFLOPS (dense, no sparsity: NVIDIA's datasheets
  quote bf16 "with sparsity", twice these); bf16 when the job computes in bf16/fp16 (train.amp,
  or FSDP's bf16), else fp32 (TF32 is off unless the user turns it on). A device not in the
  table, and every CPU, is measured: a matmul loop on each rank at the same time, with the
  rank's own threads, so a CPU job is compared with what its layout can reach on those cores.
"""

from __future__ import annotations

import contextlib
import io
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..tracking import schema
from ..workload.gpt import GPT

# (substring of torch.cuda.get_device_name(), bf16 dense TFLOP/s, fp32 dense TFLOP/s), the most
# specific name first. Sources: NVIDIA H100 datasheet (SXM5: bf16 1,979 / PCIe 1,513 / NVL 1,671
# "with sparsity"; fp32 67 / 51 / 60), H200 datasheet (same chip as H100 SXM: 1,979 / 67), A100
# datasheet (bf16 312 dense, fp32 19.5), L40S datasheet (733 sparse, fp32 91.6), L4 (242.5
# sparse, fp32 30.3).
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756.5, 51.2),
    ("H100 NVL", 835.5, 60.0),
    ("H100", 989.5, 66.9),  # "NVIDIA H100 80GB HBM3" (SXM5)
    ("H200", 989.5, 66.9),
    ("A100", 312.0, 19.5),
    ("L40S", 366.5, 91.6),
    ("L4", 121.0, 30.3),
)
MATMUL_S = 0.3  # how long each rank measures its peak (CPU, or a device not in the table)


@dataclass
class Basis:
    """What perf/mfu divides by what; recorded in the run as tags."""

    flops_per_sample: float
    flops_source: str
    peak_flops_s: float
    """The whole job's peak: every distinct device's (GPU) or every rank's measured (CPU)."""
    peak_source: str

    def mfu(self, samples_per_s: float) -> float:
        return samples_per_s * self.flops_per_sample / self.peak_flops_s if self.peak_flops_s else 0.0

    def tags(self) -> dict[str, str]:
        return {schema.MFU_FLOPS_PER_SAMPLE: f"{self.flops_per_sample:.4g}",
                schema.MFU_FLOPS_SOURCE: self.flops_source,
                schema.MFU_PEAK_TFLOPS: f"{self.peak_flops_s / 1e12:.4g}",
                schema.MFU_PEAK_SOURCE: self.peak_source}


def gpt_flops_per_sequence(model: GPT) -> float:
    """nanoGPT's count for one sequence of seq_len tokens, forward and backward."""
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    layers, width, t = len(model.blocks), model.wte.weight.shape[1], model.seq_len
    return t * (6 * n + 12 * layers * width * t)


def counted_flops_per_sample(model: nn.Module, inputs: Any) -> float:
    """torch.utils.flop_counter on one sample's forward (a batch of 1: a tensor, a tuple of
    positional tensors, or a dict of keyword arguments), x 3 for the backward. A model with
    frozen parameters (a frozen backbone, adapters) is counted through a real backward to
    its trainable ones instead: x 3 counted a backward the step never runs (3x a linear
    probe's figure). In eval mode, so no dropout draw or normalisation statistic changes, and
    no gradient is kept (``autograd.grad``, not ``backward``). Nothing of it shows: what the
    model's forward prints (after a script's end, a line its plain run never printed), and
    no ``train()`` of the user's is called to set the modes (mnist_forward_forward's
    ``Layer.train(x_pos, x_neg)`` trains)."""
    from torch.utils.flop_counter import FlopCounterMode

    device = next(model.parameters()).device
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = len(trainable) < len(list(model.parameters()))
    modes = [(m, m.training) for m in model.modules()]
    for m, _ in modes:
        m.training = False
    try:
        with torch.set_grad_enabled(frozen), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()), \
                FlopCounterMode(display=False, custom_mapping=_cpu_attention()) as counter:
            out = _call(model, inputs, device)
            root = _first_with_grad(out) if frozen else None
            if root is not None and trainable:
                torch.autograd.grad(root.float().sum(), trainable, allow_unused=True)
    finally:
        for m, training in modes:
            m.training = training
    total: int = counter.get_total_flops()
    return float(total) if frozen else 3.0 * total


def above_peak(mfu: float, peak: str) -> str:
    """The warning for an MFU over 1 ("" otherwise): a CPU's peak is a matmul measured at the
    job's start, which a busy machine measures low."""
    if mfu <= 1:
        return ""
    return (f"perf/mfu {mfu:.0%} is above the peak ({peak}): the peak was measured low, a busy "
            "machine?; this run's MFU says nothing")


def frozen_share(model: nn.Module) -> str:
    """"12 of 14 parameter tensors frozen" ("" when every one trains), for the count's source."""
    params = list(model.parameters())
    frozen = sum(not p.requires_grad for p in params)
    return f"{frozen} of {len(params)} parameter tensors frozen" if frozen else ""


def _call(model: nn.Module, inputs: Any, device: torch.device) -> Any:
    if isinstance(inputs, dict):
        return model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                        for k, v in inputs.items()})
    if isinstance(inputs, tuple):  # several positional tensors: model(ids, mask)
        return model(*(v.to(device) for v in inputs))
    return model(inputs.to(device))


def _first_with_grad(out: Any) -> torch.Tensor | None:
    """The first floating tensor of a model's output that gradients flow to (a tensor, a
    tuple or list, a dict or a Hugging Face ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad and out.is_floating_point() else None
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else ()
    for item in items:
        if (found := _first_with_grad(item)) is not None:
            return found
    return None


def _cpu_attention() -> dict[Any, Any]:
    """torch's counter knows the GPU's fused attention kernels, not the CPU's: a Hugging Face
    model's attention counted 0 FLOPs on CPU (BERT's MFU 11 % low at 128 tokens, 25 % at 512).
    The CPU kernel takes the same arguments as the GPU's flash kernel; so does its backward."""
    from torch.utils import flop_counter as fc

    aten, mapping = torch.ops.aten, {}
    for cpu, gpu in (("_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_flash_attention"),
                     ("_scaled_dot_product_flash_attention_for_cpu_backward",
                      "_scaled_dot_product_flash_attention_backward")):
        formula = fc.flop_registry.get(getattr(aten, gpu, None))
        if hasattr(aten, cpu) and formula is not None:
            def counted(*args: Any, _formula: Any = formula, **kwargs: Any) -> int:
                return int(_formula(*args, **kwargs))
            counted._get_raw = True  # type: ignore[attr-defined]  # (already shape-wrapped)
            mapping[getattr(aten, cpu)] = counted
    return mapping


def flops_per_sample(model: nn.Module, given: float, sample: Any,
                     key: str = "model.flops_per_sample") -> tuple[float, str]:
    """(FLOPs per training sample, where the figure comes from); (0, why) when unknown, naming
    ``key``, where the user gives it. ``sample``: one sample's inputs as a batch of 1."""
    if given > 0:
        return given, "model.flops_per_sample"
    if isinstance(model, GPT):
        return float(gpt_flops_per_sequence(model)), "the GPT formula (nanoGPT's: 6N + attention)"
    if not isinstance(sample, (torch.Tensor, dict, tuple)):
        return 0.0, f"no count: inputs that are neither a tensor nor a dict (give {key})"
    try:
        flops, frozen = counted_flops_per_sample(model, sample), frozen_share(model)
        return flops, ("torch.utils.flop_counter (forward and backward, " + frozen + ")" if frozen
                       else "torch.utils.flop_counter (forward x 3)")
    except Exception as e:  # noqa: BLE001 - a model the counter cannot trace only loses perf/mfu
        return 0.0, f"no count: flop_counter failed ({type(e).__name__}: {_short(str(e))}; " \
            f"give {key})"


def _short(text: str, most: int = 120) -> str:
    """An error's first line, cut at a word with "..." past ``most`` characters."""
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= most else line[:most].rsplit(" ", 1)[0] + " ..."


def table_peak(name: str, low_precision: bool) -> float:
    """A device's dense peak in FLOP/s from PEAK_TFLOPS, 0 when it is not there."""
    for key, bf16, fp32 in PEAK_TFLOPS:
        if key in name:
            return (bf16 if low_precision else fp32) * 1e12
    return 0.0


def measure_matmul(device: torch.device, dtype: torch.dtype, seconds: float = MATMUL_S) -> float:
    """FLOP/s of a square matmul loop on this device with this process's threads."""
    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):  # warm-up: kernels chosen, caches and clocks up
        a @ b
    _sync(device)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            a @ b
        _sync(device)
        done += 4
    return 2.0 * n**3 * done / (time.perf_counter() - t0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def job_peak(device: torch.device, low_precision: bool, world_size: int,
             gpus_per_rank: int = 1) -> tuple[float, str]:
    """Collective (every rank calls it): the job's peak FLOP/s and where it comes from. GPUs
    count once each, however many ranks share one; CPU ranks measure at the same time.
    ``gpus_per_rank``: dist.strategy dp spreads each rank's batch over all the node's GPUs."""
    dtype = torch.bfloat16 if low_precision else torch.float32
    precision = "bf16" if low_precision else "fp32"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        mine = table_peak(name, low_precision)
        source = f"{name} {precision} dense, from the datasheet table" if mine else ""
        if not mine:
            mine, source = measure_matmul(device, dtype), f"{name} {precision} matmul, measured"
        mine *= gpus_per_rank
        where = f"{socket.gethostname()}:{device.index}"
    else:
        mine, where = measure_matmul(device, dtype), f"rank{dist.get_rank() if world_size > 1 else 0}"
        source = f"CPU {precision} matmul measured on every rank at once"
    every: list[Any] = [(where, mine)] * world_size
    if world_size > 1:
        dist.all_gather_object(every, (where, mine))
    per_device = dict(every)  # ranks sharing a GPU count it once
    return sum(per_device.values()), f"{source} ({len(per_device)} x)"


def basis(model: nn.Module, given: float, sample: Any, device: torch.device,
          low_precision: bool, world_size: int, gpus_per_rank: int = 1) -> Basis:
    """Collective. FLOPs per sample 0 when unknown: the tags say why, and no perf/mfu."""
    flops, source = flops_per_sample(model, given, sample)
    peak, peak_source = job_peak(device, low_precision, world_size, gpus_per_rank)
    return Basis(flops, source, peak, peak_source)
