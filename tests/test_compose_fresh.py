"""Container tier: `docker compose -f compose/<file>.yml up` exactly as a user types it on a
machine that has none of the images, no `make` first. Compose must build what it needs and run
the job to one FINISHED run, and the job must print an address the user's browser can open.
Then, on the same stack (a stack of its own cost 40-60 s of CI each), what the team server,
Open MPI's launcher and Slurm must hold: the login, a server restart mid-job that loses
nothing, a wrong password refused in one line, ssh trust of only the job's keys, 2 x 2 on
ddplab's ccl, a study of Slurm jobs, scancel, a killed node or worker.

The images get names no one has built (DDPLAB_*_IMAGE), so the build path runs even where
`make images` ran before; Docker's build cache keeps that fast after the first time. The
images are removed afterwards.
"""

from __future__ import annotations

import subprocess
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
    # This runs before compose_factory's `down`: stop what still uses the images first. Only
    # containers made from these names: a fresh image built from the cache can be the very image
    # (same id) as `make images`' own, which another test running beside this one uses, and an
    # `ancestor=` filter would match its containers too.
    listed = sh(["docker", "ps", "-a", "--format", "{{.ID}}\t{{.Image}}"]).stdout.splitlines()
    ids = [line.split("\t")[0] for line in listed
           if line.split("\t")[-1] in set(names.values())]
    if ids:
        sh(["docker", "rm", "-f", "-v", *ids])  # -v: their anonymous volumes too
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


