"""Container tier: `docker compose -f compose/<file>.yml up` exactly as a user types it on a
machine that has none of the images, no `make` first. Compose must build what it needs and run
the job to one FINISHED run, and the job must print an address the user's browser can open.
Then, on the same stack (a stack of its own cost ~40 s of CI each), what the team server and
Open MPI's launcher must hold: the login, a server restart mid-job that loses nothing, a wrong
password refused in one line, ssh trust of only the job's keys, a killed node or worker.

The images get names no one has built (DDPLAB_*_IMAGE), so the build path runs even where
`make images` ran before; Docker's build cache keeps that fast after the first time. The
images are removed afterwards.
"""

from __future__ import annotations

import time
import urllib.error
import uuid

import pytest

from tests.conftest import REPO
from tests.helpers.containers import (
    Compose,
    all_runs,
    exec_in,
    finished,
    kill_a_node_without_rank0,
    metric_steps,
    metrics,
    sh,
    tags,
    train_again,
    wait_exits,
)

pytestmark = pytest.mark.container


def _image_exists(name: str) -> bool:
    return sh(["docker", "image", "inspect", name], timeout=30).returncode == 0


@pytest.fixture
def fresh_images():
    prefix = f"ddplabfresh{uuid.uuid4().hex[:8]}"
    names = {"DDPLAB_CPU_IMAGE": f"{prefix}/cpu-oneccl:latest",
             "DDPLAB_MLFLOW_IMAGE": f"{prefix}/mlflow:latest",
             "DDPLAB_POSTGRES_IMAGE": f"{prefix}/postgres:latest",
             "DDPLAB_MPI_IMAGE": f"{prefix}/openmpi:latest",
             "DDPLAB_SLURM_IMAGE": f"{prefix}/slurm:latest"}
    yield names
    # This runs before compose_factory's `down`: stop what still uses the images first.
    for name in names.values():
        ids = sh(["docker", "ps", "-aq", "--filter", f"ancestor={name}"]).stdout.split()
        if ids:
            sh(["docker", "rm", "-f", *ids])
    left = [n for n in names.values() if _image_exists(n)]
    if left:
        sh(["docker", "rmi", *left], timeout=300)


# file -> (the service the job runs in, its launcher, the image built on the CPU one, the
# service that exits when the job is done and how many of it)
CASES = {"multinode.yml": ("node", "torchrun", "", "node", 2),
         "mpi.yml": ("worker", "openmpi", "DDPLAB_MPI_IMAGE", "launcher", 1),
         "slurm.yml": ("submit", "slurm", "DDPLAB_SLURM_IMAGE", "submit", 1)}


def up_as_typed(compose_factory, fresh_images: dict[str, str], file: str) -> Compose:
    assert not any(_image_exists(n) for n in fresh_images.values())
    c = compose_factory(2, 1, file=file, service=CASES[file][0], **fresh_images)
    c.up()
    return c


def assert_as_typed(c: Compose, run: dict, file: str, fresh_images: dict[str, str]) -> None:
    """One FINISHED run of both nodes, the images compose built, the browser's address."""
    _, launcher, on_cpu, ends, count = CASES[file]
    assert run["info"]["status"] == "FINISHED", c.logs()[-4000:]
    t = tags(run)
    assert (t["ddplab.launcher"], t["ddplab.world_size"]) == (launcher, "2")
    assert len(t["ddplab.hosts"].split(",")) == 2 and len(c.runs()) == 1
    built = [n for n in fresh_images.values() if _image_exists(n)]
    # Every file includes tracking.yml: its PostgreSQL image is built too.
    expected = ["DDPLAB_CPU_IMAGE", "DDPLAB_MLFLOW_IMAGE", "DDPLAB_POSTGRES_IMAGE"]
    assert sorted(built) == sorted(fresh_images[k] for k in expected + ([on_cpu] if on_cpu else []))
    assert t["ddplab.image"] == fresh_images[on_cpu or "DDPLAB_CPU_IMAGE"]
    # The address printed is the browser's (the published port), never the in-network name.
    route = f"http://localhost:{c.port}/#/experiments/{run['info']['experiment_id']}/runs/"
    exited = wait_exits(c, ends, count, time.monotonic() + 120)
    assert exited and set(exited) == {0}
    logs = c.logs()
    assert route + run["info"]["run_id"] in logs and "http://mlflow:5000/#" not in logs


