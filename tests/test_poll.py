"""Unit: ddplab.poll, the one wait loop (servers, peers, files, a run's end)."""

import time

from ddplab.poll import poll


def test_poll_returns_the_first_truthy_answer_without_waiting_longer():
    answers = iter([None, 0, "", "ready", "later"])
    t0 = time.monotonic()
    assert poll(lambda: next(answers), timeout_s=30, interval_s=0.05) == "ready"
    assert time.monotonic() - t0 < 5


def test_poll_gives_up_at_its_deadline_and_asks_once_more_there():
    asked = []
    t0 = time.monotonic()
    assert poll(lambda: asked.append(time.monotonic()), timeout_s=0.3, interval_s=0.1) is None
    assert 0.3 <= time.monotonic() - t0 < 3 and asked[-1] - t0 >= 0.3 and len(asked) >= 3
    once = []
    assert poll(lambda: once.append(1), timeout_s=0) is None and once == [1]
