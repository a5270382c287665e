"""Per-rank profiles: the interval arithmetic, the time shares, and a real 2-rank job whose
traces and shares land in its run."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest

from ddplab.training.profiling import breakdown, intersect, length, subtract, union
from tests.conftest import QUICK, REPO, ddplab, job_env, runs


def test_interval_arithmetic():
    a = union([(5, 8), (0, 2), (1, 3), (8, 9)])
    assert a == [(0, 3), (5, 9)] and length(a) == 7
    assert intersect(a, union([(2, 6)])) == [(2, 3), (5, 6)]
    assert subtract(a, union([(1, 2), (6, 7)])) == [(0, 1), (2, 3), (5, 6), (7, 9)]
    assert intersect(a, []) == [] and subtract(a, []) == a


def ev(name, start, end, thread=1, device="DeviceType.CPU"):
    return SimpleNamespace(name=name, thread=thread, device_type=device,
                           time_range=SimpleNamespace(start=start, end=end))


def test_shares_from_a_known_timeline():
    """Two 100 us steps; compute 0-60 and 100-150 on the training thread (nested ops count
    once); a gloo all-reduce on a worker thread 40-90 (20 us under compute); data 150-160."""
    events = [ev("ProfilerStep#1", 0, 100), ev("ProfilerStep#2", 100, 200),
              ev("aten::conv2d", 0, 60), ev("aten::addmm", 10, 20), ev("aten::mul", 100, 150),
              ev("gloo:all_reduce", 40, 90, thread=7), ev("aten::add", 300, 400, thread=7),
              ev("ddplab/data", 150, 160), ev("aten::copy_", 150, 160)]
    s = breakdown(events)
    assert s["step_ms"] == pytest.approx(0.1)
    assert s["compute_frac"] == pytest.approx(110 / 200)  # the copy inside data is data
    assert s["comm_frac"] == pytest.approx(50 / 200)
    assert s["overlap_frac"] == pytest.approx(20 / 50)
    assert s["exposed_comm_frac"] == pytest.approx(30 / 200)
    assert s["data_frac"] == pytest.approx(10 / 200)
    assert breakdown([ev("aten::mm", 0, 5)]) == {}


def test_cuda_shares_come_from_kernels():
    events = [ev("ProfilerStep#1", 0, 100), ev("aten::mm", 0, 100),
              ev("void gemm_kernel", 10, 50, device="DeviceType.CUDA"),
              ev("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 80, device="DeviceType.CUDA")]
    s = breakdown(events)
    assert s["compute_frac"] == pytest.approx(0.4) and s["comm_frac"] == pytest.approx(0.4)
    assert s["overlap_frac"] == pytest.approx(10 / 40)


def profiled(tmp_path, store, *sets: str):
    args = [x for s in ("profile.enabled=true", *sets) for x in ("--set", s)]
    return ddplab(["train", str(REPO / "experiments" / "quickstart.yaml"), *QUICK, *args],
                  tmp_path, job_env(store), nproc=2)


@pytest.mark.distributed
def test_two_ranks_each_leave_a_trace_and_their_shares(tmp_path, store):
    out = profiled(tmp_path, store, "profile.active=2", "dist.bucket_cap_mb=0.05")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "profile (2 ranks" in out.stderr
    (run,) = runs(store)
    from mlflow import MlflowClient

    client = MlflowClient(store)
    names = sorted(f.path for f in client.list_artifacts(run.info.run_id, "profile"))
    assert names == ["profile/node0-rank0.pt.trace.json.gz", "profile/node0-rank1.pt.trace.json.gz"]
    path = client.download_artifacts(run.info.run_id, names[1], str(tmp_path / "dl"))
    trace = json.loads(gzip.decompress(open(path, "rb").read()))
    seen = {e.get("name", "") for e in trace["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3", "gloo:all_reduce", "ddplab/data"} <= seen
    m = run.data.metrics
    for r in (0, 1):
        shares = {k: m[f"profile/rank{r}/{k}"] for k in (
            "compute_frac", "comm_frac", "data_frac", "overlap_frac", "exposed_comm_frac")}
        assert all(0 <= v <= 1 for v in shares.values()), shares
        assert shares["compute_frac"] > 0.2 and shares["comm_frac"] > 0, shares
        assert shares["compute_frac"] + shares["exposed_comm_frac"] + shares["data_frac"] <= 1.001
        assert m[f"profile/rank{r}/step_ms"] > 0


@pytest.mark.distributed
def test_a_profile_on_ccl_records_every_rank_and_its_ccl_communication(tmp_path, store):
    """ddplab's own ccl (oneCCL) has no gather: the traces still reach rank 0, and its
    collectives count as communication."""
    from ddplab import ccl

    assert ccl.missing() is None, "make test builds it: make setup-ccl"
    out = profiled(tmp_path, store, "profile.active=2", "dist.backend=ccl")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "profile (2 ranks" in out.stderr
    (run,) = runs(store)
    assert run.data.tags["ddplab.backend"] == "ccl"
    m = run.data.metrics
    assert all(m[f"profile/rank{r}/comm_frac"] > 0 for r in (0, 1)), m


@pytest.mark.distributed
def test_a_job_shorter_than_the_window_says_so(tmp_path, store):
    out = profiled(tmp_path, store, "train.max_steps=2", "profile.wait=5")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "profile: nothing recorded: the job took 2 steps" in out.stderr
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and not any(k.startswith("profile/") for k in run.data.metrics)


def test_the_profilers_steps_are_not_the_steady_pace():
    """gpu_proof's GPT profiles steps 31-37 (wait 30, warmup 2, active 5) and logs every 25:
    the interval of steps 26-50 runs under the profiler, slower, and is left out of
    perf/samples_per_s and perf/mfu (fit._profiled); 1-25 and 51-75 are not."""
    from types import SimpleNamespace

    from ddplab.training import fit

    def job(steps_run: int, enabled: bool = True) -> SimpleNamespace:
        profile = SimpleNamespace(enabled=enabled, wait=30, warmup=2, active=5)
        return SimpleNamespace(cfg=SimpleNamespace(profile=profile),
                               state=SimpleNamespace(steps_run=steps_run))

    assert [fit._profiled(job(n), 25) for n in (25, 50, 75)] == [False, True, False]
    assert fit._profiled(job(31), 1) and fit._profiled(job(37), 1)
    assert not fit._profiled(job(30), 1) and not fit._profiled(job(38), 1)
    assert not fit._profiled(job(50, enabled=False), 25)
