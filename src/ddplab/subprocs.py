"""How ddplab starts a Python module of its own in a new process (a rank's script under its
supervisor, a node's delivery process, an orphaned run's watcher), tells whether a process still
runs, and names the temporary files a process leaves for the next one of its host to sweep."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

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


def _stat(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the command's name (state, ppid, ...); [] once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def state(pid: int) -> str:
    """A process's state letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie...), "" once gone."""
    return next(iter(_stat(pid)), "")


PAUSED = ("T", "t")
"""States of a process stopped by a signal (Ctrl-Z, SIGSTOP) or by a tracer (a debugger)."""


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


def run_tied(cmd: list[str], env: dict[str, str], cwd: str | None = None,
             stdout: IO[Any] | None = None) -> int:
    """A job (a study's, reproduce's) to its end: its exit code. Ctrl-C (SIGINT here, or what
    the caller turned into one) stops it as Ctrl-C does, one SIGINT to its process group (its
    launcher passes it on; the ranks end the run KILLED and deliver it); it gets 90 s, then
    SIGKILL, and the interrupt goes on only once it has ended, so the caller's clean-up (a
    scratch folder holding the job's spool) never pulls anything from under it. It is tied to
    this process: SIGINT too if this one dies (even SIGKILLed), and paused with it (Ctrl-Z)."""
    proc = subprocess.Popen(_tied_to_this_process(cmd), env=env, cwd=cwd, stdout=stdout,
                            stderr=subprocess.STDOUT if stdout is not None else None,
                            start_new_session=True)
    try:
        with pausing_with_this_process(proc.pid):
            return proc.wait()
    except KeyboardInterrupt:
        _stop(proc)
        raise


@contextlib.contextmanager
def pausing_with_this_process(root: int = 0) -> Iterator[None]:
    """Ctrl-Z (SIGTSTP) reaches the terminal's foreground process group only, while a job runs
    in a session of its own (run_tied's ``root``, so that Ctrl-C is said to it once, by _stop)
    and torchrun's ranks in sessions of theirs (torchrun's agent in this process: ``root`` 0):
    without this, Ctrl-Z stopped the study, reproduce or `ddplab run` command while its job
    trained on. Every process of the job is stopped first (SIGSTOP, parents first so none
    starts another unseen; the kernel drops SIGTSTP outside a terminal's session), then this
    process; `fg` or `bg` (SIGCONT) continues this process, which continues them."""
    def pause(signum: int, frame: Any) -> None:
        stopped = _signal_tree(root or os.getpid(), signal.SIGSTOP)
        signal.signal(signal.SIGTSTP, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTSTP)  # stopped here until SIGCONT
        signal.signal(signal.SIGTSTP, pause)
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    try:
        before = signal.signal(signal.SIGTSTP, pause)
    except ValueError:  # not the main thread: signals are the main thread's to handle
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTSTP, before)


def _signal_tree(root: int, sig: int) -> list[int]:
    """``sig`` to ``root`` and every process descended from it (this one excepted), parents
    first, until no new one appears: the processes signalled."""
    done: list[int] = [os.getpid()]
    while todo := [pid for pid in _descendants(root) if pid not in done]:
        for pid in todo:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            done.append(pid)
    return done[1:]


def _descendants(root: int) -> list[int]:
    """``root`` and the processes descended from it, parents first (from /proc)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        fields = _stat(proc.name)
        if len(fields) > 1:  # (else gone meanwhile)
            children.setdefault(int(fields[1]), []).append(int(proc.name))
    tree, i = [root], 0
    while i < len(tree):
        tree += children.get(tree[i], [])
        i += 1
    return tree


def _stop(proc: subprocess.Popen[Any]) -> None:
    """``proc``'s process group stopped as Ctrl-C stops it, then (after 90 s, or at a second
    Ctrl-C) killed; returns only once it has ended, whatever more interrupts come."""
    for sig, wait_s in ((signal.SIGINT, 90.0), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        while True:
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                break
            except KeyboardInterrupt:  # (again: no more patience, but still no leaving early)
                if sig == signal.SIGINT:
                    break


def stop_on_termination() -> None:
    """SIGTERM (kill, a batch system's time limit) and SIGHUP (the terminal closed) stop this
    process the way Ctrl-C does (KeyboardInterrupt): a study's or reproduce's running job ends
    its run KILLED (run_tied), then the command cleans up after it."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)


def _tied_to_this_process(cmd: list[str]) -> list[str]:
    """``cmd`` under util-linux's setpriv, which makes the kernel send it SIGINT if this
    process dies (even SIGKILLed), so a job never outlives what started it unseen. SIGINT, as
    for Ctrl-C: torchrun passes it on and the ranks end the run KILLED (SIGTERM means a peer
    failed). (subprocess's preexec_fn could set the same prctl, but is unsafe here: rich's
    progress bar runs a thread.)"""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "INT", "--", *cmd] if setpriv and _pdeathsig_ok(setpriv) else cmd


@functools.cache
def _pdeathsig_ok(setpriv: str) -> bool:
    """util-linux >= 2.33 has --pdeathsig; busybox's setpriv does not."""
    out = subprocess.run([setpriv, "--help"], capture_output=True, text=True, check=False)
    return "--pdeathsig" in out.stdout + out.stderr
