"""One rank of a script-mode job: the run, the script's process, how it ended.

Every rank's ``ddplab train SCRIPT.py`` is a small supervisor: it meets the other ranks
(meeting.py), rank 0 opens or attaches to the job's one run, and then the script runs in a child
process with the launcher's environment plus the run's (``MLFLOW_RUN_ID``, the tracking URI,
``DDPLAB_SPOOL`` for ``ddplab.track``, ``DDPLAB_CHECKPOINT_DIR``). Its stdout and stderr pass
through to the console and their tails become the run's ``logs/``; its end (exit code, signal,
exception) is reported to rank 0, which ends the run FINISHED only when every rank's script
exited 0, else FAILED naming the first rank that failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ... import config, tracking
from ...agent.protocol import RESUME_LOCK, forensics_dir, refuse_a_running_job
from ...distributed import host
from ...errors import DdplabError, keep_ends
from ...files import finite_json, named_or_id, save_copy, write_text_atomic
from ...forensics.heartbeat import STACK_SIGNAL, hang_path, stack_path, stopped_path
from ...forensics.watch import is_secondary, raised_in_a_collective
from ...launchers import LaunchEnv
from ...launchers.outlive import exit_code, subreaper
from ...launchers.tether import LAUNCHER_ENV
from ...subprocs import own_temp, python_file
from ...tracking import capsule, schema, spool
from .env import BOOT, FORENSICS_ENV, OBSERVE_ENV, REPORT_ENV, STACKS_ENV, STEP_OFFSET_ENV, T0_ENV
from .figures import Figures, figures
from .meeting import LauncherGone, Meeting

if TYPE_CHECKING:
    from ..jobend import Signals

FINISHED_MARK = ".ddplab-finished"
JOB_FILE = "job.json"
SCRIPT_DIR = "script"
PEER_FAILED = "another rank failed"
HUNG = "the hang watch"
"""How a rank was stopped when its node's hang watch SIGKILLed it (forensics/watch.py)."""
PEER_CHECK_S = 0.5
"""How often a running script's supervisor asks the meeting store whether a peer failed. The
script's own end wakes it at once (a thread blocked in waitpid): on a machine whose cores
the ranks fill, every wake-up here takes a slice of a rank's core."""
HOLD_S = 0.2
"""How long a line the script has begun but not ended is held back from the console, so
that another rank's output does not land inside it."""
EXIT_GRACE_S = 5.0
"""How long a script that has reported its own failure is given to exit by itself before a
stop's signal (it writes its traceback, its libraries shut down)."""
EXIT_SAID_S = 2.0
"""A script's last stderr line at most this long before its ``sys.exit(N)`` is what it said
of its exit (argparse's "error: unrecognized arguments")."""
OWN_ENTRIES = {"spool", FINISHED_MARK, JOB_FILE, SCRIPT_DIR, RESUME_LOCK}
"""A run's folder, ``<checkpoint.dir>/<name>/<run id>/``: the script's own folder
(``script/``, its ``DDPLAB_CHECKPOINT_DIR``), the node's spool beside it, the job that made
the run (``job.json``: what a rerun must match to resume it) and, once it finished, the mark.
Runs of ddplab before ``script/`` kept the script's files in the run's folder itself."""

class ScriptFailed(DdplabError):
    """The script failed on some rank: one line here, the user's traceback in ``detail``.

    ``user_traceback``, ``user_error`` (its last line) and ``t`` (when it failed, for which
    rank torchrun names first) are what the rank's torchrun error file says (cli.py): the
    user's error, not ddplab's frames."""

    status = "FAILED"

    def __init__(self, line: str, detail: str = "", user_error: str = "",
                 t: float | None = None, code: int = 1) -> None:
        super().__init__(line)
        self.detail = f"{line}\n\n{detail}".strip()
        self.user_traceback = detail
        self.user_error = user_error or line
        self.t = t
        # The script's own exit code, as plain python would end (sys.exit(3): 3; argparse's
        # refusal: 2), or 128 + N for signal N, as a shell says it.
        self.exit_code = exit_code(code) or 1


class ScriptStopped(ScriptFailed):
    """The job was stopped (Ctrl-C, SIGTERM, SIGHUP) and no rank had failed: KILLED."""

    status = "KILLED"


@dataclass
class Tail:
    """A stream of the script passed through, its last ``limit`` bytes kept."""

    out: Any
    limit: int
    kept: bytearray = field(default_factory=bytearray)
    total: int = 0
    last_read: float = 0.0  # time.monotonic() of the last bytes

    def pump(self, pipe: Any) -> None:
        """Pass the script's output on in whole lines: every rank's supervisor writes to the one
        console, and an unbuffered ``print`` writes its text and its newline apart, so chunks
        passed on as they came read "rank 0 sum 3.0rank 1 sum 3.0" (a hostile pass). A line
        still open is passed on as it is within ``HOLD_S``: a prompt, progress dots."""
        held, held_since = b"", 0.0
        while True:
            # held at most HOLD_S in all, not HOLD_S after each chunk: dots written faster
            # than that would wait for a line end for hours
            wait_s = held_since + HOLD_S - time.monotonic()
            if held and (wait_s <= 0 or not _readable(pipe, wait_s)):
                held = self._show(held)
            chunk = _read(pipe)
            if not chunk:
                break
            self.last_read = time.monotonic()
            self.total += len(chunk)
            self.kept += chunk
            if len(self.kept) > 2 * self.limit:
                del self.kept[:-self.limit]
            if not held:
                held_since = self.last_read
            held += chunk
            # A line ends after its \n; a progress bar's update (tqdm's) begins with its \r
            ends = max(held.rfind(b"\n") + 1, held.rfind(b"\r"), 0)
            if len(held) > 65536:
                ends = len(held)
            if ends:
                self._show(held[:ends])
                held = held[ends:]
                held_since = self.last_read
        self._show(held)

    def _show(self, data: bytes) -> bytes:
        """Write ``data`` to the console at once (b"": nothing); returns b"", what is held now."""
        if data:
            with contextlib.suppress(OSError, ValueError):
                self.out.write(data)
                self.out.flush()
        return b""

    def text(self) -> str:
        body = bytes(self.kept[-self.limit:]).decode("utf-8", errors="replace")
        dropped = self.total - min(self.total, self.limit)
        return (f"[ddplab: the first {dropped} bytes are not kept; the last {self.limit} follow]\n"
                if dropped else "") + body

    def last_line(self) -> str:
        lines = [ln.strip() for ln in self.text().splitlines() if ln.strip()]
        return lines[-1][:300] if lines else ""


