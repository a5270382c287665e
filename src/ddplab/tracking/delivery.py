"""The one process per node that talks to the tracking server, so training never does.

Local rank 0 of every node starts it; it runs at the lowest CPU priority, samples the node's
system metrics into the spool, and delivers the spool (spool.py) to MLflow: rank 0's metrics,
params, tags, texts and the run's end. Training processes only append lines to a local file.

    python -m ddplab.tracking.delivery SPOOL_DIR --timeout 60 [--system-interval 5 --node node0 --t0-ms MS]
    python -m ddplab.tracking.delivery --timeout 60 ...   (the spool on stdin: {"spool": ..., "t0_ms": ...})

A job starts it the second way, before its run exists: the start-up (importing MLflow, about
1.6 CPU-s) then runs while the ranks wait for rank 0 to open the run, not during the first
epoch; it reads which spool to deliver once it is ready, and exits at once on an empty stdin
(the run was never opened). It runs until the training process that started it writes
``closed`` into the spool (the job ended) or dies, then keeps delivering what is left for at
most --timeout seconds and exits; what is still left stays in the spool for ``ddplab sync``.
It writes what it did to ``delivery.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..forensics.watch import Watch
from ..log import logger
from . import opening, postmortem, spool

if TYPE_CHECKING:  # annotations only: this process must not import torch (backend, tracker)
    from ..config import ExperimentConfig, TrackingConfig
    from ..launchers import LaunchEnv
    from .opening import Opened, Request
    from .tracker import RunRef

# The client fails fast and this process retries on its own schedule: MLflow's defaults
# retry one call for minutes, which is how a dead server used to hang a finished job.
CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def make_client(uri: str, opened: Any = None) -> Any:
    """The delivering client (``opened``: the one that opened the run, reused). Opening the run
    kept MLflow's own retries: the job waits for that answer anyway."""
    for k, v in CLIENT_ENV.items():
        os.environ.setdefault(k, v)
    from mlflow import MlflowClient

    return opened or MlflowClient(uri)


