"""How ddplab starts a Python module of its own in a new process (a rank's script under its
supervisor, a node's delivery process, an orphaned run's watcher)."""

from __future__ import annotations

import sys

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
