"""The training process's handle on its node's agent: started by local rank 0 (early, by the
command line: ``prestart``), asked to open rank 0's run, told which spool to deliver, closed at
the job's end. Torch-free; MLflow is imported by the agent only."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import first_line
from ..log import LEVEL_SAID
from ..subprocs import PAUSED, state
from ..tracking import spool
from .protocol import (
    ABANDONED,
    DELIVERY_JSON,
    STARTUP_JSON,
    Args,
    forensics_dir,
    open_request,
    read,
    spool_message,
    stopped_message,
)

if TYPE_CHECKING:  # annotations only: this module must not import torch (backend, tracker)
    from ..config import ExperimentConfig, TrackingConfig
    from ..launchers import LaunchEnv
    from ..tracking.opening import Opened, Request
    from ..tracking.tracker import RunRef

__all__ = ["Delivery", "NoDelivery", "forensics_dir", "hang_watch", "prestart", "start_delivery"]


class Delivery:
    """This node's delivery process (this module's main), started by its local rank 0: it
    opens the run for rank 0, samples the node's system metrics and sends the node's spool to
    the server. Started before the ranks import torch (``prestart``, from the command line), so
    its start-up (importing MLflow, opening the store) runs beside theirs and rank 0 never
    imports MLflow; ``open_run()`` asks it for the run, ``attach()`` names the run's spool,
    ``close()`` lets it finish within ``timeout_s`` and says how many records are still left."""

    def __init__(self, node_rank: int, cfg: TrackingConfig, env: dict[str, str] | None = None,
                 world_size: int = 1, hang_after_s: float = 0.0) -> None:
        from ..tracking.store import resolve_uri

        self.directory, self.timeout_s = Path(), cfg.delivery_timeout_s
        interval = cfg.system_metrics_interval_s if cfg.system_metrics else 0
        args = Args(cfg.delivery_timeout_s, interval, f"node{node_rank}",
                    resolve_uri(cfg, env or os.environ), world_size, hang_after_s)
        self.proc = subprocess.Popen(
            args.argv(),
            # (a bad DDPLAB_LOG_LEVEL is said by the job's own process, not again by this one)
            env={**(env if env is not None else os.environ), LEVEL_SAID: "1"},
            # Its own session: the signals meant for the ranks (Ctrl-C, torchrun's killpg of a
            # failed job) must not stop it before the run's ending is delivered. It ends on
            # its own: closed, or its parent gone, then within its timeout.
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, close_fds=True,
            start_new_session=True)

    def open_run(self, req: Request) -> Opened | None:
        """Rank 0's run, opened by the delivery process; None when it is gone (rank 0 opens the
        run itself). Its failure is raised here: a TrackingError stays one line."""
        from ..tracking.opening import Opened
        from ..tracking.store import TrackingError

        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(open_request(req))
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (OSError, ValueError):  # it died, or its pipes are closed
            return None
        if not line:
            return None
        answer = read(line)
        if "opened" in answer:
            return Opened(**answer["opened"])
        if answer["kind"] == "TrackingError":
            raise TrackingError(answer["error"])
        raise RuntimeError(f"opening the run failed: {answer['kind']}: "
                           f"{first_line(answer['error'])}\n(in the delivery process)\n"
                           f"{answer['traceback']}")

    def attach(self, directory: Path, ref: RunRef) -> None:
        """Deliver this run's spool. (The pipes are closed here, before any DataLoader worker is
        forked, so no other process holds them.)"""
        self.directory = directory
        spool.Meta(ref.uri, ref.run_id, ref.experiment_id).write(directory)
        (directory / spool.CLOSED).unlink(missing_ok=True)  # an earlier attempt's
        (directory / DELIVERY_JSON).unlink(missing_ok=True)  # (sync reads both: job over)
        (directory / ABANDONED).unlink(missing_ok=True)
        self._tell(spool_message(directory, ref.start_ms))

    def cancel(self, status: str = "FAILED", why: str = "") -> None:
        """No run to deliver: the process exits (ending the run it opened, if it did: it must not
        stay RUNNING; KILLED with ``why`` when the job was stopped: Ctrl-C, SIGTERM)."""
        self._tell(stopped_message(status, why) if why else "")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=15)

    def _tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        if self.proc.stdout is not None:
            self.proc.stdout.close()  # its answers are read; later output goes to its stderr
        if self.proc.stdin.closed:  # told already
            return
        with contextlib.suppress(OSError):  # it died: nothing to deliver through it
            self.proc.stdin.write(line)
        with contextlib.suppress(OSError):
            self.proc.stdin.close()

    def cpu_s(self) -> tuple[float, float]:
        """CPU seconds the delivery process has used so far (what tracking costs the node), and
        how many of them its start-up took (importing MLflow, opening the store)."""
        try:
            import psutil

            t = psutil.Process(self.proc.pid).cpu_times()
            total = t.user + t.system
        except Exception:  # noqa: BLE001 - gone already, or no psutil: unknown
            return 0.0, 0.0
        try:
            startup = json.loads((self.directory / STARTUP_JSON).read_text())["cpu_s"]
        except (OSError, ValueError, KeyError):
            startup = total  # still starting
        return total, min(startup, total)

    def close(self) -> int:
        """Records not delivered: still left, or set aside (refused as records)."""
        died = self.proc.poll()  # it runs until told: ended already means it was killed
        with contextlib.suppress(OSError):  # a full disk: the delivery also ends when we do
            (self.directory / spool.CLOSED).write_text(str(spool.now_ms()))
        try:
            frozen = self._wait(self.timeout_s + 15)  # its own bound, plus its start-up
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return spool.left_in(self.directory) + spool.rejected_in(self.directory)
        if frozen:
            self._deliver_here("was stopped (SIGSTOP: frozen, not delivering); killed")
            return spool.left_in(self.directory) + spool.rejected_in(self.directory)
        # Killed during the job, it may still have been exiting a moment ago (a big process's
        # exit takes a while on a busy machine: poll() said None then); told to end, it exits 0.
        code = died if died is not None else self.proc.returncode
        if (died is not None or code) and not (self.directory / DELIVERY_JSON).exists():
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            self._deliver_here(f"ended during the job ({how})")
        return spool.left_in(self.directory) + spool.rejected_in(self.directory)

    def _wait(self, bound_s: float) -> bool:
        """Wait for the delivery process to end; True once it has been found stopped (SIGSTOP,
        its state T) twice a second apart, then killed: a frozen process delivers nothing, and
        the job waited its whole bound, then blamed the store and left the run RUNNING (a
        hostile pass)."""
        deadline, stopped = time.monotonic() + bound_s, 0
        while True:
            try:
                self.proc.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
                return False
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise
            stopped = stopped + 1 if state(self.proc.pid) in PAUSED else 0
            if stopped >= 2:
                self.proc.kill()
                self.proc.wait()
                return True

    def _deliver_here(self, what: str) -> None:
        """The delivery process died during the job (killed, out of memory) or froze: this
        process delivers what it left, instead of the job blaming the store for records it
        never sent."""
        from ..log import logger

        logger().warning(f"this node's tracking delivery process (pid {self.proc.pid}) {what}; "
                         "delivering its spool from here")
        try:
            meta = spool.Meta.read(self.directory)
            from .sync import make_client

            out = spool.deliver(self.directory, make_client(meta.uri), lambda: False,
                                self.timeout_s, final=True)
        except Exception as e:  # noqa: BLE001 - the spool keeps it all for `ddplab sync`
            logger().warning(f"delivering it failed too ({spool.describe(e)})")
            return
        with contextlib.suppress(OSError):
            (self.directory / DELIVERY_JSON).write_text(json.dumps(
                {"left": out.left, "set_aside": out.set_aside, "error": out.error,
                 "pid": os.getpid(), "delivered_by": "the training process"}))


class NoDelivery:
    """Ranks that are not their node's leader, and untracked jobs."""

    directory = Path()

    def open_run(self, req: Request) -> Opened | None:
        return None

    def attach(self, directory: Path, ref: RunRef) -> None: ...
    def cancel(self, status: str = "FAILED", why: str = "") -> None: ...

    def cpu_s(self) -> tuple[float, float]:
        return 0.0, 0.0

    def close(self) -> int:
        return 0


