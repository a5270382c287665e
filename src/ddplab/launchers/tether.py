"""A rank ends with its launcher.

torchrun starts its ranks in sessions of their own: when torchrun itself dies outright
(``kill -9`` of ``ddplab run`` or of ``torchrun``, the OOM killer), nothing stops them. They
trained on alone, to the end, and a rerun of the same command resumed their run beside them
(a hostile pass: one run, every step from 160 on recorded twice). Under torchrun a rank
therefore asks the kernel for SIGHUP when its launcher dies (``PR_SET_PDEATHSIG``): it stops
as on a closed terminal, its run KILLED, saying why (training/jobend.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Mapping

PR_SET_PDEATHSIG = 1
LAUNCHER_ENV = "DDPLAB_LAUNCHER_PID"
"""Set by ``ddplab run`` (whose process is torchrun's agent): the pid its ranks' parent has. A
rank started just before its launcher was killed finds another parent by the time it tethers
(the tether then held to init): 20 of a stopped 100000-rank job slept on for 24 minutes."""
launcher_pid: int | None = None
"""The launcher this rank is tethered to (None: not tethered)."""


def to_launcher(env: Mapping[str, str]) -> None:
    """Under torchrun (its workers have TORCHELASTIC_RUN_ID): SIGHUP when the launcher dies.
    (Other launchers stop their ranks themselves: mpirun's daemons, srun's slurmstepd.)"""
    global launcher_pid
    expected = os.environ.pop(LAUNCHER_ENV, "")  # this rank's: nothing it starts inherits it
    if not env.get("TORCHELASTIC_RUN_ID"):
        return
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):  # not Linux: no tether
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGHUP) != 0:
            return
        expected = expected or env.get(LAUNCHER_ENV, "")
        launcher_pid = int(expected) if expected.isdigit() else parent
        if os.getppid() != launcher_pid:  # it died before the tether held, or before this rank
            os.kill(os.getpid(), signal.SIGHUP)  # got here at all


def launcher_gone(within_s: float = 2.0) -> bool:
    """Whether this rank's launcher has died (its SIGHUP is the tether's, not a terminal's).
    The kernel sends the signal when the thread that started the rank ends: a launcher killed
    outright may still be ending its other threads, and be this rank's parent, for a moment."""
    if launcher_pid is None:
        return False
    from ..subprocs import alive

    deadline = time.monotonic() + within_s
    while True:
        if os.getppid() != launcher_pid or not alive(launcher_pid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)