def test_compose_up_as_typed_on_the_team_server_restarted_mid_job_then_a_wrong_password_and_a_killed_node(
        compose_factory, fresh_images):
    """compose/tracking.yml: MLflow on PostgreSQL behind its login. An anonymous client gets 401;
    restarting the server mid-job loses no metric (the job's spool delivers what it missed);
    a job with a wrong password refuses at start, in one line, before any process group; then
    the nodes train again and one is killed mid-job: the run ends FAILED, both nodes exit
    non-zero in bounded time, and the verdict names the rank whose node vanished."""
    c = up_as_typed(compose_factory, fresh_images, "multinode.yml")
    # A cold machine builds torch's layer first (minutes); a warm build cache takes seconds.
    c.wait_run(lambda r: "train/loss" in metrics(r), timeout=1800)
    with pytest.raises(urllib.error.HTTPError) as anonymous:
        all_runs(c.base)
    assert anonymous.value.code == 401
    restart = sh([*c.cmd, "restart", "mlflow"], env=c.env, cwd=REPO)
    assert restart.returncode == 0, restart.stderr
    run = c.wait_run(finished, timeout=600)
    assert_as_typed(c, run, "multinode.yml", fresh_images)
    m = metrics(run)
    for node in range(2):  # every node's system metrics reached the restarted server
        assert any(k.startswith(f"system/node{node}/cpu_utilization") for k in m), sorted(m)
    steps = metric_steps(c, run["info"]["run_id"], "train/loss")
    every = steps[1] - steps[0]
    assert steps == list(range(every, steps[-1] + 1, every)), steps  # no hole from the restart
    last = {x["key"]: x["step"] for x in run["data"]["metrics"]}
    epochs = int(m["epoch/epoch"])  # the quickstart's 3, to the end
    assert epochs == 3 and steps[-1] == last["epoch/epoch"]
    assert metric_steps(c, run["info"]["run_id"], "epoch/time_s") == [
        last["epoch/epoch"] // epochs * e for e in range(1, epochs + 1)]
    wrong = sh([*c.cmd, "run", "--rm", "--no-deps", "-e", "MLFLOW_TRACKING_USERNAME=admin",
                "-e", "MLFLOW_TRACKING_PASSWORD=not-the-password", "node", "ddplab", "train",
                "experiments/quickstart.yaml"], env=c.env, cwd=REPO)
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr
    assert "MLFLOW_TRACKING_PASSWORD: the tracking server" in wrong.stderr
    assert "Traceback" not in wrong.stderr and len(c.runs()) == 1  # no second run was made

    # A new job (not the finished one resumed), long enough to be killed mid-job.
    c.env["DDPLAB_SET"] = "train.epochs=20 checkpoint.resume=never"
    t0 = kill_a_node_without_rank0(c, train_again(c, c.service))
    codes = wait_exits(c, c.service, 2, t0 + 240)
    assert len(codes) == 2 and all(code != 0 for code in codes), codes
    assert time.monotonic() - t0 < 240
    verdict = ""
    while not verdict and time.monotonic() < t0 + 300:
        verdict = tags(c.runs()[0]).get("ddplab.verdict", "")
        time.sleep(2)
    assert verdict.startswith("rank 1 reported nothing (their node lost?); rank 0 stopped"), verdict


def test_compose_mpi_up_as_typed_then_2x2_on_ccl_then_only_its_keys_are_trusted_and_a_killed_worker_fails(
        compose_factory, fresh_images):
    """mpi.yml as typed (2 workers x 1 slot); then, on the same stack, 2 x 2 on ddplab's ccl to
    FINISHED (mpirun forwards what ccl needs); then a 2 x 1 job during which the launcher trusts
    only this job's host keys (no TOFU, no key swapped between workers), and whose worker,
    killed mid-job, fails it in bounded time (Open MPI is fail-stop). On gloo: a dead peer
    closes gloo's sockets at once, while oneCCL waits for it until dist.timeout_s."""
    c = up_as_typed(compose_factory, fresh_images, "mpi.yml")
    assert_as_typed(c, c.wait_run(finished, timeout=1800), "mpi.yml", fresh_images)
    # The workers stop once their job ends; the next `up` must find them stopped (one still
    # stopping is left out of it: CI saw the next job wait for a worker that never came).
    assert wait_exits(c, c.service, 2, time.monotonic() + 120) == [0, 0]

    c.env.update(SLOTS="2", NPROC_PER_NODE="2",
                 DDPLAB_SET="dist.backend=ccl data.train_samples=2048 checkpoint.resume=never")
    first = train_again(c, "launcher", c.service)["info"]["run_id"]
    run = c.wait_run(lambda r: r["info"]["run_id"] == first and finished(r), timeout=600)
    assert run["info"]["status"] == "FINISHED", c.logs()[-4000:]
    t = tags(run)
    assert (t["ddplab.launcher"], t["ddplab.world_size"], t["ddplab.nnodes"]) == ("openmpi", "4", "2")
    assert (t["ddplab.backend"], t["ddplab.backend_requested"]) == ("ccl", "ccl")
    assert len(t["ddplab.hosts"].split(",")) == 2
    assert t["ddplab.image"] == fresh_images["DDPLAB_MPI_IMAGE"]
    deadline = time.monotonic() + 120
    assert wait_exits(c, "launcher", 1, deadline) == [0]
    assert wait_exits(c, c.service, 2, deadline) == [0, 0]  # workers stop at the end

    c.env.update(SLOTS="1", NPROC_PER_NODE="1", DDPLAB_SET="train.epochs=20 checkpoint.resume=never")
    run = train_again(c, "launcher", c.service)
    assert tags(run)["ddplab.world_size"] == "2"
    ssh = ("ssh -p 2222 -i ~/.ssh/ddplab_job_ed25519 -o BatchMode=yes -o StrictHostKeyChecking=yes "
           "-o ConnectTimeout=5")
    ips = exec_in(c, "launcher", "getent ahostsv4 worker | awk '{print $1}' | sort -u").stdout.split()
    assert len(ips) == 2
    ok = exec_in(c, "launcher", f"{ssh} -o UserKnownHostsFile=~/.ssh/ddplab_known_hosts {ips[0]} true")
    assert ok.returncode == 0, ok.stderr
    # An empty known_hosts: the worker's key is unknown, and ssh refuses it (no TOFU).
    unknown = exec_in(c, "launcher", f"{ssh} -o UserKnownHostsFile=/dev/null {ips[0]} true")
    assert unknown.returncode != 0 and "Host key verification failed" in unknown.stderr
    # Worker 0's key presented as worker 1's: refused as well.
    known = exec_in(c, "launcher", "cat ~/.ssh/ddplab_known_hosts").stdout.splitlines()
    other_key = next(line for line in known if line.startswith(f"[{ips[1]}]")).split(" ", 1)[1]
    swapped = exec_in(c, "launcher", f"echo '[{ips[0]}]:2222 {other_key}' > /tmp/kh && "
                      f"{ssh} -o UserKnownHostsFile=/tmp/kh {ips[0]} true")
    assert swapped.returncode != 0, swapped.stderr

    t0 = kill_a_node_without_rank0(c, run)
    codes = wait_exits(c, "launcher", 1, t0 + 240)
    assert codes and codes[0] != 0
    assert time.monotonic() - t0 < 240  # Open MPI is fail-stop: no hang


def test_compose_slurm_up_as_typed_builds_its_images_and_runs_the_job(compose_factory, fresh_images):
    """slurm.yml as typed: the cluster's submit service runs `sbatch slurm/cpu.sbatch` (the
    cluster's other checks run in tests/test_slurm.py, on `make images`' images)."""
    c = up_as_typed(compose_factory, fresh_images, "slurm.yml")
    assert_as_typed(c, c.wait_run(finished, timeout=1800), "slurm.yml", fresh_images)
