"""This machine in one line: usable cores, CPU model, memory. No torch import, so the page
writers and the tracking processes can call it cheaply."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> float | None:
    try:
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib / 2**20


def summary() -> str:
    """e.g. "2 cores (AMD EPYC 7B13), 24 GiB, Linux": what a measured figure depends on; "1 of 2
    cores" when this process may use only some of them (taskset, a pinned rank)."""
    gib = memory_gib()
    memory = f", {gib:.0f} GiB" if gib is not None else ""
    usable, total = len(os.sched_getaffinity(0)), os.cpu_count() or 0
    cores = f"{usable} cores" if usable >= total else f"{usable} of {total} cores"
    return f"{cores} ({cpu_model()}){memory}, {platform.system()}"
