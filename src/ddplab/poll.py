"""The one way ddplab waits for something outside it (a server, a peer, a file, a run's end):
ask, sleep, ask again until it holds or the deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(check: Callable[[], T], timeout_s: float, interval_s: float = 1.0) -> T | None:
    """``check()``'s first truthy result, or None once ``timeout_s`` has passed (it is asked
    once more at the deadline, so a timeout of 0 asks exactly once). ``timeout_s`` may be
    ``math.inf``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(interval_s, left))
