"""A node's watch over its ranks' heartbeats (heartbeat.py), run by its delivery process, which
outlives the ranks: it sees a hang before the collective timeout and, once the job is over,
which rank failed first and how. Imports nothing of torch or MLflow.

A hang: a live rank's heartbeat older than ``dist.hang_after_s`` (three times that in set-up,
evaluation and checkpoints, which are longer). The watch then asks every rank of its node for
its stack (heartbeat.STACK_SIGNAL) and its Flight Recorder (which collective it waits in, the last one it
finished: the rank that never entered the collective the others wait in is named), kills them
(a rank blocked in a collective never reaches a Python signal handler: only SIGKILL ends it
before the collective timeout) and keeps the verdict. The rank
that stopped is the one furthest behind; the others wait for it, in their phase. Furthest
behind: the lowest step, then the earliest phase of a step (data loading, forward, backward,
optimizer, evaluation, checkpoint: the others reach the backward's collective and wait there),
then the oldest heartbeat.

A failure: the rank whose ending came first. A rank that raised recorded its error and where
it was; a rank that vanished without an ending died outright (a signal: SIGKILL, the OOM
killer: at its last heartbeat), or crashed (its crash file names SIGSEGV and the like: when it
was written). The ranks stopped after it (the launcher's SIGTERM, a broken connection) are
secondary, not causes. A rank a hang's watch found dead already died before the hang was seen:
the others waited for it (on ccl a peer's death is no error).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..subprocs import PAUSED, alive, state
from ..tracking import schema
from .heartbeat import (
    AFTER_TRAINING,
    DUMP,
    JOINING,
    OWN_COLLECTIVE,
    PHASES,
    RECORD,
    STACK_SIGNAL,
    ask,
    crash_path,
    error_path,
    fifo_path,
    flight_path,
    hang_path,
    hb_path,
    stack_path,
    stopped_path,
)

LONG_PHASES = ("setup", JOINING, "evaluation", "checkpoint")
IN_A_STEP = ("forward", "backward", "optimizer")
"""Phases in which a rank waits in its peers' collectives."""
"""Phases allowed three times ``dist.hang_after_s``."""
WAITS_IN = {"backward": "backward (gradient all-reduce)", "forward": "forward",
            "optimizer": "optimizer step", "evaluation": "evaluation (metric all-reduce)",
            "checkpoint": "checkpoint", "setup": "set-up", "data loading": "data loading",
            JOINING: "init_process_group (for the other ranks)"}


@dataclass(frozen=True)
class Beat:
    rank: int
    step: int
    time: float
    phase: str
    pid: int
    world: int


@dataclass(frozen=True)
class Ending:
    """How one rank ended, or stopped: what the verdict is made of (published per node)."""

    rank: int
    step: int
    phase: str
    time: float
    what: str
    """"failed" (raised), "died" (vanished), "stopped" (hung), "waits" (behind a stopped one),
    "done"."""
    detail: str = ""
    host: str = ""
    entered: int = -1
    """The Flight Recorder's newest collective this rank entered (its sequence number in the
    default process group), -1 when unknown."""
    finished: int = -1
    """... and the newest it saw finished: below ``entered``, the rank waits in that one."""
    waits_in: str = ""
    """The collective it waits in (``gloo:all_reduce``), when it does."""
    dead_at_stop: int = 0
    """1: its node's watch, stopping a hang, found it dead already: it died before the others
    were seen to hang (on ccl a peer's death is no error: they wait for it)."""


def read(directory: Path) -> list[Beat]:
    beats = []
    for path in directory.glob("rank-*.hb"):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if len(data) >= RECORD.size:
            step, t, phase, pid, rank, world = RECORD.unpack_from(data)
            if pid:
                beats.append(Beat(rank, step, t, PHASES[phase], pid, world))
    return sorted(beats, key=lambda b: b.rank)