# The delivery process the command line started for this job (prestart), until the job takes it.
_EARLY: list[Delivery] = []


def prestart(cfg: ExperimentConfig, le: LaunchEnv, env: dict[str, str]) -> None:
    """Start this node's delivery process now, before the ranks import torch (``ddplab train``
    calls this first): importing MLflow and opening the store then run beside that instead of
    on rank 0's way to its first step."""
    if cfg.tracking.enabled and le.is_node_leader and not _EARLY:
        _EARLY.append(Delivery(le.node_rank, cfg.tracking, env, le.world_size, hang_watch(cfg)))


def hang_watch(cfg: ExperimentConfig) -> float:
    """dist.hang_after_s where ranks beat: ddplab's loop, and a script whose steps are observed
    (script.observe); an unobserved script says nothing of its steps."""
    return 0.0 if cfg.kind == "script" and not cfg.script.observe else cfg.dist.hang_after_s


def start_delivery(cfg: ExperimentConfig, le: LaunchEnv) -> Delivery | NoDelivery:
    """This node's delivery process (the one prestart started, if any) on its leader."""
    early = _EARLY.pop() if _EARLY else None
    if not (cfg.tracking.enabled and le.is_node_leader):
        if early is not None:
            early.cancel()
        return NoDelivery()
    return early or Delivery(le.node_rank, cfg.tracking, world_size=le.world_size,
                             hang_after_s=hang_watch(cfg))
