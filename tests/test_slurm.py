"""Container tier: a real Slurm cluster (compose/slurm.yml: slurmctld, two slurmd nodes, MUNGE)
runs `sbatch slurm/cpu.sbatch`; checked through MLflow's REST API. Needs the images
(`make image-slurm image-mlflow`; CI builds them, see .ci/run)."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.conftest import REPO
from tests.helpers.containers import SMALL, exec_in, finished, metrics, sh, tags, wait_exits

pytestmark = pytest.mark.container
IMAGES = ("ddplab/slurm:latest", "ddplab/mlflow:latest")


@pytest.fixture(scope="module", autouse=True)
def images() -> None:
    if sh(["docker", "info"], timeout=30).returncode:
        pytest.fail("no Docker engine: start dockerd (`docker info` must answer)")
    for image in IMAGES:
        if sh(["docker", "image", "inspect", image], timeout=30).returncode:
            pytest.fail(f"{image} is missing: `make image-slurm image-mlflow` (CI: see .ci/run)")


def cluster(compose_factory, **env: str):  # noqa: F811 - the fixture, passed on
    c = compose_factory(2, 1, file="slurm.yml", service="submit", **env)
    c.up()
    return c


# The scancelled and the killed job must still be running when they are stopped: the cluster's
# quickstart ended between its first delivered train/loss and the kill once (CI, FINISHED).
LONG = "train.epochs=40"


def sbatch(c, more: str = "") -> subprocess.Popen:
    """`sbatch --wait slurm/cpu.sbatch` as user ddplab on the running cluster's login node, as
    compose/slurm.yml's header tells a user to submit more jobs (the job gets the environment
    compose gave the cluster, DDPLAB_SET's data sizes included). Not resumed: the quickstart's
    last checkpoint on this cluster is another layout's. On gloo, as the cluster's default (its
    BACKEND here is ccl): a dead peer closes gloo's sockets at once, while oneCCL waits for it
    until dist.timeout_s."""
    submit = (f'BACKEND=gloo DDPLAB_SET="$DDPLAB_SET checkpoint.resume=never {more}" exec sbatch '
              "--wait --output=/jobs/ddplab-%j.out slurm/cpu.sbatch experiments/quickstart.yaml")
    return subprocess.Popen([*c.cmd, "exec", "-T", "-u", "ddplab", "-w", "/workspace",
                             "slurmctld", "sh", "-c", submit],
                            env=c.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_new_run(c, before: set[str], predicate, timeout: float) -> dict:
    """The newest run not in ``before``, once it satisfies ``predicate``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = [r for r in c.runs() if r["info"]["run_id"] not in before]
        if new and predicate(new[0]):
            return new[0]
        time.sleep(2)
    raise AssertionError(f"no new run within {timeout:.0f} s:\n{c.logs()[-3000:]}")


def scancel_then_kill_a_node(c) -> None:
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


STUDY = """
name: slurm-layouts
experiment: /workspace/experiments/quickstart.yaml
set: {data.train_samples: 1536, data.eval_samples: 512, train.epochs: 2}
baseline: 2x1
variants:
  - {name: 2x1, nnodes: 2, nproc: 1, launcher: slurm}
  - {name: 1x2, nnodes: 1, nproc: 2, launcher: slurm}
"""


def test_one_slurm_cluster_sbatch_2x2_on_ccl_a_study_scancel_and_a_killed_node(compose_factory):  # noqa: F811
    """The cluster's own `sbatch slurm/cpu.sbatch`: srun with 2 tasks on each of 2 nodes, on
    ddplab's ccl (the layout that hung in oneCCL's first broadcast before ddplab told it each
    rank is alone on its host). Then, on the same cluster (one start-up, not four: each cost
    ~60 s of CI), `ddplab study run` on its login node (the controller): each variant is an
    `sbatch --wait` job into its own child run of the study's parent run; then a job scancelled
    and a job whose node is killed."""
    # Nodes of 4 CPUs: the study's 1x2 asks 2 tasks x --cpus-per-task 2 (the template's) of one.
    c = cluster(compose_factory, BACKEND="ccl", SLURM_CPUS="4",
                SBATCH_ARGS="--ntasks-per-node=2 --cpus-per-task=1",
                # The 2x1 tests' global batch (64 = 4 ranks x 16) on a third more data: at the
                # quickstart's 32 per rank, 4 ranks took 32 steps and reached 0.29, below the check.
                DDPLAB_SET=SMALL.replace("--set ", "").replace("1536", "2048") + " data.batch_size=16")
    codes = wait_exits(c, "submit", 1, time.monotonic() + 600)
    assert codes == [0], c.up_output()[-4000:]
    run = c.wait_run(finished, timeout=60)
    t = tags(run)
    assert run["info"]["status"] == "FINISHED"
    assert (t["ddplab.launcher"], t["ddplab.world_size"], t["ddplab.nnodes"]) == ("slurm", "4", "2")
    assert (t["ddplab.backend"], t["ddplab.ccl_impl"]) == ("ccl", "ddplab")
    assert sorted(t["ddplab.hosts"].split(",")) == ["node1", "node2"]  # two hosts
    assert t["ddplab.slurm_job_id"] == "1" and t["ddplab.slurm_nodelist"] == "node[1-2]"
    name = t["mlflow.runName"]
    assert name.startswith("quickstart ccl 2n x 2r x ") and name.endswith("t slurm"), name
    assert metrics(run)["eval/accuracy"] > 0.3
    out = c.up_output()
    assert "submitting as ddplab" in out and "job 1 ended with exit code 0" in out

    # The study, as a user on the login node types it: their own environment, not the one the
    # first job was given (compose hands BACKEND and DDPLAB_SET to every service).
    script = (f"cat > /jobs/study.yaml <<'EOF'\n{STUDY}\nEOF\n"
              "cd /workspace && env -u BACKEND DDPLAB_SET='dist.threads_per_rank=1 "
              "dist.timeout_s=120 tracking.wait_s=60' ddplab study run /jobs/study.yaml --repeats 1")
    out = sh([*c.cmd, "exec", "-T", "-u", "ddplab", "slurmctld", "bash", "-c", script],
             env=c.env, cwd=REPO, timeout=900)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    children = [r for r in c.runs() if tags(r).get("ddplab.variant")]
    assert sorted(tags(r)["ddplab.variant"] for r in children) == ["1x2", "2x1"]
    for r in children:
        t = tags(r)
        assert r["info"]["status"] == "FINISHED" and t["ddplab.launcher"] == "slurm"
        assert t["ddplab.nnodes"] == ("2" if t["ddplab.variant"] == "2x1" else "1")
        assert t["ddplab.slurm_job_id"] and t["mlflow.parentRunId"]
    assert "2x1" in out.stdout and "1x2" in out.stdout  # the report's table
    assert "http://mlflow:5000/#" not in out.stdout  # only addresses the browser can open
    scancel_then_kill_a_node(c)
