"""Unit: ddplab.poll, the one wait loop (servers, peers, files, a run's end)."""

import time
from types import SimpleNamespace

from ddplab.poll import poll


def test_poll_returns_the_first_truthy_answer_without_waiting_longer():
    answers = iter([None, 0, "", "ready", "later"])
    t0 = time.monotonic()
    assert poll(lambda: next(answers), timeout_s=30, interval_s=0.05) == "ready"
    assert time.monotonic() - t0 < 5


def test_poll_gives_up_at_its_deadline_and_asks_once_more_there(monkeypatch):
    """On a clock of its own (a busy machine's late wake-ups would change how often it asked)."""
    now = [100.0]
    monkeypatch.setattr("ddplab.poll.time", SimpleNamespace(
        monotonic=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s)))
    asked: list[float] = []
    assert poll(lambda: asked.append(now[0]), timeout_s=1.0, interval_s=0.25) is None
    assert asked == [100.0, 100.25, 100.5, 100.75, 101.0]  # the last at the deadline
    once = []
    assert poll(lambda: once.append(1), timeout_s=0) is None and once == [1]
