"""Container tier: the real Docker engine, the images from docker/, `make run-cpu-oneccl` and
`docker compose -f compose/multinode.yml up`, checked through MLflow's REST API.

Needs a running engine and the images (`make images`; CI builds them, see .ci/run).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import REPO, runs
from tests.helpers import faulty_experiment, free_port
from tests.helpers.containers import (
    CPU_IMAGE,
    MLFLOW_IMAGE,
    MPI_IMAGE,
    POSTGRES_IMAGE,
    SMALL,
    finished,
    metrics,
    need_images,
    rest,
    sh,
    tags,
    wait_exits,
)

# No xdist_group: these tests share nothing but the images, so `--dist loadgroup` spreads them
# over both workers beside the compose tests (the k8s emulation's module stays on one worker).
pytestmark = pytest.mark.container


@pytest.fixture(scope="module", autouse=True)
def images() -> None:
    need_images(CPU_IMAGE, MLFLOW_IMAGE, MPI_IMAGE, POSTGRES_IMAGE)


NATIVE_TORCH = __import__("torch").__version__.split("+")[0]


def test_images_carry_their_versions_and_run_as_non_root():
    labels = json.loads(sh(["docker", "image", "inspect", CPU_IMAGE]).stdout)[0]["Config"]
    assert labels["Labels"]["io.ddplab.torch"] == NATIVE_TORCH  # the same PyTorch as natively
    assert labels["Labels"]["io.ddplab.with-oneccl"] in ("auto", "0", "1")
    assert labels["Labels"]["io.ddplab.stack"] == "native"
    assert labels["User"] == "10001"
    who = sh(["docker", "run", "--rm", CPU_IMAGE, "sh", "-c", "id -u; cat /opt/ddplab/image.json"])
    assert who.returncode == 0, who.stderr
    uid, found = who.stdout.split("\n", 1)
    assert uid == "10001" and json.loads(found)["torch"].split("+")[0] == NATIVE_TORCH
    asked, got = labels["Labels"]["io.ddplab.with-oneccl"], json.loads(found)["oneccl_bind_pt"]
    assert (asked, got == "absent") not in (("1", True), ("0", False))  # the build kept its word
    assert json.loads(found)["ddplab_ccl"] == "2022.2.0"  # ddplab's own ccl loads in the image


@pytest.mark.parametrize("image", [CPU_IMAGE, MLFLOW_IMAGE, MPI_IMAGE])
def test_pip_freeze_in_each_image_agrees_with_the_lock(image):
    """Every package an image shares with requirements.lock has the lock's version (torch may
    carry a local build label, +cpu, when PyTorch's CPU index served it)."""
    sys.path.insert(0, str(REPO / "docker"))
    from lock_subset import entries

    lock = {n.lower().replace("_", "-"): v for n, v, _ in entries((REPO / "requirements.lock").read_text())}
    out = sh(["docker", "run", "--rm", "--entrypoint", "pip", image, "freeze", "--all"])
    assert out.returncode == 0, out.stderr
    frozen = dict(line.split("==", 1) for line in out.stdout.splitlines() if "==" in line)
    frozen = {n.lower().replace("_", "-"): v.split("+")[0] for n, v in frozen.items()}
    shared = set(lock) & set(frozen)
    assert len(shared) > 50 and "mlflow" in shared
    assert {n: (lock[n], frozen[n]) for n in shared if lock[n] != frozen[n]} == {}


CUDA_IMAGE = "ddplab/cuda-nccl:latest"


def test_the_cuda_image_is_the_locks_torch_with_nccl_and_says_no_gpu_cleanly():
    """Built in CI without a GPU: torch's CUDA build with NCCL, the lock's version; ddplab doctor
    reports zero devices instead of failing. (Its quickstart on a real GPU: see docs/containers.md.)"""
    probe = ("import torch, torch.distributed as d; "
             "print(torch.__version__.split('+')[0], torch.version.cuda is not None, d.is_nccl_available())")
    out = sh(["docker", "run", "--rm", "--entrypoint", "python", CUDA_IMAGE, "-c", probe])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [NATIVE_TORCH, "True", "True"]
    doctor = sh(["docker", "run", "--rm", CUDA_IMAGE, "ddplab", "doctor"])
    assert "Traceback" not in doctor.stderr and "cuda         0 device(s)" in doctor.stdout, \
        doctor.stdout + doctor.stderr


