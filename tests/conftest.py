"""Shared fixtures. Tests run real processes: torchrun, make, the ddplab CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STAND_INS = REPO / "tests" / "stand_ins"
QUICK = [  # a smaller quickstart for tests that need a real job but not its full length
    "--set", "data.train_samples=1024", "--set", "data.eval_samples=256",
    "--set", "train.epochs=1", "--set", "train.log_every=4",
    "--set", "tracking.system_metrics_interval_s=1",
]


LONGEST = ("tests/test_k8s_emulation.py",  # one xdist_group: ~11 min on one worker
           "tests/test_compose_fresh.py::test_compose_slurm",
           "tests/test_compose_fresh.py::test_compose_mpi",
           "tests/test_compose_fresh.py::test_compose_up",
           "tests/test_containers.py::test_compose_multinode",
           "tests/test_study_compose.py",
           "tests/test_study.py::test_a_tiny_study_gives_a_parent",
           "tests/test_hostile.py::test_a_study_whose_server_dies")
"""The longest tests of each tier, longest first (CI's --durations): started before all others,
so that none of them starts last and runs on alone while the other worker idles."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long tests first (end-to-end, then multi-process), the quick ones last: pytest-xdist
    hands tests out in this order (make test: one at a time, --maxschedchunk 1), so the quick
    ones fill the workers' gaps at the end instead of one worker finishing a two-minute study
    alone (longest first: the tier's wall time falls)."""
    def weight(item: pytest.Item) -> int:
        first = [i for i, prefix in enumerate(LONGEST) if item.nodeid.startswith(prefix)]
        if first:
            return first[0] - len(LONGEST)
        return 0 if item.get_closest_marker("e2e") else 1 if item.get_closest_marker("distributed") else 2

    items.sort(key=weight)
    _xdist_groups(items)


def _xdist_groups(items: list[pytest.Item]) -> None:
    """`--dist loadgroup` (make test-container) sends an `xdist_group`'s tests to one worker by
    a suffix pytest-xdist 3.8 adds to each test's id, through `item._nodeid`; pytest 9.2 builds
    the id from `item._id` instead, so the suffix was lost and the k8s emulation's tests ran on
    two workers at once, starting pods of the same name (CI: "name already in use"). The suffix
    is added here where xdist's did not take; with no `xdist_group`, nothing changes."""
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        grouped = "@" in item.nodeid.rpartition("]")[2]  # xdist's own test: an "@" after any "]"
        if names and getattr(item.config.option, "loadgroup", False) and not grouped \
                and hasattr(item, "_id"):  # before pytest 9.2, xdist's own suffix works
            item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(names)}")


@pytest.fixture(autouse=True)
def _artifacts_in_the_tests_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store opened in the test's own process puts a new experiment's artifacts at MLflow's
    default, ./mlruns of the working directory: the checkout (make test left a mlruns/ of a
    dozen runs in it). Here they go to the test's folder, where a test that changes into that
    folder expects them anyway. (Jobs in child processes use their own working directory.)"""
    from mlflow.tracking._tracking_service import utils

    monkeypatch.setattr(utils, "DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH", str(tmp_path / "mlruns"))


@pytest.fixture(scope="session")
def migrated_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow store with its schema made, once per session: each new store cost its
    first user ~1 s of schema migration, in every test that trains."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("migrated") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(tmp_path: Path, migrated_store: Path) -> str:
    """A fresh embedded MLflow store for one test (a copy of the migrated empty one): tests
    that prove nothing was recorded look for runs, not for the file."""
    target = tmp_path / "mlflow.db"
    shutil.copyfile(migrated_store, target)
    return f"sqlite:///{target}"


# A machine where `make setup-ccl` never ran: ddplab's own ccl backend is not there.
NO_CCL = {"DDPLAB_CCL_HOME": "/nonexistent/ddplab-ccl"}


def job_env(store: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_",
                                "PMI_", "SLURM_", "PET_", "TORCHELASTIC"))}
    env.update({"MLFLOW_TRACKING_URI": store, "PYTHONUNBUFFERED": "1"}, **extra)
    return env


def ddplab(args: list[str], cwd: Path, env: dict[str, str], nproc: int = 0,
           timeout: int = 300) -> subprocess.CompletedProcess:
    """``ddplab train ...`` as a user types it: one process, or under torchrun."""
    bindir = Path(sys.executable).parent
    cmd = [str(bindir / "ddplab")] if nproc == 0 else [
        str(bindir / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m", "ddplab"]
    return subprocess.run(cmd + args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


Done = subprocess.CompletedProcess


def once_per_session(factory: pytest.TempPathFactory, name: str,
                     make: Callable[[Path], Done]) -> tuple[Path, Done]:
    """A module fixture's job made once for the whole session, not once per pytest-xdist worker
    (make test spreads a module's tests over its workers one at a time: a job three tests share
    ran three times). pytest-xdist's own recipe: the first worker makes it in a folder all
    workers share, under a lock; the others wait and read its result. Its store is read-only."""
    import fcntl
    import json

    base = factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root, result = shared / name, shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            root.mkdir(exist_ok=True)  # a worker whose job raised left it: the next one tries again
            res = make(root)
            result.write_text(json.dumps({"args": res.args, "returncode": res.returncode,
                                          "stdout": res.stdout, "stderr": res.stderr}))
    return root, subprocess.CompletedProcess(**json.loads(result.read_text()))


def runs(store: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(store)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps) if exps else []


@pytest.fixture
def compose_factory():
    from tests.helpers.containers import Compose, anonymous_volumes, sh

    made: list[Compose] = []

    def make(nnodes: int, nproc: int, file: str = "multinode.yml", service: str = "node",
             **env: str) -> Compose:
        made.append(Compose(nnodes, nproc, env, file, service))
        return made[-1]

    yield make
    unnamed = {c.project: anonymous_volumes(c.project) for c in made}
    for c in made:
        c.down()
        left = sh(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={c.project}"])
        volumes = sh(["docker", "volume", "ls", "-q", "--filter",
                      f"label=com.docker.compose.project={c.project}"])
        assert not left.stdout.strip() and not volumes.stdout.strip(), "down -v left something"
        assert not unnamed[c.project], f"volumes no compose file names (`down` leaves them): {unnamed}"


@pytest.fixture(scope="module")
def login_server(tmp_path_factory):
    """A real MLflow server with MLflow's own authentication (docker/mlflow/serve.py, the team
    server's entry point), admin's password ADMIN_PASSWORD, and a second user, bob."""
    import secrets
    import signal
    import time

    from tests.helpers import ADMIN_PASSWORD, BIN, call, free_port

    root = tmp_path_factory.mktemp("auth")
    port = free_port()
    (root / "admin-password").write_text(ADMIN_PASSWORD + "\n")
    (root / "flask-secret-key").write_text(secrets.token_hex(16) + "\n")
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}",
           "MLFLOW_AUTH_ADMIN_PASSWORD_FILE": str(root / "admin-password"),
           "MLFLOW_FLASK_SERVER_SECRET_KEY_FILE": str(root / "flask-secret-key"),
           "MLFLOW_AUTH_DATABASE_URI": f"sqlite:///{root / 'basic_auth.db'}",
           "MLFLOW_BACKEND_STORE_URI": f"sqlite:///{root / 'mlflow.db'}",
           "MLFLOW_ARTIFACTS_DESTINATION": str(root / "artifacts"), "MLFLOW_HOST": "127.0.0.1",
           "MLFLOW_PORT": str(port), "MLFLOW_WORKERS": "1",
           "MLFLOW_ALLOWED_HOSTS": f"127.0.0.1:{port},localhost:{port}",
           # serve.py's basic-auth ini outlives it (it execs the server; in the image /tmp goes
           # with the container): here it goes with the test's folder, not into the host's /tmp.
           "TMPDIR": str(root)}
    proc = subprocess.Popen([sys.executable, str(REPO / "docker" / "mlflow" / "serve.py")],
                            cwd=root, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while call(uri, "/health")[0] != 200:
        assert time.monotonic() < deadline and proc.poll() is None, "basic-auth server did not start"
        time.sleep(0.5)
    status, _ = call(uri, "/api/2.0/mlflow/users/create", {"username": "bob", "password":
                     "bob-" + ADMIN_PASSWORD}, user=("admin", ADMIN_PASSWORD))
    assert status == 200
    yield uri
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
