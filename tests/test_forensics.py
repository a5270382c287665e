"""A job that hangs or dies names the rank, host, phase and step in its run, with every rank's
stack (forensics/): heartbeats, the node's watch in the delivery process, the verdict, and
`ddplab diagnose`. End to end: a user's experiment (tests/data/faulty/) that goes wrong on
purpose on rank 1 at one step, under real torchrun with 2 ranks."""

from __future__ import annotations

import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddplab.forensics.watch import Ending, verdict
from tests.conftest import job_env, runs
from tests.helpers import faulty_experiment, left_behind, omni_path_library, shm_regions

BIN = Path(sys.executable).parent
HOST = socket.gethostname()


def run_faulty(tmp_path: Path, store: str, fault: str, where: str = "data", step: int = 5,
               *extra: str):
    exp = faulty_experiment(tmp_path)
    t0 = time.monotonic()
    out = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "ddplab",
                          "train", str(exp), "--set", f"checkpoint.dir={tmp_path / 'ck'}", *extra],
                         cwd=tmp_path, env=job_env(store, FAULT=fault, FAULT_WHERE=where,
                                                   FAULT_STEP=str(step)),
                         capture_output=True, text=True, timeout=300)
    (run,) = runs(store)
    return out, run, time.monotonic() - t0


@pytest.mark.e2e
def test_a_rank_asleep_in_its_dataset_is_named_with_every_ranks_stack_before_the_timeout(
        tmp_path, store):
    out, run, took = run_faulty(tmp_path, store, "sleep", step=7)
    assert out.returncode != 0 and run.info.status == "FAILED", out.stderr[-3000:]
    # The whole job (imports, start-up, 7 steps) included: far below the 300 s a hang would take.
    assert took < 8 + 120, f"{took:.0f} s: not within dist.hang_after_s + 120 (timeout_s is 300)"
    error = run.data.tags["ddplab.error"]
    assert error.startswith(f"rank 1 (host {HOST}) stopped at step 7 in data loading "), error
    # The Flight Recorder (gloo's, read through the rank's FIFO while it waits in the
    # collective) names the all-reduce rank 0 is in, and rank 1 as the one that never entered it.
    assert re.search(r"; rank 0 waits in backward \(gradient all-reduce\); Flight Recorder: rank 0 "
                     r"in collective #\d+ \(gloo:all_reduce\), which rank 1 never entered$",
                     error), error
    assert run.data.tags["ddplab.verdict"] == error
    from mlflow import MlflowClient

    client = MlflowClient(store)
    stacks = {a.path for a in client.list_artifacts(run.info.run_id, "forensics/node0")}
    assert {"forensics/node0/rank-0.stack.txt", "forensics/node0/rank-1.stack.txt",
            "forensics/node0/rank-0.flight-recorder.json",
            "forensics/node0/rank-1.flight-recorder.json"} <= stacks
    rank1 = Path(client.download_artifacts(run.info.run_id, "forensics/node0/rank-1.stack.txt",
                                           str(tmp_path))).read_text()
    assert "in go_wrong" in rank1 and "in __getitem__" in rank1, rank1  # where it sleeps
    diag = subprocess.run([str(BIN / "ddplab"), "diagnose", run.info.run_id], cwd=tmp_path,
                          env=job_env(store), capture_output=True, text=True, timeout=120)
    assert diag.returncode == 0 and f"verdict: {error}" in diag.stdout, diag.stdout + diag.stderr
    assert "forensics/node0/rank-1.stack.txt" in diag.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("fault, how", [
    ("segv", r"died \(Segmentation fault\)"),
    ("raise", r"failed \(ValueError: sample broken on purpose at step 5; in sample \d+ of the "
              r"training set\)")], ids=["segv", "raise"])
def test_the_rank_that_failed_first_is_the_runs_error_not_what_the_others_saw(
        tmp_path, store, fault, how):
    out, run, _ = run_faulty(tmp_path, store, fault)
    assert out.returncode != 0 and run.info.status == "FAILED", out.stderr[-3000:]
    error = run.data.tags["ddplab.error"]
    assert re.match(rf"rank 1 \(host {re.escape(HOST)}\) {how} at step 5 in data loading", error), error
    assert "rank 0 stopped after it" in error or "ddplab.error.rank0" in run.data.tags, error


