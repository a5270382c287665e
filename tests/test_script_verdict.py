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


def test_ranks_that_each_failed_the_same_way_are_all_the_cause_in_both_verdicts():
    """A bug that meets every rank (argparse's refusal, sys.exit(3), a NameError): each line
    named one of them and the other "stopped after it", and the two lines named different
    ranks (the report's time against the heartbeat's)."""
    outcomes = {0: _o(0, 10.1, 3, "SystemExit: 3"), 1: _o(1, 10.0, 3, "SystemExit: 3")}
    failed = supervisor._verdict(outcomes, 2, None)
    assert str(failed) == "the script failed on ranks 0,1 (host h0,h1): SystemExit: 3", failed
    assert failed is not None and failed.exit_code == 3
    endings = [watch.Ending(r, 17, "data loading", 10.0 + r / 10, "failed", "SystemExit: 3", "vm")
               for r in (0, 1)]
    assert watch.verdict(endings, 2) == \
        "ranks 0,1 (host vm) each failed (SystemExit: 3) at step 17 in data loading"
    # One of them failing differently: the earliest own failure, then the other's own error,
    # which it raised by itself (it did not stop "after" the first).
    outcomes[0] = _o(0, 10.1, 1, "ValueError: bad batch")
    assert str(supervisor._verdict(outcomes, 2, None)) == (
        "the script failed on rank 1 (host h1): SystemExit: 3; rank 0 (host h0): ValueError: "
        "bad batch also failed by itself")


def test_ranks_raising_their_own_errors_at_once_are_each_named_not_stopped_after_it():
    """Two ranks that each raised at once ("boom on rank 0", "boom on rank 1"): both verdicts
    said the second "stopped after" (or "failed or were stopped" after) the first."""
    endings = [watch.Ending(r, 3, "forward", 10.0 + r / 100, "failed",
                            f"RuntimeError: boom on rank {r}\n\ntrace", "vm") for r in (0, 1)]
    endings.append(watch.Ending(2, 3, "backward", 10.5, "failed", "killed by SIGTERM", "vm"))
    assert watch.verdict(endings, 3) == (
        "rank 0 (host vm) failed (RuntimeError: boom on rank 0) at step 3 in forward; rank 1 "
        "(host vm) also failed (RuntimeError: boom on rank 1) at step 3 in forward; rank 2 "
        "stopped after it")
    # A rank whose error came out of a collective (a peer's end in words the list of
    # consequences does not know, a script's own re-raise of it) still stopped after it.
    gloo = "RuntimeError: [enforce fail at ../gloo/transport/tcp/pair.cc:446] op.preamble.length"
    trace = f'  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py", line 9\n{gloo}'
    endings[1] = watch.Ending(1, 3, "backward", 10.01, "failed", f"{gloo}\n\n{trace}", "vm")
    assert watch.verdict(endings, 3).endswith("; ranks 1,2 stopped after it")
    outcomes = {r: _o(r, 10.0 + r / 100, 1, f"RuntimeError: boom on rank {r}") for r in (0, 1)}
    outcomes[2] = _o(2, 10.5, -15, "killed by SIGTERM")
    assert str(supervisor._verdict(outcomes, 3, None)) == (
        "the script failed on rank 0 (host h0): RuntimeError: boom on rank 0; rank 1 (host h1): "
        "RuntimeError: boom on rank 1 also failed by itself; then rank(s) 2 failed or were "
        "stopped")
    outcomes[1] = {**_o(1, 10.01, 1, gloo), "traceback": trace}
    assert str(supervisor._verdict(outcomes, 3, None)).endswith("then rank(s) 1,2 failed or were stopped")


def test_both_kinds_of_job_take_the_same_errors_for_consequences():
    for why in ("killed by SIGTERM", "DistNetworkError: x", "Connection closed by peer",
                "Timed out after 30 s", "terminated by SIGTERM"):
        assert watch.is_secondary(why) and supervisor._secondary({"why": why}), why
    assert not watch.is_secondary("ValueError: bad batch")


# faulthandler's dump of a rank asked for its stack while it was already unwinding its own
# exception (formatting the traceback, which imports): none of the script's frames (seen in CI).
UNWINDING = '''Thread 0x00007f01 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait

Current thread 0x00007f00 (most recent call first):
  File "<frozen importlib._bootstrap_external>", line 147 in _path_stat
  File "<frozen importlib._bootstrap>", line 1178 in _find_and_load
  File "/repo/src/ddplab/training/scriptmode/child.py", line 170 in _run
'''
WAITING = '''Current thread 0x00007f00 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 4800 in barrier
  File "/work/faulty.py", line 14 in <module>
  File "<frozen runpy>", line 88 in _run_code
'''
RAISED = '''Traceback (most recent call last):
  File "/work/faulty.py", line 12, in <module>
    loss.backward()
  File "/venv/torch/_tensor.py", line 625, in backward
RuntimeError: Connection closed by peer
'''


def test_a_stopped_rank_is_placed_in_its_script_even_when_asked_while_unwinding(tmp_path):
    def where(stack: str, traceback: str) -> str:
        (tmp_path / "stack.txt").write_text(stack)
        rank = type("Rank", (), {"stack_file": tmp_path / "stack.txt",
                                 "file": tmp_path / "faulty.py"})()
        return supervisor.Script.where(rank, traceback)

    assert where(WAITING, RAISED) == "faulty.py:14 in <module>"  # where it waited: its stack
    assert where(UNWINDING, RAISED) == "faulty.py:12 in <module>"  # where it raised
    assert where(UNWINDING, "") == "<frozen importlib._bootstrap_external>:147 in _path_stat"


def test_a_store_gone_while_the_script_runs_is_one_line_not_a_traceback():
    """torchrun killed outright (kill -9) takes its agent's store with it: each rank's
    supervisor printed 'unexpected DistNetworkError: Broken pipe' and its traceback. The store
    here is a real TCPStore served by a process that is then killed."""
    import datetime
    import subprocess
    import sys
    from types import SimpleNamespace

    import pytest
    import torch.distributed as dist

    from ddplab.training.scriptmode.meeting import LauncherGone, Meeting

    from .helpers import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", (
        "import datetime, time, torch.distributed as d\n"
        f"s = d.TCPStore('127.0.0.1', {port}, 2, True, datetime.timedelta(seconds=30), "
        "wait_for_workers=False)\nprint('up', flush=True)\ntime.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        meeting = Meeting.__new__(Meeting)
        meeting.le = SimpleNamespace(world_size=2, rank=1, is_rank0=False)
        meeting.hosts_store = False
        meeting.store = dist.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=5))
        assert meeting.peer_failed() is False
    finally:
        server.kill()
        server.wait()
    with pytest.raises(LauncherGone) as gone:
        meeting.peer_failed()
    assert str(gone.value).startswith("the launcher is gone (the store the ranks meet through")
    assert "\n" not in str(gone.value)
    meeting.report({"rank": 1, "failed": True})  # nobody to tell: no error of its own
    meeting.leave()


def test_a_failures_line_has_no_terminal_colour_codes():
    """rich's and loguru's errors carry colour codes: they went raw into the run's tags and
    the verdict (``\\x1b[31m``)."""
    from ddplab.training.scriptmode.child import one_line

    assert one_line(ValueError("\x1b[1;31mbad batch\x1b[0m at step 5")) == \
        "ValueError: bad batch at step 5"
