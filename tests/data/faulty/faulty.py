"""A user's experiment that goes wrong on purpose, on one rank at one step (tests/test_forensics.py):
FAULT=sleep|spin|kill|segv|raise at FAULT_STEP (5), or at the first step once the file
FAULT_WHEN exists (removing it: once), or slow (50 ms more every step); FAULT_RANK (1),
FAULT_WHERE=data|forward. Where no environment reaches the ranks (a compose node), the
experiment's data.args say it: {fault: sleep, step: 7}."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import torch
from spirals import Spirals, mlp  # noqa: F401 - the example's parts, beside this file
from torch import nn

from ddplab.forensics.heartbeat import current_step

FAULT, WHERE = os.environ.get("FAULT", ""), os.environ.get("FAULT_WHERE", "data")
RANK, STEP = os.environ.get("FAULT_RANK", "1"), int(os.environ.get("FAULT_STEP", "5"))


def go_wrong(where: str) -> None:
    if not FAULT or where != WHERE or os.environ.get("RANK") != RANK:
        return
    if FAULT == "slow":  # every step, 50 ms more than the others
        time.sleep(0.05)
    when = os.environ.get("FAULT_WHEN")
    if not os.path.exists(when) if when else current_step() != STEP:
        return
    if when:
        os.unlink(when)  # once: a restarted attempt runs on
    if FAULT == "sleep":
        time.sleep(3600)
    if FAULT == "spin":
        while True:
            pass
    if FAULT == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "segv":
        ctypes.string_at(0)
    if FAULT == "raise":
        raise ValueError(f"sample broken on purpose at step {current_step()}")


class Faulty(Spirals):
    def __getitem__(self, i: int):
        go_wrong("data")
        return super().__getitem__(i)


def make_data(seed: int = 0, fault: str = "", step: int = 5) -> tuple[Faulty, Faulty]:
    global FAULT, STEP
    if fault:
        FAULT, STEP = fault, step
    return Faulty(1024, 3, 0.02, seed), Faulty(256, 3, 0.02, seed + 1)


class Model(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = mlp(num_classes, hidden=16, depth=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        go_wrong("forward")
        return self.net(x)
