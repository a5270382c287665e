"""Script mode's verdict from every rank's report (supervisor._verdict): the cause, never a
consequence, with the one list of consequences both kinds of job use (forensics/watch.py)."""

from __future__ import annotations

from ddplab.forensics import watch
from ddplab.training.scriptmode import supervisor


def _o(rank: int, t: float, code: int = 0, why: str = "", stopped: str = "") -> dict:
    return {"rank": rank, "host": f"h{rank}", "code": code, "t": t, "failed": code != 0,
            "stopped": stopped, "why": why, "traceback": ""}


def test_a_rank_that_exits_0_early_is_the_cause_not_the_peer_left_waiting():
    outcomes = {0: _o(0, 12.0, 1, "DistBackendError: Connection closed by peer"), 1: _o(1, 10.0)}
    line = str(supervisor._verdict(outcomes, 2, None))
    assert line.startswith("the script failed: rank 1 (host h1) exited 0 before the job ended"), line


def test_a_rank_failing_by_itself_is_named_before_a_consequence_seen_earlier():
    outcomes = {0: _o(0, 10.0, 1, "RuntimeError: Connection reset by peer"),
                1: _o(1, 11.0, 1, "ValueError: bad batch")}
    assert "rank 1 (host h1): ValueError: bad batch" in str(supervisor._verdict(outcomes, 2, None))


def test_both_kinds_of_job_take_the_same_errors_for_consequences():
    for why in ("killed by SIGTERM", "DistNetworkError: x", "Connection closed by peer",
                "Timed out after 30 s", "terminated by SIGTERM"):
        assert watch.is_secondary(why) and supervisor._secondary({"why": why}), why
    assert not watch.is_secondary("ValueError: bad batch")