def preload(uri: str) -> Any:
    """Import what opening the run, delivering and sampling need, and open the store (an
    existing database; a server is asked only when the run is opened), before there is
    anything to do. Returns the client, or None (opening the run then says what is wrong)."""
    import mlflow.system_metrics.metrics.cpu_monitor  # noqa: F401
    from mlflow import MlflowClient  # noqa: F401

    if not uri or uri.startswith(("http://", "https://")):
        return None
    from .store import open_client, sqlite_path

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
    client, opened = preload(uri), None
    while True:
        line = sys.stdin.readline()
        if not line.strip():
            if opened is not None:
                opening.end_unclaimed(client, opened)
            return None, 0, client
        told = json.loads(line)
        if "open" not in told:
            return Path(told["spool"]), int(told["t0_ms"]), client
        req = opening.Request(**told["open"])
        try:
            opened, client = opening.open_run(req, client if req.uri == uri else None)
            answer: dict[str, Any] = {"opened": opened.to_json()}
        except Exception as e:  # noqa: BLE001 - rank 0 raises it (a TrackingError: one line)
            answer = {"error": str(e), "kind": type(e).__name__,
                      "traceback": traceback.format_exc()}
        with contextlib.suppress(OSError):  # rank 0 stopped waiting (Ctrl-C): stdin says so next
            answers.write(json.dumps(answer) + "\n")
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

    def tick(self) -> None:
        if time.monotonic() < self.due:
            return
        self.due = time.monotonic() + self.interval_s
        values: dict[str, float] = {}
        for m in self.monitors:
            with contextlib.suppress(Exception):  # one sensor failing must not stop the rest
                m.collect_metrics()
                values.update(m.aggregate_metrics())
                m.clear_metrics()
        ts = spool.now_ms()
        self.stream.append({"op": "log", "ts": ts, "step": max(0, (ts - self.t0_ms) // 1000),
                            "metrics": {self.prefix + k: float(v) for k, v in values.items()}})


class Producer:
    """True while the training process that started us is alive and has not closed the spool.
    (A file and the parent's pid, not a pipe: DataLoader workers forked from the trainer would
    inherit a pipe's write end and keep it open.)"""

    def __init__(self, directory: Path) -> None:
        self.closed, self.parent = directory / spool.CLOSED, os.getppid()

    def __call__(self) -> bool:
        return os.getppid() == self.parent and not self.closed.exists()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddplab.tracking.delivery")
    p.add_argument("spool", type=Path, nargs="?", help="default: read from stdin when ready")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--system-interval", type=float, default=0.0)
    p.add_argument("--node", default="node0")
    p.add_argument("--t0-ms", type=int, default=0)
    p.add_argument("--uri", default="", help="the store to open while waiting (stdin mode)")
    p.add_argument("--world-size", type=int, default=1,
                   help="the job's ranks (more than one: the others' watchers end a lost rank 0's run)")
    p.add_argument("--hang-after-s", type=float, default=0.0,
                   help="dist.hang_after_s: a rank's heartbeat older than this is a hang (0: off)")
    args = p.parse_args(argv)
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
    with contextlib.suppress(OSError):
        os.nice(19)  # from here every cycle taken here is taken from the ranks
    sampler = (SystemSampler(spool.Stream(args.spool, "system"), args.node,
                             args.system_interval, args.t0_ms or spool.now_ms())
               if args.system_interval > 0 else None)
    alive = Producer(args.spool)
    watch = Watch(forensics_dir(args.spool), args.hang_after_s, socket.gethostname())

    def producing() -> bool:
        if sampler:
            sampler.tick()
        watch.tick()
        return alive()

    meta = spool.Meta.read(args.spool)
    client = make_client(meta.uri, client if meta.uri == args.uri else None)
    # What starting costs (importing MLflow, opening its store) apart from what running costs:
    # the first is paid once per job, the second grows with the job.
    started = os.times()
    (args.spool / "delivery-startup.json").write_text(json.dumps(
        {"cpu_s": round(started.user + started.system, 3)}))
    since = time.time()
    # (The watch ticks with the delivery's cycle, every 3 s: a hang is seen within that.)
    out = spool.deliver(args.spool, client, producing, args.timeout, final=True)
    holds_rank0 = (args.spool / "records.jsonl").exists()
    verdict = postmortem.record(client, meta.run_id, watch, args.node, args.world_size, holds_rank0)
    if not out.left and not alive.closed.exists() and holds_rank0:
        # Global rank 0's process is gone without closing its spool: killed outright (by the
        # watch, when it saw a hang: the verdict says why, and no peer is left to wait for).
        _end_if_killed(client, args.spool, meta, since, args.world_size, alive.parent, verdict,
                       stopped=watch.hang is not None)
    elif verdict and holds_rank0:
        postmortem.name_the_cause(client, meta.run_id, verdict)
    if verdict:  # the job's last line: after torchrun's report, which blames whoever it saw first
        print(f"ddplab: {verdict} (every rank's stack and error: ddplab diagnose {meta.run_id})",
              file=sys.stderr)
    cpu = os.times()
    with contextlib.suppress(OSError):  # a full disk: the spool itself still says what is left
        (args.spool / "delivery.json").write_text(json.dumps(
            {"cpu_s": round(cpu.user + cpu.system, 3), "left": out.left,
             "set_aside": out.set_aside, "error": out.error, "pid": os.getpid()}))
    return 0 if out.left == 0 else 1



# What went wrong goes through ddplab's logging (stderr, "ddplab sync: warning: ..."); what was
# delivered is the command's result, on stdout.
SYNC_LOG = logger("sync")


def sync(paths: list[str], timeout_s: float, uri: str = "") -> int:
    """``ddplab sync``: deliver every spool under ``paths`` that still holds records, each to
    its run (ended with its recorded status). Idempotent: delivered records are not sent
    again. Returns 0 when everything is delivered everywhere; 1 when records are still left (a
    server that did not answer or refused for now), were set aside (refused as records, or no
    records), or a run is not in the store."""
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        SYNC_LOG.error(f"no such file or directory: {missing[0]}")
        return 2
    found = spool.find([Path(p) for p in paths])
    if not found:
        print(f"ddplab sync: no tracking spool under {' '.join(paths)}: nothing to deliver")
        return 0
    still = 0
    for directory in found:
        try:
            still += _sync_one(directory, timeout_s, uri)
        except (OSError, ValueError, KeyError) as e:  # an unreadable spool: the others go on
            SYNC_LOG.error(f"{directory}: cannot be read ({type(e).__name__}: {e})")
            still += 1
    return 1 if still else 0


def job_over(directory: Path) -> bool:
    """The job that wrote this spool has ended: it closed the spool, or its delivery process
    finished (it outlives the job, and attach() clears both for a new attempt)."""
    return (directory / spool.CLOSED).exists() or (directory / "delivery.json").exists()


def _sync_one(directory: Path, timeout_s: float, uri: str) -> int:
    meta = spool.Meta.read(directory)
    target = uri or meta.uri
    over = job_over(directory)
    todo = sum(s.left(over) for s in (spool.Stream(directory, n) for n in spool.STREAMS))
    where = f"run {meta.run_id} ({directory})"
    client = make_client(target)
    try:
        client.get_run(meta.run_id)
    except Exception as e:  # noqa: BLE001 - no run, or no answer: say which, keep everything
        if spool.status_of(e) == 404:
            SYNC_LOG.error(f"{where}: {target} has no run {meta.run_id} (the job tracked to "
                           f"{meta.uri}); sync to that store, or --tracking-uri the one that "
                           "holds the run")
        else:
            SYNC_LOG.warning(f"{where}: {target} {_failed(spool.describe(e))}; {todo} records "
                             "kept in the spool")
        return max(todo, 1)
    before = spool.rejected_in(directory)
    ends = [r["status"] for s in spool.STREAMS for _, r in spool.Stream(directory, s).pending(over)
            if r.get("op") == "end"]
    out = spool.Outcome()
    if todo:
        out = spool.deliver(directory, client, lambda: False, timeout_s, final=over)
        if out.left:
            SYNC_LOG.warning(f"{where}: {target} {_failed(out.error)} within {timeout_s:.0f} s: "
                             f"{out.left} of {todo} records still left in the spool")
        else:
            print(f"{where}: delivered {todo - out.set_aside} records"
                  + (f"; run ended {ends[-1]}" if ends else ""))
    else:
        print(f"{where}: up to date")
    refused = spool.rejected_in(directory)
    if refused:
        new = f", {refused - before} of them now" if refused > before else ""
        SYNC_LOG.warning(f"{where}: {refused} records set aside{new} (refused by the server as "
                         f"records, or no records), kept with the reasons in "
                         f"{directory / spool.REJECTED}")
    if over and not out.left:
        _end_if_abandoned(client, meta, where)
    return out.left + refused


def _failed(error: str) -> str:
    """"refused ..." when the server answered no, "did not answer (...)" when it was silent."""
    return error if error.startswith("refused") else f"did not answer ({error})"


def _end_if_killed(client: Any, directory: Path, meta: spool.Meta, since: float,
                   world_size: int, pid: int, verdict: str = "", stopped: bool = False) -> None:
    """Global rank 0's process died outright (SIGKILL, the OOM killer) and nothing recorded the
    run's end. With peers, their watchers get their grace first (orphan.py: their reason is the
    better one); a lone process has none, nor has a job the watch stopped for a hang
    (``stopped``: the ``verdict`` is the reason), so its run is ended at once. Not when a
    restarted attempt took the run over meanwhile (it rewrote meta.json)."""
    from .orphan import GRACE_S

    def taken_over() -> bool:
        with contextlib.suppress(OSError):
            return (directory / "meta.json").stat().st_mtime > since
        return False

    deadline = time.monotonic() + (GRACE_S + 5 if world_size > 1 and not stopped else 0)
    while time.monotonic() < deadline and not taken_over():
        with contextlib.suppress(Exception):
            if client.get_run(meta.run_id).info.status != "RUNNING":
                return
        time.sleep(1)
    lost = (f"global rank 0 lost: its process (pid {pid}) died without recording the run's end "
            "(killed outright: SIGKILL, or the OOM killer); ended by its node's delivery process")
    if not taken_over():
        _end_if_abandoned(client, meta, "ddplab delivery", why=verdict if stopped else
                          f"{lost}; {verdict}" if verdict else lost)


def _end_if_abandoned(client: Any, meta: spool.Meta, where: str, why: str = "") -> None:
    """Everything the job recorded is in, the job is over, and the run still says RUNNING: its
    end was never recorded (killed outright, or its last line torn). End it FAILED, saying so."""
    try:
        if client.get_run(meta.run_id).info.status != "RUNNING":
            return
        opening.end_failed(client, meta.run_id, why or (
            "the job ended without recording its end (killed outright, or its last record "
            "torn); ended by ddplab sync"))
    except Exception as e:  # noqa: BLE001
        print(f"{where}: could not end the run ({spool.describe(e)})", file=sys.stderr)
        return
    print(f"{where}: the job had ended without recording the run's end: ended it FAILED")


# ---- the training process's handle on it ----

class Delivery:
    """This node's delivery process (this module's main), started by its local rank 0: it
    opens the run for rank 0, samples the node's system metrics and sends the node's spool to
    the server. Started before the ranks import torch (``prestart``, from the command line), so
    its start-up (importing MLflow, opening the store) runs beside theirs and rank 0 never
    imports MLflow; ``open_run()`` asks it for the run, ``attach()`` names the run's spool,
    ``close()`` lets it finish within ``timeout_s`` and says how many records are still left."""

    def __init__(self, node_rank: int, cfg: TrackingConfig, env: dict[str, str] | None = None,
                 world_size: int = 1, hang_after_s: float = 0.0) -> None:
        from .store import resolve_uri

        self.directory, self.timeout_s = Path(), cfg.delivery_timeout_s
        interval = cfg.system_metrics_interval_s if cfg.system_metrics else 0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddplab.tracking.delivery", "--timeout", str(cfg.delivery_timeout_s),
             "--system-interval", str(interval), "--node", f"node{node_rank}",
             "--uri", resolve_uri(cfg, env or os.environ), "--world-size", str(world_size),
             "--hang-after-s", str(hang_after_s)],
            env=env,
            # Its own session: the signals meant for the ranks (Ctrl-C, torchrun's killpg of a
            # failed job) must not stop it before the run's ending is delivered. It ends on
            # its own: closed, or its parent gone, then within its timeout.
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, close_fds=True,
            start_new_session=True)

    def open_run(self, req: Request) -> Opened | None:
        """Rank 0's run, opened by the delivery process; None when it is gone (rank 0 opens the
        run itself). Its failure is raised here: a TrackingError stays one line."""
        from .opening import Opened
        from .store import TrackingError

        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"open": dataclasses.asdict(req)}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (OSError, ValueError):  # it died, or its pipes are closed
            return None
        if not line:
            return None
        answer = json.loads(line)
        if "opened" in answer:
            return Opened(**answer["opened"])
        if answer["kind"] == "TrackingError":
            raise TrackingError(answer["error"])
        raise RuntimeError(f"opening the run failed: {answer['kind']}: {answer['error']}\n"
                           f"(in the delivery process)\n{answer['traceback']}")

    def attach(self, directory: Path, ref: RunRef) -> None:
        """Deliver this run's spool. (The pipes are closed here, before any DataLoader worker is
        forked, so no other process holds them.)"""
        self.directory = directory
        spool.Meta(ref.uri, ref.run_id, ref.experiment_id).write(directory)
        (directory / spool.CLOSED).unlink(missing_ok=True)  # an earlier attempt's
        (directory / "delivery.json").unlink(missing_ok=True)  # (sync reads both: job over)
        self._tell(json.dumps({"spool": str(directory), "t0_ms": ref.start_ms}) + "\n")

    def cancel(self) -> None:
        """No run to deliver: the process exits on the empty stdin (ending the run it opened, if
        it did: it must not stay RUNNING)."""
        self._tell("")
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
            startup = json.loads((self.directory / "delivery-startup.json").read_text())["cpu_s"]
        except (OSError, ValueError, KeyError):
            startup = total  # still starting
        return total, min(startup, total)

    def close(self) -> int:
        """Records not delivered: still left, or set aside (refused as records)."""
        died = self.proc.poll()  # it runs until told: ended already means it was killed
        with contextlib.suppress(OSError):  # a full disk: the delivery also ends when we do
            (self.directory / spool.CLOSED).write_text(str(spool.now_ms()))
        try:
            self.proc.wait(timeout=self.timeout_s + 15)  # its own bound, plus its start-up
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if died is not None and not (self.directory / "delivery.json").exists():
            self._deliver_here(died)
        return spool.left_in(self.directory) + spool.rejected_in(self.directory)

    def _deliver_here(self, code: int) -> None:
        """The delivery process died during the job (killed, out of memory): this process
        delivers what it left, instead of the job blaming the store for records it never sent."""
        from ..log import logger

        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        logger().warning(f"this node's tracking delivery process (pid {self.proc.pid}) ended "
                         f"during the job ({how}); delivering its spool from here")
        try:
            meta = spool.Meta.read(self.directory)
            out = spool.deliver(self.directory, make_client(meta.uri), lambda: False,
                                self.timeout_s, final=True)
        except Exception as e:  # noqa: BLE001 - the spool keeps it all for `ddplab sync`
            logger().warning(f"delivering it failed too ({spool.describe(e)})")
            return
        with contextlib.suppress(OSError):
            (self.directory / "delivery.json").write_text(json.dumps(
                {"left": out.left, "set_aside": out.set_aside, "error": out.error,
                 "pid": os.getpid(), "delivered_by": "the training process"}))


class NoDelivery:
    """Ranks that are not their node's leader, and untracked jobs."""

    directory = Path()

    def open_run(self, req: Request) -> Opened | None:
        return None

    def attach(self, directory: Path, ref: RunRef) -> None: ...
    def cancel(self) -> None: ...

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
    return 0.0 if cfg.script.path and not cfg.script.observe else cfg.dist.hang_after_s


def start_delivery(cfg: ExperimentConfig, le: LaunchEnv) -> Delivery | NoDelivery:
    """This node's delivery process (the one prestart started, if any) on its leader."""
    early = _EARLY.pop() if _EARLY else None
    if not (cfg.tracking.enabled and le.is_node_leader):
        if early is not None:
            early.cancel()
        return NoDelivery()
    return early or Delivery(le.node_rank, cfg.tracking, world_size=le.world_size,
                             hang_after_s=hang_watch(cfg))


def forensics_dir(spool_dir: Path) -> Path:
    """Where a node's ranks keep their heartbeats and stacks: beside its spool."""
    return spool_dir / "forensics"


if __name__ == "__main__":
    sys.exit(main())
