"""Runs a training script as ``__main__`` (``python epoch_clock.py SCRIPT ARGS...``) and writes
when each of its epochs began (``DistributedSampler.set_epoch``) into
``$BENCH_CLOCK_DIR/rank<RANK>.json``: ``[wall seconds, this process's CPU seconds, the seconds
its threads spent runnable but waiting for a CPU]`` per epoch (the last from the kernel's
scheduler statistics, /proc/self/task/*/schedstat; 0 where the kernel keeps none), and the
threads the script's torch ran into ``rank<RANK>.threads``: a few clock calls and file reads
per epoch, the same in every variant bench_script.py compares, so the
comparison is of what the variants add, not of this."""

import importlib.abc
import importlib.util
import json
import os
import runpy
import sys
import time
from pathlib import Path

marks: list[tuple[float, float, float]] = []


def waited() -> float:
    """Seconds this process's threads have spent on a run queue, runnable, not running: the
    time other work on its cores took from it (schedstat's second field, nanoseconds)."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):  # a thread that just ended; no schedstat
            continue
    return total / 1e9


def clock(sampler: type) -> None:
    set_epoch = sampler.set_epoch

    def clocked(self, epoch):  # noqa: ANN001, ANN202 - the sampler's own signature
        marks.append((time.perf_counter(), time.process_time(), waited()))
        set_epoch(self, epoch)

    sampler.set_epoch = clocked


class WhenImported(importlib.abc.MetaPathFinder):
    """Clocks DistributedSampler once the SCRIPT imports it. Importing torch here first would
    change the script: torch takes its thread count from OMP_NUM_THREADS when it is imported
    (by the time its first parallel operation runs), and the book's script sets 8 before its
    own ``import torch``; torchrun set 1."""

    NAME = "torch.utils.data.distributed"

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 - importlib's own
        if name != self.NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):  # noqa: ANN001, ANN202
            run(module)
            clock(module.DistributedSampler)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, WhenImported())
script = Path(sys.argv[1]).resolve()
sys.argv = sys.argv[1:]
sys.path[0] = str(script.parent)
try:
    runpy.run_path(str(script), run_name="__main__")
finally:
    out = Path(os.environ["BENCH_CLOCK_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps(marks))
    if "torch" in sys.modules:  # the threads the script's torch ran (its own count)
        out.with_suffix(".threads").write_text(str(sys.modules["torch"].get_num_threads()))
