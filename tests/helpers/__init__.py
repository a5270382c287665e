"""Helpers several test modules share (no test module imports another)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, job_env

BIN = Path(sys.executable).parent
ADMIN_PASSWORD = secrets.token_urlsafe(18)
"""The login server's admin password (conftest's login_server), new each session."""
LOSS_LINE = re.compile(r"step (\d+)/\d+ loss (\d+\.\d+)")


def faulty_experiment(folder: Path, **fault: object) -> Path:
    """faulty.yaml in ``folder``, beside its parts (tests/data/faulty/faulty.py, the spirals
    example): 2 epochs of spirals that go wrong on rank 1 as the FAULT* environment says, or as
    ``fault`` says (its data.args, where no environment reaches the ranks: a compose node)."""
    import yaml

    for f in (REPO / "experiments" / "examples" / "spirals.py",
              REPO / "tests" / "data" / "faulty" / "faulty.py"):
        shutil.copy(f, folder / f.name)
    data = {"dataset": "faulty:make_data", "batch_size": 32, "num_workers": 0}
    exp = folder / "faulty.yaml"
    exp.write_text(yaml.safe_dump({
        "name": "faulty", "data": {**data, "args": fault} if fault else data,
        "model": {"name": "faulty:Model"}, "train": {"epochs": 2, "log_every": 2},
        "tracking": {"system_metrics": False}, "dist": {"hang_after_s": 8, "timeout_s": 300}}))
    return exp


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each process's output (started with start_new_session=True, stdout PIPE, text), read
    together: one waiting on another never fills its pipe. On a timeout every process and its
    descendants (torchrun's workers and ddplab's delivery process run in sessions of their own,
    holding the pipe) are killed, and the test fails with each one's last lines."""
    import concurrent.futures

    import psutil

    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        reads = [pool.submit(p.communicate) for p in procs]
        done, _ = concurrent.futures.wait(reads, timeout=timeout)
        if len(done) < len(procs):
            for p, r in zip(procs, reads, strict=True):
                if r.done():
                    continue
                tree = []  # before any kill: a killed parent's children go to init
                with contextlib.suppress(psutil.Error):
                    tree = psutil.Process(p.pid).children(recursive=True)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)  # its group, orphans included
                for child in tree:
                    with contextlib.suppress(psutil.Error):
                        child.kill()
        outs = [r.result(timeout=60)[0] or "" for r in reads]
    if len(done) < len(procs):
        tails = "\n".join(f"--- process {i} (exit {p.returncode}):\n{o[-2000:]}"
                          for i, (p, o) in enumerate(zip(procs, outs, strict=True)))
        pytest.fail(f"not all ended within {timeout:.0f} s; killed\n{tails}")
    return outs


def artifact_text(client, run_id: str, path: str) -> str:
    """A run's artifact as text. MLflow's download_artifacts without a destination copies into
    a temporary folder of its own that it never removes: one left in /tmp per call."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return Path(client.download_artifacts(run_id, path, tmp)).read_text()


def left_behind(before: set[str], settle_s: float = 90.0) -> set[str]:
    """Regions made since ``before`` whose process is gone: leaked. A ccl job of another test
    running beside this one (make test's workers) has regions too, while its ranks live, and for
    a while after its ranks were killed, until its delivery process (nice 19: on a saturated
    2-core machine it waited over 30 s for a turn) frees them: what is still there after
    ``settle_s`` is left for good (nothing left: no wait)."""
    deadline = time.monotonic() + settle_s
    while True:
        gone = {r for r in shm_regions() - before if not Path(f"/proc/{r.split(':')[0]}").exists()}
        if not gone or time.monotonic() > deadline:
            return gone
        time.sleep(1.0)


def omni_path_library() -> str | None:
    """Omni-Path's libinfinipath, which Debian's libfabric links (it takes SIGSEGV when loaded):
    ddplab's ccl bundle's copy (make setup-ccl), else the system's; None where there is none."""
    import ctypes.util

    from ddplab import ccl

    bundled = ccl.home() / "fabric" / "libinfinipath.so.4"
    return str(bundled) if bundled.exists() else ctypes.util.find_library("infinipath")


def shm_regions() -> set[str]:
    """libfabric shm transport's regions in /dev/shm (``<pid>:<n>:<n>``)."""
    return {p.name for p in Path("/dev/shm").iterdir() if re.fullmatch(r"\d+:\d+:\d+", p.name)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# As ddplab's own servers run MLflow (make ui, docker/mlflow/serve.py): without its job runner,
# whose seven processes took 31 s of CPU at each start (7.5 s without), beside the other tests.
QUIET_SERVER = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


class Server:
    """`mlflow server` with its store in a folder; killed with SIGKILL, started again on the
    same port and store."""

    def __init__(self, root: Path, host: str = "127.0.0.1") -> None:
        self.root, self.port, self.host = root, free_port(), host
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # Containers reach a server on all interfaces as host.docker.internal (compose/).
        allowed = ",".join(f"{h}:{self.port}" for h in ("127.0.0.1", "localhost",
                                                        "host.docker.internal"))
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--host", self.host, "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--artifacts-destination", str(self.root / "artifacts"),
             "--allowed-hosts", allowed],
            cwd=self.root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, **QUIET_SERVER})
        deadline = time.monotonic() + 90
        while not self.answers():
            assert time.monotonic() < deadline and self.proc.poll() is None, "server did not start"
            time.sleep(0.5)

    def answers(self) -> bool:
        from ddplab.tracking import check_reachable

        return check_reachable(self.uri, timeout_s=2) is None

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(self.uri)


def fresh_copy(dest: Path) -> Path:
    """The tree as a fresh clone has it: tracked and untracked-but-not-ignored files."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)  # keep mtimes: the venv's setup stamp stays valid
    return dest


def printed_losses(output: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in LOSS_LINE.findall(output)}


def cli(args: list[str], cwd: Path, store: str, timeout: int = 600,
        **env_extra: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([str(BIN / "ddplab"), *args], cwd=cwd, env=job_env(store, **env_extra),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"ddplab {' '.join(args)}: no end in {timeout} s\n{_text(e.stdout)}\n"
                    f"{_text(e.stderr)[-2000:]}\n{newest_job_log(cwd)}")


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else b or ""


def newest_job_log(cwd: Path) -> str:
    """The tail of the study's most recent job log: where a stuck study was stuck."""
    logs = sorted((cwd / "checkpoints" / "studies").glob("*/logs/*.log"),
                  key=lambda p: p.stat().st_mtime)
    return f"{logs[-1]}:\n{logs[-1].read_text(errors='replace')[-6000:]}" if logs else "(no job log)"


def call(uri: str, path: str, body: dict | None = None, user: tuple[str, str] | None = None,
         method: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(uri + path, data=json.dumps(body).encode() if body else None,
                                 headers={"Content-Type": "application/json"}, method=method)
    if user:
        req.add_header("Authorization",
                       "Basic " + base64.b64encode(f"{user[0]}:{user[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read()
            return r.status, (json.loads(text) if text.strip().startswith(b"{") else {})
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:  # not listening yet
        return 0, {}
