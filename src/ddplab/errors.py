"""One base for every failure ddplab can name in one line.

The command line prints such an error as its one line and exits with its ``exit_code``: 2 for
bad input (a setting, a file, an argument, found before anything ran), 1 for a job or command
that failed. Anything else that escapes is a bug (ddplab's or the user's code's): it gets a
one-line summary, then its traceback (cli.py).
"""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class DdplabError(Exception):
    """A failure named in one line: what, where, and what to do."""

    exit_code: int = 1
    collective: bool = False
    """Every rank raises it alike (a check of what rank 0 read and sent): each node says it
    once (cli._train), not each rank."""


class BadInput(DdplabError):
    """Bad input, refused before anything ran: exit 2, like argparse."""

    exit_code = 2


NOTES = ("(raised as a result of ",)
"""Lines a library puts before what happened: SQLAlchemy's autoflush note ("(raised as a
result of Query-invoked autoflush; consider using a session.no_autoflush block ...)") above
"(sqlite3.OperationalError) database or disk is full"."""


def first_line(text: str, limit: int = 600) -> str:
    """A message's first line that says what happened (not a library's note before it), cut at
    ``limit`` characters with "..." (an unreachable server's line, its advice last, is ~400)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    first = next((ln for ln in lines if not ln.startswith(NOTES)), lines[0] if lines else "")
    return first if len(first) <= limit else first[:limit - 3] + "..."


def keep_ends(text: str, limit: int) -> str:
    """``text`` within about ``limit`` characters, in whole lines: its first quarter (a
    traceback's header and the script's own frames, where a deep library's stack would push them
    out of a tail) and its end (where it was raised), the lines between said to be left out."""
    if len(text) <= limit:
        return text
    lines = text.splitlines(keepends=True)
    head: list[str] = []
    while lines and sum(map(len, head)) + len(lines[0]) <= limit // 4:
        head.append(lines.pop(0))
    tail: list[str] = []
    while lines and sum(map(len, tail)) + len(lines[-1]) <= limit - limit // 4:
        tail.insert(0, lines.pop())
    if not tail and lines:  # the exception's own line, longer than the rest: its start, always
        last = lines.pop()
        tail = [last[:limit // 2] + f" [... {len(last) - limit // 2} characters left out ...]\n"]
    if not lines:
        return "".join(head + tail)
    return "".join(head) + f"  [... {len(lines)} lines left out ...]\n" + "".join(tail)


def chain(e: BaseException) -> list[BaseException]:
    """``e``, then what it was raised from or while handling, and so on, as python's traceback
    shows them: the reasons under a wrapper's error (``__cause__``; else ``__context__``, unless
    ``raise ... from None`` set it aside: an error that replaced the one it handled on purpose,
    a verdict raised on a signal)."""
    found: list[BaseException] = []
    seen: BaseException | None = e
    while seen is not None and all(seen is not c for c in found):  # (a chain may loop back)
        found.append(seen)
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    return found


def in_chain(e: BaseException, kind: type[E] | tuple[type[E], ...]) -> E | None:
    """The first exception of ``kind`` in ``e``'s chain."""
    return next((c for c in chain(e) if isinstance(c, kind)), None)