def job_identity(cfg: config.ExperimentConfig) -> dict[str, Any]:
    """What makes a rerun the same job, whose run it resumes: the script (its resolved file),
    its sha256 and its arguments."""
    s = cfg.script
    file = s.file().resolve()
    return {"script": str(file), "path": s.named,
            "sha256": hashlib.sha256(file.read_bytes()).hexdigest(), "args": s.argv()}


def recorded_identity(run_dir: Path) -> dict[str, Any] | None:
    """The job that made the run in ``run_dir`` (its job.json; for a run of the earlier layout,
    the tags its spool recorded), or None when nothing says."""
    try:
        found = json.loads((run_dir / JOB_FILE).read_text())
        return found if isinstance(found, dict) else None
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        return None
    tags: dict[str, Any] = {}
    for records in sorted(run_dir.glob("spool/node*/records.jsonl")):
        with contextlib.suppress(OSError):
            for line in records.read_bytes().splitlines():
                tags.update(spool.parse(line).get("tags", {}))
    if schema.SCRIPT_SHA256 not in tags:
        return None
    with contextlib.suppress(ValueError):
        path = str(tags.get(schema.SCRIPT, ""))
        return {"script": "" if path.startswith("-m ") else path, "path": path,
                "sha256": tags[schema.SCRIPT_SHA256],
                "args": json.loads(tags.get(schema.SCRIPT_ARGS, "null"))}
    return None


