"""ddplab's messages to people, through :mod:`logging`: one logger per part (``ddplab``,
``ddplab.mpi``, ``ddplab.launch``, ``ddplab.bench``, a command's name), on stderr, in the
console format ddplab always had:

    [ddplab] epoch 1/2 ...                 progress (INFO)
    ddplab: warning: ...                   WARNING
    [rank 1] ddplab bench: error: ...      ERROR (the rank when the job has several)

Rank-aware: progress comes from global rank 0 only (every rank trains the same steps; N copies
of each line say nothing more), while warnings and errors come from every rank, named.
``DDPLAB_LOG_LEVEL`` (debug, info, warning, error) sets how much; an application that embeds
ddplab can add its own handlers to the ``ddplab`` logger.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def rank() -> int | None:
    """This process's global rank, when a launcher started it as one of several."""
    if os.environ.get("WORLD_SIZE", "2") == "1":
        return None
    for name in RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg] # subscripted only from 3.11
    """Always today's sys.stderr (a test, or an application, may replace it after start-up)."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # the base class sets it once; today's is read instead
        pass


def flush_std() -> None:
    """stdout and stderr flushed before a process ends by os._exit (nothing else would)."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class _Console(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        from .logins import mask

        who = record.name.replace(".", " ")
        text = mask(record.getMessage())  # no password of a URL reaches a console or a log
        if record.levelno < logging.WARNING:
            return f"[{who}] {text}"
        r = rank()
        where = f"[rank {r}] " if r is not None else ""
        return f"{where}{who}: {record.levelname.lower()}: {text}"


class _Rank0Progress(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or rank() in (None, 0)


LEVEL_SAID = "DDPLAB_LOGLEVEL_SAID"
"""Set once a bad DDPLAB_LOG_LEVEL was said: the processes the job starts inherit it."""


def _configure() -> logging.Logger:
    root = logging.getLogger("ddplab")
    if not root.handlers:
        handler = _Stderr()
        handler.setFormatter(_Console())
        handler.addFilter(_Rank0Progress())
        root.addHandler(handler)
        root.propagate = False  # an application's root handlers would print every line twice
        level = os.environ.get("DDPLAB_LOG_LEVEL", "info").upper()
        known = level in ("DEBUG", "INFO", "WARNING", "ERROR")
        root.setLevel(level if known else "INFO")
        # (a typo's silence read as the level working; said once a job: by rank 0, or the
        # process before any rank, not again by the processes it starts)
        if not known and rank() in (None, 0) and not os.environ.get(LEVEL_SAID):
            os.environ[LEVEL_SAID] = "1"
            root.warning(f"DDPLAB_LOG_LEVEL: got {os.environ['DDPLAB_LOG_LEVEL']!r}; allowed: debug, "
                         "info, warning, error (info used)")
    return root


def logger(part: str = "") -> logging.Logger:
    """The logger of a part of ddplab ("" for ddplab itself, "mpi", "launch", "bench", or a
    command's name: its errors read "ddplab <part>: error: ...")."""
    _configure()
    return logging.getLogger("ddplab" + (f".{part}" if part else ""))
