"""Each rank's heartbeat: (step, phase, time, pid) in a 32-byte memory-mapped file beside its
node's spool, read by that node's delivery process (watch.py). A beat is a store into shared
memory: no system call, no network call, nothing on the training path that could block.

The rank also answers SIGUSR2 with every thread's Python stack (faulthandler, at C level, so
also while blocked in a collective), and a fatal signal (SIGSEGV, SIGABRT...) with its stack,
into files the watch collects. SIGUSR2, not SIGUSR1: Slurm's ``--signal`` and Lightning use
SIGUSR1 for their own warnings. And a byte written into its FIFO (``rank-R.flight-recorder.fifo``)
with PyTorch's Flight Recorder: the collectives this rank entered and finished. That one is a
thread, not a signal handler: a rank blocked in a collective never runs a Python signal handler,
but it does not hold the GIL either.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import mmap
import os
import signal
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

PHASES = ("setup", "data loading", "forward", "backward", "optimizer", "evaluation",
          "checkpoint", "done", "failed")
INDEX = {p: i for i, p in enumerate(PHASES)}
RECORD = struct.Struct("<qdiiii")  # step, time, phase, pid, rank, world size
STACK_SIGNAL = signal.SIGUSR2
FATAL_SIGNALS = (signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL)
"""The signals faulthandler answers with the crashing thread's stack."""


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
        self.directory, self.rank, self.world = directory, rank, world_size
        self.pid, self.step = os.getpid(), 0
        path = hb_path(directory, rank)
        path.write_bytes(b"\0" * RECORD.size)
        self._file = path.open("r+b")
        self._map = mmap.mmap(self._file.fileno(), RECORD.size)
        self._stacks: list[IO[str]] = []
        self._faulthandler_was_on = faulthandler.is_enabled()
        self._fifo: Path | None = None
        error_path(directory, rank).unlink(missing_ok=True)  # an earlier attempt's
        self.beat("setup")

    def beat(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        RECORD.pack_into(self._map, 0, self.step, time.time(), INDEX[phase], self.pid, self.rank,
                         self.world)

    def answer_stack_requests(self) -> None:
        """SIGUSR2 -> every thread's stack into rank-R.stack.txt; a fatal signal -> the stack
        into rank-R.crash.txt. (The files stay open: faulthandler writes from a signal handler.)"""
        stacks = stack_path(self.directory, self.rank).open("w")
        self._stacks.append(stacks)
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True, chain=False)
        self.record_crashes()

    def record_crashes(self) -> None:
        """A fatal signal (SIGSEGV...) -> the crashing process's stacks into rank-R.crash.txt,
        which the watch reads as how the rank died."""
        crash = crash_path(self.directory, self.rank).open("w")
        self._stacks.append(crash)
        # enable() on an enabled faulthandler only changes its file: a handler that native
        # code put in its place since (crash_handlers_kept) would stay.
        if faulthandler.is_enabled():
            faulthandler.disable()
        faulthandler.enable(file=crash, all_threads=True)

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


OMNI_PATH = ("libpsm", "libinfinipath")
"""Libraries whose fatal-signal handlers print a C backtrace and exit(1): Omni-Path's, which
Debian's libfabric links. Only their handlers are undone by ``crash_handlers_kept``."""


@contextlib.contextmanager
def crash_handlers_kept() -> Iterator[None]:
    """The fatal signals' handlers as they were before the native code run inside, where
    Omni-Path's libraries (OMNI_PATH) took them: Debian's libfabric (oneCCL's transport) links
    libinfinipath and libpsm2, which take SIGSEGV and the like when loaded. A rank that crashed
    then read as "died outright", its Python stack lost, faulthandler's handler gone. Other
    libraries' handlers stay: libfabric's shared-memory transport unlinks its /dev/shm regions
    on SIGSEGV, then passes the signal to the handler before it."""
    kept = sigactions(FATAL_SIGNALS)
    try:
        yield
    finally:
        libc = ctypes.CDLL(None)
        for sig, now in sigactions(kept).items():
            if handler(now) != handler(kept[sig]) \
                    and any(lib in _library_of_handler(libc, now) for lib in OMNI_PATH):
                put_back({sig: kept[sig]})


def sigactions(signals: Iterable[int]) -> dict[int, ctypes.Array[ctypes.c_char]]:
    """Each signal's handler as the C library holds it, its whole record as bytes (none where
    there is no C library to ask): a handler set in C (faulthandler's, libfabric's) too, which
    ``signal.getsignal`` does not see and ``signal.signal`` cannot put back."""
    try:
        sigaction = ctypes.CDLL(None).sigaction
    except (AttributeError, OSError):
        return {}
    records = {}
    for sig in signals:
        record = ctypes.create_string_buffer(256)  # larger than any C library's struct sigaction
        if sigaction(int(sig), None, record) == 0:
            records[int(sig)] = record
    return records


def handler(record: ctypes.Array[ctypes.c_char]) -> int:
    """The address of a sigaction record's handler, its first field (0: SIG_DFL, 1: SIG_IGN)."""
    return ctypes.c_void_p.from_buffer(record).value or 0


def put_back(records: dict[int, ctypes.Array[ctypes.c_char]]) -> None:
    """The handlers ``sigactions`` read, in place again."""
    if records:
        sigaction = ctypes.CDLL(None).sigaction
        for sig, record in records.items():
            sigaction(sig, record, None)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _library_of_handler(libc: ctypes.CDLL, record: ctypes.Array[ctypes.c_char]) -> str:
    """The file name of the library a sigaction record's handler is in ("" for SIG_DFL and
    SIG_IGN, or where the C library cannot say)."""
    address = handler(record)
    info = _DlInfo()
    try:
        if not address or address < 4096 or not libc.dladdr(ctypes.c_void_p(address),
                                                             ctypes.byref(info)):
            return ""
    except AttributeError:  # a C library without dladdr (glibc < 2.34 keeps it in libdl)
        return ""
    return os.path.basename((info.dli_fname or b"").decode(errors="replace"))


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

    step = 0

    def beat(self, phase: str, step: int | None = None) -> None: ...

    def failed(self, error: str) -> None: ...

    def close(self, phase: str = "done") -> None: ...


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


def beat(phase: str, step: int | None = None) -> None:
    _current.beat(phase, step)


def current_step() -> int:
    """The optimizer step this rank is working on (1-based, as its metrics are logged); 0
    before training or without a heartbeat. For code of your own that acts at a step (a fault
    injected on purpose, say), in the training process (not in DataLoader workers)."""
    return _current.step


def failed(error: str) -> None:
    _current.failed(error)


def stop(phase: str = "done") -> None:
    global _current
    _current.close(phase)
    _current = _Off()