@pytest.mark.e2e
def test_a_rank_50_ms_slower_every_step_is_named_the_straggler_in_a_finished_run(tmp_path, store):
    out, run, _ = run_faulty(tmp_path, store, "slow", where="forward")
    assert out.returncode == 0 and run.info.status == "FINISHED", out.stderr[-3000:]
    named = run.data.tags.get("ddplab.straggler", "")
    assert named.startswith(f"rank 1 (host {HOST}) is a straggler: "), named
    assert f"warning: {named}" in out.stderr
    from mlflow import MlflowClient

    busy = {r: [m.value for m in MlflowClient(store).get_metric_history(
        run.info.run_id, f"train/rank{r}_busy_s")] for r in (0, 1)}
    # The 50 ms are rank 1's, every interval; rank 0's is a typical one (a loaded machine may
    # deschedule it now and then).
    assert min(busy[1]) > 0.05 > statistics.median(busy[0]), busy


def test_a_missing_beat_file_changes_nothing_and_a_clean_job_has_no_verdict():
    done = [Ending(r, 9, "done", 1.0, "done", host="h") for r in range(2)]
    assert verdict(done, 2) == ""
    ctrl_c = [Ending(r, 3, "forward", 1.0 + r, "failed", "interrupted (SIGINT / Ctrl-C)", "h")
              for r in range(2)]
    assert verdict(ctrl_c, 2) == ""  # a stop, not a failure: the run says KILLED itself
    # A script's ranks, Ctrl-C raising KeyboardInterrupt in each: "each failed" said so.
    scripts = [Ending(r, 3, "forward", 1.0 + r, "failed", "KeyboardInterrupt", "h")
               for r in range(2)]
    assert verdict(scripts, 2) == ""


def test_the_first_real_failure_is_the_cause_and_a_peers_sigterm_is_not():
    endings = [
        Ending(0, 5, "backward", 10.0, "failed", "Terminated: terminated by SIGTERM (a peer ...)", "a"),
        Ending(1, 5, "forward", 11.0, "failed", "RuntimeError: CUDA out of memory\n\ntrace", "a"),
        Ending(2, 5, "backward", 9.0, "failed", "RuntimeError: Connection reset by peer", "b"),
        Ending(3, 5, "backward", 12.0, "done", "", "b")]
    assert verdict(endings, 4) == ("rank 1 (host a) failed (RuntimeError: CUDA out of memory) at "
                                   "step 5 in forward; ranks 0,2 stopped after it")


def test_a_hang_across_nodes_names_the_rank_behind_and_who_waits_where():
    """Each node's watch names the rank furthest behind OF ITS OWN stopped (node-1's rank 0
    here, the compose job's case): the verdict ranks them over all nodes."""
    endings = [Ending(0, 37, "backward", 100.0, "stopped", "", "node-1"),
               Ending(1, 37, "data loading", 95.0, "stopped", "", "node-2"),
               Ending(2, 37, "backward", 100.5, "waits", "", "node-2"),
               Ending(3, 37, "backward", 100.2, "waits", "", "node-1")]
    assert verdict(endings, 4, now=235.0) == (
        "rank 1 (host node-2) stopped at step 37 in data loading 140 s ago; ranks 0,2,3 wait in "
        "backward (gradient all-reduce)")
    # With their Flight Recorders: ranks 0,2,3 in collective 75, which rank 1 never entered.
    fr = {0: (75, 74, "gloo:all_reduce"), 1: (74, 74, ""), 2: (75, 74, "gloo:all_reduce"),
          3: (75, 74, "gloo:all_reduce")}
    endings = [Ending(e.rank, e.step, e.phase, e.time, e.what, e.detail, e.host, *fr[e.rank])
               for e in endings]
    assert verdict(endings, 4, now=235.0).endswith(
        "backward (gradient all-reduce); Flight Recorder: ranks 0,2,3 in collective #75 "
        "(gloo:all_reduce), which rank 1 never entered")


def test_a_hang_whose_peer_failed_when_the_rank_behind_was_ended_names_both():
    """Node 1's watch ends rank 1 (stopped in its dataset) before node 0's watch fires: rank 0's
    all-reduce then fails on the closed connection (CI saw the line name rank 1 alone)."""
    endings = [Ending(0, 7, "backward", 101.0, "failed",
                      "RuntimeError: [gloo] Connection closed by peer", "node-1"),
               Ending(1, 7, "data loading", 90.0, "stopped", "", "node-2")]
    assert verdict(endings, 2, now=100.0) == (
        "rank 1 (host node-2) stopped at step 7 in data loading 10 s ago; rank 0 stopped after it")
    assert verdict(endings[1:], 3, now=100.0).endswith(
        "10 s ago; ranks 0,2 reported nothing (their node lost?)")