def oneccl_in_image() -> bool:
    """What the build installed (image.json), not what it asked for."""
    out = sh(["docker", "run", "--rm", CPU_IMAGE, "cat", "/opt/ddplab/image.json"])
    return json.loads(out.stdout)["oneccl_bind_pt"] != "absent"


def test_the_mlflow_image_serves_the_ui_opening_on_the_runs():
    """The compose and Kubernetes tracking server is ddplab's MLflow app (--app-name ddplab):
    its page stores the model-training view on a browser's first visit, as `make ui`'s does."""
    port = free_port()
    cid = sh(["docker", "run", "-d", "--rm", "-p", f"127.0.0.1:{port}:5000", "-e",
              f"MLFLOW_ALLOWED_HOSTS=127.0.0.1:{port}", MLFLOW_IMAGE]).stdout.strip()
    try:
        deadline, page = time.monotonic() + 120, b""
        while time.monotonic() < deadline and not page:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
                    page = r.read()
            except OSError:
                time.sleep(1)
        assert b"mlflow.workflowType_v1" in page and b"static-files/static/js/main" in page
    finally:
        sh(["docker", "rm", "-f", "-v", cid])  # -v: the image's VOLUME too (its store)


def test_dockerfiles_lint_clean():
    out = sh([str(Path(sys.executable).parent / "hadolint"), *map(str, REPO.glob("docker/*/Dockerfile"))])
    assert out.returncode == 0, out.stdout + out.stderr


def store_keeping_artifacts_in(tmp_path: Path, experiment: str) -> str:
    """A store in ``tmp_path`` whose experiment keeps its artifacts there too. make's container
    runs in the checkout, where a new SQL store's experiment would put them (MLflow's default
    ./mlruns): each of these tests left a run's artifacts in the developer's clone."""
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(store).create_experiment(experiment, artifact_location=str(tmp_path / "artifacts"))
    return store


