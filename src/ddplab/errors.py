"""One base for every failure ddplab can name in one line.

The command line prints such an error as its one line and exits with its ``exit_code``: 2 for
bad input (a setting, a file, an argument, found before anything ran), 1 for a job or command
that failed. Anything else that escapes is a bug (ddplab's or the user's code's): it gets a
one-line summary, then its traceback (cli.py).
"""

from __future__ import annotations


class DdplabError(Exception):
    """A failure named in one line: what, where, and what to do."""

    exit_code: int = 1


class BadInput(DdplabError):
    """Bad input, refused before anything ran: exit 2, like argparse."""

    exit_code = 2