def test_a_hang_whose_rank_behind_was_ended_by_its_launcher_still_names_it_behind():
    """The other order: node 1's watch fires first and stops rank 0 (in backward), its job ends,
    and node 2's launcher SIGTERMs rank 1, asleep in its data, before node 2's watch fires. Rank
    1 is still the rank the other waited for; the line said rank 0 stopped, rank 1 after it."""
    endings = [Ending(0, 7, "backward", 90.5, "stopped", "", "node-1"),
               Ending(1, 7, "data loading", 101.0, "failed",
                      "Terminated: terminated by SIGTERM (its launcher ...)", "node-2")]
    assert verdict(endings, 2, now=102.0) == (
        "rank 1 (host node-2) stopped at step 7 in data loading (ended when the job stopped); "
        "rank 0 waits in backward (gradient all-reduce)")


def test_a_rank_that_raised_is_the_cause_even_when_its_peer_then_hung():
    """On ccl across nodes a peer's end is no error: rank 0 waits until its watch stops it.
    The rank that raised is the cause; the one its watch stopped, stopped after it."""
    endings = [Ending(0, 7, "backward", 90.5, "stopped", "", "node-1"),
               Ending(1, 7, "forward", 90.0, "failed", "ValueError: bad sample 17\n\ntrace",
                      "node-2")]
    assert verdict(endings, 2, now=200.0, hang_after_s=8) == (
        "rank 1 (host node-2) failed (ValueError: bad sample 17) at step 7 in forward; rank 0 "
        "stopped after it")


def test_an_error_raised_after_a_watch_stopped_the_rank_behind_is_not_the_cause():
    """A transport's words for a peer's end that SECONDARY does not know (oneCCL's, say),
    raised once node 2's watch had stopped rank 1 (its heartbeat 8 s old or more): the hang is
    the cause, as when the error is a known one."""
    endings = [Ending(0, 7, "backward", 99.0, "failed",
                      "RuntimeError: oneCCL: ofi.cpp:212 fi_cq_readerr: Transport endpoint", "n1"),
               Ending(1, 7, "data loading", 90.0, "stopped", "", "n2")]
    assert verdict(endings, 2, now=100.0, hang_after_s=8) == (
        "rank 1 (host n2) stopped at step 7 in data loading 10 s ago; rank 0 stopped after it")


def test_a_rank_killed_outright_while_blocked_is_not_the_cause_of_its_peers_error():
    """Rank 1 raises at 100.0; rank 0, blocked in an all-reduce since 99.8 (ccl: its peer's end
    is no error), cannot run its SIGTERM handler, so torchrun SIGKILLs it 30 s later: a death
    without a dump, timed by its last heartbeat, before rank 1's error. Rank 1 is the cause."""
    endings = [Ending(0, 7, "backward", 99.8, "died", "", "a"),
               Ending(1, 7, "forward", 100.0, "failed", "ValueError: bad sample 17\n\ntrace", "a")]
    assert verdict(endings, 2) == ("rank 1 (host a) failed (ValueError: bad sample 17) at step 7 "
                                   "in forward; rank 0 stopped after it")
    # A crash with its dump keeps its time: a SIGSEGV before the error is the cause.
    crashed = [Ending(0, 7, "backward", 99.8, "died", "Fatal Python error: Segmentation fault", "a"),
               endings[1]]
    assert verdict(crashed, 2).startswith("rank 0 (host a) died (Segmentation fault) at step 7")


def test_a_rank_that_died_while_its_peer_hung_is_the_cause():
    """On ccl a peer's death is no error: rank 0 waits in its all-reduce until its node's watch
    stops it (the watch, 9 s after rank 0's last beat, finds rank 1 dead). A crash with its
    dump, or a death without one where rank 1 was behind, is the cause, not rank 0's hang."""
    stopped = Ending(0, 5, "backward", 100.0, "stopped", "last heartbeat 9 s before", "vm")
    segv = Ending(1, 5, "data loading", 99.9, "died", "Fatal Python error: Segmentation fault\n\n"
                  "Current thread (most recent call first):", "vm")
    assert verdict([stopped, segv], 2, now=120.0, hang_after_s=8) == (
        "rank 1 (host vm) died (Segmentation fault) at step 5 in data loading; rank 0 stopped "
        "after it")
    oom = Ending(1, 5, "data loading", 99.9, "died", "", "vm")
    assert verdict([stopped, oom], 2, now=120.0, hang_after_s=8) == (
        "rank 1 (host vm) died outright (killed by a signal: SIGKILL, or the OOM killer; or its code "
        "called os._exit) at step 5 "
        "in data loading; rank 0 stopped after it")


