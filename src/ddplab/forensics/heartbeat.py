"""Each rank's heartbeat: (step, phase, time, pid) in a 32-byte memory-mapped file beside its
node's spool, read by that node's delivery process (watch.py). A beat is a store into shared
memory: no system call, no network call, nothing on the training path that could block.

The rank also answers STACK_SIGNAL (SIGRTMIN+5) with every thread's Python stack (faulthandler,
at C level, so also while blocked in a collective), and a fatal signal (SIGSEGV, SIGABRT...)
with its stack, into files the watch collects. A real-time signal, not SIGUSR1 or SIGUSR2:
Slurm's ``--signal``, Lightning and submitit install handlers of their own on those (a
script's requeue handler ran when the watch asked for its stacks, and no stack came). And a
byte written into its FIFO (``rank-R.flight-recorder.fifo``) with PyTorch's Flight Recorder:
the collectives this rank entered and finished. That one is a thread, not a signal handler: a
rank blocked in a collective never runs a Python signal handler, but it does not hold the GIL
either.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import mmap
import os
import signal
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ..ccl import handlers

AFTER_TRAINING = "after training"
"""A script's phase once it destroyed its process group (scriptmode/observe.py): its step is
its last."""
BETWEEN_STEPS = "data loading or other code between steps"
"""A script's phase between steps when no torch DataLoader fed them (scriptmode/observe.py):
its own iterator, or whatever else it does there; ddplab cannot tell which."""
OUTSIDE_LOADER = "its code between steps, outside its data loader"
"""A script's phase between steps, its DataLoader's ``next()`` not running (a metric's
all-reduce after the optimizer step, a checkpoint, a print): "data loading" is inside it."""
JOINING = "joining the process group"
"""A script's phase inside ``init_process_group`` (scriptmode/child.py): waiting there for the
other ranks, after its own set-up; a rank still in its set-up then is the one behind."""
OWN_COLLECTIVE = "a torch.distributed call of its own"
"""A script inside a collective it calls itself (scriptmode/child.py): a rank that ran out of
batches waits there while its peers wait in their step's gradient all-reduce."""
PHASES = ("setup", JOINING, "data loading", BETWEEN_STEPS, OUTSIDE_LOADER, "forward", "backward", "optimizer",
          "evaluation", "checkpoint", "done", "failed", AFTER_TRAINING, OWN_COLLECTIVE)
INDEX = {p: i for i, p in enumerate(PHASES)}
RECORD = struct.Struct("<qdiiii")  # step, time, phase, pid, rank, world size
STACK_SIGNAL = signal.SIGRTMIN + 5


def hb_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.hb"


def stack_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.stack.txt"


def crash_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.crash.txt"


def error_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.error.txt"


def flight_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.flight-recorder.json"


def fifo_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.flight-recorder.fifo"


def stopped_path(directory: Path, rank: int) -> Path:
    """How a rank's script ended, in the words its supervisor (script mode) writes here when the
    heartbeat cannot say: stopped by it ("terminated by SIGTERM: ..."; the watch then knows that
    death for a consequence), or gone by itself before its script's end (``os._exit``)."""
    return directory / f"rank-{rank}.stopped.txt"


def hang_path(directory: Path) -> Path:
    """Written by the node's watch before it SIGKILLs the ranks of a hang: what it saw, for the
    ranks' supervisors (script mode), whose script's end is otherwise a bare SIGKILL."""
    return directory / "hang.txt"


DUMP, QUIT = b"d", b"q"
"""What the watch (a dump) and the rank's own ending (quit) write into the FIFO."""