EXIT_WAIT_S = 30.0
"""How long the ranks a watch stopped get to finish exiting before their shm is released (10 s
left a SIGKILLed ccl rank's 64 MB region behind on a loaded 2-core CI machine, its exit not
done; the wait ends as soon as they are gone, so only such a machine waits longer)."""


def live_in(directory: Path) -> Beat | None:
    """A rank of this folder's heartbeats whose process runs on this host yet: its pid alive
    and its heartbeat file mapped (a rank maps its own for its whole life; a pid reused since,
    or a rank on another host, does not). None if none."""
    for b in read(directory):
        if b.pid != os.getpid() and alive(b.pid) and _maps(b.pid, hb_path(directory, b.rank)):
            return b
    return None


def _maps(pid: int, path: Path) -> bool:
    try:
        return f" {path.resolve()}\n" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def behind_key(b: Beat | Ending) -> tuple[int, int, float]:
    """Furthest behind first: the lowest step, the earliest phase of it, the oldest heartbeat."""
    return b.step, PHASES.index(b.phase) if b.phase in PHASES else len(PHASES), b.time


def limit(phase: str, hang_after_s: float) -> float:
    if phase == AFTER_TRAINING:  # no process group left to hang in: its own work, however long
        return float("inf")
    return hang_after_s * (3 if phase in LONG_PHASES else 1)


UNSEEN_S = 60.0
"""A gap between two looks of the watch longer than this: it saw nothing meanwhile, and counts
the ranks' silence from its next look. (It looks every 0.2-3 s; a delivery to a server that
does not answer holds it up to one request's 10 s, as the first failure ends the attempt.)"""