def test_a_rank_killed_while_it_waited_for_the_rank_behind_is_named_after_the_hang():
    """Rank 1 asleep in its data on node 2 is stopped by its watch; rank 0, blocked in the
    all-reduce on node 1, was SIGKILLed by its launcher once node 2's job ended (no dump, its
    last beat in backward): the hang is the cause, rank 0 named after it."""
    endings = [Ending(0, 7, "backward", 91.0, "died", "", "n1"),
               Ending(1, 7, "data loading", 90.0, "stopped", "", "n2")]
    assert verdict(endings, 2, now=100.0, hang_after_s=8) == (
        "rank 1 (host n2) stopped at step 7 in data loading 10 s ago; rank 0 stopped after it")


def test_a_lost_node_is_the_cause_when_the_others_only_saw_it_go():
    endings = [Ending(0, 9, "backward", 10.0, "failed", "RuntimeError: Connection reset by peer", "a"),
               Ending(1, 9, "backward", 10.5, "failed", "Terminated: terminated by SIGTERM", "a")]
    assert verdict(endings, 4) == ("ranks 2,3 reported nothing (their node lost?); ranks 0,1 "
                                   "stopped after it")


def test_a_node_that_reports_nothing_is_named():
    endings = [Ending(0, 5, "data loading", 10.0, "died", "", "a"),
               Ending(1, 5, "backward", 12.0, "failed", "Terminated: terminated by SIGTERM", "a")]
    line = verdict(endings, 4)
    assert line.startswith("rank 0 (host a) died outright (killed by a signal") and \
        line.endswith("; rank 1 stopped after it; ranks 2,3 reported nothing (their node lost?)"), line


def test_a_rank_of_the_verdicts_own_node_that_said_nothing_was_stopped_not_lost(monkeypatch):
    """A hostile pass: rank 0 failed in argparse while rank 1, on the same host, was still
    importing torch; torchrun stopped it before its first heartbeat, and the verdict said
    "rank 1 reported nothing (their node lost?)". The node making the verdict is alive: its
    own ranks (torchrun's numbering: GROUP_RANK x LOCAL_WORLD_SIZE on) were stopped after it;
    another node's silent ranks may still be lost."""
    from ddplab.agent.postmortem import _ranks_here

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "0")
    here = _ranks_here(4)
    endings = [Ending(0, 1, "setup", 10.0, "failed", "SystemExit: 2", "a")]
    assert (here, verdict(endings, 4, here=here)) == ([0, 1], (
        "rank 0 (host a) failed (SystemExit: 2) at step 1 in setup; rank 1 stopped after it; "
        "ranks 2,3 reported nothing (their node lost?)"))
    monkeypatch.delenv("GROUP_RANK")  # (another launcher: nothing known of the nodes)
    assert _ranks_here(4) == [] and verdict(endings, 2, here=[]).endswith(
        "; rank 1 reported nothing (their node lost?)")


def _until_the_watch_stops(watch, rank: subprocess.Popen):
    """The watch ticking until it sees the hang; then the hung rank has been SIGKILLed (a rank
    in a collective hears nothing else)."""
    deadline = time.monotonic() + 60
    while watch.hang is None:
        assert time.monotonic() < deadline and rank.poll() is None, "no hang seen"
        watch.tick()
        time.sleep(0.2)
    assert rank.wait(timeout=30) == -9
    return watch