def test_make_run_cpu_oneccl_gives_one_honest_run(tmp_path):
    store = store_keeping_artifacts_in(tmp_path, "quickstart")
    out = sh(["make", "run-cpu-oneccl", f"MLFLOW_TRACKING_URI={store}",
              f"DOCKER_ARGS=-v {tmp_path}:{tmp_path}", f"ARGS={SMALL} --set checkpoint.dir={tmp_path}/ck"],
             cwd=REPO, env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (run,) = runs(store)
    t = run.data.tags
    assert run.info.status == "FINISHED" and t["ddplab.world_size"] == "2"
    assert t["ddplab.backend_requested"] == "ccl"
    assert run.info.artifact_uri.startswith(str(tmp_path)), run.info.artifact_uri  # not the clone
    # Real oneCCL in every CPU image: Intel's bindings where the build could install them,
    # else ddplab's own backend, compiled into the image; the run says which.
    assert t["ddplab.backend"] == "ccl" and "fallback" not in t["ddplab.backend_reason"]
    assert t["ddplab.ccl_impl"] == ("intel-bindings" if oneccl_in_image() else "ddplab")
    assert "ccl (" in out.stderr  # the start line names the backend
    assert t["ddplab.image"].startswith("ddplab/cpu-oneccl:")
    assert t["ddplab.version.torch"].split("+")[0] == NATIVE_TORCH
    assert t["ddplab.ipex"].startswith("not used")  # IPEX lives in the Intel image only


@pytest.mark.parametrize("experiment, extra, metric", [
    ("experiments/examples/spirals.yaml", "--set train.epochs=2", "eval/accuracy"),
    ("experiments/lm-tiny.yaml", "--set train.max_steps=40 --set train.eval_every_steps=20",
     "eval/perplexity"),
])
def test_your_own_experiment_and_lm_tiny_run_in_the_cpu_image(tmp_path, experiment, extra, metric):
    """The user's module beside its experiment (spirals.py) and the GPT on the documentation's bytes,
    in the CPU image on ddplab's ccl, as `make run-cpu-oneccl` runs them."""
    store = store_keeping_artifacts_in(tmp_path, Path(experiment).stem)
    out = sh(["make", "run-cpu-oneccl", f"MLFLOW_TRACKING_URI={store}", f"EXPERIMENT={experiment}",
              f"DOCKER_ARGS=-v {tmp_path}:{tmp_path}", f"ARGS={extra} --set checkpoint.dir={tmp_path}/ck"],
             cwd=REPO, env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.tags["ddplab.backend"] == "ccl"
    assert run.data.tags["ddplab.image"].startswith("ddplab/cpu-oneccl:") and metric in run.data.metrics
    assert run.info.artifact_uri.startswith(str(tmp_path)), run.info.artifact_uri  # not the clone
    if "spirals" in experiment:
        assert run.data.tags["ddplab.user.model"] == "spirals:mlp"


@pytest.mark.parametrize("file, service", [("multinode.yml", "node"), ("mpi.yml", "launcher")])
def test_compose_keeps_the_experiments_backend_unless_backend_is_set(file, service):
    """compose put dist.backend=auto into DDPLAB_SET, which outranks the experiment file: an
    experiment's backend: ccl silently ran auto. Now only BACKEND=... sets one, without a
    warning about an unset variable."""
    def ddplab_set(backend: str | None) -> tuple[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "BACKEND"}
        if backend is not None:
            env["BACKEND"] = backend
        out = sh(["docker", "compose", "-f", str(REPO / "compose" / file), "config", "--format",
                  "json"], env=env, cwd=REPO)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["services"][service]["environment"]["DDPLAB_SET"], out.stderr

    unset, warned = ddplab_set(None)
    assert "dist.backend" not in unset and "BACKEND" not in warned
    assert "dist.backend=gloo" in ddplab_set("gloo")[0]


def test_compose_multinode_2x2_on_ddplabs_ccl_then_the_books_script_then_a_hang_across_nodes(
        compose_factory, tmp_path):
    """`docker compose -f compose/multinode.yml up` with 2 containers x 2 ranks on ccl, the layout
    that hung in oneCCL's first broadcast until ddplab stopped telling oneCCL the true ranks per
    host across nodes (distributed/oneccl.py, ccl_env_defaults): ofi, libfabric's tcp provider between the
    containers, the key-value store's address passed through the c10d Store. One FINISHED run of
    world size 4 with every node's system metrics. (2 x 1 runs as typed in test_compose_fresh,
    with the team server's checks; one 2 x 2 job, not one per backend: each cost ~50 s of CI.)
    Then, on the same stack (a stack of its own cost ~20 s of CI), script mode across
    containers: the book's chapter 9 gloo script, unchanged but for its --synthetic flag, as
    EXPERIMENT on 2 x 1: one FINISHED run with both nodes' system metrics and every rank's logs.
    Last, a hang across the containers: the user's dataset sleeps on rank 1, alone on the other
    node, at step 7; the run says so in one line, with each node's stacks."""
    c = compose_factory(2, 2, DDPLAB_SET="dist.backend=ccl data.train_samples=2048")  # the user's wins
    c.up()
    run = c.wait_run(finished, timeout=600)
    assert run["info"]["status"] == "FINISHED", c.logs()[-4000:]
    t, m = tags(run), metrics(run)
    assert (t["ddplab.backend"], t["ddplab.ccl_impl"], t["ddplab.nnodes"]) == ("ccl", "ddplab", "2")
    assert t["ddplab.world_size"] == "4" and len(t["ddplab.hosts"].split(",")) == 2
    for node in range(2):
        assert any(k.startswith(f"system/node{node}/cpu_utilization") for k in m), sorted(m)
    assert m["eval/accuracy"] > 0.3  # the collectives summed the right gradients
    assert len(c.runs()) == 1  # one job, one run
    assert wait_exits(c, c.service, 2, time.monotonic() + 120) == [0, 0]

    c.env.update(NPROC_PER_NODE="1", EXPERIMENT="experiments/scripts/gloo_distributed-cnn_cifar10.py",
                 DDPLAB_SET="script.flags.synthetic=128")
    again = sh([*c.cmd, "up", "-d", "--no-deps", c.service], env=c.env, cwd=REPO)
    assert again.returncode == 0, again.stderr
    run = c.wait_run(lambda r: tags(r).get("ddplab.mode") == "script" and finished(r), timeout=600)
    assert run["info"]["status"] == "FINISHED", c.logs()[-4000:]
    t, m = tags(run), metrics(run)
    assert t["ddplab.backend"] == "gloo" and t["ddplab.world_size"] == "2"
    assert len(t["ddplab.hosts"].split(",")) == 2
    for node in range(2):
        assert any(k.startswith(f"system/node{node}/") for k in m), sorted(m)
    # Each node's delivery sends its rank's log as the node ends: read them once both have
    # (CI saw rank 1's not there yet when the run had just FINISHED).
    assert wait_exits(c, c.service, 2, time.monotonic() + 120) == [0, 0]
    arts = rest(c.base, f"/api/2.0/mlflow/artifacts/list?run_id={run['info']['run_id']}&path=logs",
                login=c.login())
    assert {f["path"] for f in arts.get("files", [])} >= {"logs/rank0.stdout.txt",
                                                         "logs/rank1.stdout.txt"}
    assert len(c.runs()) == 2
    assert_a_hang_across_nodes_is_named(c, tmp_path)


def assert_a_hang_across_nodes_is_named(c, tmp_path: Path) -> None:
    """Each node's watch (in its delivery process) sees its own rank's heartbeat stop past
    dist.hang_after_s (8 s), takes that rank's stack and ends it; rank 0's node reads the other
    node's endings from the run and names the rank behind and its host, long before
    dist.timeout_s (120 s here). The experiment's files are copied into the node containers,
    as a user's own files reach a node (the image holds only ddplab's experiments)."""
    folder = tmp_path / "faulty"
    folder.mkdir()
    faulty_experiment(folder, fault="sleep", step=7)
    c.env.update(EXPERIMENT="faulty/faulty.yaml", DDPLAB_SET="")
    created = sh([*c.cmd, "up", "--no-start", "--no-deps", c.service], env=c.env, cwd=REPO)
    assert created.returncode == 0, created.stderr
    ids = sh(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={c.project}",
              "--filter", f"label=com.docker.compose.service={c.service}"]).stdout.split()
    assert len(ids) == 2, ids
    for i in ids:
        copied = sh(["docker", "cp", f"{folder}/.", f"{i}:/workspace/faulty"])
        assert copied.returncode == 0, copied.stderr
    before = {r["info"]["run_id"] for r in c.runs()}
    started = sh([*c.cmd, "start", c.service], env=c.env, cwd=REPO)
    assert started.returncode == 0, started.stderr
    run = c.wait_run(lambda r: r["info"]["run_id"] not in before and "train/loss" in metrics(r),
                     timeout=400)
    t0 = time.monotonic()  # training: rank 1 stops at step 7, a few seconds on
    run = c.wait_run(lambda r: r["info"]["run_id"] not in before and finished(r), timeout=240)
    assert run["info"]["status"] == "FAILED" and time.monotonic() - t0 < 8 + 120, c.logs()[-4000:]
    # Rank 0 ends the run FAILED with what it saw; the verdict over both nodes' endings comes
    # from its node's delivery process a moment later (it waits up to 15 s for node 1's).
    run_id = run["info"]["run_id"]
    t = tags(c.wait_run(lambda r: r["info"]["run_id"] == run_id and "ddplab.verdict" in tags(r),
                        timeout=120))
    (other,) = [h for h in t["ddplab.hosts"].split(",") if h != t["ddplab.rank0_host"]]
    error = t["ddplab.error"]
    assert error.startswith(f"rank 1 (host {other}) stopped at step 7 in data loading "), error
    # Each node's watch stops its own rank: rank 0 is found waiting in the gradient all-reduce,
    # or, when node 1's watch fired first, stopped by its peer's end.
    assert ("rank 0 waits in backward (gradient all-reduce)" in error
            or "rank 0 stopped after it" in error), error
    found = set()
    for node in ("node0", "node1"):
        listed = rest(c.base, f"/api/2.0/mlflow/artifacts/list?run_id={run['info']['run_id']}"
                              f"&path=forensics/{node}", login=c.login())
        found |= {f["path"] for f in listed.get("files", [])}
    # Each rank's evidence is its stacks when its own node's watch stopped it, or its traceback
    # when the other node's end reached it first (rank 0: its all-reduce failed on the closed
    # connection; rank 1: its launcher's SIGTERM once node 0's job ended): the line says which.
    rank0 = "error" if "rank 0 stopped after it" in error else "stack"
    rank1 = "error" if "(ended when the job stopped)" in error else "stack"
    assert {f"forensics/node0/rank-0.{rank0}.txt", f"forensics/node1/rank-1.{rank1}.txt"} <= found, \
        (error, found)
    codes = wait_exits(c, c.service, 2, time.monotonic() + 120)
    assert len(codes) == 2 and all(code != 0 for code in codes), codes
