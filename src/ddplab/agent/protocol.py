"""What the node agent and the processes around it say to each other: its command line, the
messages on its stdin and stdout, and the files it and the ranks leave in the spool folder.
Stdlib only: the training process, the agent and ``ddplab sync`` all read it.

The agent's life, as the messages go (handle.Delivery is the training process's side):

    training process (local rank 0)            node agent (python -m ddplab.agent)
    Args(...).argv(), Popen          ->         imports MLflow, opens the store
    open_request(Request)  (rank 0)  ->
                                     <-         opened_answer(Opened) or error_answer(e)
    spool_message(folder, t0_ms)     ->         delivers SPOOL_FILES, samples the node,
                                                watches FORENSICS heartbeats
    (an empty stdin: no run; the agent ends any run it opened and exits)
    CLOSED written at the job's end  ->         delivers what is left within --timeout,
                                                writes DELIVERY_JSON, exits
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..subprocs import python_m

#: ``python -m ddplab.agent``: the module a node's agent runs as.
MODULE = "ddplab.agent"

# ---- files in a job's spool folder (spool.py owns the record streams and CLOSED) ----
DELIVERY_JSON = "delivery.json"
"""The agent's last word: records left, set aside, the error, its pid (``ddplab sync`` reads
it: the job is over)."""
DELIVERING = "delivering.lock"
"""Locked (flock) by the agent for its whole life: the lock free, the agent is gone, however it
ended (``ddplab sync`` reads it: a job killed outright, agent and all, is over)."""
QUIET_S = 600.0
"""How long a spool whose agent's lock is free must have been unchanged before ``ddplab sync``
takes its job for over (a file system whose locks one host cannot see: the agent, alive on
another, writes the node's system metrics every few seconds)."""
STARTUP_JSON = "delivery-startup.json"
"""CPU seconds the agent's start-up took (importing MLflow, opening the store)."""
ABANDONED = "abandoned.json"
"""In rank 0's node's spool: why the run's end was never recorded and when (ms), written by
the node's delivery process when global rank 0 died outright and the run could not be ended
(the server silent): ``ddplab sync`` ends it with both."""
FORENSICS = "forensics"
"""The folder of every local rank's heartbeat and stacks, beside the spool (forensics/)."""
META_JSON = "meta.json"
"""The run the spool belongs to (spool.Meta); rewritten when a restarted attempt takes it over."""


# The client fails fast and the agent's processes retry on their own schedule: MLflow's
# defaults retry one call for minutes, which is how a dead server used to hang a finished job
# (and kept a failed job's orphan watcher four minutes past its 20 s grace). And no "View run
# at <tracking URI>" as a run ends: inside compose or a cluster an in-network name no browser
# opens (the job prints the run's address itself: jobend.where).
CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
              "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


def fail_fast() -> None:
    """This process's MLflow clients, made from now on, as ``CLIENT_ENV`` says (unless the
    user set those variables)."""
    import os

    for k, v in CLIENT_ENV.items():
        os.environ.setdefault(k, v)


def forensics_dir(spool_dir: Path) -> Path:
    """Where a node's ranks keep their heartbeats and stacks: beside its spool."""
    return spool_dir / FORENSICS


RESUME_LOCK = ".resume.lock"
"""In a run's folder: locked by the rank 0 that resumes the run, while its process lives."""
_HELD: dict[Path, Any] = {}  # the run folders' locks this process holds (their open files)


def _not_in_children() -> None:
    """A forked child (a DataLoader worker) closes its copy of the locks' files: a flock held
    through a copy outlived rank 0 in its orphaned workers and refused the job's own restart."""
    for f in _HELD.values():
        with contextlib.suppress(OSError):
            f.close()
    _HELD.clear()


os.register_at_fork(after_in_child=_not_in_children)


def refuse_a_running_job(run_dir: Path, head: str, hold: bool = False) -> None:
    """ConfigError when a job still runs in this run's folder on this host (a rank of it alive:
    forensics/watch.live_in on each node's heartbeats): resuming its run would record its steps
    twice into it. A hostile pass: the same `make run` typed in a second terminal resumed the
    first's run, and steps 208-288 came twice, from two jobs, both writing its checkpoints.
    (A job's own earlier attempt, restarted by torchrun, has ended before this one starts.)
    ``hold``: rank 0, taking the run: it locks the folder for its process's life too (two
    jobs started together both passed, neither's rank having a heartbeat yet)."""
    from ..config import ConfigError
    from ..forensics.watch import live_in

    tail = ("resuming it would record the same steps twice in one run; let that job end or stop "
            "it, or start a new run beside it with --set checkpoint.resume=never")
    for node in sorted(run_dir.glob("spool/node*")):  # (tracking/spool.spool_dir's folders)
        b = live_in(forensics_dir(node))
        if b is not None:
            raise ConfigError(f"{head} the run of a job still running on this host (its rank "
                              f"{b.rank}, pid {b.pid}): {tail}")
    if hold and not _lock(run_dir):
        raise ConfigError(f"{head} the run of a job starting or running on this host (it holds "
                          f"{run_dir / RESUME_LOCK}): {tail}")


def release_runs() -> None:
    """This process's jobs have ended their runs: their folders' locks go (a process that runs
    jobs one after another, in-process)."""
    while _HELD:
        _, f = _HELD.popitem()
        f.close()


def _lock(run_dir: Path) -> bool:
    """This process's exclusive lock on the run's folder (flock: gone with the process);
    False when another process holds it. A folder that cannot take one (read-only, a
    filesystem without locks) is left to the heartbeats' check."""
    import fcntl

    key = run_dir.resolve()
    if key in _HELD:
        return True
    try:
        f = open(key / RESUME_LOCK, "a")  # noqa: SIM115 - held open for the process's life
    except OSError:
        return True
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return False
    except OSError:
        f.close()
        return True
    _HELD[key] = f
    return True


@dataclass(frozen=True)
class Args:
    """The agent's command line."""

    timeout_s: float = 60.0
    """After the job ends: how long to go on delivering (tracking.delivery_timeout_s)."""
    system_interval_s: float = 0.0
    """Seconds between the node's system-metrics samples; 0: none."""
    node: str = "node0"
    uri: str = ""
    """The store to open while waiting for rank 0's request."""
    world_size: int = 1
    """More than one: a lost rank 0's run is ended by its peers' watchers first (orphan.py)."""
    hang_after_s: float = 0.0
    """dist.hang_after_s: a rank's heartbeat older than this is a hang (0: off)."""

    def argv(self) -> list[str]:
        return [*python_m(MODULE), "--timeout", str(self.timeout_s),
                "--system-interval", str(self.system_interval_s), "--node", self.node,
                "--uri", self.uri, "--world-size", str(self.world_size),
                "--hang-after-s", str(self.hang_after_s)]

    @staticmethod
    def parser() -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=f"python -m {MODULE}")
        p.add_argument("spool", type=Path, nargs="?", help="default: read from stdin when ready")
        p.add_argument("--timeout", type=float, default=Args.timeout_s)
        p.add_argument("--system-interval", type=float, default=Args.system_interval_s)
        p.add_argument("--node", default=Args.node)
        p.add_argument("--t0-ms", type=int, default=0)
        p.add_argument("--uri", default="", help="the store to open while waiting (stdin mode)")
        p.add_argument("--world-size", type=int, default=1,
                       help="the job's ranks (more than one: the others' watchers end a lost "
                            "rank 0's run)")
        p.add_argument("--hang-after-s", type=float, default=0.0,
                       help="dist.hang_after_s: a rank's heartbeat older than this is a hang "
                            "(0: off)")
        return p


# ---- the messages, one JSON object per line ----

def open_request(req: Any) -> str:
    """Rank 0 asks the agent to open (or attach to) its run: an opening.Request."""
    return json.dumps({"open": asdict(req)}) + "\n"


def opened_answer(opened: Any) -> str:
    """The run the agent opened: an opening.Opened."""
    return json.dumps({"opened": opened.to_json()}) + "\n"


def error_answer(e: BaseException, traceback_text: str) -> str:
    """Opening failed: rank 0 raises it (a TrackingError stays one line)."""
    return json.dumps({"error": str(e), "kind": type(e).__name__,
                       "traceback": traceback_text}) + "\n"


def spool_message(folder: Path, t0_ms: int) -> str:
    """Which spool to deliver, and when the run started (the system metrics' step 0)."""
    return json.dumps({"spool": str(folder), "t0_ms": t0_ms}) + "\n"


def stopped_message(status: str, why: str) -> str:
    """The job stopped before it started training (Ctrl-C, SIGTERM): the run it opened ends so."""
    return json.dumps({"stopped": {"status": status, "why": why}}) + "\n"


def read(line: str) -> dict[str, Any]:
    """One message (any of the above); an empty line means the sender closed its end."""
    message: dict[str, Any] = json.loads(line)
    return message