class Watch:
    """``tick()`` from the delivery loop while the job runs; ``endings()`` once it is over."""

    def __init__(self, directory: Path, hang_after_s: float, host: str) -> None:
        self.directory, self.hang_after_s, self.host = directory, hang_after_s, host
        self.hang: list[Ending] | None = None
        self._due = 0.0
        self.since = time.time()  # (an earlier attempt's heartbeats are older)
        self._continued = 0.0  # when a paused rank (or this watch) last ran again
        self._looked = self.since

    def continued(self) -> None:
        """This process ran again after it was stopped (SIGCONT): the ranks' silence counts
        from now."""
        self._continued = time.time()

    def tick(self) -> None:
        now = time.time()
        if self.hang is not None or self.hang_after_s <= 0 or now < self._due:
            return
        if now - self._looked > UNSEEN_S:
            # The machine slept (or this process was stopped unseen): the heartbeats' age
            # since then is no hang's.
            self._continued = now
        self._due, self._looked = now + 1.0, now
        beats = read(self.directory)
        # A rank's script ended well (in this attempt): the others' work between steps is
        # their own now (rank 0's evaluation or save, its process group never destroyed),
        # however long; in a step's forward, backward or optimizer (uneven inputs: a peer's
        # all-reduce that never comes) it is still a hang.
        over = any(b.phase == "done" and b.time >= self.since for b in beats)
        live = [b for b in beats if b.phase not in ("done", "failed") and alive(b.pid)]
        if any(state(b.pid) in PAUSED for b in live):
            # Ctrl-Z on `ddplab run`, a study or reproduce, a debugger attached: a paused
            # rank beats no more, and its peers wait for it; none is late until a whole
            # hang_after_s after they run again (a 5-minute pause was killed as a hang).
            self._continued = now
            return
        watched = [b for b in live if not over or b.phase in IN_A_STEP]
        if any(now - max(b.time, self._continued) > limit(b.phase, self.hang_after_s)
               for b in watched):
            self.hang = self._stop(beats, live, now)

    def _stop(self, beats: list[Beat], live: list[Beat], now: float) -> list[Ending]:
        """Every live rank's stack, then an end to them; the endings say who stopped where."""
        collect_stacks(self.directory, live)
        behind = min(live, key=behind_key)
        endings = [Ending(b.rank, b.step, b.phase, b.time,
                          "stopped" if b is behind else "waits",
                          f"last heartbeat {now - b.time:.0f} s before the watch stopped the job",
                          self.host, *collectives(flight_path(self.directory, b.rank)))
                   for b in live]
        with contextlib.suppress(OSError):
            hang_path(self.directory).write_text(
                f"rank {behind.rank} stopped at step {behind.step} in {behind.phase} (no "
                f"heartbeat for {now - behind.time:.0f} s; dist.hang_after_s "
                f"{self.hang_after_s:g})")
        for b in live:
            try:
                os.kill(b.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        done = [self._ending(b) for b in beats if b not in live]
        return endings + [replace(e, dead_at_stop=1) if e.what == "died" else e for e in done]

    def endings(self) -> list[Ending]:
        """How each of this node's ranks ended (after the job), or the hang's picture. A rank
        still alive is not ended: a restarted attempt's (torchrun --max-restarts), not ours."""
        if self.hang is not None:
            return self.hang
        return [self._ending(b) for b in read(self.directory)
                if b.phase in ("done", "failed") or not alive(b.pid)]

    def still_running(self) -> list[Ending]:
        """This node's ranks alive yet when the job's rank 0 has ended (blocked in a collective
        with it until the launcher stops them): "waits", for the verdict only. They were named
        "reported nothing (their node lost?)" beside rank 0 on their own node."""
        if self.hang is not None:
            return []
        return [Ending(b.rank, b.step, b.phase, b.time, "waits", "", self.host)
                for b in read(self.directory) if b.phase not in ("done", "failed") and alive(b.pid)]

    def _ending(self, b: Beat) -> Ending:
        if b.phase == "failed":
            try:
                err = json.loads(error_path(self.directory, b.rank).read_text())
                return Ending(b.rank, err["step"], err["phase"], err["time"], "failed",
                              err["error"], self.host)
            except (OSError, ValueError, KeyError):
                return Ending(b.rank, b.step, b.phase, b.time, "failed", "", self.host)
        if b.phase == "done":
            return Ending(b.rank, b.step, b.phase, b.time, "done", "", self.host)
        why = _read(stopped_path(self.directory, b.rank))
        if why:  # how its supervisor saw it end: stopped by it (SIGTERM: a consequence, never
            # the cause), or gone before its script's end by itself (os._exit: a cause)
            return Ending(b.rank, b.step, b.phase, b.time, "failed", why, self.host)
        path = crash_path(self.directory, b.rank)
        crash = _read(path)
        when = b.time  # a silent death: its last heartbeat; a dump: when it was written
        if crash:
            with contextlib.suppress(OSError):
                when = path.stat().st_mtime
        return Ending(b.rank, b.step, b.phase, when, "died", crash, self.host)

    def release_shm(self, shm: Path = Path("/dev/shm")) -> int:
        """The ccl shared memory of this node's ranks that died outright (the watch's own SIGKILL
        after a hang, the OOM killer's), whose clean-up never ran (ccl.release_shm): 64 MB
        reserved each until reboot. Returns how many regions went. A rank that ended itself
        (done, failed) released its own at its last line (cli.entry), unless it was killed on
        its way there (its failure said, its launcher's SIGKILL after it): every rank's pid
        gone by now is looked at; only a live process's regions are its own yet."""
        from ..ccl import release_shm

        ranks = read(self.directory)
        # The ranks this watch SIGKILLed may still be exiting (a big process's exit takes a
        # while on a busy machine): alive then, their regions were kept (seen in CI).
        deadline = time.monotonic() + (EXIT_WAIT_S if self.hang is not None else 0.0)
        while any(alive(b.pid) for b in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        return sum(release_shm(shm, b.pid) for b in ranks if not alive(b.pid))

    def files(self) -> list[Path]:
        """The stacks, crash dumps and errors its ranks left (the run's forensics/)."""
        return sorted(p for pattern in ("rank-*.txt", "rank-*.flight-recorder.json")
                      for p in self.directory.glob(pattern) if p.stat().st_size)


def collect_stacks(directory: Path, ranks: list[Beat], wait_s: float = 5.0) -> None:
    """Every rank's stack (STACK_SIGNAL) and Flight Recorder (its FIFO), waited for together."""
    wanted = []
    for b in ranks:
        try:
            os.kill(b.pid, STACK_SIGNAL)
        except ProcessLookupError:
            continue
        wanted.append(stack_path(directory, b.rank))
        flight_path(directory, b.rank).unlink(missing_ok=True)  # a restarted attempt's
        if ask(fifo_path(directory, b.rank), DUMP):
            wanted.append(flight_path(directory, b.rank))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(p.exists() and p.stat().st_size for p in wanted):
        time.sleep(0.1)
    time.sleep(0.2)  # the last thread's lines


def collectives(path: Path) -> tuple[int, int, str]:
    """(entered, finished, waits_in) from a rank's Flight Recorder dump (PyTorch's JSON: the
    default group's ``pg_status`` and its entries); (-1, -1, "") without one."""
    try:
        fr = json.loads(path.read_text())
        status = fr["pg_status"]["0"]
        entered, finished = int(status["last_enqueued_collective"]), int(
            status["last_completed_collective"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1, -1, ""
    op = next((e.get("profiling_name", "") for e in reversed(fr.get("entries", []))
               if e.get("pg_id") == 0 and e.get("collective_seq_id") == entered), "")
    return entered, finished, op if entered > finished else ""


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


# ---- the verdict, from every node's endings ----

PEER_GONE = ("DistBackendError", "DistNetworkError", "Connection reset", "Connection closed",
             "Broken pipe")
"""What a rank's collective raises when a peer's process is gone (its connection broke)."""
SECONDARY = ("terminated by SIG", "killed by SIGTERM", "interrupted (SIGINT", *PEER_GONE,
             "timed out", "Timed out", "Timeout")
"""What a rank raises when it is stopped, or because another rank stopped: never a cause. The
one list for both kinds of job (ddplab's loop here, script mode's verdict in supervisor.py)."""


def is_secondary(error: str) -> bool:
    """Whether an error's first line is a consequence of another rank's end (SECONDARY)."""
    first = error.splitlines()[0] if error else ""
    return any(s in first for s in SECONDARY)


def raised_in_a_collective(traceback: str) -> bool:
    """Whether a traceback passes through torch.distributed: a peer's end, in words SECONDARY
    does not know (a transport's, gloo's enforce, a script's own re-raise of it), not an error
    a rank met by itself."""
    return "torch/distributed/" in traceback.replace("\\", "/")


def verdict(endings: list[Ending], world_size: int, now: float | None = None,
            hang_after_s: float = 0.0, here: Sequence[int] = ()) -> str:
    """The one line: who stopped or failed first, where, and what the others did. "" when no
    rank failed (every one done, or stopped by Ctrl-C). ``hang_after_s``: the job's, when
    known (no watch stopped a rank sooner after its last heartbeat). ``here``: the ranks of
    the node making the verdict (alive): one of them that reported nothing after another
    failed was stopped by the launcher before it could (it was still importing torch)."""
    # Each node's watch sees only its own ranks, and names one of them stopped: across nodes,
    # the rank behind is the one furthest behind of all (the others wait for it).
    hung = [e for e in endings if e.what in ("stopped", "waits")]
    failed = [e for e in endings if e.what in ("failed", "died")]
    missing = sorted(set(range(world_size)) - {e.rank for e in endings})
    lost = f"{_ranks(missing)} reported nothing (their node lost?)"
    stopped = [e for e in hung if e.what == "stopped"]
    # A rank that raised an error of its own (or crashed) before any watch could stop a rank
    # is the cause even when its peers then hung (on ccl across nodes a peer's end is no
    # error: they wait until their watch stops them). One that raised later may be an end it
    # saw, worded in a way SECONDARY does not know (a transport's error): the hang stays the
    # cause.
    acted = min((e.time for e in stopped), default=float("inf")) + hang_after_s
    # (KeyboardInterrupt: Ctrl-C reached every rank's script, which the run says itself as
    # KILLED; it is no rank's failure: "ranks 0,1 each failed (KeyboardInterrupt)" said so)
    raised = [e for e in failed if e.time < acted and (
        (e.what == "failed" and not is_secondary(e.detail)
         and not e.detail.startswith("KeyboardInterrupt")) or _crashed(e))]
    if stopped and not raised:
        # The rank the others waited for may have died: killed outright (the OOM killer) while
        # they wait in a collective that never ends (ccl), or aborted. Then its death is the cause.
        dead = [e for e in failed if e.what == "died" and e.dead_at_stop]
        behind = min(dead, key=_cause_order) if dead else min(hung + failed, key=behind_key)
        if behind.what != "died":
            return _hang_verdict(behind, hung, failed, now) + (f"; {lost}" if missing else "")
        causes = [behind]
    else:
        # (no watch acted: every raise; a crash is both)
        causes = list(dict.fromkeys(raised + [e for e in failed if e.what == "died"]))
    if not causes:
        # Only what ranks see of a peer's end: a node gone (its container killed), one rank
        # stopped from outside (a `kill` of its process), else a stop of the whole job
        # (Ctrl-C, scancel's SIGTERM to every rank), which the run says itself.
        if missing and failed:
            return f"{lost}; {_ranks(sorted(e.rank for e in failed))} stopped after it"
        return _one_stopped(failed)
    first = min(causes, key=_cause_order)
    # Every rank that failed the same way by itself (a bug that meets all of them: a NameError,
    # argparse's refusal) is a cause: none of them "stopped after" another.
    alike = [e for e in causes if _how(e) == _how(first)]
    # A rank that raised an error of its own, another than the first's, failed by itself too:
    # it did not stop after the first ("boom on rank 1" beside "boom on rank 0").
    also = sorted((e for e in causes if e not in alike and e.what == "failed"
                   and not raised_in_a_collective(e.detail)), key=lambda e: e.rank)
    after = sorted(e.rank for e in failed + hung if e not in alike and e not in also)
    who = (f"rank {first.rank} (host {first.host})" if len(alike) == 1 else
           f"{_ranks(sorted(e.rank for e in alike))} (host "
           f"{','.join(sorted({e.host for e in alike}))}) each")
    line = f"{who} {_how(first)} {where(first)}" + "".join(
        f"; rank {e.rank} (host {e.host}) also {_how(e)} {where(e)}" for e in also)
    quiet = [r for r in missing if r in here]
    missing = [r for r in missing if r not in here]
    lost = f"{_ranks(missing)} reported nothing (their node lost?)"
    after = sorted(after + quiet)
    if after:
        line += f"; {_ranks(after)} stopped after it"
    return line + (f"; {lost}" if missing else "")


def _one_stopped(failed: list[Ending]) -> str:
    """Some ranks stopped by a signal from outside (not the launcher's stop of them all), the
    others only saw them go: the first one stopped is what ended the job (its peers' closed
    connections said nothing of it). "" when every rank was stopped."""
    signalled = [e for e in failed if e.detail.startswith(("Terminated:", "terminated by SIG"))]
    if not signalled or len(signalled) == len(failed):
        return ""
    first = min(signalled, key=lambda e: e.time)
    after = sorted(e.rank for e in failed if e is not first)
    return (f"rank {first.rank} (host {first.host}) was stopped "
            f"({first.detail.splitlines()[0][:300]}) {where(first)} while no rank had failed; "
            f"{_ranks(after)} stopped after it")


def _cause_order(e: Ending) -> tuple[bool, float]:
    """The earliest cause first, but a silent death (SIGKILL: no dump, and its time only its
    last heartbeat) after any rank that raised or crashed. A rank blocked in a collective that
    its peer will never join runs no signal handler: its launcher's SIGTERM does nothing, and
    its SIGKILL 30 s later leaves a death timed before the peer's own error."""
    return e.what == "died" and not e.detail, e.time


def _hang_verdict(behind: Ending, hung: list[Ending], failed: list[Ending], now: float | None
                  ) -> str:
    """A hang: the rank furthest behind of all (``behind``), where the others wait, who ended
    after it. Each node's watch stops its own ranks, and which fires first is a race. A rank
    whose watch had not fired yet raises where it is when the hang's end reaches it: a peer's
    collective closed on it, or its launcher's SIGTERM once another node's job ended (or, blocked
    in a collective, its SIGKILL). Such a rank, when it is the furthest behind (asleep in its
    data, say), is the rank the others waited for."""
    line = _hang_line(behind, [e for e in hung if e is not behind], now)
    after = sorted(e.rank for e in failed if e is not behind)
    return line + (f"; {_ranks(after)} stopped after it" if after else "")


def where(e: Ending) -> str:
    """Where a rank was: "at step 7 in forward"; past a script's training, after which its
    phase said nothing true ("data loading" of a step that never came)."""
    if e.phase == AFTER_TRAINING:
        return f"after its training (step {e.step}, its process group destroyed)"
    return f"at step {e.step} in {e.phase}"


def _crashed(e: Ending) -> bool:
    """A rank that crashed of itself: a fatal signal with its stack (SIGSEGV, SIGBUS...). Not a
    death without one (SIGKILL: whoever sent it), nor an abort (a transport aborts a process
    whose peer is gone: a consequence as often as a cause)."""
    return e.what == "died" and bool(e.detail) and "Aborted" not in e.detail.splitlines()[0]


def _hang_line(stopped: Ending, waiting: list[Ending], now: float | None) -> str:
    # A rank its watch stopped: how long since its last heartbeat. One that raised when the
    # hang's end reached it: only where it was (the error's time is when it was ended).
    ago = (f"{(now or time.time()) - stopped.time:.0f} s ago" if stopped.what != "failed"
           else "(ended when the job stopped)")
    line = f"rank {stopped.rank} (host {stopped.host}) stopped {where(stopped)} {ago}"
    by_phase: dict[str, list[int]] = {}
    for e in waiting:
        by_phase.setdefault(WAITS_IN.get(e.phase, e.phase), []).append(e.rank)
    waits = "; ".join(f"{_ranks(sorted(r))} wait{'s' if len(r) == 1 else ''} in {p}"
                      for p, r in by_phase.items())
    return line + (f"; {waits}" if waits else "") + _never_entered([stopped, *waiting]) + \
        _uneven([stopped, *waiting])


def _uneven(ranks: list[Ending]) -> str:
    """Ranks in a collective of the script's own (its barrier after the loop) while others
    wait in a step's: one ran out of batches first (uneven data per rank, DDP's classic hang)."""
    own = sorted(e.rank for e in ranks if e.phase == OWN_COLLECTIVE)
    stepping = sorted(e.rank for e in ranks if e.phase in IN_A_STEP)
    if not own or not stepping:
        return ""
    return (f"; uneven data? {_ranks(own)} left {'its' if len(own) == 1 else 'their'} training "
            f"steps while {_ranks(stepping)} still {'waits' if len(stepping) == 1 else 'wait'} in "
            "one: give every rank as many batches, or train inside DDP's join()")


def _never_entered(ranks: list[Ending]) -> str:
    """What the Flight Recorder adds: the collective the waiting ranks are in, and the ranks
    that never entered it (where they are: the heartbeat's phase above)."""
    waiting = [e for e in ranks if e.waits_in]
    if not waiting:
        return ""
    seq = max(e.entered for e in waiting)
    absent = sorted(e.rank for e in ranks if 0 <= e.entered < seq)
    if not absent:
        return ""
    inside = sorted(e.rank for e in waiting if e.entered == seq)
    op = next(e.waits_in for e in waiting if e.entered == seq)
    return (f"; Flight Recorder: {_ranks(inside)} in collective #{seq} ({op}), which "
            f"{_ranks(absent)} never entered")


def _how(e: Ending) -> str:
    if e.what == "died":
        first = e.detail.splitlines()[0] if e.detail else ""
        signal_line = first.removeprefix("Fatal Python error: ") if first else ""
        return (f"died ({signal_line})" if signal_line else
                "died outright (killed by a signal: SIGKILL, or the OOM killer; or its code "
                "called os._exit)")
    if not e.detail:
        return "failed"
    lines = e.detail.splitlines()
    sample = next((line.removeprefix("ddplab: ") for line in lines
                   if line.startswith("ddplab: in sample ")), "")
    return f"failed ({lines[0][:300]}{'; ' + sample if sample else ''})"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


TAG_LIMIT = schema.TAG_LIMIT
"""Characters MLflow keeps of a tag's value: the endings' JSON is made to fit, never cut."""
CUT = " [...]"


def to_json(endings: list[Ending], limit: int = TAG_LIMIT) -> str:
    """The endings as JSON of at most ``limit`` characters, always whole: when they are longer
    (long tracebacks), each one's detail is shortened to the same length, its beginning kept
    (the line the verdict and diagnose show) and marked with CUT; a node with so many ranks that
    even no detail is too long leaves out the ranks that finished, then the last ones."""
    rows = [asdict(e) for e in endings]
    text = json.dumps(rows)
    if len(text) <= limit:
        return text

    def shortened(keep: int) -> str:
        return json.dumps([{**r, "detail": r["detail"] if len(r["detail"]) <= keep
                            else r["detail"][:keep] + CUT} for r in rows])

    lo, hi = 0, max(len(r["detail"]) for r in rows)
    while lo < hi:  # the longest detail that fits (not strictly monotonic: checked below)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(shortened(mid)) <= limit else (lo, mid - 1)
    text = shortened(lo)
    if len(text) <= limit:
        return text
    rows = sorted(({**r, "detail": ""} for r in rows), key=lambda r: r["what"] == "done")
    while rows and len(text := json.dumps(rows)) > limit:
        rows.pop()
    return text if rows else "[]"


FIELDS = {"rank": int, "step": int, "phase": str, "time": float, "what": str, "detail": str,
          "host": str, "entered": int, "finished": int, "waits_in": str, "dead_at_stop": int}
REQUIRED = ("rank", "step", "phase", "time", "what")


def from_json(text: str) -> list[Ending]:
    """The endings ``to_json`` wrote; ValueError (one line: what is wrong, where) for anything
    else: JSON cut or garbled, not a list, an ending without a required field or with one of
    the wrong type. Fields it does not know (a newer ddplab's) are ignored."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"a JSON {type(data).__name__}, not a list of endings")
    return [_ending_of(i, row) for i, row in enumerate(data)]


def _ending_of(i: int, row: object) -> Ending:
    if not isinstance(row, dict):
        raise ValueError(f"ending {i} is a JSON {type(row).__name__}, not an object")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise ValueError(f"ending {i} has no {', '.join(missing)}")
    fields: dict[str, Any] = {}
    for k, kind in FIELDS.items():
        if k not in row:
            continue
        v = row[k]
        ok = isinstance(v, (int, float) if kind is float else kind) and not isinstance(v, bool)
        if not ok:
            raise ValueError(f"ending {i}'s {k} is {json.dumps(v)[:40]}, not {kind.__name__}")
        fields[k] = float(v) if kind is float else v
    return Ending(**fields)