def test_the_watch_takes_a_stuck_ranks_stack_then_ends_it(tmp_path):
    """A real process beating as rank 1, then stuck in a loop: past hang_after_s the watch has
    its stack (STACK_SIGNAL, answered at C level while Python spins) and its flight records (the
    heartbeat's thread, which gets the GIL from the spinning loop), then SIGKILLs it."""
    from ddplab.forensics.watch import Watch

    records = {"pg_status": {"0": {"last_enqueued_collective": "9", "last_completed_collective": "8"}},
               "entries": [{"pg_id": 0, "collective_seq_id": 9, "profiling_name": "gloo:broadcast"}]}
    shm = tmp_path / "shm"  # /dev/shm's stand-in: the rank's ccl region, and a live process's
    shm.mkdir()
    (shm / f"{os.getpid()}:0:0").write_bytes(b"x")
    code = ("import json, os, sys\nfrom pathlib import Path\nfrom ddplab.forensics import heartbeat\n"
            f"Path({str(shm)!r}, f'{{os.getpid()}}:0:0').write_bytes(b'x')\n"
            f"heartbeat.start(Path({str(tmp_path)!r}), 1, 2, lambda: json.dumps({records!r}).encode())\n"
            "heartbeat.beat('data loading', 3)\n"
            "heartbeat.beat('forward')\n"
            "def stuck_in_the_forward():\n    while True:\n        pass\nstuck_in_the_forward()\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    watch = _until_the_watch_stops(Watch(tmp_path, hang_after_s=1.0, host="h"), proc)
    (ending,) = watch.endings()
    assert (ending.rank, ending.step, ending.phase, ending.what) == (1, 3, "forward", "stopped")
    assert (ending.entered, ending.finished, ending.waits_in) == (9, 8, "gloo:broadcast")
    stack = (tmp_path / "rank-1.stack.txt").read_text()
    assert "in stuck_in_the_forward" in stack, stack
    assert verdict(watch.endings(), 1).startswith("rank 1 (host h) stopped at step 3 in forward ")
    # The killed rank's libfabric region goes with it (its own clean-up never ran); not others'.
    assert watch.release_shm(shm) == 1
    assert [p.name for p in shm.iterdir()] == [f"{os.getpid()}:0:0"]


def test_a_rank_killed_after_saying_its_failure_has_its_shm_released_a_live_ones_kept(tmp_path):
    """A rank that failed by itself releases its ccl region at its last line; one killed on its
    way there (its failure said, then its launcher's SIGKILL on a busy machine) left its 64 MB
    region behind (CI: one region left after a hung ccl job). Every gone rank's regions go;
    a live process's, and another process's, stay."""
    from ddplab.forensics.watch import Watch

    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / f"{os.getpid()}:0:0").write_bytes(b"x")  # a live process's: never touched
    code = ("import os, time\nfrom pathlib import Path\nfrom ddplab.forensics import heartbeat\n"
            f"Path({str(shm)!r}, f'{{os.getpid()}}:0:0').write_bytes(b'x')\n"
            f"heartbeat.start(Path({str(tmp_path)!r}), 1, 2)\n"
            "heartbeat.beat('forward', 4)\nheartbeat.failed('RuntimeError: boom')\n"
            "print('said', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "said\n"
    watch = Watch(tmp_path, hang_after_s=60.0, host="h")
    assert watch.release_shm(shm) == 0  # alive yet: its own
    proc.kill()
    proc.wait()
    ((ending,),) = {tuple(watch.endings())}
    assert (ending.rank, ending.what) == (1, "failed")
    assert watch.release_shm(shm) == 1
    assert [p.name for p in shm.iterdir()] == [f"{os.getpid()}:0:0"]


def test_a_script_past_its_process_group_is_no_hang_however_long_its_own_work(tmp_path):
    """After a script destroyed its process group (its evaluation on rank 0, a long save), no
    collective is left to hang in: the watch lets it work on (it was SIGKILLed as hung in
    "data loading" after hang_after_s), and its failure there is said as after its training."""
    from ddplab.forensics.heartbeat import AFTER_TRAINING
    from ddplab.forensics.watch import Watch

    code = ("import time\nfrom pathlib import Path\nfrom ddplab.forensics import heartbeat\n"
            f"heartbeat.start(Path({str(tmp_path)!r}), 0, 2)\n"
            "heartbeat.beat('data loading', 5)\n"
            f"heartbeat.beat({AFTER_TRAINING!r}, 4)\n"
            "time.sleep(4)\nheartbeat.failed('RuntimeError: evaluation failed')\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    watch = Watch(tmp_path, hang_after_s=1.0, host="h")
    while proc.poll() is None:
        watch.tick()
        time.sleep(0.2)
    assert proc.returncode == 0 and watch.hang is None
    assert verdict(watch.endings(), 1) == (
        "rank 0 (host h) failed (RuntimeError: evaluation failed) after its training (step 4, its "
        "process group destroyed)")


@pytest.mark.parametrize("phase, hung", [("backward", True),
                                          ("its code between steps, outside its data loader", False)])
def test_after_a_peer_ended_well_only_a_wait_in_a_step_is_a_hang(tmp_path, phase, hung):
    """Rank 0's script ended well: rank 1's own work between steps (its save, its evaluation)
    is never a hang; waiting in a backward's all-reduce (uneven inputs: rank 0 has no batch
    left) still is. A "done" of an earlier attempt says nothing of this one."""
    from ddplab.forensics.watch import Watch

    def rank(r: int, then: str) -> subprocess.Popen:
        code = ("import time\nfrom pathlib import Path\nfrom ddplab.forensics import heartbeat\n"
                f"heartbeat.start(Path({str(tmp_path)!r}), {r}, 2)\n{then}\n")
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)

    def waiting() -> subprocess.Popen:
        """Rank 1 in ``phase`` from the moment this returns (a loaded machine's python start-up
        is not counted in the watch's 3 s)."""
        proc = rank(1, f"heartbeat.beat({phase!r}, 11)\nprint('up', flush=True)\ntime.sleep(60)")
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        return proc

    stale = rank(0, "heartbeat.beat('done', 3)")  # an earlier attempt's: before this watch
    stale.wait(timeout=60)
    watch = Watch(tmp_path, hang_after_s=1.0, host="h")
    alone = waiting()
    if hung:  # without a good end in this attempt: a hang as ever
        _tick_until(watch, alone, 30.0)  # (it ends when the hang is seen)
        assert watch.hang is not None
        alone.kill()
        alone.wait()
        alone = waiting()
        watch = Watch(tmp_path, hang_after_s=1.0, host="h")
    done = rank(0, "heartbeat.beat('done', 10)")
    done.wait(timeout=60)
    _tick_until(watch, alone, 30.0 if hung else 3.0)
    assert (watch.hang is not None) == hung
    alone.kill()
    alone.wait()


def _tick_until(watch, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while proc.poll() is None and watch.hang is None and time.monotonic() < deadline:
        watch.tick()
        time.sleep(0.2)


def test_ranks_their_supervisors_stopped_are_no_cause_of_their_own(tmp_path):
    """torchrun killed outright: each rank's supervisor stops its script (SIGTERM) and says why
    first; the verdict read "rank 1 died outright (killed by a signal: SIGKILL ...)"."""
    from ddplab.forensics.heartbeat import stopped_path
    from ddplab.forensics.watch import Watch

    procs = []
    for r in (0, 1):
        code = ("import time\nfrom pathlib import Path\nfrom ddplab.forensics import heartbeat\n"
                f"heartbeat.start(Path({str(tmp_path)!r}), {r}, 2)\n"
                "heartbeat.beat('backward', 9)\nprint('up', flush=True)\ntime.sleep(60)\n")
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                      text=True))
    for r, proc in enumerate(procs):
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        stopped_path(tmp_path, r).write_text(
            "terminated by SIGTERM: the launcher is gone (...): the script was stopped")
        proc.terminate()
        assert proc.wait(timeout=30) == -signal.SIGTERM
    endings = Watch(tmp_path, hang_after_s=300.0, host="h").endings()
    assert {e.what for e in endings} == {"failed"}, endings
    assert verdict(endings, 2) == ""


