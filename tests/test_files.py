"""Unit: ddplab.files, the one way a file another process reads is written (whole or not at all)."""

import subprocess
import sys

import pytest

from ddplab.files import write_text_atomic

READER = """
import sys, time
from pathlib import Path
path, size = Path(sys.argv[1]), int(sys.argv[2])
seen = 0
deadline = time.monotonic() + 60
while seen < 400 and time.monotonic() < deadline:
    text = path.read_text()
    if len(text) != size or len(set(text)) != 1:
        sys.exit(f"half a file: {len(text)} characters of {size}, {sorted(set(text))}")
    seen += 1
print(seen)
"""


def test_a_reader_in_another_process_never_meets_half_a_file(tmp_path):
    path, size = tmp_path / "meta.json", 1 << 20
    write_text_atomic(path, "a" * size)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(path), str(size)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    n = 0
    while reader.poll() is None:
        write_text_atomic(path, "ab"[n % 2] * size)
        n += 1
    out, err = reader.communicate()
    assert reader.returncode == 0, err
    assert int(out) == 400 and n > 10
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]  # no temporary left


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "job.json"
    write_text_atomic(path, "old")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "new \udc80")  # not encodable: fails after the temporary opened
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["job.json"]


DEAF_JOB = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a job slow to end: it takes no notice of Ctrl-C
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(60)
"""


# What a study or reproduce is around its job: run_tied, Ctrl-C (a KeyboardInterrupt) taken
# where their own clean-up would be.
STARTER = """
import sys, time
from ddplab.subprocs import alive, run_tied
job, pid_file = sys.argv[1], sys.argv[2]
t0 = time.monotonic()
try:
    run_tied([sys.executable, job, pid_file], {})
except KeyboardInterrupt:
    pid = int(open(pid_file).read())
    print(f"interrupted after {time.monotonic() - t0:.1f} s, job alive: {alive(pid)}", flush=True)
    sys.exit(130)
"""


def test_a_tied_job_has_ended_before_its_starter_goes_on_even_at_a_second_ctrl_c(tmp_path):
    """study and reproduce clean up after their job (reproduce removes its scratch, the job's
    spool in it) once run_tied returns. Ctrl-C stops the job as Ctrl-C does; a second Ctrl-C
    during that wait escaped at once and the scratch went from under the job (a review). Now
    it kills the job, and the interrupt goes on only once the job has ended. The presses go to
    a starter process of its own, as a terminal's do (sent to pytest's own process, one that
    landed past run_tied's return ended pytest's worker: CI)."""
    import os
    import signal
    import time

    pid_file = tmp_path / "pid"
    (tmp_path / "job.py").write_text(DEAF_JOB)
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path / "job.py"),
                                str(pid_file)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert starter.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # the starter is in run_tied's wait by now
        starter.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert starter.poll() is None  # the job takes no notice: the starter still waits
        t0 = time.monotonic()
        starter.send_signal(signal.SIGINT)
        said = starter.communicate(timeout=60)[0]
    finally:
        starter.kill()
    assert starter.returncode == 130 and "job alive: False" in said, said
    assert time.monotonic() - t0 < 30
    assert not os.path.exists(f"/proc/{pid_file.read_text()}")


# A job as torchrun is: its ranks in sessions of their own (torch's elastic agent starts them so).
LAUNCHER_JOB = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                        start_new_session=True)
open(sys.argv[1], "w").write(str(rank.pid))
try:
    rank.wait()
except KeyboardInterrupt:  # (its starter gone: run_tied's tie)
    pass
"""


# `ddplab run`: torchrun's agent in the starter itself, its ranks in sessions of their own.
AGENT = """
import subprocess, sys
from ddplab.subprocs import pausing_with_this_process
with pausing_with_this_process():
    subprocess.run([sys.executable, *sys.argv[1:]])
"""


@pytest.mark.parametrize("starter_code", [STARTER, AGENT], ids=["study", "ddplab run"])
def test_ctrl_z_pauses_a_tied_job_with_its_starter_and_fg_continues_both(starter_code, tmp_path):
    """Ctrl-Z reaches the terminal's foreground process group, neither the job's own session nor
    its ranks': the study or reproduce command stopped while its job trained on. SIGTSTP to the
    starter (what a terminal sends it) stops it and every process of the job, down to the
    ranks; SIGCONT (fg, bg) continues them all."""
    import os
    import signal
    import time

    from ddplab.subprocs import state

    pid_file = tmp_path / "pid"
    (tmp_path / "job.py").write_text(LAUNCHER_JOB)
    # In a process group of its own in this session, as a shell starts a job: the kernel drops
    # Ctrl-Z's stop for an orphaned group (no parent in the session outside it), as CI's was.
    starter = subprocess.Popen([sys.executable, "-c", starter_code, str(tmp_path / "job.py"),
                                str(pid_file)], stdout=subprocess.PIPE, text=True,
                               process_group=0)

    def states_become(want: str) -> tuple[str, str]:
        deadline = time.monotonic() + 30
        while (now := (state(starter.pid), state(rank))) != (want, want) and time.monotonic() < deadline:
            time.sleep(0.05)
        return now

    rank = 0
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()):
            assert starter.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        rank = int(pid_file.read_text())
        time.sleep(0.5)  # the starter is in run_tied's wait by now
        starter.send_signal(signal.SIGTSTP)
        assert states_become("T") == ("T", "T")
        starter.send_signal(signal.SIGCONT)
        assert states_become("S") == ("S", "S")
    finally:
        starter.kill()
        starter.wait(timeout=30)
        if rank:
            os.kill(rank, signal.SIGKILL)
