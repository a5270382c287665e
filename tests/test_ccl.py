"""ddplab's own ``ccl`` backend (oneCCL 2022.2.0 from PyPI, built by ``make setup-ccl``, which
``make test`` runs first): real oneCCL collectives between real processes, checked against
gloo; DDP on ccl equals one rank with the global batch; the build's own pieces."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddplab import ccl
from ddplab.bench import OP_NAMES
from ddplab.ccl import build
from ddplab.distributed import choice, oneccl
from ddplab.launchers.detect import LaunchEnv
from tests import ccl_workers, dist_workers
from tests.conftest import QUICK, REPO, ddplab, job_env, runs
from tests.helpers import fresh_copy, left_behind, shm_regions, wait_all
from tests.helpers.dist import reference, spawn


def built() -> None:
    why = ccl.missing()
    assert why is None, f"{why} (make test builds it: make setup-ccl)"


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_and_dtype_gives_glooes_result(tmp_path, world):
    """20 cases (each reduce op, small/large/uneven/non-contiguous, list and tensor
    forms, point to point) x float32, bfloat16, float16, float64, int32, int64: ccl's result
    is bit-identical to gloo's on every rank (the inputs are small integers, so every result
    is exact in every dtype and the order of summation cannot excuse a difference)."""
    built()
    ranks = spawn(ccl_workers.compare_with_gloo, world, tmp_path)
    for r in ranks:
        assert r["differ"] == []
        assert r["checked"] == 19 * 6 + 4  # 20 cases; avg only in the 4 floating dtypes
        # What ccl cannot do fails at once with a message, never a hang or a wrong answer.
        assert "does not support gather" in r["errors"]["gather"]
        assert "cannot reduce bool tensors" in r["errors"]["bool"]
        assert "AVG needs a floating dtype" in r["errors"]["avg_int"]


@pytest.mark.distributed
def test_ddp_on_ccl_matches_one_rank_with_the_global_batch(tmp_path):
    """DDP's gradient all-reduce (async, bucketed, through the Work's Future) on ccl: 2 ranks
    reach the parameters of 1 rank with the global batch (rtol 1e-4: float32 sums in another
    order), and both ranks hold identical parameters."""
    built()
    ranks = spawn(dist_workers.train_k_steps, 2, tmp_path, 12, 1, 4, None, "ccl")
    ref = reference(tmp_path, 12, 4)
    for p, q in zip(ranks[0]["params"], ref["params"], strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"],
                                                 strict=True))


@pytest.mark.distributed
def test_async_all_reduce_returns_at_once_and_completes_its_future(tmp_path):
    built()
    for r in spawn(ccl_workers.async_overlap, 2, tmp_path):
        assert r["ok"] and r["done"]
        assert r["returned_s"] < r["waited_s"]  # started, not finished, when the call returned


@pytest.mark.distributed
def test_a_silent_peer_is_an_error_within_the_timeout_not_a_hang(tmp_path):
    """Rank 1 stays alive but never calls the second all-reduce; the group's timeout is 3 s."""
    built()
    r = spawn(ccl_workers.missing_peer, 2, tmp_path)[0]
    assert "did not complete within 3000 ms" in r["outcome"]
    assert 2.5 < r["after_s"] < 10


def test_the_build_is_recorded_and_picked_over_nothing(monkeypatch):
    """After make setup-ccl, without Intel's bindings: ccl is ddplab's backend, which says what
    it is."""
    built()
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", None)  # import fails
    info = ccl.build_info()
    assert (info["torch"], info["oneccl"]) == (torch.__version__, ccl.ONECCL_VERSION)
    impl = choice.import_ccl()
    assert impl.name == "ddplab" and "oneCCL 2022.2.0" in impl.why
    assert choice.available("cpu")["ccl"][0]


LOADS = """
import json, sys
from ddplab.config import DistConfig
from ddplab.distributed.layout import plan_layout
from ddplab.launchers.detect import LaunchEnv
backend, local = sys.argv[1], int(sys.argv[2])
le = LaunchEnv("torchrun", 0, local, 0, local, 0, "127.0.0.1", 29500)
layout = plan_layout(DistConfig(backend=backend, device="cpu"), le)
with open("/proc/self/maps") as maps:
    print(json.dumps([layout.choice.name, layout.choice.reason, "libccl.so" in maps.read()]))
"""