def differs(was: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """Why the run ``was`` made is not this job's ("" when it is)."""
    if was is None:
        return "no record of the job that made it (job.json)"
    same_script = was.get("script") == now["script"] if was.get("script") else \
        was.get("path") == now["path"]
    if not same_script:
        return "another script"
    why = [w for w, same in (("the script changed (sha256)", was.get("sha256") == now["sha256"]),
                             ("other arguments", was.get("args") == now["args"])) if not same]
    return " and ".join(why)


def resumable_run(cfg: config.ExperimentConfig, identity: dict[str, Any] | None = None,
                  say: Any = None) -> str:
    """The run this job continues, "" for a new one (rank 0, before any run is opened).

    ``checkpoint.resume=auto``: the newest run of THIS job (the same script file, sha256 and
    arguments: ``job.json``) that left files in its script folder and did not finish (the
    script restarted, by hand or by torchrun --max-restarts), as ddplab's own loop resumes. A
    run another job made is left alone, and one line says why (of the newest such). ``never``:
    a new run. A run's folder or id: that run, whatever made it (one line when that differs)."""
    if cfg.checkpoint.resume == "never" or not cfg.tracking.enabled:
        return ""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    now = identity or job_identity(cfg)
    root = (Path(cfg.checkpoint.dir) / cfg.name).resolve()
    if cfg.checkpoint.resume != "auto":
        run_dir = chosen_run(cfg.checkpoint.resume, root)
        refuse_a_running_job(run_dir, f"checkpoint.resume: {cfg.checkpoint.resume!r} is", hold=True)
        why = differs(recorded_identity(run_dir), now)
        if why:
            say(f"ddplab: resuming run {run_dir.name} ({_made_by(run_dir)}) as checkpoint.resume "
                f"asks, though not the same job: {why}")
        _adopt_earlier_layout(run_dir)
        (run_dir / FINISHED_MARK).unlink(missing_ok=True)
        return run_dir.name
    candidates = []
    for d in root.iterdir() if root.is_dir() else []:
        script_dir = d / SCRIPT_DIR
        if (d / FINISHED_MARK).exists() or not d.is_dir() or d.name == "untracked":
            continue
        if script_dir.is_dir() and any(script_dir.iterdir()):
            candidates.append((max(d.stat().st_mtime, script_dir.stat().st_mtime), d))
        elif not script_dir.exists() and not (d / JOB_FILE).exists() and \
                any(p.name not in OWN_ENTRIES for p in d.iterdir()):
            candidates.append((d.stat().st_mtime, d))  # the earlier layout
    others = []
    for _, d in sorted(candidates, reverse=True):
        why = differs(recorded_identity(d), now)
        if not why:
            refuse_a_running_job(d, f"checkpoint.resume: auto found {d},", hold=True)
            _adopt_earlier_layout(d)
            return d.name
        others.append((d, why))
    if others:
        d, why = others[0]
        say(f"ddplab: not resuming run {d.name} ({_made_by(d)}): {why}; starting a new run; "
            f"--set checkpoint.resume={d} resumes it anyway")
    return ""


def _made_by(run_dir: Path) -> str:
    was = recorded_identity(run_dir) or {}
    return str(was.get("path") or was.get("script") or "its script unknown")


def chosen_run(resume: str, root: Path) -> Path:
    """``checkpoint.resume`` naming a run of this experiment: its folder, or its id."""
    run_dir = named_or_id(resume, root)
    if not run_dir.is_dir() or run_dir.resolve().parent != root.resolve():
        raise config.ConfigError(
            f"checkpoint.resume: {resume!r} is no run of {root} (a script's run is resumed by "
            f"its folder, {root}/<run id>, or its run id); 'auto' or 'never' otherwise")
    return run_dir.resolve()


def _adopt_earlier_layout(run_dir: Path) -> None:
    """A run of the earlier layout kept the script's files in its folder, beside the spool:
    they move into ``script/``, where the resumed script looks (rank 0, before any rank runs)."""
    if (run_dir / SCRIPT_DIR).exists() or (run_dir / JOB_FILE).exists():
        return
    entries = [p for p in run_dir.iterdir() if p.name not in OWN_ENTRIES]
    (run_dir / SCRIPT_DIR).mkdir()
    for p in entries:
        p.rename(run_dir / SCRIPT_DIR / p.name)


def write_identity(run_dir: Path, identity: dict[str, Any], run_id: str) -> None:
    """``job.json``: the job now running in ``run_dir`` (a resumed run: this attempt's)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / JOB_FILE, json.dumps({**identity, "run_id": run_id}, indent=1))


def git_state(script: Path) -> str:
    """committed | modified | untracked | not in a git checkout: what the sha256 does not say."""
    def git(*args: str) -> subprocess.CompletedProcess[str] | None:
        try:
            return subprocess.run(["git", *args], cwd=script.parent, capture_output=True,
                                  text=True, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None

    inside = git("rev-parse", "--is-inside-work-tree")
    if inside is None or inside.returncode != 0:
        return "not in a git checkout"
    status = git("status", "--porcelain", "--", script.name)
    text = status.stdout if status is not None else ""
    if text.startswith("??"):
        return "untracked"
    if text.strip():
        return "modified"
    tracked = git("ls-files", "--error-unmatch", "--", script.name)
    return "committed" if tracked is not None and tracked.returncode == 0 else "untracked"


def _die_with_parent() -> None:
    """In the child: SIGKILL when this rank's supervisor dies (SIGKILL, OOM) - no orphan."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Script:
    """The script's process on this rank."""

    def __init__(self, cfg: config.ExperimentConfig, le: LaunchEnv, run: tracking.NullTracker,
                 meeting: Meeting, t0: float, signals: Signals) -> None:
        self.cfg, self.le, self.run, self.meeting, self.t0 = cfg, le, run, meeting, t0
        self.signals = signals
        s = cfg.script
        self.file = s.file()  # the script, or the module's file (-m pkg.module)
        root = Path(cfg.checkpoint.dir).resolve() / cfg.name
        self.run_dir = root / (run.run_id or "untracked")
        self.ckpt_dir = self.run_dir / SCRIPT_DIR  # the script's: the spool is not in it
        self.spool = spool.spool_dir(root, run.run_id, le.node_rank) if run.run_id else None
        # The script's report and stacks (made by run_to_end, which removes them whatever
        # happens: made here, a job stopped before the script started left them in /tmp).
        self.report_file = self.stack_file = Path(f"/nonexistent/ddplab-script-rank{le.rank}")
        self.forensics = forensics_dir(self.spool) if self.spool and s.observe else None
        self.tails = (Tail(sys.stdout.buffer, s.log_tail_kb * 1024),
                      Tail(sys.stderr.buffer, s.log_tail_kb * 1024))
        # A resumed attempt's records continue the run's step axis after the earlier attempt's
        # (its observation counts from 1 again; a metric's value is the one at its highest step).
        self.step_offset = max(run.logged_through, run.last_step) + 1
        self.exited_at = 0.0  # when the script's process ended (time.time())
        self.stop_at = float("inf")  # when this supervisor signalled the script to stop
        self.stopped_why = f"{PEER_FAILED}: its supervisor stopped the script"
        self.readers: list[Any] = []  # the script's stdout and stderr, as read here
        self.given_run = False  # the job was given its run (MLFLOW_RUN_ID, reproduce): its name stays

    def env(self) -> dict[str, str]:
        le, s = self.le, self.cfg.script
        env = {**os.environ, **{k: str(v) for k, v in s.env.items()},
               **self.meeting.child_env()}
        # What torchrun gives a script, from whichever launcher started this rank. One process
        # (no launcher) gets what env:// needs for a world of one, not LOCAL_RANK: Lightning,
        # Hugging Face's Trainer and Accelerate read it as "a launcher started my ranks", and
        # Lightning's devices=2 then waited for a rank nobody started instead of starting it
        # as it does under plain python.
        for key, value in (("RANK", le.rank), ("WORLD_SIZE", le.world_size),
                           ("LOCAL_RANK", le.local_rank), ("LOCAL_WORLD_SIZE", le.local_world_size),
                           ("GROUP_RANK", le.node_rank), ("MASTER_ADDR", le.master_addr),
                           ("MASTER_PORT", le.master_port)):
            if le.launcher != "none" or key not in LAUNCHED_ONLY:
                env.setdefault(key, str(value))
        if le.launcher == "none" and "MASTER_PORT" not in os.environ:
            env["MASTER_PORT"] = str(_free_port())  # one process: any port its env:// can use
        if self.cfg.dist.threads_per_rank != "auto":
            env["OMP_NUM_THREADS"] = str(self.cfg.dist.threads_per_rank)
        env.update({"PYTHONUNBUFFERED": "1", "DDPLAB_CHECKPOINT_DIR": str(self.ckpt_dir),
                    REPORT_ENV: str(self.report_file), T0_ENV: str(self.t0),
                    STACKS_ENV: str(self.stack_file)})
        if self.run.run_id:
            env.update({"MLFLOW_RUN_ID": self.run.run_id, "MLFLOW_TRACKING_URI": self.run.uri,
                        "DDPLAB_SPOOL": str(self.spool)})
        else:
            env.pop("DDPLAB_SPOOL", None)
        env.pop(OBSERVE_ENV, None)
        env.pop(FORENSICS_ENV, None)
        env.pop(LAUNCHER_ENV, None)  # this rank's launcher, not of a torchrun the script starts
        env[STEP_OFFSET_ENV] = str(self.step_offset)
        if s.observe:
            env[OBSERVE_ENV] = str(s.flops_per_sample)
            if self.forensics is not None:
                env[FORENSICS_ENV] = str(self.forensics)
        return env

    def run_to_end(self) -> dict[str, Any]:
        """Start the script, pass its output through, and wait for its end, a peer's failure
        or a signal (raised here by run.Signals: the script is then stopped the same way)."""
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        # (named by host and pid: a supervisor killed outright leaves it to the next one's sweep)
        self.report_file = own_temp("script", suffix=f".rank{self.le.rank}.json")
        self.stack_file = self.report_file.with_suffix(".stack.txt")
        if self.forensics is not None:
            # The node's hang watch asks the observed script for its stacks here
            # (heartbeat.STACK_SIGNAL).
            self.forensics.mkdir(parents=True, exist_ok=True)
            hang_path(self.forensics).unlink(missing_ok=True)  # an earlier attempt's
            stopped_path(self.forensics, self.le.rank).unlink(missing_ok=True)
            self.stack_file = stack_path(self.forensics, self.le.rank)
        try:
            return self._supervise()
        finally:  # read by then (_keep_logs); here only when something else went wrong first
            self.report_file.unlink(missing_ok=True)
            self.stack_file.unlink(missing_ok=True)

    def _supervise(self) -> dict[str, Any]:
        s = self.cfg.script
        target = ["-m", s.module] if s.module else [str(self.file)]
        ends = [_output_for(stream) for stream in (sys.stdout, sys.stderr)]
        # What the script starts and leaves behind (a Popen'd process, a DataLoader worker stuck
        # in a hang) becomes this process's child once the script is gone: ended with the job.
        subreaper()
        try:
            proc = subprocess.Popen(
                [*python_file(BOOT), *target, *s.argv()],
                env=self.env(), stdout=ends[0][0], stderr=ends[1][0],
                preexec_fn=_die_with_parent)  # noqa: PLW1509 - no threads yet
        except BaseException:
            for _, read in ends:
                if read is not None:
                    read.close()
            raise
        finally:
            for given, _ in ends:
                if given != subprocess.PIPE:
                    os.close(given)  # the script's end of its terminal: the script holds it now
        self.readers = [read if read is not None else pipe
                        for (_, read), pipe in zip(ends, (proc.stdout, proc.stderr), strict=True)]
        terminals = [(stream.fileno(), read.fileno()) for stream, (_, read)
                     in zip((sys.stdout, sys.stderr), ends, strict=True) if read is not None]
        pumps = [threading.Thread(target=t.pump, args=(p,), daemon=True)
                 for t, p in zip(self.tails, self.readers, strict=True)]
        for p in pumps:
            p.start()
        stopped = ""
        ended = threading.Event()

        def reap() -> None:
            proc.wait()
            self.exited_at = time.time()
            ended.set()

        threading.Thread(target=reap, daemon=True).start()
        try:
            while not ended.wait(PEER_CHECK_S):
                _follow_size(terminals)
                # Only a script still running was stopped by us: one that died meanwhile (its
                # own failure, which its peer's error may have been reported before) is not.
                # (ended, not poll(): the reaping thread holds Popen's lock, poll() says None.)
                if not stopped and self.meeting.peer_failed() and not ended.is_set():
                    stopped = PEER_FAILED
                    self._before_stop(proc, ended)
                    if not ended.is_set():
                        self.stop_at = time.time()
                        proc.terminate()
        except BaseException as e:
            # A script that had ended by itself when the launcher's signal came (argparse's
            # refusal on every rank: torchrun stops the rest once the first one exits) ended its
            # own way; Ctrl-C is the user's stop, whoever ended first.
            if not stopped:  # (stopped already: a peer had failed, the better reason)
                self.stopped_why = str(e) if isinstance(e, LauncherGone) else \
                    "interrupted (SIGINT / Ctrl-C)" if isinstance(e, KeyboardInterrupt) else \
                    "its launcher stopped the job"
            stopped = "" if ended.is_set() and not isinstance(e, KeyboardInterrupt) and \
                not stopped else stopped or type(e).__name__
            # Ctrl-C reached the script too (the terminal signals the whole process group):
            # it gets time to stop by itself before SIGTERM. Anything else is passed on.
            interrupted = isinstance(e, KeyboardInterrupt)
            self._before_stop(proc, ended)
            # The stop begins at our signal, not at the launcher's: a script that ended by
            # itself while its stacks were asked for (rank 0's argparse refusal, a moment after
            # rank 1's: seen in CI) was not stopped.
            self.stop_at = time.time()
            _stop(proc, None if interrupted else signal.SIGTERM)
            self._end(proc, pumps, stopped)
            raise
        return self._end(proc, pumps, stopped)

    def _before_stop(self, proc: subprocess.Popen[bytes], ended: threading.Event) -> None:
        """The script's stacks, asked for before it is stopped; but a script that has reported
        its own failure is ending by itself: its exit is waited for (up to EXIT_GRACE_S), not
        cut short by our signal in its teardown (rank 0 failing of its peer's closed connection
        read "killed by SIGTERM", not its own error: seen in a test run)."""
        if "exception" not in self.observed():
            self._stacks(proc)
        if "exception" in self.observed():
            ended.wait(EXIT_GRACE_S)

    def _stacks(self, proc: subprocess.Popen[bytes], wait_s: float = 2.0) -> None:
        """Ask the running script for its stacks (child.py: STACK_SIGNAL, faulthandler) before it
        is stopped; wait until they are written."""
        if proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            proc.send_signal(STACK_SIGNAL)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError):
                if "File " in self.stack_file.read_text():
                    time.sleep(0.1)  # the rest of the threads
                    return
            time.sleep(0.05)

    def where(self, traceback: str = "") -> str:
        """'my_train.py:45 in <module>': where a stopped rank was, the innermost frame of the
        script's own file in the main thread's dumped stack. A script that had raised already
        when its stack was asked for was unwinding past its own frames (formatting its
        traceback, importing for it: seen in CI): then where its ``traceback`` (innermost frame
        last) says it raised; else the stack's innermost frame ('' without a dump)."""
        stack = ""
        with contextlib.suppress(OSError):
            stack = self.stack_file.read_text().split("Current thread", 1)[-1]
        return (_innermost(stack, self.file, last_first=True, own=True)
                or _innermost(traceback, self.file, last_first=False)
                or _innermost(stack, self.file, last_first=True))

    def raised_at(self, traceback: str) -> str:
        """Where a failed rank's script raised: its traceback's frame of the script's file."""
        return _innermost(traceback, self.file, last_first=False)

    def _end(self, proc: subprocess.Popen[bytes], pumps: list[threading.Thread], stopped: str
             ) -> dict[str, Any]:
        # torchrun's SIGTERM (a peer failed: this rank's script often failed of it too) must not
        # cut this rank's report short: its ending would read "ended without reporting" (seen in
        # CI). Held until the report is made, then raised as ever.
        with self.signals.held():
            _end_leftovers()
            self._drain(pumps, self.readers)
            for pipe in self.readers:
                if pipe is not None:
                    pipe.close()
            self.wall_s = time.time() - self.t0
            outcome = self.outcome(proc.returncode, stopped)
            self._say_ending(outcome)
            self._keep_logs()
            self.meeting.report(outcome)
        return outcome

    def _drain(self, pumps: list[threading.Thread], pipes: list[Any], limit_s: float = 10.0,
               quiet_s: float = 0.5) -> None:
        """The script's last output through, up to EOF; but a process the script started and
        left running (``Popen(["sleep", "60"])``) holds the pipes open: once nothing is left
        to read and nothing came for ``quiet_s`` the rest is not waited for (plain torchrun
        does not wait for it either), nor beyond ``limit_s``."""
        start = time.monotonic()
        while any(p.is_alive() for p in pumps) and time.monotonic() < start + limit_s:
            last = max(start, *(t.last_read for t in self.tails))
            if time.monotonic() - last > quiet_s and not any(_unread(p) for p in pipes):
                return
            for p in pumps:
                p.join(timeout=0.05)

    def _say_ending(self, out: dict[str, Any]) -> None:
        """How the script ended, for the node's hang watch (forensics/watch.py), which sees only
        heartbeats: a script this supervisor stopped, or one that left without ending its
        script (``os._exit``), did not die outright of a signal nobody sent."""
        why = ""
        if out["stopped"] and out["stopped"] != HUNG:
            sig = _signal_name(-out["code"]) if out["code"] < 0 else "SIGTERM"
            why = f"terminated by {sig}: {self.stopped_why}"
        elif out.get("left"):
            why = out["why"]
        if why and self.forensics is not None:
            with contextlib.suppress(OSError):
                stopped_path(self.forensics, self.le.rank).write_text(why)

    def observed(self) -> dict[str, Any]:
        try:
            report: dict[str, Any] = json.loads(self.report_file.read_text())
            return report
        except (OSError, ValueError):
            return {}

    def hang(self) -> str:
        """What the node's hang watch saw, when it stopped this job's ranks; else ""."""
        if self.forensics is None:
            return ""
        try:
            return hang_path(self.forensics).read_text().strip()
        except OSError:
            return ""

    def outcome(self, code: int, stopped: str) -> dict[str, Any]:
        seen = self.observed()
        # (a script deaf to that SIGTERM ends by the SIGKILL after it: stopped, not its failure)
        ours = code in (-signal.SIGTERM, -signal.SIGKILL) and self.exited_at >= self.stop_at
        if stopped == PEER_FAILED and not ours and (code < 0 or "exception" in seen):
            stopped = ""  # it failed by itself just before our SIGTERM reached it
        elif stopped not in ("", "KeyboardInterrupt") and seen.get("t", self.stop_at) < self.stop_at:
            stopped = ""  # it had failed by itself (argparse's refusal) when the stop began
        out: dict[str, Any] = {"rank": self.le.rank, "host": socket.gethostname(), "code": code,
                               "t": seen.get("t") or self.exited_at or time.time(),
                               "failed": code != 0, "stopped": stopped,
                               "observed": {k: v for k, v in seen.items() if k != "traceback"}}
        hang = self.hang()
        if code == -signal.SIGKILL and hang:
            out.update(why=f"stopped by ddplab's hang watch: {hang}", stopped=HUNG)
        elif code < 0:
            out["why"] = f"killed by {_signal_name(-code)}"
        elif "returned" not in seen and not stopped:
            # The process ended without the script returning (os._exit, a library's exit()):
            # not at the script's end, whatever its code (os._exit(3): not a death by a signal).
            out.update(left=True, why=f"exited {code} before the script's end (os._exit, or a "
                                      "library's exit())")
        elif code:
            out["why"] = self._why(seen, code)
        out["traceback"] = keep_ends(seen.get("traceback", ""), 6000)
        if out["stopped"] and (where := self.where(out["traceback"])):
            out["where"] = where  # where a stopped rank was (the hang watch's too): its stack
        elif code and (where := self.raised_at(out["traceback"])):
            out["raised_at"] = where  # where a failed rank's script raised
        with contextlib.suppress(OSError):
            if self.spool is not None and "File " in self.stack_file.read_text():
                out["stack"] = f"forensics/rank{self.le.rank}.stack.txt"  # _keep_logs
        return out

    def _why(self, seen: dict[str, Any], code: int) -> str:
        """A failed script's one line: its exception; for ``sys.exit(N)`` (argparse's refusal
        is ``SystemExit: 2``), what it wrote to stderr last as it exited, where it did."""
        said, last = seen.get("exception", ""), self.tails[1].last_line()
        if said.startswith("SystemExit: ") and last and self.exited_at:
            # (a line written long before it exited is not why it did)
            before_exit_s = (time.monotonic() - self.tails[1].last_read) - (time.time() - self.exited_at)
            if before_exit_s < EXIT_SAID_S:
                return f"{last} ({said})"
        if self.le.launcher == "none" and said.startswith("KeyError: ") and any(
                f"'{k}'" in said for k in LAUNCHED_ONLY):
            return (f"{said} (one process, no launcher: nothing gave it {', '.join(sorted(LAUNCHED_ONLY))}, "
                    "as under plain python; start its ranks with ddplab run --nproc-per-node N or "
                    "torchrun -m ddplab train)")
        return said or last or f"exit code {code}"

    def _keep_logs(self) -> None:
        """Both tails into the run (logs/rank<r>.stdout.txt, ...) through the node's spool."""
        self.report_file.unlink(missing_ok=True)
        stacks = self.stack_file.read_text() if self.stack_file.exists() else ""
        self.stack_file.unlink(missing_ok=True)
        if self.spool is None:
            return
        files = self.spool / "files"
        with contextlib.suppress(OSError):  # a full disk: the console had the output
            files.mkdir(parents=True, exist_ok=True)
            stream = spool.Stream(self.spool, "track")
            for name, tail in zip(("stdout", "stderr"), self.tails, strict=True):
                kept = files / f"rank{self.le.rank}.{name}.txt"
                kept.write_text(tail.text())
                stream.append({"op": "file", "ts": spool.now_ms(), "path": str(kept),
                               "dir": "logs"})
            if "File " in stacks:  # asked for before the script was stopped
                kept = files / f"rank{self.le.rank}.stack.txt"
                kept.write_text(stacks)
                stream.append({"op": "file", "ts": spool.now_ms(), "path": str(kept),
                               "dir": "forensics"})
            stream.close()


