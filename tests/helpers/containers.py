"""The container tier's shared parts: docker and compose calls, MLflow's REST API on a
published port, and one isolated compose project per test (Compose; conftest's
compose_factory)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.helpers import free_port

CPU_IMAGE, MLFLOW_IMAGE = "ddplab/cpu-oneccl:latest", "ddplab/mlflow:latest"
MPI_IMAGE, POSTGRES_IMAGE = "ddplab/openmpi:latest", "ddplab/postgres:latest"
SMALL = "--set data.train_samples=1536 --set data.eval_samples=512 --set train.epochs=2"


def need_images(*images: str) -> None:
    """A Docker engine that answers, and these images built (else the tier fails, saying how)."""
    if sh(["docker", "info"], timeout=30).returncode:
        pytest.fail("no Docker engine: start dockerd (`docker info` must answer)")
    for image in images:
        if sh(["docker", "image", "inspect", image], timeout=30).returncode:
            pytest.fail(f"{image} is missing: build it with `make images` (CI: see .ci/run)")


def sh(cmd: list[str], timeout: int = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def remove(*containers: str, within_s: float = 120) -> None:
    """Remove these containers and wait until their names are free, so that the next pod of the
    same name starts (`docker rm -f`'s own exit status was never read). Fails the caller with the
    engine's words if a name stays taken, instead of the next test failing on "already in use"."""
    deadline, left, said = time.monotonic() + within_s, list(containers), ""
    while left:
        said = sh(["docker", "rm", "-f", "-v", *left], timeout=300).stderr.strip()
        left = [c for c in left
                if sh(["docker", "container", "inspect", c], timeout=60).returncode == 0]
        if left and time.monotonic() > deadline:
            pytest.fail(f"docker rm -f {' '.join(left)}: still there after {within_s:.0f} s: {said}")
        if left:
            time.sleep(2)


def rest(base: str, path: str, body: dict | None = None, login: str = "") -> dict:
    """MLflow's REST API; ``login`` ("user:password") for a server that asks for one."""
    headers = {"Content-Type": "application/json"}
    if login:
        headers["Authorization"] = "Basic " + base64.b64encode(login.encode()).decode()
    req = urllib.request.Request(base + path, data=json.dumps(body).encode() if body else None,
                                 headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def all_runs(base: str, login: str = "") -> list[dict]:
    exps = rest(base, "/api/2.0/mlflow/experiments/search", {"max_results": 100}, login)["experiments"]
    ids = [e["experiment_id"] for e in exps]
    return rest(base, "/api/2.0/mlflow/runs/search", {"experiment_ids": ids}, login).get("runs", [])


def tags(run: dict) -> dict[str, str]:
    return {t["key"]: t["value"] for t in run["data"].get("tags", [])}


def metrics(run: dict) -> dict[str, float]:
    return {m["key"]: m["value"] for m in run["data"].get("metrics", [])}


def anonymous_volumes(project: str) -> list[str]:
    """The volumes a compose project's containers hold that its file does not name: an image's
    VOLUME no service mounts a named volume on. `down` (which keeps the runs) leaves each behind,
    one more every `up` after it."""
    ids = sh(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"])
    if not ids.stdout.split():
        return []
    each = '{{range .Mounts}}{{if eq .Type "volume"}} {{.Destination}}={{.Name}}{{end}}{{end}}'
    mounts = sh(["docker", "inspect", "--format", "{{.Name}}" + each, *ids.stdout.split()])
    return [f"{line.split()[0]} {m}" for line in mounts.stdout.splitlines()
            for m in line.split()[1:] if not m.split("=", 1)[1].startswith(f"{project}_")]


class Compose:
    """One isolated `docker compose -f compose/multinode.yml` project on a free port."""

    def __init__(self, nnodes: int, nproc: int, extra_env: dict[str, str] | None = None,
                 file: str = "multinode.yml", service: str = "node") -> None:
        self.service = service
        self.project = f"ddplabtest{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
                    "NNODES": str(nnodes), "NPROC_PER_NODE": str(nproc), "SLOTS": str(nproc),
                    "MLFLOW_PORT": str(self.port),
                    # One server worker: a test's stack has one client at a time, and each
                    # worker's start-up (importing MLflow) is CPU that CI's 2 cores lack.
                    "MLFLOW_WORKERS": "1",
                    "COMPOSE_PROJECT_NAME": self.project, **(extra_env or {})}
        self.cmd = ["docker", "compose", "-f", str(REPO / "compose" / file)]
        self.proc: subprocess.Popen | None = None
        self.up_log: Path | None = None
        self._login = ""

    def login(self) -> str:
        """"admin:<password>" of tracking.yml's generated login, read the way docs/tracking.md
        tells a user to (empty until the server's container runs)."""
        if not self._login:
            out = sh([*self.cmd, "exec", "-T", "mlflow", "cat", "/run/ddplab-tracking/admin-password"],
                     env=self.env, cwd=REPO)
            if out.returncode == 0 and out.stdout.strip():
                self._login = "admin:" + out.stdout.strip()
        return self._login

    def runs(self) -> list[dict]:
        return all_runs(self.base, self.login())

    def up(self) -> None:
        self.started = time.monotonic()
        # A file, not a pipe: a cold build prints far more than a pipe holds, and compose
        # blocks on a full pipe nobody reads (the build then never ends).
        self.up_log = Path(tempfile.mkstemp(prefix=f"{self.project}-up-", suffix=".log")[1])
        with self.up_log.open("w") as out:
            self.proc = subprocess.Popen([*self.cmd, "up"], env=self.env, cwd=REPO, text=True,
                                         stdout=out, stderr=subprocess.STDOUT)

    def wait_run(self, predicate, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                found = self.runs()
                if found and predicate(found[0]):
                    return found[0]
            except OSError:
                pass  # server still starting (or not yet asked for its login)
            time.sleep(2)
        raise AssertionError(f"timed out after {timeout:.0f} s; `up` printed:\n"
                             f"{self.up_output()[-3000:]}\nlogs:\n{self.logs()[-3000:]}")

    def up_output(self) -> str:
        """What `compose up` printed (the build's progress, then the containers' output)."""
        return self.up_log.read_text(errors="replace") if self.up_log else ""

    def node_exit_codes(self, service: str = "") -> list[int]:
        out = sh([*self.cmd, "ps", "-a", "--format", "json", service or self.service],
                 env=self.env, cwd=REPO)
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        return [r["ExitCode"] for r in rows if r["State"] == "exited"]

    def logs(self) -> str:
        return sh([*self.cmd, "logs", "--no-color"], env=self.env, cwd=REPO).stdout

    def down(self) -> None:
        if self.proc:
            self.proc.kill()
        if self.up_log:
            self.up_log.unlink(missing_ok=True)
        sh([*self.cmd, "down", "-v", "--remove-orphans"], env=self.env, cwd=REPO, timeout=180)


def kill_a_node_without_rank0(c: Compose, run: dict) -> float:
    """docker kill one node container that does not hold global rank 0 (which records the run's
    end); returns when it was killed. The run must then end FAILED."""
    rank0_host = tags(run)["ddplab.rank0_host"]
    ids = sh(["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={c.project}",
              "--filter", f"label=com.docker.compose.service={c.service}"]).stdout.split()
    victim = next(i for i in ids if not rank0_host.startswith(i[:12]))
    t0 = time.monotonic()
    sh(["docker", "kill", victim])
    assert c.wait_run(finished, timeout=240)["info"]["status"] == "FAILED"
    return t0


def wait_exits(c: Compose, service: str, count: int, deadline: float) -> list[int]:
    while len(c.node_exit_codes(service)) < count and time.monotonic() < deadline:
        time.sleep(1)
    return c.node_exit_codes(service)


def finished(run: dict) -> bool:
    return run["info"]["status"] in ("FINISHED", "FAILED", "KILLED")


def exec_in(c: Compose, service: str, script: str) -> subprocess.CompletedProcess:
    return sh([*c.cmd, "exec", "-T", service, "sh", "-c", script], env=c.env, cwd=REPO)


def metric_steps(c: Compose, run_id: str, key: str) -> list[int]:
    h = rest(c.base, f"/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key={key}",
             login=c.login())["metrics"]
    return sorted(m["step"] for m in h)


def train_again(c: Compose, *services: str) -> dict:
    """A new job on a running stack (its services started again with c.env), once its run
    has logged a training loss."""
    before = {r["info"]["run_id"] for r in c.runs()}
    again = sh([*c.cmd, "up", "-d", "--no-deps", *services], env=c.env, cwd=REPO)
    assert again.returncode == 0, again.stderr
    deadline = time.monotonic() + 400
    while not (new := [r for r in c.runs() if r["info"]["run_id"] not in before
               and "train/loss" in metrics(r)]):
        assert time.monotonic() < deadline, c.logs()[-4000:]
        time.sleep(2)
    return new[0]