@pytest.mark.parametrize("backend, local, name, loaded", [
    ("ccl", 2, "ccl", True),
    ("gloo", 2, "gloo", False),
    ("auto", 2 * os.cpu_count(), "gloo", False),  # 1 core a rank: ccl cannot win
    ("auto", 1, "gloo", False),  # one rank exchanges nothing
])
def test_a_rank_loads_oneccl_only_where_ccl_can_be_its_backend(backend, local, name, loaded):
    """Loading oneCCL costs each rank 0.2-0.3 s before its first step: a rank whose backend is
    gloo (asked for, or auto's where ccl cannot win) leaves it unloaded. A process of its own
    each (what a rank is), its memory map read."""
    built()
    out = subprocess.run([sys.executable, "-c", LOADS, backend, str(local)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "DDPLAB_NODES_ON_HOST": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    picked, why, mapped = json.loads(out.stdout.splitlines()[-1])
    assert (picked, mapped) == (name, loaded), why


@pytest.mark.parametrize("impl, cores, world, name, why", [
    ("intel-bindings", 1, 2, "gloo", "worker thread needs one of its own"),
    ("intel-bindings", 2, 2, "ccl", "each rank has 2 cores"),
    ("intel-bindings", None, 2, "ccl", "enough cores"),
    ("ddplab", 16, 4, "ccl", "ddplab's own oneCCL backend"),
    ("ddplab", 1, 4, "gloo", "worker thread needs one of its own"),
    ("ddplab", 16, 1, "gloo", "one rank exchanges nothing"),
])
def test_auto_picks_ccl_only_where_it_should_win(impl, cores, world, name, why):
    table = {"gloo": (True, ""), "nccl": (False, ""), "ccl": (True, impl), "mpi": (False, "")}
    picked = choice.resolve("auto", "cpu", False, table, cores_per_rank=cores, ccl_impl=impl,
                            world_size=world)
    assert picked.name == name and why in picked.reason
    assert choice.resolve("ccl", "cpu", False, table, cores_per_rank=1, ccl_impl=impl).name == "ccl"


def _vote(choices: list[choice.BackendChoice]) -> list[choice.BackendChoice]:
    """Each rank's agree() in its own thread, on one real store."""
    store = dist.HashStore()
    out: list[choice.BackendChoice | None] = [None] * len(choices)

    def rank(r: int) -> None:
        le = LaunchEnv("torchrun", r, len(choices), 0, 1, r, "127.0.0.1", 29500)
        out[r] = choice.agree(choices[r], le, store)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(choices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(out), "a rank did not finish voting"
    return out


def test_on_several_nodes_auto_runs_ccl_only_if_every_rank_chose_it():
    ccl_ = choice.BackendChoice("ccl", "auto", "auto: ccl on CPU (x), each rank has 8 cores")
    gloo = choice.BackendChoice("gloo", "auto", "auto: gloo, because each rank has 1 core(s)")
    agreed = _vote([ccl_, ccl_, ccl_])
    assert {c.name for c in agreed} == {"ccl"} and "all 3 ranks agree" in agreed[0].reason
    mixed = _vote([ccl_, gloo, ccl_])
    assert {c.name for c in mixed} == {"gloo"}
    assert "because rank 1 (host " in mixed[0].reason and "1 core(s)" in mixed[2].reason
    assert mixed[1] == gloo  # the rank that chose gloo keeps its own reason


def test_unbuilt_stale_or_transportless_builds_say_what_to_run(tmp_path, monkeypatch):
    where = tmp_path / "ccl"
    assert "not built" in ccl.missing(where) and "make setup-ccl" in ccl.missing(where)
    where.mkdir()
    (where / f"{ccl.EXT_NAME}.so").write_bytes(b"")
    (where / "BUILD.json").write_text(json.dumps({"torch": "2.7.0", "oneccl": "2022.2.0"}))
    assert "built for torch 2.7.0" in ccl.missing(where)
    (where / "BUILD.json").write_text(json.dumps({"torch": torch.__version__}))
    monkeypatch.setattr(ccl, "libfabric", lambda where=None: None)
    assert "run make setup-ccl, which fetches it" in ccl.missing(where)


def test_without_a_build_ccl_is_unavailable_with_both_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAB_CCL_HOME", str(tmp_path / "nowhere"))
    monkeypatch.setitem(sys.modules, "oneccl_bindings_for_pytorch", None)  # import fails
    ok, why = choice.available("cpu")["ccl"]
    assert not ok and "not built" in why and "oneccl_bindings_for_pytorch" in why


def test_extract_takes_only_the_named_members(tmp_path):
    wheel = tmp_path / "w.whl"
    prefix = "oneccl-2022.2.0.data/data/"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in ("lib/libccl.so.1", "lib/libccl.so.2", "include/oneapi/ccl.hpp",
                     "include/oneapi/ccl/types.hpp", "etc/conda/x.sh"):
            zf.writestr(prefix + name, name)
    dest = tmp_path / "out"
    build.extract(wheel, prefix, {"lib/libccl.so.2": "lib/libccl.so.2", "include/": "include/"},
                  dest)
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["include/oneapi/ccl.hpp", "include/oneapi/ccl/types.hpp", "lib/libccl.so.2"]
    assert (dest / "lib/libccl.so.2").read_text() == "lib/libccl.so.2"


def test_a_failed_build_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    """No compiler: one line saying what to install, and the old build is untouched."""
    dest = tmp_path / "ddplab-ccl"
    dest.mkdir()
    (dest / "BUILD.json").write_text("{}")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert build.main(["--dest", str(dest)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["setup-ccl: error: no C++ compiler (c++/g++) on PATH "
                   "(Debian/Ubuntu: apt-get install g++)"]
    assert (dest / "BUILD.json").read_text() == "{}"
    assert not Path(str(dest) + ".new").exists()


@pytest.mark.e2e
def test_make_run_on_ccl_gives_a_finished_run_that_says_which_ccl(tmp_path):
    """The issue's command, `make run ARGS="--set dist.backend=ccl"`, after make setup-ccl:
    one FINISHED run of 2 ranks on real oneCCL, tagged with which implementation ran, and its
    ranks' shared memory given back (a failed job's: test_a_ccl_job_gives_its_shared_memory_back)."""
    built()
    before = shm_regions()
    repo = fresh_copy(tmp_path / "clone")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {k: v for k, v in job_env(store).items() if not k.startswith(("MAKE", "MFLAGS"))}
    venv = Path(sys.executable).parent.parent
    args = " ".join(["--set", "dist.backend=ccl", *QUICK])
    out = subprocess.run(["make", "-o", f"{venv}/.ddplab-setup", "run", f"VENV={venv}",
                          f"ARGS={args}"], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    tags = run.data.tags
    assert run.info.status == "FINISHED" and "eval/accuracy" in run.data.metrics
    assert (tags["ddplab.backend"], tags["ddplab.ccl_impl"], tags["ddplab.world_size"]) == (
        "ccl", "ddplab", "2")
    assert "oneCCL 2022.2.0" in tags["ddplab.backend_reason"]
    assert tags["ddplab.version.ddplab_ccl"].startswith("oneccl 2022.2.0")
    assert left_behind(before) == set()  # each rank's libfabric shm region is gone


def test_release_takes_only_this_process_regions_and_doctor_counts_the_orphans(tmp_path):
    """release_shm unlinks <own pid>:n:n and nothing else; stale_shm counts the regions of
    processes that are gone (a SIGKILLed rank's), not live ones nor other files."""
    built()
    ccl.load()
    gone = subprocess.Popen(["true"])
    gone.wait()
    alive = subprocess.Popen(["sleep", "30"])
    try:
        names = [f"{os.getpid()}:0:0", f"{os.getpid()}:1:0", f"{gone.pid}:0:0",
                 f"{alive.pid}:0:0", "torch_123", f"{os.getpid()}x:0:0"]
        for n in names:
            (tmp_path / n).write_bytes(b"x" * 8192)
        assert ccl.stale_shm(tmp_path)[0] == 1
        assert ccl.release_shm(tmp_path) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
        assert ccl.stale_shm(tmp_path) == (1, (tmp_path / names[2]).stat().st_blocks * 512)
    finally:
        alive.kill()


@pytest.mark.distributed
@pytest.mark.parametrize("outcome, extra", [
    # A finished job's: test_make_run_on_ccl_gives_a_finished_run_that_says_which_ccl checks it.
    ("failed", ["--set", "data.dataset=cifar10", "--set", "data.root=nodata",
                "--set", "data.download=true"]),  # fails after the ranks connected
])
def test_a_ccl_job_gives_its_shared_memory_back(tmp_path, outcome, extra):
    """Each ccl rank's libfabric shm region (about 20 MB of RAM) is gone when its job ends,
    finished or failed: ranks end by os._exit, which skips libfabric's own clean-up, and a few
    hundred left behind filled /dev/shm."""
    built()
    before = shm_regions()
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = ddplab(["train", str(REPO / "experiments" / "quickstart.yaml"), "--set", "dist.backend=ccl",
                  "--set", "data.train_samples=128", "--set", "data.eval_samples=64",
                  "--set", "train.epochs=1", "--set", f"checkpoint.dir={tmp_path / 'ck'}", *extra],
                 tmp_path, job_env(store), nproc=2)
    assert (out.returncode == 0) == (outcome == "finished"), out.stderr[-3000:]
    assert "[rank0]: Traceback" not in out.stderr  # the failure is one line per rank
    (run,) = runs(store)
    assert run.info.status == outcome.upper()
    assert left_behind(before) == set()


@pytest.mark.distributed
def test_bench_collectives_on_ccl_checks_every_op_and_names_what_it_lacks(tmp_path):
    """`ddplab bench collectives --backend ccl` on 2 ranks: every op ccl has comes out right;
    gather and scatter (oneCCL has none) are "no" in the support matrix, with torch's reason."""
    built()
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = ddplab(["bench", "collectives", "--backend", "ccl", "--sizes", "1K,1M", "--iters", "3",
                  "--no-tracking", "--out", "."], tmp_path, job_env(store), nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    with open(tmp_path / "support.csv") as f:
        support = {r["op"]: r for r in csv.DictReader(f)
                   if (r["backend"], r["device"]) == ("ccl", "cpu")}
    works = {op for op, r in support.items() if r["works"] == "True"}
    assert works == set(OP_NAMES) - {"gather", "scatter"}
    assert "does not support gather" in support["gather"]["why_not"]
    assert {r["op"] for r in rows if r["backend"] == "ccl"} == works
    assert all(r["correct"] == "True" for r in rows)


@pytest.mark.parametrize("world, local, expected", [
    (4, 2, ("0", "1")), (2, 1, ("0", "1")), (3, 3, ("1", "3"))])
def test_oneccl_is_told_each_rank_is_alone_on_its_host_only_across_nodes(world, local, expected):
    """The cause of the 2 containers x 2 ranks hang: oneCCL given the true ranks-per-host
    (CCL_LOCAL_SIZE=2) on several nodes. Across nodes ddplab gives it 1 (the container tier runs
    that layout: test_compose_multinode_on_ddplabs_ccl_across_containers); one node keeps the
    true count (its shared-memory path and worker pinning use it)."""
    le = LaunchEnv("torchrun", 1, world, 1, local, 0, "node0", 29500)
    out = oneccl.ccl_env_defaults(le, None, {})
    assert (out["CCL_LOCAL_RANK"], out["CCL_LOCAL_SIZE"]) == expected
    assert "CCL_LOCAL_SIZE" not in oneccl.ccl_env_defaults(le, None, {"CCL_LOCAL_SIZE": "2"})


@pytest.mark.distributed
def test_a_rank_that_never_joins_is_an_error_after_the_timeout_not_a_hang(tmp_path):
    """oneCCL makes its communicator in a barrier whose reads never time out: rank 0 of a
    group whose rank 1 died during set-up waited there for ever (seen in this suite: a 2-node
    job, one node's torchrun gone, the other still blocked 20 minutes on). Now it raises after
    the group's timeout, saying why, and its process ends."""
    built()
    code = (f"from tests import ccl_workers; ccl_workers.alone_in_a_group_of_two({str(tmp_path)!r}, 5)")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    assert "a rank did not join it (it failed or was stopped during set-up)" in out.stdout
    assert time.monotonic() - t0 < 90


@pytest.mark.distributed
@pytest.mark.parametrize("node1_cores, backend_run, why", [
    ("0,1", "ccl", "all 2 ranks agree"),
    ("0", "gloo", "because rank 1 (host "),
])
def test_auto_on_two_nodes_agrees_on_one_backend(tmp_path, node1_cores, backend_run, why):
    """Two torchrun nodes of one rank each; node 1 may use one core (`taskset`), so it alone
    would choose gloo. Every rank runs what all chose: one FINISHED run, no wait for a peer
    on another backend."""
    built()
    from tests.helpers import free_port

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    port = free_port()
    bindir = Path(sys.executable).parent
    procs = []
    for node, cores in ((0, "0,1"), (1, node1_cores)):
        cmd = ["taskset", "-c", cores, str(bindir / "torchrun"), "--nnodes=2", "--nproc-per-node=1",
               f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
               "-m", "ddplab", "train", str(REPO / "experiments" / "quickstart.yaml"), *QUICK]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=job_env(store), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    outs = wait_all(procs, timeout=400)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    (run,) = runs(store)
    tags = run.data.tags
    assert run.info.status == "FINISHED" and tags["ddplab.nnodes"] == "2"
    assert (tags["ddplab.backend"], tags["ddplab.backend_requested"]) == (backend_run, "auto")
    assert why in tags["ddplab.backend_reason"], tags["ddplab.backend_reason"]