def _innermost(stack: str, script: Path, last_first: bool, own: bool = False) -> str:
    """The innermost frame of ``script``'s own file in a stack (faulthandler's dump: innermost
    first; a traceback: innermost last), else (unless ``own``) the innermost frame at all."""
    frames = re.findall(r'File "([^"]+)", line (\d+),? in (\S+)', stack)
    if not last_first:
        frames.reverse()
    mine = [f for f in frames if Path(f[0]).name == script.name] or ([] if own else frames)
    if not mine:
        return ""
    file, line, func = mine[0]
    return f"{Path(file).name}:{line} in {func}"


def _end_leftovers(grace_s: float = 2.0) -> None:
    """The processes the ended script left running in this rank's session (its own children's,
    reparented here: subreaper; one in a process group of its own, ``Popen(process_group=0)``,
    too: it outlived the job, a hostile pass): SIGTERM, then SIGKILL after ``grace_s``, reaped.
    One started in a session of its own (``start_new_session=True``: a daemon on purpose) is
    left alone, as is every process of ddplab's own (the delivery process, in its session)."""
    deadline = time.monotonic() + grace_s
    sent: set[int] = set()
    # (bounded: a process stuck in the kernel outlives even SIGKILL for a while)
    while (left := _leftovers()) and time.monotonic() < deadline + 3.0:
        for pid in left:
            sig = signal.SIGKILL if time.monotonic() > deadline else signal.SIGTERM
            if pid not in sent or sig == signal.SIGKILL:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
                sent.add(pid)
        time.sleep(0.05)
        for pid in sent:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def _leftovers() -> list[int]:
    """Children of this process in its session, alive (not zombies)."""
    me, session, found = os.getpid(), os.getsid(0), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            state, ppid, sid = fields[0], int(fields[1]), int(fields[3])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and sid == session and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def _output_for(stream: Any) -> tuple[Any, Any]:
    """Where the script writes what this rank writes to ``stream``, and what is read of it
    here: where ``stream`` is a terminal, a pseudo-terminal of its size (tqdm, rich and coloured
    logs see a terminal, as under plain torchrun), its output passed through byte for byte (no
    newline made CR-LF twice); else a pipe (subprocess.PIPE, read from the Popen's end)."""
    import pty

    try:
        if not stream.isatty():
            return subprocess.PIPE, None
        read, write = pty.openpty()
    except (OSError, ValueError, AttributeError):
        return subprocess.PIPE, None
    with contextlib.suppress(OSError, termios.error):
        attrs = termios.tcgetattr(write)
        attrs[1] &= ~termios.OPOST  # output as written: the outer terminal makes its CR-LF
        termios.tcsetattr(write, termios.TCSANOW, attrs)
        size = fcntl.ioctl(stream.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(write, termios.TIOCSWINSZ, size)
    return write, os.fdopen(read, "rb", buffering=0)


def _follow_size(terminals: list[tuple[int, int]]) -> None:
    """The rank's terminal resized: the script's pseudo-terminal takes its new size, which tqdm
    and rich read at each refresh, as under plain torchrun. (Polled: torchrun starts each rank
    in a session of its own, which the terminal's SIGWINCH never reaches.)"""
    for outer, inner in terminals:
        with contextlib.suppress(OSError):
            size = fcntl.ioctl(outer, termios.TIOCGWINSZ, b"\0" * 8)
            if fcntl.ioctl(inner, termios.TIOCGWINSZ, b"\0" * 8) != size:
                fcntl.ioctl(inner, termios.TIOCSWINSZ, size)


def _signal_name(number: int) -> str:
    """SIGTERM, ...; a real-time signal (SIGRTMIN+n) has no name of its own."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _read(pipe: Any) -> bytes:
    """The next bytes of the script's output; b"" at its end (a pseudo-terminal whose every
    writer closed it says EIO)."""
    try:
        return os.read(pipe.fileno(), 65536)
    except (OSError, ValueError):  # (ValueError: closed here once the script had ended)
        return b""


def _readable(pipe: Any, timeout_s: float) -> bool:
    """The script wrote more within ``timeout_s`` (or its stream ended: a read says so)."""
    try:
        return bool(select.select([pipe.fileno()], [], [], timeout_s)[0])
    except (OSError, ValueError):
        return True


def _unread(pipe: Any) -> int:
    """Bytes waiting in a pipe (0 once it is closed)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(pipe.fileno(), termios.FIONREAD, b"\0" * 4))[0])
    except (OSError, ValueError):
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes], sig: int | None, grace_s: float = 10.0) -> None:
    """``sig`` to the script (None: it has its own already), then SIGTERM, then SIGKILL."""
    for send in (sig, signal.SIGTERM, signal.SIGKILL):
        if send is not None:
            with contextlib.suppress(OSError):
                proc.send_signal(send)
        try:
            proc.wait(timeout=grace_s / 2)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def train(cfg: config.ExperimentConfig, summary_out: str = "") -> str:
    """Script mode's pipeline: launch environment -> checks -> meeting -> run -> the script on
    every rank -> how every rank ended -> the run's end. Returns the run id ("" untracked)."""
    from .. import checks, mfu
    from ..jobend import Signals, say_last, where
    from ..summary import Console

    t0 = time.time()
    given_run = bool(os.environ.get("MLFLOW_RUN_ID"))  # (before the job's run sets it here)
    le = LaunchEnv.from_environ(os.environ)
    checks.for_script(cfg, le, summary_out)
    identity = job_identity(cfg) if le.is_rank0 else {}
    with Signals() as signals:
        # Before the meeting: a checkpoint.resume naming no run is one line, as checks are.
        resume = resumable_run(cfg, identity) if le.is_rank0 else ""
        meeting = Meeting(le, cfg.dist.timeout_s)
        name = cfg.tracking.run_name or script_run_name(cfg.name, le)
        with tracking.job_run(cfg, le, None, resume, signals, share=meeting.share_from_rank0,
                              run_name=name, beats=False) as run:
            signals.attach(run)  # a failed job names its run last too (cli.py)
            script = Script(cfg, le, run, meeting, t0, signals)
            script.given_run = given_run
            if le.is_rank0:
                if run.run_id:
                    write_identity(script.run_dir, identity, run.run_id)
                _record_start(run, cfg, le, script, resume, identity)
            try:
                own = script.run_to_end()
                # Every rank stays until all have reported: a node's delivery takes its ranks'
                # logs, and the store rank 0 may host must outlive the others' last look at it.
                everyone = meeting.wait_all() if le.is_rank0 or not own["failed"] else {}
                # Inside the try: torchrun's SIGTERM (a peer's failure ended its process) can
                # come while rank 0 waits here for the others to leave; the cause is the peer's.
                meeting.leave()
                if le.is_rank0:
                    # Every rank has reported: the verdict comes from their reports. A SIGTERM
                    # from here on only follows a peer's failure already in them, and must not
                    # cut the verdict short (seen in CI: "Terminated" instead of the peer).
                    signals.shield()
            except BaseException as e:  # a signal (torchrun stopping us once a peer failed)
                if not le.is_rank0 or isinstance(e, LauncherGone):  # (no one else's end to hear)
                    raise
                everyone = meeting.wait_all(lambda: True)
                _record_end(run, script, everyone)
                raise (_verdict(everyone, le.world_size, e)
                       or ScriptStopped(f"stopped ({type(e).__name__})")) from None
            if le.is_rank0:
                seen = _record_end(run, script, everyone)
                _summary(summary_out, run, script, everyone, seen)
                console = Console(True)
                if seen.straggler:
                    console.say(f"warning: {seen.straggler}")
                if said := mfu.above_peak(seen.metrics.get("perf/mfu", 0.0),
                                          seen.tags.get(schema.MFU_PEAK_SOURCE, "its peak")):
                    console.say(f"warning: {said}")
                if seen.mixed:
                    console.say(
                        f"warning: the script logged {', '.join(seen.mixed)} itself only after "
                        "ddplab had logged its observed values there: the run's series holds "
                        f"both (tag {schema.OBSERVED_MIXED}); give the script's its own name, or "
                        "set script.observe: false")
                failed = _verdict(everyone, le.world_size, None)
                if failed is not None:
                    if own["failed"]:  # rank 0 exits with its own script's code, not the cause's
                        failed.exit_code = exit_code(own["code"]) or 1
                    raise failed  # its line, not "done in" (the figures are in the run)
                run.asked = _asked(everyone)
                if seen.line:
                    console.say(seen.line)
                elif cfg.script.observe and _trains_likely(everyone, script.wall_s):
                    console.say(_no_training(everyone))
            elif own["failed"]:
                # Its own failure, the user's traceback in torchrun's error file; a peer's
                # consequence a second later, so torchrun names the cause first.
                later = 1.0 if own["stopped"] or _secondary(own) else 0.0
                raise ScriptFailed(_line(own), own["traceback"], own.get("why", ""),
                                   own["t"] + later, own["code"])
        if le.is_rank0 and run.run_id:
            (script.run_dir / FINISHED_MARK).write_text(run.run_id)
    say_last(where(run, run.asked[0] if run.asked else "FINISHED"), le.is_rank0)
    return run.run_id


