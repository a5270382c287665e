"""A container's first process: runs its command, then waits for what the command left running.

Each node's tracking delivery process (tracking/delivery.py) is started by local rank 0 in a
session of its own, so that it outlives the ranks and records the run's ending: a rank
SIGKILLed (by the hang watch, the OOM killer) cannot record it itself. On a host it then lives
on as an orphan; in a container it did not: the container ends when its first process
(torchrun) exits, and the kernel kills everything left in it, the delivery included, so a hung
compose job stayed RUNNING with no verdict. The image's entrypoint runs the command under this
process instead: it becomes the orphans' parent (it is PID 1, or a child subreaper elsewhere),
forwards the signals meant for the command, and once the command ends, waits (bounded) for
the orphans to end on their own. Interactive (a terminal on stdin), it only runs the command.

    python -m ddplab.launchers.outlive COMMAND [ARG ...]
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
BOUND_S = 180.0
"""The most it waits after the command (DDPLAB_OUTLIVE_S): a delivery ends by itself within
its delivery_timeout_s (60 s) plus its wait for the other nodes' endings (15 s) and a peer's
grace (20 s)."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


def subreaper() -> None:
    """Orphaned descendants become this process's children (PID 1 gets them anyway)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: orphans go to init, which outlives the command anyway


def reap(deadline: float) -> bool:
    """Waits until no child is left or ``deadline``; True when none is left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


def exit_code(returncode: int) -> int:
    """A shell's exit code for the command's end: 128 + N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


def run(argv: list[str], bound_s: float) -> int:
    if os.isatty(0):
        # Interactive (docker run -it): the terminal signals the command's process group, this
        # process included; forwarding would signal the command twice. The command runs as is.
        os.execvp(argv[0], argv)
    subreaper()
    try:
        child = subprocess.Popen(argv)
    except OSError as e:
        print(f"ddplab: cannot run {argv[0]}: {e.strerror}", file=sys.stderr)
        return 127
    for sig in FORWARDED:
        signal.signal(sig, lambda n, _frame: child.send_signal(n))
    code = exit_code(child.wait())
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return code  # nothing left running: the usual end
    print(f"[ddplab] {argv[0]} ended ({code}); waiting for what it left running (this node's "
          f"tracking delivery records the run's end), at most {bound_s:.0f} s", file=sys.stderr,
          flush=True)
    if not reap(time.monotonic() + bound_s):
        print(f"[ddplab] still running after {bound_s:.0f} s; leaving it", file=sys.stderr)
    return code


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m ddplab.launchers.outlive COMMAND [ARG ...]", file=sys.stderr)
        return 2
    raw = os.environ.get("DDPLAB_OUTLIVE_S", "")
    try:
        bound = float(raw) if raw else BOUND_S
    except ValueError:
        print(f"ddplab: DDPLAB_OUTLIVE_S: got {raw!r}; expected seconds (a number >= 0)",
              file=sys.stderr)
        return 2
    return run(argv, max(bound, 0.0))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
