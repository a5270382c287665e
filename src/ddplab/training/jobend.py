"""How a job ends: the signals that stop it (and how its run then ends), and its last line."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Mapping
from types import FrameType, TracebackType
from typing import Any

from .. import tracking
from ..ccl import handlers
from ..errors import DdplabError, chain
from ..files import write_text_atomic


class Terminated(DdplabError):
    """SIGTERM: the launcher stops the survivors when a rank fails, or the job was stopped."""


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Signals:
    """SIGINT raises KeyboardInterrupt, SIGTERM and SIGHUP raise Terminated, once each job.

    The first signal is remembered: after Ctrl-C a rank may fail in a collective (its peer is
    gone) before its own interrupt surfaces, and the run must still end KILLED, not FAILED.
    Later signals are ignored, so torchrun's follow-up SIGTERM cannot cut the run's ending.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.raised: BaseException | None = None
        self.previous: dict[int, Any] = {}
        self.run: tracking.NullTracker | None = None
        self.holding = False
        self.pending: BaseException | None = None
        self.native: dict[int, Any] = {}
        self.chld: dict[int, Any] = {}  # (shield)

    def attach(self, run: tracking.NullTracker) -> None:
        """The job's run: a job that fails or is stopped names it last too (``run_line``)."""
        self.run = run

    def __enter__(self) -> Signals:
        # The handlers before, as C holds them too: libfabric's (a ccl group's) unlinks its
        # /dev/shm regions on SIGTERM and SIGINT, then ends the process as before. Python's
        # own record of a handler set in C is SIG_DFL: put back through it alone, a ccl rank
        # SIGTERMed by its launcher once its job had ended (its peer exited first) left its
        # 64 MB region behind.
        self.native = handlers.sigactions(SIGNALS)
        for sig in SIGNALS:
            self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            return
        self.received = signum
        if signum == signal.SIGINT:
            e: BaseException = KeyboardInterrupt()
        elif signum == signal.SIGHUP:
            e = Terminated(f"terminated by SIGHUP ({_hung_up_by()})")
        else:
            e = Terminated(f"terminated by SIGTERM ({who_stops(os.environ)})")
        self.raised = e
        if self.holding:
            self.pending = e
            return
        raise e

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A signal in here is raised when it ends: what it does (a rank's report of how it
        ended) is not cut short. (Signals a thread blocks still reach the process through the
        others: this holds them in Python, where the handler runs.)"""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        pending, self.pending = self.pending, None
        if pending is not None:
            raise pending

    def cause(self, e: BaseException) -> BaseException:
        """Why the rank ends: the first signal's exception when ``e`` came of it (what the signal
        cut short raised an error of its own: a checkpoint's write, a collective's), else ``e``.
        Recorded as the error, a stop reads as one (forensics' SECONDARY), never as a cause
        that outranks the peer whose death made the launcher stop this rank."""
        if self.raised is None:
            return e
        return next((c for c in chain(e) if c is self.raised), e)

    def status(self) -> str:
        """Ctrl-C and a closed terminal stop the job (KILLED); SIGTERM is also how launchers end
        the survivors of a failed rank (FAILED)."""
        return "KILLED" if self.received in (signal.SIGINT, signal.SIGHUP) else "FAILED"

    def shield(self) -> None:
        """From here on nothing interrupts: the run's ending must reach the store. Nor does a
        DataLoader worker's death: torch's SIGCHLD handler raises it in this process at any
        line, and, raised again in the ending (a second worker's), it cut short the record
        of the rank's cause (3 of 5 jobs whose worker died: "failed at step 9 in failed")."""
        for sig in self.previous:
            signal.signal(sig, signal.SIG_IGN)
        if signal.SIGCHLD not in self.chld:
            self.chld[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in {**self.previous, **self.chld}.items():
            signal.signal(sig, handler)
        handlers.put_back(self.native)
        if exc is not None and not hasattr(exc, "run_line"):
            run = self.run or _run_in(tb)
            if run is not None and run.run_id:
                # Printed after the job's error line (cli.py): where the failed run is, as a
                # finished job says where its run is.
                exc.run_line = where(  # type: ignore[attr-defined]
                    run, getattr(exc, "status", None) or self.status())


def _run_in(tb: TracebackType | None) -> tracking.NullTracker | None:
    """The job's run, from the frames the exception left (ddplab's loop: the ``run`` of
    ``with tracking.job_run(...) as run`` in run.train), when none was attached."""
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, tracking.NullTracker):
                return value
        tb = tb.tb_next
    return None


def _hung_up_by() -> str:
    from ..launchers import tether

    if tether.launcher_gone():
        return f"its launcher, pid {tether.launcher_pid}, died without stopping it: killed?"
    return "the terminal or ssh session closed"


def who_stops(env: Mapping[str, str]) -> str:
    """Who sends a rank SIGTERM, where ddplab can tell: the scheduler that placed the job (its
    stop, time limit or preemption), or the launcher after a peer failed (the run's verdict then
    names that peer: forensics/)."""
    if env.get("SLURM_JOB_ID"):
        return (f"Slurm stopped job {env['SLURM_JOB_ID']}: scancel, its time limit or a "
                "preemption; or a peer rank failed")
    if env.get("KUBERNETES_SERVICE_HOST"):
        return ("Kubernetes stopped the pod: deleted, evicted or preempted; or a peer rank "
                "failed")
    return "a peer rank failed, or the job was stopped"


RUN_LINE_ENV = "DDPLAB_RUN_LINE"
"""A file where rank 0 also leaves the job's last line: ``ddplab run`` says it again after
torchrun's own closing output, so that a failed job too ends on its run's address."""


def say_last(line: str, active: bool = True) -> None:
    """The job's last line (``where``), on rank 0's console and in RUN_LINE_ENV's file."""
    from ..log import logger, rank

    if not active or not line or rank() not in (None, 0):
        return
    logger().info(line)
    path = os.environ.get(RUN_LINE_ENV)
    from ..launchers import tether

    if path and tether.launcher_gone(within_s=0):  # (killed outright: nobody will read it)
        with contextlib.suppress(OSError):
            os.unlink(path)
    elif path:
        try:  # whole or not at all (the launcher reads it once torchrun is done)
            write_text_atomic(path, line)
        except OSError:
            pass  # the console has it


def where(tracker: tracking.NullTracker, status: str = "FINISHED") -> str:
    """A job's last line: its run, how it ended and where a browser shows it."""
    if not tracker.run_id:
        return "tracking was off: ddplab recorded no run (what your own code logs goes where it sends it)"
    status += _restarting(status)
    if tracker.left:
        return (f"MLflow run {tracker.run_id} {status}: not all delivered yet (see the warning "
                "above)")
    return f"MLflow run {tracker.run_id} {status}" + tracking.ui_address(
        tracker.uri, tracker.experiment_id, tracker.run_id)


def _restarting(status: str) -> str:
    """What follows a failed attempt's status when torchrun starts another (--max-restarts):
    the console said FAILED, then FINISHED, of one run."""
    try:
        done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return ""
    if status != "FAILED" or done >= most:  # (KILLED: Ctrl-C or a launcher gone, no restart)
        return ""
    return (f" for now: torchrun starts attempt {done + 2} (--max-restarts {most}) unless it was "
            "stopped itself, and that attempt resumes this run where it can")