def _asked(outcomes: dict[int, dict[str, Any]]) -> tuple[str, str] | None:
    """The status a script that ran to its end asked for the job's run (``mlflow.end_run(
    status="FAILED")``: mlflow_join.py), and why, else None. The job's exit code stays the
    script's, as under plain torchrun."""
    asked = {r: o.get("observed", {}).get("asked_status") for r, o in outcomes.items()}
    ranks = sorted(r for r, s in asked.items() if s)
    if not ranks:
        return None
    status = "FAILED" if any(asked[r] == "FAILED" for r in ranks) else "KILLED"
    return status, (f"the script ended the job's run {status}: mlflow.end_run(status='{status}') "
                    f"on rank(s) {','.join(map(str, ranks))}")


LAUNCHED_ONLY = frozenset({"LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"})
"""What a script gets only from a launcher: frameworks take it for ranks started outside them."""


def _trains_likely(outcomes: dict[int, dict[str, Any]], wall_s: float) -> bool:
    """Whether a script with no training seen looks like one that trained (it made a process
    group, started processes (torch.multiprocessing's spawn or Process), ran a minute, or a backward was
    seen): the note on what is not observed is for it, not for ``--help``."""
    seen = outcomes.get(0, {}).get("observed", {})
    return "backend" in seen or bool(seen.get("spawned")) or wall_s >= 60 or \
        bool(seen.get("observe", {}).get("backwards"))  # (one process, its own updates)


