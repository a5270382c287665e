"""Marks on a GPU's stream: when the device, not the host, passed a point of the step.

On a GPU the host only queues the step's kernels and runs ahead, so the host clock times
launches. A CUDA event recorded at a point of the step is stamped when the device reaches it;
two stamps give the device's time between them. Reading a stamp before the device has passed
it would wait for the device, so a mark is read only once ``passed`` says so (ddplab's loop
reads its marks at log points, after its one wait there; the script observer polls them).
"""

from __future__ import annotations

from typing import Any

import torch


def record(device: torch.device) -> Any:
    """A mark on ``device``'s current stream (the stream the step's kernels are queued on), or
    None where there is nothing to mark: not a GPU, or a stream being captured into a CUDA
    graph (an event recorded there would be part of the graph, or refused)."""
    if device.type != "cuda" or capturing():
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def capturing() -> bool:
    """Whether this thread's current stream is being captured into a CUDA graph: then no mark
    may be recorded or asked about, and nothing read to the host (each would break the
    capture). Never initialises CUDA."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def passed(mark: Any) -> bool:
    """Whether the device has passed ``mark`` (never waits)."""
    return bool(mark.query())


def seconds(start: Any, end: Any) -> float:
    """The device's seconds from ``start`` to ``end``; both must have been passed."""
    return float(start.elapsed_time(end)) / 1000