def test_compose_slurm_up_as_typed_then_2x2_on_ccl_a_study_scancel_and_a_killed_node(
        compose_factory, fresh_images):
    """slurm.yml as typed: the cluster's submit service runs `sbatch slurm/cpu.sbatch`. Then, on
    the same cluster (a cluster of its own cost ~60 s of CI), as a user on its login node:
    `sbatch` of 2 tasks on each of 2 nodes on ddplab's ccl (the layout that hung in oneCCL's
    first broadcast before ddplab told it each rank is alone on its host); `ddplab study run`,
    each variant an `sbatch --wait` job into its own child run of the study's parent run; then
    a job scancelled and a job whose node is killed."""
    c = up_as_typed(compose_factory, fresh_images, "slurm.yml")
    assert_as_typed(c, c.wait_run(finished, timeout=1800), "slurm.yml", fresh_images)
    out = c.up_output()
    assert "submitting as ddplab" in out and "job 1 ended with exit code 0" in out

    # The nodes have 2 CPUs (SLURM_CPUS' default): 2 tasks of 1 CPU each on both. The global
    # batch of the 2x1 job (64 = 4 ranks x 16) on a third more data than the quickstart's
    # reduced size: at 32 per rank, 4 ranks took 32 steps and reached 0.29, below the check.
    before = {r["info"]["run_id"] for r in c.runs()}
    job = sbatch(c, "data.train_samples=2048 data.eval_samples=512 train.epochs=2 "
                 "data.batch_size=16", backend="ccl", args="--ntasks-per-node=2 --cpus-per-task=1")
    assert job.wait(timeout=600) == 0, (job.stderr.read() if job.stderr else "") + c.logs()[-3000:]
    run = wait_new_run(c, before, finished, 60)
    t = tags(run)
    assert run["info"]["status"] == "FINISHED"
    assert (t["ddplab.launcher"], t["ddplab.world_size"], t["ddplab.nnodes"]) == ("slurm", "4", "2")
    assert (t["ddplab.backend"], t["ddplab.ccl_impl"]) == ("ccl", "ddplab")
    assert sorted(t["ddplab.hosts"].split(",")) == ["node1", "node2"]  # two hosts
    assert t["ddplab.slurm_job_id"] == "2" and t["ddplab.slurm_nodelist"] == "node[1-2]"
    name = t["mlflow.runName"]
    assert name.startswith("quickstart ccl 2n x 2r x ") and name.endswith("t slurm"), name
    assert metrics(run)["eval/accuracy"] > 0.3

    # The study, as a user on the login node types it: their own environment, not the one the
    # cluster's services were given (compose hands BACKEND and DDPLAB_SET to every service).
    script = (f"cat > /jobs/study.yaml <<'EOF'\n{STUDY}\nEOF\n"
              "cd /workspace && env -u BACKEND DDPLAB_SET='dist.threads_per_rank=1 "
              "dist.timeout_s=120 tracking.wait_s=60' ddplab study run /jobs/study.yaml --repeats 1")
    out = sh([*c.cmd, "exec", "-T", "-u", "ddplab", "slurmctld", "bash", "-c", script],
             env=c.env, cwd=REPO, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    children = [r for r in c.runs() if tags(r).get("ddplab.variant")]
    assert sorted(tags(r)["ddplab.variant"] for r in children) == ["1x1", "2x1"]
    for r in children:
        t = tags(r)
        assert r["info"]["status"] == "FINISHED" and t["ddplab.launcher"] == "slurm"
        assert t["ddplab.nnodes"] == ("2" if t["ddplab.variant"] == "2x1" else "1")
        assert t["ddplab.slurm_job_id"] and t["mlflow.parentRunId"]
    assert "2x1" in out.stdout and "1x1" in out.stdout  # the report's table
    assert "http://mlflow:5000/#" not in out.stdout  # only addresses the browser can open
    scancel_then_kill_a_node(c)


# The scancelled and the killed job must still be running when they are stopped: the cluster's
# quickstart ended between its first delivered train/loss and the kill once (CI, FINISHED).
LONG = "train.epochs=40"

# The template asks 2 CPUs a task: on the 2-CPU nodes, one task a node.
STUDY = """
name: slurm-layouts
experiment: /workspace/experiments/quickstart.yaml
set: {data.train_samples: 1536, data.eval_samples: 512, train.epochs: 2}
baseline: 2x1
variants:
  - {name: 2x1, nnodes: 2, nproc: 1, launcher: slurm}
  - {name: 1x1, nnodes: 1, nproc: 1, launcher: slurm}
"""


def sbatch(c: Compose, more: str = "", backend: str = "gloo", args: str = "") -> subprocess.Popen:
    """`sbatch --wait slurm/cpu.sbatch` as user ddplab on the running cluster's login node, as
    compose/slurm.yml's header tells a user to submit more jobs (the job gets the environment
    compose gave the cluster). Not resumed: the cluster's last checkpoint is another layout's.
    On gloo by default: a dead peer closes gloo's sockets at once, while oneCCL waits for it
    until dist.timeout_s."""
    submit = (f'BACKEND={backend} DDPLAB_SET="$DDPLAB_SET checkpoint.resume=never {more}" exec '
              f"sbatch --wait {args} --output=/jobs/ddplab-%j.out slurm/cpu.sbatch "
              "experiments/quickstart.yaml")
    return subprocess.Popen([*c.cmd, "exec", "-T", "-u", "ddplab", "-w", "/workspace",
                             "slurmctld", "sh", "-c", submit],
                            env=c.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_new_run(c: Compose, before: set[str], predicate, timeout: float) -> dict:
    """The newest run not in ``before``, once it satisfies ``predicate``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = [r for r in c.runs() if r["info"]["run_id"] not in before]
        if new and predicate(new[0]):
            return new[0]
        time.sleep(2)
    raise AssertionError(f"no new run within {timeout:.0f} s:\n{c.logs()[-3000:]}")


def scancel_then_kill_a_node(c: Compose) -> None:
    """On a running cluster: scancel sends SIGTERM to every process of a job, so its ranks end
    the run FAILED ("terminated by SIGTERM") and the delivery process outlives them to send
    that; then a node killed mid-job fails the next job in bounded time."""
    before = {r["info"]["run_id"] for r in c.runs()}
    job = sbatch(c, LONG)
    wait_new_run(c, before, lambda r: "train/loss" in metrics(r), 400)
    t0 = time.monotonic()
    assert exec_in(c, "slurmctld", "scancel -u ddplab").returncode == 0
    run = wait_new_run(c, before, finished, 60)
    assert run["info"]["status"] == "FAILED" and time.monotonic() - t0 < 60
    assert "SIGTERM" in tags(run)["ddplab.error"]
    time.sleep(5)
    assert wait_new_run(c, before, finished, 10)["info"]["status"] == "FAILED"  # and it stays so
    assert job.wait(timeout=60) != 0

    before = {r["info"]["run_id"] for r in c.runs()}
    job = sbatch(c, LONG)
    wait_new_run(c, before, lambda r: "train/loss" in metrics(r), 400)
    victim = sh(["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={c.project}",
                 "--filter", "label=com.docker.compose.service=node2"]).stdout.split()
    t0 = time.monotonic()
    sh(["docker", "kill", *victim])  # rank 1 (node1, the first host, holds rank 0)
    run = wait_new_run(c, before, finished, 180)
    assert run["info"]["status"] == "FAILED" and time.monotonic() - t0 < 180
    assert job.wait(timeout=max(1.0, t0 + 180 - time.monotonic())) != 0
