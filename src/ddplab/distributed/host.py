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


# The vector units a figure depends on most (bf16 matmuls run natively or are emulated), best first.
UNITS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def vector_units() -> str:
    """The best of UNITS this CPU has ("" when none or unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return next((u for u in UNITS if u in flags), "")


def memory_gib() -> float | None:
    try:
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib / 2**20


def summary() -> str:
    """e.g. "2 cores (AMD EPYC 7B13; avx512_bf16), 24 GiB, Linux": what a measured figure depends
    on; "1 of 2 cores" when this process may use only some of them (taskset, a pinned rank)."""
    gib = memory_gib()
    memory = f", {gib:.0f} GiB" if gib is not None else ""
    usable, total = len(os.sched_getaffinity(0)), os.cpu_count() or 0
    cores = f"{usable} cores" if usable >= total else f"{usable} of {total} cores"
    units = vector_units()
    return f"{cores} ({cpu_model()}{'; ' + units if units else ''}){memory}, {platform.system()}"