def _no_training(outcomes: dict[int, dict[str, Any]]) -> str:
    """Why a script that looks like it trained has no training figure: the ranks it started
    itself are not observed, or it trains without a torch.optim step (it may say its own)."""
    head = "no training seen in the script's process (no optimizer step after a forward or backward)"
    if outcomes.get(0, {}).get("observed", {}).get("spawned"):
        return (f"{head}: processes it starts itself (torch.multiprocessing.spawn or Process, "
                "or torchrun's own main) are not observed; torchrun starting the ranks is")
    return (f"{head}: the run has no training figure; a script whose steps are not seen (its "
            "own updates through p.data never followed by model.zero_grad(), a model without an "
            "nn.Module) records its own with "
            "ddplab.track.log (docs/your-own-script.md)")


def _summary(path: str, run: tracking.NullTracker, script: Script, outcomes: dict[int, dict[str, Any]],
             seen: Figures) -> None:
    if not path:
        return
    save_copy(path, json.dumps({
        "run_id": run.run_id, "mode": "script", "wall_s": round(script.wall_s, 3),
        "observed": seen.summary or None,
        "ranks": [{k: v for k, v in o.items() if k != "traceback"}
                  for _, o in sorted(outcomes.items())]}, indent=2))


def _line(o: dict[str, Any]) -> str:
    ranks = "ranks" if "," in str(o["rank"]) else "rank"
    return f"{ranks} {o['rank']} (host {o['host']}): {o.get('why') or 'exit code ' + str(o['code'])}"


