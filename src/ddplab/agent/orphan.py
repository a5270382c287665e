"""A detached watcher a surviving rank leaves behind when its job failed: if global rank 0 does
not end the run within the grace time (it was SIGKILLed, or OOM-killed), end it FAILED.

    python -m ddplab.agent.orphan URI RUN_ID WHY [--grace S] [--rank0-spool DIR]

Detached (its own session, deaf to SIGTERM/SIGINT/SIGHUP) so that the rank itself exits at
once: a rank that stays to watch keeps its sockets open, and a rank 0 blocked in a collective
with it never learns the job is over (under Slurm's scancel both were SIGKILLed before the run
ended). Started by tracking.job_run's ending on the surviving ranks; of tracking it imports
only the run's life and the spool's names, never job_run's module (one direction only).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..poll import poll
from ..subprocs import python_m
from ..tracking import life
from ..tracking.spool import CLOSED
from .protocol import fail_fast

GRACE_S = 20.0
"""How long a surviving rank lets global rank 0 end the run itself. torchrun gives ranks it
stops 30 s between SIGTERM and SIGKILL; this must fit inside that."""

SPOOL_FIRST_S = 5.0
"""How long a watcher that sees rank 0's spool watches only the spool before it asks the
server too: rank 0 ending well closes it within a second or two, and the watcher then ends
without importing MLflow (~2 s of CPU on every surviving rank of every failed job, taken from
the ranks still stopping beside it). Rank 0 killed outright: the server is asked from then on,
as before (its node's delivery process ends the run, and the watcher sees that)."""


WATCHERS: list[subprocess.Popen[bytes]] = []
"""The watchers this process left running, kept: a Popen collected while its process runs is
Python's "ResourceWarning: subprocess N is still running" on the failed rank's console."""


def start(uri: str, run_id: str, why: str, grace_s: float, rank0_spool: Path | None = None) -> None:
    """Leave the watcher running and return at once. ``rank0_spool``: global rank 0's spool
    where this node can see it (its node, or a shared disk)."""
    spool_arg = ["--rank0-spool", str(rank0_spool)] if rank0_spool is not None else []
    WATCHERS.append(subprocess.Popen(
        [*python_m("ddplab.agent.orphan"), uri, run_id, why[:500], "--grace",
         str(grace_s), *spool_arg], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        close_fds=True, start_new_session=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddplab.agent.orphan")
    p.add_argument("uri")
    p.add_argument("run_id")
    p.add_argument("why")
    p.add_argument("--grace", type=float, default=GRACE_S)
    p.add_argument("--rank0-spool", type=Path, default=None)
    a = p.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    fail_fast()  # a silent server: not minutes of MLflow's retries past the grace
    end_orphan(a.uri, a.run_id, a.why, a.grace, a.rank0_spool)
    return 0



def end_orphan(uri: str, run_id: str, why: str, grace_s: float = GRACE_S,
               rank0_spool: Path | None = None) -> bool:
    """Run by survivors of a failed job: if the run is still RUNNING after ``grace_s``, global
    rank 0 is gone (SIGKILL, OOM) and can no longer end it: end it FAILED. True if it did.
    Not when rank 0 closed its spool (``rank0_spool``): its ending is there, for its delivery
    or ``ddplab sync`` (with the server down at the end, the run read "global rank 0 lost" once
    it came back, over rank 0's own ending: a hostile pass)."""
    if not run_id:
        return False
    closed = rank0_spool / CLOSED if rank0_spool is not None else None

    def rank0s() -> bool:
        return closed is not None and closed.exists()

    def ended() -> bool:
        if rank0s():
            return True
        try:
            return bool(client.get_run(run_id).info.status != "RUNNING")
        except Exception:  # noqa: BLE001 - a silent server: asked again within the grace
            return False

    t0 = time.monotonic()
    if closed is not None and poll(rank0s, min(SPOOL_FIRST_S, grace_s), interval_s=0.25):
        return False
    from mlflow import MlflowClient

    try:
        client = MlflowClient(uri)
        if not poll(ended, max(0.0, grace_s - (time.monotonic() - t0))) and not rank0s():
            life.end(client, run_id, life.FAILED, f"global rank 0 lost; this rank saw: {why}")
            return True
    except Exception as e:  # noqa: BLE001 - best effort on the way out; never mask the failure
        import warnings

        warnings.warn(f"could not check run {run_id} after the failure: {e}", stacklevel=2)
    return False


if __name__ == "__main__":
    sys.exit(main())