def test_a_rank_the_watch_finds_dead_when_it_stops_a_hang_is_the_cause(tmp_path):
    """Rank 1 is killed outright (the OOM killer) in its backward, after rank 0 entered its own
    backward's all-reduce, where rank 0 then waits (on ccl a peer's death is no error) until the
    watch stops it. By heartbeats alone rank 0 is behind; the watch found rank 1 dead already."""
    from ddplab.forensics.watch import Watch

    def rank(r: int, then: str) -> subprocess.Popen:
        code = ("import os, time\nfrom pathlib import Path\nfrom ddplab.forensics import heartbeat\n"
                f"heartbeat.start(Path({str(tmp_path)!r}), {r}, 2)\n"
                "heartbeat.beat('data loading', 5)\n" + then)
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)

    waits = rank(0, "heartbeat.beat('backward')\nprint('up', flush=True)\n"
                    "while True:\n    time.sleep(0.05)\n")
    assert waits.stdout is not None and waits.stdout.readline() == "up\n"  # in its backward now
    dies = rank(1, "time.sleep(0.5)\nheartbeat.beat('backward')\nos.kill(os.getpid(), 9)\n")
    assert dies.wait(timeout=60) == -9
    watch = _until_the_watch_stops(Watch(tmp_path, hang_after_s=3.0, host="h"), waits)
    endings = {e.rank: e for e in watch.endings()}
    assert (endings[0].what, endings[1].what, endings[1].dead_at_stop) == ("stopped", "died", 1)
    assert endings[1].time > endings[0].time  # its last beat came after rank 0's
    assert verdict(list(endings.values()), 2, hang_after_s=3.0) == (
        "rank 1 (host h) died outright (killed by a signal: SIGKILL, or the OOM killer; or its code "
        "called os._exit) at step 5 "
        "in backward; rank 0 stopped after it")