def _secondary(o: dict[str, Any]) -> bool:
    """A consequence of another rank's end (the one list: forensics/watch.py), not a cause."""
    return is_secondary(str(o.get("why", "")))


def _left_early(outcomes: dict[int, dict[str, Any]], first: dict[str, Any]
                ) -> dict[str, Any] | None:
    """A rank whose script exited 0 before ``first`` failed only of a consequence (a peer's
    closed connection), or left without its script's end (``os._exit(0)``, whose exit closes
    its connections before its supervisor can tell the time): the rank that left is the
    cause, not the one left waiting."""
    if not _secondary(first):
        return None
    early = [o for o in outcomes.values()
             if not o["failed"] and (o.get("left") or o["t"] <= first["t"])]
    return min(early, key=lambda o: o["t"]) if early else None


def _verdict(outcomes: dict[int, dict[str, Any]], world: int, signal_e: BaseException | None
             ) -> ScriptFailed | None:
    """The first rank that failed by itself, or a stopped job, or a rank that never reported."""
    # The cause: a rank that failed by itself, its own error before a consequence of another's
    # (a connection its dead peer closed), then the earliest.
    own = sorted((o for o in outcomes.values() if o["failed"] and not o["stopped"]),
                 key=lambda o: (_secondary(o), o["t"]))
    hung = next((o for o in outcomes.values() if o["stopped"] == HUNG), None)
    if hung is not None and (not own or _secondary(own[0])):
        # (the verdict, from every node's heartbeats, follows from the delivery process)
        return ScriptFailed(f"the job hung: {hung['why']}")
    if own and (left := _left_early(outcomes, own[0])) is not None:
        return ScriptFailed(
            f"the script failed: rank {left['rank']} (host {left['host']}) exited 0 before the "
            f"job ended, while the others still ran; then {_line(own[0])}", own[0]["traceback"])
    if own:
        first = own[0]
        # Ranks that failed the same way by themselves (a bug that meets every rank) are all
        # the cause, as the forensics verdict says them (watch.verdict).
        alike = sorted(o["rank"] for o in own if o.get("why") == first.get("why"))
        if len(alike) > 1:
            hosts = sorted({o["host"] for o in own if o["rank"] in alike})
            first = {**first, "rank": ",".join(map(str, alike)), "host": ",".join(hosts)}
        # A rank that raised an error of its own, another than the first's, failed by itself
        # too: it did not stop because of the first ("boom on rank 1" beside "boom on rank 0").
        also = [o for o in own if o["rank"] not in alike and not _secondary(o)
                and not raised_in_a_collective(str(o.get("traceback", "")))]
        others = [r for r in sorted(outcomes) if r not in alike and outcomes[r]["failed"]
                  and all(r != o["rank"] for o in also)]
        waited = "; ".join(f"rank {r} at {outcomes[r]['where']}" for r in others
                           if outcomes[r].get("where"))
        tail = "".join(f"; {_line(o)} also failed by itself" for o in also) + (
            f"; then rank(s) {','.join(map(str, others))} failed or were stopped"
            f"{f' ({waited}; stacks in forensics/)' if waited else ''}" if others else "")
        # torchrun names the rank whose error file is oldest: this (rank 0's) one only when
        # rank 0 is the cause.
        t = first["t"] if 0 in alike else max(time.time(), first["t"] + 1.0)
        return ScriptFailed(f"the script failed on {_line(first)}{tail}", first["traceback"],
                            t=t, code=first["code"])
    missing = sorted(set(range(world)) - set(outcomes))
    if signal_e is None and not missing and all(not o["failed"] for o in outcomes.values()):
        return None
    if isinstance(signal_e, KeyboardInterrupt):
        return ScriptStopped("interrupted (SIGINT / Ctrl-C)", code=-signal.SIGINT)  # exit 130
    if missing:
        return ScriptFailed(f"the job failed: rank(s) {','.join(map(str, missing))} ended without "
                            "reporting (the rank's process killed outright: SIGKILL, the OOM "
                            "killer?)")
    why = str(signal_e).split(" (")[0] if signal_e is not None else "a peer was stopped"
    waited = "; ".join(f"rank {r} at {o['where']}" for r, o in sorted(outcomes.items())
                       if o.get("where"))
    return ScriptStopped(f"stopped ({why}) while no rank had failed: the job was stopped"
                         f"{f'; {waited} (stacks in forensics/)' if waited else ''}")


