"""The one process per node that talks to the tracking server, so training never does.

Local rank 0 of every node starts it; it runs at the lowest CPU priority, samples the node's
system metrics into the spool, and delivers the spool (spool.py) to MLflow: rank 0's metrics,
params, tags, texts and the run's end. Training processes only append lines to a local file.

    python -m ddplab.agent SPOOL_DIR --timeout 60 [--system-interval 5 --node node0 --t0-ms MS]
    python -m ddplab.agent --timeout 60 ...   (the spool on stdin: {"spool": ..., "t0_ms": ...})

A job starts it the second way, before its run exists: the start-up (importing MLflow, about
1.6 CPU-s) then runs while the ranks wait for rank 0 to open the run, not during the first
epoch; it reads which spool to deliver once it is ready, and exits at once on an empty stdin
(the run was never opened). It runs until the training process that started it writes
``closed`` into the spool (the job ended) or dies, then keeps delivering what is left for at
most --timeout seconds and exits; what is still left stays in the spool for ``ddplab sync``.
It writes what it did to ``delivery.json``. Its command line, messages and files:
protocol.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from ..forensics.watch import Watch
from ..tracking import opening, spool
from . import postmortem
from .protocol import (
    ABANDONED,
    DELIVERING,
    DELIVERY_JSON,
    META_JSON,
    STARTUP_JSON,
    Args,
    error_answer,
    forensics_dir,
    opened_answer,
    read,
)
from .sync import end_if_abandoned, make_client


def preload(uri: str) -> Any:
    """Import what opening the run, delivering and sampling need, and open the store (an
    existing database; a server is asked only when the run is opened), before there is
    anything to do. Returns the client, or None (opening the run then says what is wrong)."""
    import mlflow.system_metrics.metrics.cpu_monitor  # noqa: F401
    from mlflow import MlflowClient  # noqa: F401

    if not uri or uri.startswith(("http://", "https://")):
        return None
    from ..tracking.store import open_client, sqlite_path

    db = sqlite_path(uri)
    if db is not None and not db.exists():
        return None  # not created before the job gets as far as opening its run

    try:
        return open_client(uri)
    except Exception:  # noqa: BLE001 - opening it again for the run names the problem
        return None


def serve(uri: str) -> tuple[Path | None, int, Any]:
    """Before the run exists: open it when rank 0 asks (a line {"open": Request}, answered on
    stdout), then learn which spool to deliver ({"spool": ..., "t0_ms": ...}). Returns
    (None, 0, client) when stdin closes first (the job stopped): a run opened by then is ended,
    not left RUNNING."""
    answers = os.fdopen(os.dup(1), "w")  # rank 0 reads these; anything else printed: stderr
    os.dup2(2, 1)
    try:
        return _answer(uri, answers)
    finally:
        with contextlib.suppress(OSError):  # rank 0 gone, an answer unsent: nothing to tell
            answers.close()


def _answer(uri: str, answers: Any) -> tuple[Path | None, int, Any]:
    client, opened = preload(uri), None
    while True:
        line = sys.stdin.readline()
        if not line.strip():
            if opened is not None:
                opening.end_unclaimed(client, opened)
            return None, 0, client
        told = read(line)
        if "stopped" in told:  # the job was stopped before it started training
            opening.end_unclaimed(client, opened, **told["stopped"])
            return None, 0, client
        if "open" not in told:
            return Path(told["spool"]), int(told["t0_ms"]), client
        req = opening.Request(**told["open"])
        try:
            opened, client = opening.open_run(req, client if req.uri == uri else None)
            answer = opened_answer(opened)
        except Exception as e:  # noqa: BLE001 - rank 0 raises it (a TrackingError: one line)
            answer = error_answer(e, traceback.format_exc())
        with contextlib.suppress(OSError):  # rank 0 stopped waiting (Ctrl-C): stdin says so next
            answers.write(answer)
            answers.flush()


class SystemSampler:
    """This node's CPU, memory, disk, network (and GPU) metrics, with MLflow's own collectors,
    as ``system/<node>/...`` at step = seconds since the run started (so a resumed run's
    samples continue its axis instead of repeating steps)."""

    def __init__(self, stream: spool.Stream, node: str, interval_s: float, t0_ms: int) -> None:
        from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
        from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
        from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

        self.monitors: list[Any] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
        with contextlib.suppress(Exception):  # no NVIDIA GPU or no nvidia-ml-py: none
            from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

            self.monitors.append(GPUMonitor())
        self.stream, self.prefix = stream, f"system/{node}/"
        self.interval_s, self.t0_ms = interval_s, t0_ms
        self.due = time.monotonic()
        self.step = -1

    def tick(self) -> None:
        if time.monotonic() < self.due:
            return
        self.due = time.monotonic() + self.interval_s
        # Each sample its own step, however long collecting took this time and the last (this
        # process runs at nice 19: a busy machine delays it by a second): two samples at one
        # step were seen in CI.
        ts = spool.now_ms()
        self.step = max(self.step + 1, (ts - self.t0_ms) // 1000)
        values: dict[str, float] = {}
        for m in self.monitors:
            with contextlib.suppress(Exception):  # one sensor failing must not stop the rest
                m.collect_metrics()
                values.update(m.aggregate_metrics())
                m.clear_metrics()
        self.stream.append({"op": "log", "ts": ts, "step": self.step,
                            "metrics": {self.prefix + k: float(v) for k, v in values.items()}})


class Producer:
    """True while the training process that started us is alive and has not closed the spool.
    (A file and the parent's pid, not a pipe: DataLoader workers forked from the trainer would
    inherit a pipe's write end and keep it open.)"""

    def __init__(self, directory: Path) -> None:
        self.closed, self.parent = directory / spool.CLOSED, os.getppid()

    def __call__(self) -> bool:
        return os.getppid() == self.parent and not self.closed.exists()


class Yielding:
    """This process at the lowest priority while the ranks run (made so), and back at its
    group's usual one once they are gone (``end``).

    nice 19, and where the kernel groups tasks by session (autogroup: most distributions'
    default) the same for this process's group. Its own session (handle.py) is a group of its
    own, weighed against each rank's group as a whole: nice alone ranks it only within its
    group, where it is alone, and a busy delivery took half of a rank's core (measured: two
    busy processes beside a nice-19 one in its own session kept 52% of their loops, 92% once
    its group was niced too). Once the ranks are gone it yields to nobody of the job's: on a
    machine busy with other work, a group at nice 19 gets ~1.5% of a core, and the job's end
    (its last records, the run's status) waited behind that work. The group's nice goes back
    to 0 (any user may raise a group's nice and lower it back to 0); the process's own nice
    stays, which within its group of one weighs nothing."""

    def __init__(self) -> None:
        with contextlib.suppress(OSError):
            os.nice(19)
        self.ended = not _group_nice(19)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            _group_nice(0)


def _group_nice(value: int) -> bool:
    """Set this process's autogroup's nice; False where the kernel has no autogroup."""
    # The kernel takes one such change in 0.1 s from a user without CAP_SYS_ADMIN (EAGAIN):
    # two nodes' delivery processes on one machine start together.
    for _ in range(20):
        try:
            Path("/proc/self/autogroup").write_text(str(value))
            return True
        except BlockingIOError:
            time.sleep(0.06)
        except OSError:  # no autogroup in this kernel
            return False
    return False


def main(argv: list[str] | None = None) -> int:
    args = Args.parser().parse_args(argv)
    # MLflow prints "View run at <tracking URI>" when a run ends: inside compose or a cluster an
    # in-network name no browser opens. The job prints the run's address itself (jobend.where).
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # A scheduler stopping the job (Slurm's scancel, a node's shutdown) signals every process
    # of the job, this one included: it must outlive the ranks long enough to deliver the
    # run's ending. It ends on its own (closed, or its parent gone, then --timeout); the
    # scheduler's SIGKILL (Slurm: KillWait later) still bounds it.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    client = None
    if args.spool is None:
        # Full priority until the run is open: rank 0 is waiting for it.
        args.spool, args.t0_ms, client = serve(args.uri)
        if args.spool is None:
            return 0
    # Read once, now: the script may delete its spool before this process gets a cycle at
    # nice 19 (seen in CI: a delivery that read meta.json late died, and the run's records
    # stayed in the spool put back).
    meta = spool.Meta.read(args.spool)
    lock = _hold(args.spool / DELIVERING)  # noqa: F841 - held until this process ends
    sampler = (SystemSampler(spool.Stream(args.spool, "system"), args.node,
                             args.system_interval, args.t0_ms or spool.now_ms())
               if args.system_interval > 0 else None)
    alive = Producer(args.spool)
    watch = Watch(forensics_dir(args.spool), args.hang_after_s, socket.gethostname())
    # Stopped with the job's ranks (Ctrl-Z on `ddplab run`, a study or reproduce stops the whole
    # job; so does Slurm's `scontrol suspend`), this process is continued with them: their
    # silence meanwhile is no hang.
    signal.signal(signal.SIGCONT, lambda signum, frame: watch.continued())

    ranks_gone_ms = 0  # when the delivery first saw the ranks gone

    def producing() -> bool:
        if sampler:
            sampler.tick()
        watch.tick()
        if alive():
            return True
        nonlocal ranks_gone_ms
        ranks_gone_ms = ranks_gone_ms or spool.now_ms()
        yielding.end()  # the ranks are gone: the run's end must not wait behind other work
        return False

    client = make_client(meta.uri, client if meta.uri == args.uri else None)
    # What starting costs (importing MLflow, opening its store) apart from what running costs:
    # the first is paid once per job, the second grows with the job.
    started = os.times()
    with contextlib.suppress(OSError):  # the spool deleted already (by the script?)
        (args.spool / STARTUP_JSON).write_text(json.dumps(
            {"cpu_s": round(started.user + started.system, 3)}))
    since = time.time()
    yielding = Yielding()  # from here every cycle taken here is taken from the ranks
    # (The watch ticks with the delivery's cycle, every 3 s: a hang is seen within that.)
    out = spool.deliver(args.spool, client, producing, args.timeout, final=True, meta=meta)
    watch.release_shm()
    holds_rank0 = spool.of_rank0(args.spool)
    # A restarted attempt (torchrun --max-restarts, an elastic pod) may have taken the run over
    # meanwhile: this attempt's endings must not land on the run it goes on with.
    verdict = postmortem.record(client, meta.run_id, watch, args.node, args.world_size, holds_rank0,
                                superseded=lambda: _taken_over(args.spool, since), keep=args.spool)
    if not alive.closed.exists() and holds_rank0:
        # Global rank 0's process is gone without closing its spool: killed outright (by the
        # watch, when it saw a hang: the verdict says why, and no peer is left to wait for).
        stopped = watch.hang is not None
        ended = not out.left and _end_if_killed(client, args.spool, meta, since, args.world_size,
                                                alive.parent, verdict, stopped=stopped)
        if not ended and not _taken_over(args.spool, since):
            # the server silent: `ddplab sync` ends it, with this reason and this time
            with contextlib.suppress(OSError):
                (args.spool / ABANDONED).write_text(json.dumps(
                    {"why": _lost(alive.parent, verdict, stopped),
                     "ts": ranks_gone_ms or spool.now_ms()}))
    if verdict:  # the job's last line: after torchrun's report, which blames whoever it saw first
        print(f"ddplab: {verdict} (every rank's stack and error: ddplab diagnose {meta.run_id})",
              file=sys.stderr)
    cpu = os.times()
    with contextlib.suppress(OSError):  # a full disk: the spool itself still says what is left
        (args.spool / DELIVERY_JSON).write_text(json.dumps(
            {"cpu_s": round(cpu.user + cpu.system, 3), "left": out.left,
             "set_aside": out.set_aside, "error": out.error, "pid": os.getpid()}))
    return 0 if out.left == 0 else 1



def _hold(path: Path) -> Any:
    """``path`` opened and locked for this process's life: ``ddplab sync`` tells from it that
    the job's agent is gone (a lock dies with its process, SIGKILL too). A restarted attempt's
    agent takes it once the last attempt's lets go (its last deliveries: a thread waits for
    it); None if the spool is gone or locks fail (sync then waits for closed or delivery.json,
    or for the spool's changes to stop)."""
    try:
        held = path.open("a")
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return held
    except BlockingIOError:
        threading.Thread(target=_take_when_free, args=(held,), daemon=True).start()
        return held
    except OSError:
        return None


def _take_when_free(held: Any) -> None:
    with contextlib.suppress(OSError):
        fcntl.flock(held, fcntl.LOCK_EX)


def _taken_over(directory: Path, since: float) -> bool:
    """A restarted attempt attached to the run after ``since``: it rewrote the spool's meta.json."""
    with contextlib.suppress(OSError):
        return (directory / META_JSON).stat().st_mtime > since
    return False


def _end_if_killed(client: Any, directory: Path, meta: spool.Meta, since: float,
                   world_size: int, pid: int, verdict: str = "", stopped: bool = False) -> bool:
    """Global rank 0's process died outright (SIGKILL, the OOM killer) and nothing recorded the
    run's end. With peers, their watchers get their grace first (orphan.py: their reason is the
    better one); a lone process has none, nor has a job the watch stopped for a hang
    (``stopped``: the ``verdict`` is the reason), so its run is ended at once. Not when a
    restarted attempt took the run over meanwhile (it rewrote meta.json). False when the run
    could not be ended (the server silent)."""
    from .orphan import GRACE_S

    def taken_over() -> bool:
        return _taken_over(directory, since)

    deadline = time.monotonic() + (GRACE_S + 5 if world_size > 1 and not stopped else 0)
    while time.monotonic() < deadline and not taken_over():
        with contextlib.suppress(Exception):
            if client.get_run(meta.run_id).info.status != "RUNNING":
                return True
        time.sleep(1)
    if taken_over():
        return True  # (the run is the restarted attempt's to end)
    return end_if_abandoned(client, meta, "ddplab delivery", why=_lost(pid, verdict, stopped))


def _lost(pid: int, verdict: str, stopped: bool) -> str:
    """Why the run of a job whose global rank 0 died outright ended FAILED."""
    lost = (f"global rank 0 lost: its process (pid {pid}) died without recording the run's end "
            "(killed outright: SIGKILL, or the OOM killer; or its code called os._exit); ended by "
            "its node's delivery process")
    return verdict if stopped else f"{lost}; {verdict}" if verdict else lost


