"""A detached watcher a surviving rank leaves behind when its job failed: if global rank 0 does
not end the run within the grace time (it was SIGKILLed, or OOM-killed), end it FAILED.

    python -m ddplab.orphan URI RUN_ID WHY [--grace S]

Detached (its own session, deaf to SIGTERM/SIGINT/SIGHUP) so that the rank itself exits at
once: a rank that stays to watch keeps its sockets open, and a rank 0 blocked in a collective
with it never learns the job is over (under Slurm's scancel both were SIGKILLed before the run
ended). See tracking.end_orphan.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys


def start(uri: str, run_id: str, why: str, grace_s: float) -> None:
    """Leave the watcher running and return at once."""
    subprocess.Popen([sys.executable, "-m", "ddplab.orphan", uri, run_id, why[:500],
                      "--grace", str(grace_s)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True,
                     start_new_session=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddplab.orphan")
    p.add_argument("uri")
    p.add_argument("run_id")
    p.add_argument("why")
    p.add_argument("--grace", type=float, default=20.0)
    a = p.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    from .tracking import end_orphan

    end_orphan(a.uri, a.run_id, a.why, a.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