def ask(fifo: Path, request: bytes) -> bool:
    """One request into a rank's FIFO; False when nobody listens (the rank is gone)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader; ENOENT: never made
        return False
    try:
        os.write(fd, request)
    finally:
        os.close(fd)
    return True


class Heartbeat:
    """This rank's heartbeat file, mapped once; ``beat`` rewrites it in place."""

    def __init__(self, directory: Path, rank: int, world_size: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        _forget_ranks_past(directory, world_size)
        self.directory, self.rank, self.world = directory, rank, world_size
        self.pid, self.step, self.phase = os.getpid(), 0, ""
        path = hb_path(directory, rank)
        path.write_bytes(b"\0" * RECORD.size)
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), RECORD.size)
        self._stacks: list[IO[str]] = []
        self._faulthandler_was_on = faulthandler.is_enabled()
        self._crash: IO[str] | None = None
        self._fifo: Path | None = None
        error_path(directory, rank).unlink(missing_ok=True)  # an earlier attempt's
        self.beat("setup")

    def beat(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.phase = phase
        RECORD.pack_into(self._map, 0, self.step, time.time(), INDEX[phase], self.pid, self.rank,
                         self.world)

    def answer_stack_requests(self) -> None:
        """STACK_SIGNAL -> every thread's stack into rank-R.stack.txt; a fatal signal -> the stack
        into rank-R.crash.txt. (The files stay open: faulthandler writes from a signal handler.)"""
        stacks = stack_path(self.directory, self.rank).open("w")
        self._stacks.append(stacks)
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True, chain=False)
        self.record_crashes()

    def record_crashes(self) -> None:
        """A fatal signal (SIGSEGV...) -> the crashing process's stacks into rank-R.crash.txt,
        which the watch reads as how the rank died."""
        self._crash = crash_path(self.directory, self.rank).open("w")
        self._stacks.append(self._crash)
        self.crash_handler_on_top()

    def crash_handler_on_top(self) -> None:
        """faulthandler's dump the first handler of every fatal signal again, with no Omni-Path
        exit(1) behind it (ccl/handlers.py): native code loaded since may have put its own in
        its place. (enable() on an enabled faulthandler only changes its file: disabled first,
        it puts back the handler it found, and saves the one it finds now.)"""
        if self._crash is None:
            return
        if faulthandler.is_enabled():
            faulthandler.disable()
        handlers.without_omni_path()
        faulthandler.enable(file=self._crash, all_threads=True)

    def answer_flight_requests(self, records: Callable[[], bytes]) -> None:
        """DUMP in the FIFO -> ``records()`` (the Flight Recorder's JSON) into
        rank-R.flight-recorder.json; QUIT (this rank's own ending) ends the thread."""
        fifo = fifo_path(self.directory, self.rank)
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo, 0o600)
        self._fifo = fifo
        out = flight_path(self.directory, self.rank)
        threading.Thread(target=_serve, args=(fifo, out, records), daemon=True,
                         name="ddplab-flight-recorder").start()

    def failed(self, error: str) -> None:
        """This rank ends on an exception: where it was (phase, step) when it was raised, and
        the error, kept for the watch; then its phase says ``failed``."""
        step, _, phase, *_ = RECORD.unpack_from(self._map, 0)
        with contextlib.suppress(OSError):
            error_path(self.directory, self.rank).write_text(json.dumps(
                {"time": time.time(), "phase": PHASES[phase], "step": step, "error": error}))
        self.beat("failed")

    def close(self, phase: str = "done") -> None:
        self.beat(phase)
        if self._fifo is not None:
            ask(self._fifo, QUIT)
            self._fifo.unlink(missing_ok=True)
        with contextlib.suppress(ValueError, RuntimeError):
            faulthandler.unregister(STACK_SIGNAL)
            faulthandler.disable()
            if self._faulthandler_was_on:  # (pytest's, python -X faulthandler's) back on stderr
                faulthandler.enable()
        for f in self._stacks:
            f.close()
        self._map.close()
        self._file.close()


def _serve(fifo: Path, out: Path, records: Callable[[], bytes]) -> None:
    while True:
        try:
            with fifo.open("rb") as f:  # waits (without the GIL) for the watch or the ending
                request = f.read(1)
        except OSError:
            return
        if request != DUMP:
            return
        part = out.with_name(out.name + ".part")  # renamed whole: the watch never reads half
        try:
            part.write_bytes(records())
        except Exception as e:  # noqa: BLE001 - forensics must not end the rank; say why
            with contextlib.suppress(OSError):
                part.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        with contextlib.suppress(OSError):
            part.replace(out)


class _Off:
    """No heartbeat (untracked jobs, the one-process checks): every beat is nothing."""

    step, phase = 0, ""

    def beat(self, phase: str, step: int | None = None) -> None: ...

    def failed(self, error: str) -> None: ...

    def close(self, phase: str = "done") -> None: ...

    def crash_handler_on_top(self) -> None: ...


_current: Heartbeat | _Off = _Off()


def start(directory: Path, rank: int, world_size: int,
          flight_records: Callable[[], bytes] | None = None) -> None:
    """This rank's heartbeat, which ``beat()`` then writes (the loop calls it, not a handle).
    ``flight_records``: the Flight Recorder's JSON, asked for on a hang. A heartbeat that
    cannot be made (a full disk) is left off, saying so: it must never be what stops a job."""
    global _current
    try:
        hb = Heartbeat(directory, rank, world_size)
        hb.answer_stack_requests()
        if flight_records is not None:
            hb.answer_flight_requests(flight_records)
    except (OSError, ValueError) as e:
        from ..log import logger

        logger().warning(f"no heartbeat for this rank ({e}): a hang will not be named")
        return
    _current = hb


def _forget_ranks_past(directory: Path, world_size: int) -> None:
    """An earlier attempt's ranks that this one does not have (a failed 2-rank run resumed by
    one process): their files read as this attempt's, and its FINISHED run kept their failure
    as its verdict. (Ranks this attempt has write their own files over theirs.)"""
    import re

    for path in directory.glob("rank-*"):
        m = re.match(r"rank-(\d+)\.", path.name)
        if m and int(m.group(1)) >= world_size:
            with contextlib.suppress(OSError):
                path.unlink()


def beat(phase: str, step: int | None = None) -> None:
    _current.beat(phase, step)


def crash_handler_on_top() -> None:
    """This rank's crash dump set again over whatever native code took the fatal signals
    (Heartbeat.crash_handler_on_top); nothing without a heartbeat."""
    _current.crash_handler_on_top()


def current_step() -> int:
    """The optimizer step this rank is working on (1-based, as its metrics are logged); 0
    before training or without a heartbeat. For code of your own that acts at a step (a fault
    injected on purpose, say), in the training process (not in DataLoader workers)."""
    return _current.step


def current_phase() -> str:
    """The phase this rank last beat ("" without a heartbeat)."""
    return _current.phase


def failed(error: str) -> None:
    _current.failed(error)


def stop(phase: str = "done") -> None:
    global _current
    _current.close(phase)
    _current = _Off()