def _record_start(run: tracking.NullTracker, cfg: config.ExperimentConfig, le: LaunchEnv, script: Script,
                  resume: str, identity: dict[str, Any]) -> None:
    path = script.file  # the script, or the module's file (ddplab.script: "-m pkg.module")
    s = cfg.script
    # ddplab's own checkout as the loop records it (a results page's stamp, reproduce's warning).
    dirty, diff = capsule.git_dirty()
    if diff:
        run.log_text(diff, "git.diff")
    run.set_tags({
        schema.GIT_DIRTY: dirty,
        schema.SCRIPT: s.named, schema.SCRIPT_CWD: os.getcwd(),
        schema.SCRIPT_SHA256: identity["sha256"],
        schema.SCRIPT_GIT: git_state(path), schema.SCRIPT_ARGS: json.dumps(s.argv()),
        **schema.identity_tags(
            le, kind=cfg.kind, resumed_from=resume, rank0_host=socket.gethostname(),
            machine=host.summary(),
            git_sha=capsule.git_sha(), lock=capsule.lock_digest(),
            torch_build=capsule.torch_build(), image=capsule.container_image(),
            versions=capsule.versions(), scheduler=capsule.scheduler_tags()),
        schema.CHECKPOINT_DIR: str(script.ckpt_dir)})
    kept = {"name": cfg.name, "description": cfg.description,
            "script": {**cfg.to_dict()["script"], "path": s.path},
            "dist": {k: getattr(cfg.dist, k) for k in config.SCRIPT_DIST},
            "tracking": cfg.to_dict()["tracking"], "checkpoint": cfg.to_dict()["checkpoint"]}
    # Under ddplab.: a script's own params (argparse's --name, Lightning's hyperparameters) are
    # the plain names, which MLflow lets one value each.
    run.log_params({schema.SCRIPT_PARAMS_PREFIX + k: v for k, v in config.flatten(kept).items()})
    run.log_text(yaml.safe_dump(kept, sort_keys=False), "config.yaml")
    run.log_text(json.dumps(capsule.build({"launch": le.__dict__}), indent=2, default=str),
                 "environment.json")


def ranks_tag(outcomes: dict[int, dict[str, Any]], world: int,
              limit: int = schema.TAG_LIMIT - 200) -> str:
    """The ranks' endings in one tag, schema.SCRIPT_RANKS (MLflow keeps schema.TAG_LIMIT
    characters of a tag: entries beyond that are counted, not listed)."""
    keys = ("rank", "host", "code", "why", "stopped", "where", "raised_at", "stack")
    entries: list[dict[str, Any]] = []
    for r in range(world):
        o = outcomes.get(r)
        if o is None:
            entries.append({"rank": r, "missing": True})
        elif o.get("failed"):
            entries.append({k: str(o[k])[:300] if isinstance(o[k], str) else o[k]
                            for k in keys if o.get(k) not in (None, "")})
    ok = sum(1 for o in outcomes.values() if not o.get("failed"))
    while True:
        unlisted = world - ok - len(entries)
        text = json.dumps([*entries, {"ok": ok, **({"unlisted": unlisted} if unlisted else {})}])
        if len(text) <= limit or not entries:
            return text
        entries.pop()


def script_run_name(name: str, le: LaunchEnv, backend: str = "", threads: Any = "") -> str:
    """The loop's vocabulary (tracking/runs.py layout_name) with "script" after the name; the
    backend and threads once the script's own init_process_group said them (the run is named
    again at its end), e.g. "my_train script gloo 1n x 2r x 1t torchrun"."""
    layout = f"{le.nnodes}n x {le.local_world_size}r" + (f" x {threads}t" if threads else "")
    return " ".join(p for p in (name, "script", backend, layout, le.launcher) if p)


def _record_end(run: tracking.NullTracker, script: Script, outcomes: dict[int, dict[str, Any]]) -> Figures:
    """What the script's own init_process_group chose (observed on rank 0), the hosts, times,
    and what its training did (observe.py, figures.py): returned for the console."""
    seen = outcomes.get(0, {}).get("observed", {}) or script.observed()
    hosts = sorted({o["host"] for o in outcomes.values()})
    tags = {schema.HOSTS: ",".join(hosts),
            schema.SCRIPT_RANKS: ranks_tag(outcomes, script.le.world_size)}
    if "backend" in seen:
        backend = seen["backend"]
        stand_in = backend == "ccl" and importlib.util.find_spec(
            "oneccl_bindings_for_pytorch") is None
        tags.update({schema.BACKEND: backend, schema.BACKEND_REASON: "the script's own "
                     "init_process_group", schema.DEVICE: seen.get("device", "cpu"),
                     schema.THREADS_PER_RANK: seen.get("threads", ""),
                     schema.SCRIPT_WORLD_SIZE: seen.get("world_size", "")})
        if stand_in:
            tags[schema.CCL_IMPL] = "ddplab (standing in for oneccl_bindings_for_pytorch)"
        # (a name the user gave stays, and so does a run the job was given: MLFLOW_RUN_ID,
        # `ddplab reproduce`'s)
        if not script.cfg.tracking.run_name and not script.given_run:
            tags["mlflow.runName"] = script_run_name(script.cfg.name, script.le, backend,
                                                     seen.get("threads", ""))
    else:
        tags[schema.BACKEND] = "none (the script made no process group)"
    run.set_tags(tags)
    # perf/wall_time_s is the loop's name, for one column in the UI; perf/wall_s stays, as
    # script runs have always had it (studies of scripts and their files read it).
    metrics = {"perf/wall_s": round(script.wall_s, 3), "perf/wall_time_s": round(script.wall_s, 3)}
    for key, name in (("process_group_s", "perf/time_to_process_group_s"),
                      ("first_collective_s", "perf/time_to_first_collective_s")):
        if key in seen:
            metrics[name] = float(seen[key])
    run.log_metrics(metrics, script.step_offset)
    fig = figures(outcomes, script.wall_s)
    if fig.last_log:
        run.log_metrics(fig.last_log["metrics"], fig.last_log["step"], fig.last_log["ts"])
    if fig.metrics:
        run.log_metrics(fig.metrics, script.step_offset + fig.step)
        run.set_tags(fig.tags)
        run.log_text(finite_json(fig.summary), "summary.json")
    return fig