@pytest.mark.e2e
def test_a_hung_ccl_job_stopped_by_the_watch_leaves_no_shared_memory(tmp_path, store):
    """The watch SIGKILLs hung ranks, whose libfabric clean-up then never runs: their node's
    delivery process removes their shm regions (64 MB reserved each, until reboot) after."""
    from ddplab import ccl

    assert ccl.missing() is None, f"{ccl.missing()} (make test builds it: make setup-ccl)"
    before = shm_regions()
    out, run, _ = run_faulty(tmp_path, store, "sleep", "data", 3, "--set", "dist.backend=ccl")
    assert run.info.status == "FAILED" and run.data.tags["ddplab.backend"] == "ccl", out.stderr[-3000:]
    assert run.data.tags["ddplab.error"].startswith(f"rank 1 (host {HOST}) stopped at step 3")
    assert left_behind(before) == set()


@pytest.mark.parametrize("env, says", [
    ({"SLURM_JOB_ID": "42"}, "Slurm stopped job 42: scancel, its time limit or a preemption"),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "Kubernetes stopped the pod: deleted, evicted or "
                                              "preempted"),
    ({}, "a peer rank failed, or the job was stopped")])
def test_a_sigterm_says_who_sends_it_where_ddplab_can_tell(env, says):
    from ddplab.training.jobend import who_stops

    assert who_stops(env).startswith(says)


def test_the_job_gives_back_the_native_handlers_it_found(tmp_path):
    """libfabric's shared-memory transport (a ccl group) unlinks its /dev/shm regions on
    SIGTERM, in C. The job's own handlers came and went through Python's signal module, whose
    record of a C handler is SIG_DFL: the rank SIGTERMed after its job ended died with its
    region left. faulthandler's C handler for SIGTERM stands in for libfabric's here."""
    import faulthandler
    import signal

    from ddplab.ccl.handlers import handler, sigactions
    from ddplab.training.jobend import Signals

    def sigterm() -> int:
        return handler(sigactions([signal.SIGTERM])[signal.SIGTERM])

    with open(tmp_path / "stacks", "w") as f:
        faulthandler.register(signal.SIGTERM, file=f, chain=True)
        try:
            before = sigterm()
            with Signals():
                assert sigterm() != before
            assert sigterm() == before
        finally:
            faulthandler.unregister(signal.SIGTERM)


