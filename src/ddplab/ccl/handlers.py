"""Signal handlers around native code: what oneCCL's transport, Debian's libfabric, does to
them. It links Omni-Path's libinfinipath and libpsm2, which take SIGSEGV and the like when
loaded (a C backtrace, then exit(1)); its shared-memory transport takes SIGSEGV, SIGBUS, SIGTERM
and SIGINT to unlink its /dev/shm regions, then passes the signal to the handler before it.
Python's signal module sees none of them: these read and put back the C library's records.

Here, in ccl/, because the CPU image's build stage copies this package alone (with errors.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Iterable, Iterator

FATAL_SIGNALS = (signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL)
"""The signals faulthandler answers with the crashing thread's stack."""

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
        for sig, now in sigactions(kept).items():
            if handler(now) != handler(kept[sig]) and _omni_paths(now):
                put_back({sig: kept[sig]})


def without_omni_path() -> None:
    """Each fatal signal Omni-Path's libraries hold back to its default action: for code they
    were loaded by outside ``crash_handlers_kept`` (a script's own import of Intel's bindings),
    before a crash handler (faulthandler's) is set on top, which then passes a crash on to
    the signal's own end, not to their exit(1)."""
    for sig, now in sigactions(FATAL_SIGNALS).items():
        if _omni_paths(now):
            put_back({sig: ctypes.create_string_buffer(256)})  # zeros: SIG_DFL, no flags


def _omni_paths(record: ctypes.Array[ctypes.c_char]) -> bool:
    return any(lib in _library_of_handler(record) for lib in OMNI_PATH)


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


def _library_of_handler(record: ctypes.Array[ctypes.c_char]) -> str:
    """The file name of the library a sigaction record's handler is in ("" for SIG_DFL and
    SIG_IGN, or where the C library cannot say)."""
    address = handler(record)
    info = _DlInfo()
    try:
        if not address or address < 4096 or not ctypes.CDLL(None).dladdr(
                ctypes.c_void_p(address), ctypes.byref(info)):
            return ""
    except AttributeError:  # a C library without dladdr (glibc < 2.34 keeps it in libdl)
        return ""
    return os.path.basename((info.dli_fname or b"").decode(errors="replace"))
