"""How ddplab starts a Python module of its own in a new process (a rank's script under its
supervisor, a node's delivery process, an orphaned run's watcher), tells whether a process still
runs, and names the temporary files a process leaves for the next one of its host to sweep."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []
"""python's -P (3.11+): nothing put first on sys.path for the file or module it runs."""


def python_m(module: str) -> list[str]:
    """``python -P -m MODULE``: without ``-P`` (Python 3.11+), ``-m`` puts the current directory
    first on ``sys.path``, and a user's ``random.py`` or ``json.py`` there (a stray file beside
    their data) is imported instead of the standard library's, breaking ddplab's own process
    where ``python train.py`` would never see it."""
    return [sys.executable, *SAFE_PATH, "-m", module]


def python_file(path: str) -> list[str]:
    """``python -P FILE``: without ``-P``, FILE's own directory would come first on
    ``sys.path``, ddplab's package directory where the file is one of ddplab's."""
    return [sys.executable, *SAFE_PATH, path]


def state(pid: int) -> str:
    """A process's state letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie...), "" once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its launcher, is not)."""
    return state(pid) not in ("", "Z", "X")


def own_temp(kind: str, *, folder: bool = False, suffix: str = "") -> Path:
    """A new file (or folder) in the temporary directory, ``ddplab-KIND-HOST-PID-RANDOM``, after
    removing those of this host's processes of the same kind that are gone without removing
    their own: a process killed outright (SIGKILL) cannot, and nothing else would (a hostile
    pass found a SIGKILLed script supervisor's report left in /tmp)."""
    mine = f"ddplab-{kind}-{socket.gethostname()}-"
    _sweep(mine)
    prefix = f"{mine}{os.getpid()}-"
    if folder:
        return Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix))
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
    os.close(fd)
    return Path(path)


def _sweep(mine: str) -> None:
    for left in Path(tempfile.gettempdir()).glob(f"{mine}*-*"):
        # exactly PID-RANDOM[.suffix] (mkstemp's RANDOM has no "-"): host node's sweep must not
        # read host node-12's file, ddplab-KIND-node-12-PID-RANDOM, as pid 12's
        pid, _, rest = left.name[len(mine):].partition("-")
        if pid.isdigit() and rest and "-" not in rest and not alive(int(pid)):
            if left.is_dir():
                shutil.rmtree(left, ignore_errors=True)
            else:  # (another user's, in a shared /tmp: theirs to remove)
                with contextlib.suppress(OSError):
                    left.unlink(missing_ok=True)