def test_native_code_keeps_the_crash_handler_but_libfabrics_own(tmp_path):
    """Loading libinfinipath took SIGSEGV (a C backtrace, then exit(1)): put back. A handler of
    another library stays (faulthandler's set inside, as libfabric's clean-up would be)."""
    code = f"""
import ctypes, faulthandler, signal
from ddplab.ccl.handlers import crash_handlers_kept, handler, sigactions
def segv():
    return handler(sigactions([signal.SIGSEGV])[signal.SIGSEGV])
with crash_handlers_kept():
    faulthandler.enable()
    other = segv()
assert segv() == other, "another library's handler was undone"
faulthandler.disable()
omni = {omni_path_library()!r}
if omni:
    faulthandler.enable()
    mine = segv()
    with crash_handlers_kept():
        ctypes.CDLL(omni)
        assert segv() != mine, "the library took no handler: nothing is tested"
    assert segv() == mine, "Omni-Path's handler stayed"
print("ok", bool(omni))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stdout + out.stderr


def test_a_sigterm_while_a_rank_reports_its_end_is_raised_after_the_report():
    """torchrun's SIGTERM (a peer failed) came while script mode's rank 0 was making its report:
    the report was lost and the rank read "ended without reporting" (seen in CI). Held, the
    signal is raised once the held work is done, and only then; a real SIGTERM, from a thread
    as the kernel may deliver it to any thread."""
    import os
    import signal
    import threading

    from ddplab.training.jobend import Signals, Terminated

    done = []
    with Signals() as signals, pytest.raises(Terminated, match="terminated by SIGTERM"):
        with signals.held():
            sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM))
            sender.start()
            sender.join()  # sent: the handler runs in the main thread, here, and holds it
            done.append("reported")
    assert done == ["reported"] and signals.status() == "FAILED"


def test_a_dataloader_workers_death_cannot_cut_the_ending_short():
    """torch's DataLoader raises from its SIGCHLD handler when a worker dies, at any line of
    this process: raised again in the run's ending (a second worker's death), it cut short
    the record of the rank's cause (a hostile pass, 3 of 5: "failed at step 9 in failed").
    Shielded, a child's exit runs no such handler; the job's end puts it back."""
    import signal
    import subprocess

    from ddplab.training.jobend import Signals

    def worker_died(signum, frame):
        raise RuntimeError("DataLoader worker (pid(s) 1) exited unexpectedly")

    before = signal.signal(signal.SIGCHLD, worker_died)
    try:
        with Signals() as signals:
            signals.shield()
            subprocess.run(["true"], check=True)  # a child ends: SIGCHLD
            signals.shield()  # (twice, as the ending does: torch's handler is still put back)
        assert signal.getsignal(signal.SIGCHLD) is worker_died
    finally:
        signal.signal(signal.SIGCHLD, before)


def test_an_attempt_with_fewer_ranks_forgets_the_earlier_attempts_other_ranks(tmp_path):
    """A failed 2-rank script run resumed by one process (checkpoint.resume=RUN): rank 1's
    heartbeat and error from the failed attempt read as the new attempt's, and the FINISHED run
    kept "rank 1 failed (RuntimeError ...)" as its verdict."""
    from ddplab.forensics import heartbeat
    from ddplab.forensics.watch import Watch

    earlier = heartbeat.Heartbeat(tmp_path, 1, 2)
    earlier.beat("backward", 20)
    earlier.failed("RuntimeError: injected failure at step 20")
    assert [e.what for e in Watch(tmp_path, 300.0, "h").endings()] == ["failed"]
    now = heartbeat.Heartbeat(tmp_path, 0, 1)  # (script mode makes it so, ddplab's loop by start)
    now.beat("forward", 3)
    now.close()
    endings = Watch(tmp_path, 300.0, "h").endings()
    assert [(e.rank, e.what) for e in endings] == [(0, "done")]
    assert not list(tmp_path.glob("rank-1.*"))


def test_a_failed_attempt_that_torchrun_restarts_says_so_on_its_last_line(monkeypatch):
    """A hostile pass: under `torchrun --max-restarts 1` the first attempt's last line said the
    run FAILED; the next attempt resumed it and said FINISHED, of the same run."""
    from ddplab.tracking.tracker import NullTracker
    from ddplab.training.jobend import where

    run = NullTracker()
    run.run_id, run.uri = "abc", "sqlite:///x.db"
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert "abc FAILED for now: torchrun starts attempt 2 (--max-restarts 1)" in where(run, "FAILED")
    assert "for now" not in where(run, "FINISHED") and "for now" not in where(run, "KILLED")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the last attempt: its end is the run's
    assert "abc FAILED" in where(run, "FAILED") and "for now" not in where(run, "FAILED")


def test_one_rank_stopped_from_outside_is_named_not_what_its_peer_saw():
    """`kill -TERM` of rank 1's process alone: rank 0 raised "Connection closed by peer" and
    the run's error was that, with no verdict; the stop of the whole job (every rank SIGTERMed,
    scancel) still has none: the run says it itself."""
    stop = "Terminated: terminated by SIGTERM (a peer rank failed, or the job was stopped)"
    endings = [Ending(0, 9, "backward", 10.2, "failed",
                      "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                      "Connection closed by peer [127.0.0.1]:5000\n\ntrace", "a"),
               Ending(1, 9, "forward", 10.0, "failed", f"{stop}\n\ntrace", "a")]
    assert verdict(endings, 2) == (
        f"rank 1 (host a) was stopped ({stop}) at step 9 in forward while no rank had failed; "
        "rank 0 stopped after it")
    everyone = [Ending(r, 9, "forward", 10.0 + r, "failed", f"{stop}\n\ntrace", "a") for r in (0, 1)]
    assert verdict(everyone, 2) == ""


def test_a_paused_rank_is_no_hang_until_a_whole_hang_after_s_after_it_continues(tmp_path):
    """Ctrl-Z on a study stops its job's ranks (SIGSTOP), and a paused rank beats no more: the
    watch killed it as hung once the pause passed dist.hang_after_s. Paused, it waits; once the
    rank runs again and stays silent for hang_after_s, that is a hang as ever."""
    from ddplab.forensics.watch import Watch

    code = ("import time\nfrom pathlib import Path\nfrom ddplab.forensics import heartbeat\n"
            f"heartbeat.start(Path({str(tmp_path)!r}), 0, 1)\n"
            "heartbeat.beat('backward', 4)\nprint('up', flush=True)\ntime.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        watch = Watch(tmp_path, hang_after_s=2.0, host="h")
        proc.send_signal(signal.SIGSTOP)
        _tick_until(watch, proc, 5.0)  # past hang_after_s twice over, paused
        assert watch.hang is None
        proc.send_signal(signal.SIGCONT)
        continued = time.monotonic()
        _tick_until(watch, proc, 10.0)
        # (the watch looks once a second: it saw the pause last up to ~1 s before it ended)
        assert watch.hang is not None and time.monotonic() - continued > 2.0 - 1.3
    finally:
        proc.kill()
        proc.wait()
