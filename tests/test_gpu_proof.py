"""The GPU proof kit, kept from rotting where there is no GPU: the kit is built for this Python,
benchmarks/gpu_proof.sh installs it and ddplab into a temporary site exactly as on the GPU
machine, and the proof runs with --device cpu --quick: every step with a CPU meaning must
finish, the CUDA-only ones must be refused in ddplab's one line. Its store then comes home
through ``ddplab import`` (twice: the second adds nothing). The unit tests below need no run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import bench_peers  # noqa: E402

# The steps run here for real: the kit's install, the CUDA refusals, two ranks sharing a device,
# FSDP with bf16, MFU both ways, the peers' benchmark, the store coming home. Left out (each is
# a whole job of what other tests run: amp, checkpoint and resume in test_run.py, the chapter 9
# study and its page in test_study.py), their commands are checked by the plan test below.
RUN_HERE = ("doctor,quickstart-nccl,no-sync,flight-recorder,nccl-2-ranks-1-gpu,dp,gloo-2-ranks,"
            "fsdp-bf16,gpt,peers")


@pytest.mark.e2e
@pytest.mark.kit
def test_the_proof_runs_every_cpu_step_and_refuses_the_cuda_ones_in_one_line(tmp_path):
    kit, out = tmp_path / "kit", tmp_path / "proof"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    made = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_kit.py"), "--dest", str(kit),
                           "--python-version", py], capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-2000:]
    assert "MiB" in made.stdout and not (kit / "torch").exists()
    assert not list(kit.glob("torch-*.whl")) and list(kit.glob("mlflow_skinny-*.whl"))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": sys.executable,
           "DDPLAB_GIT_SHA": "0123456789abcdef"}  # nothing of .venv's PATH: the kit's site only
    proof = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_proof.sh"), str(out), "--device",
                            "cpu", "--quick", "--cores", "2", "--kit", str(kit), "--only", RUN_HERE],
                           capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert proof.returncode == 0, proof.stdout[-4000:] + proof.stderr[-2000:]
    got = json.loads((out / "proof.json").read_text())
    steps = got["steps"]
    cuda_only = ("quickstart-nccl", "no-sync", "nccl-2-ranks-1-gpu", "dp")
    for name in cuda_only:  # need CUDA: one line each
        assert steps[name]["status"] == "refused in one line", steps[name]
        assert "Traceback" not in (out / "logs" / f"{name}.log").read_text()
    ran = [s for s in steps.values() if s["status"] == "ok"]
    assert len(ran) == len(steps) - len(cuda_only), {k: v["status"] for k, v in steps.items()}
    # ddplab's Flight Recorder reader on a real (gloo) group: every all-reduce in the dump
    assert "5 entries (5 all-reduces" in (out / "logs" / "flight-recorder.log").read_text()
    runs = got["runs"]
    assert runs and all(r["status"] == "FINISHED" for r in runs.values()), runs
    by_step = {r["step"]: r for r in runs.values()}
    for step in ("gpt", "gloo-2-ranks"):  # the GPT by its formula, the CNN by the flop counter
        assert 0 < by_step[step]["mfu"] < 1, by_step[step]
    pages = ["cpu-proof-proof.md", "cpu-proof-peers.md", "cpu-proof-gpt-profile.md"]
    listed = subprocess.run(["tar", "tzf", str(out / "pages.tar.gz")], capture_output=True, text=True)
    assert all(f"results/{p}" in listed.stdout for p in pages), listed.stdout
    assert "| commit | 0123456789 |" in (out / "work" / "docs" / "results" / pages[0]).read_text()
    # The GPT's profiled steps: busy against gaps and the top names (ops on a CPU, kernels on a GPU)
    profile = (out / "work" / "docs" / "results" / pages[2]).read_text()
    assert "outermost aten ops of the training thread" in profile and "| `aten::" in profile

    store = f"sqlite:///{tmp_path / 'home.db'}"
    imported = [subprocess.run([sys.executable, "-m", "ddplab", "import", str(out / "store.tar.gz"),
                                "--tracking-uri", store], capture_output=True, text=True, timeout=300,
                               cwd=tmp_path)  # the store's new experiments keep artifacts in ./mlruns
                for _ in range(2)]
    assert imported[0].returncode == 0, imported[0].stderr[-2000:]
    total = len(runs)
    assert "run(s) into" in imported[0].stdout and "0 run(s)" in imported[1].stdout, imported
    from mlflow import MlflowClient

    home = MlflowClient(store)
    copies = [r for e in home.search_experiments() for r in home.search_runs([e.experiment_id])]
    assert len(copies) == total and all(r.info.status == "FINISHED" for r in copies)
    gpt = next(r for r in copies if r.data.tags["ddplab.imported_from"] == steps["gpt"]["run_ids"][0])
    assert gpt.data.metrics["perf/mfu"] == by_step["gpt"]["mfu"]
    assert {a.path for a in home.list_artifacts(gpt.info.run_id)} >= {"config.yaml", "summary.json"}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("quick", [False, True])
def test_every_step_of_the_proofs_plan_is_a_valid_command(tmp_path, device, quick):
    """Every job the proof plans, on the GPU machine (where nothing can be fixed once there) and
    here, is a config ddplab accepts; the chapter 9 study passes its checks; the resume step
    continues the checkpoint step's newest checkpoint. No job runs."""
    import argparse

    import gpu_proof

    from ddplab.config import load
    from ddplab.study.runner import check_variants
    from ddplab.study.spec import load_study

    a = argparse.Namespace(device=device, quick=quick, cores=16 if device == "cuda" else 2,
                           gpt_steps=600, gpt_compile_mode="max-autotune-no-cudagraphs", only="",
                           peers="plain,ddplab", peer_rounds=2)
    steps = {s.name: s for s in gpu_proof.plan(a, tmp_path)}
    peers = " ".join(steps["peers"].argv)
    assert ("--rounds 2 --only plain,ddplab" in peers) == (device == "cuda")  # --peers, --peer-rounds
    assert set(RUN_HERE.split(",")) < set(steps) and {"ch09-cores", "script-cuda"} < set(steps)
    for s in steps.values():
        if s.script:  # the script and its own arguments, as script mode takes them
            assert s.argv[4].endswith(".py") and Path(s.argv[4]).is_file() and s.argv[5] == "--"
            load(s.argv[4], [])
        elif s.argv[:2] == ["ddplab", "run"]:
            exp, rest = s.argv[4], s.argv[5:]
            assert rest[::2] == ["--set"] * (len(rest) // 2), s.argv
            load(exp, rest[1::2])  # a ConfigError names the step's bad key
        elif s.argv[:3] == ["ddplab", "study", "run"]:
            study = load_study(s.argv[3])
            assert [v.nproc for v in study.variants][:2] == [1, 2]
            if device == "cpu":
                check_variants(study)
    ck = tmp_path / "work" / "resume-ck" / "quickstart" / "step-40.pt"
    ck.parent.mkdir(parents=True)
    ck.touch()
    gpu_proof.fill_resume(steps["resume"], tmp_path, steps["checkpoint"])
    assert f"checkpoint.resume={ck}" in steps["resume"].argv
    assert "train.max_steps=80" in steps["resume"].argv


def test_fake_gpu_two_ranks_share_it_over_gloo_and_nccl_is_refused_in_one_line(monkeypatch):
    """A fake GPU (none can run here): one visible device, two local ranks."""
    from ddplab.distributed.choice import BackendError, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda", 1, "gloo") == torch.device("cuda", 0)
    assert resolve_device("cuda", 0, "nccl") == torch.device("cuda", 0)
    with pytest.raises(BackendError, match="NCCL cannot put two ranks on one GPU"):
        resolve_device("cuda", 1, "nccl")


def test_the_peers_page_is_rebuilt_from_a_cut_off_runs_log():
    log = ("round 1 plain: samples_per_s 1,000.00, cpu_ms_per_step 4.00, job_cpu_s 10.00, "
           "first_step_s 2.00, wall_s 5.00\n"
           "round 1 ddplab: samples_per_s 900.00, cpu_ms_per_step 5.00, job_cpu_s 20.00, "
           "first_step_s 3.00, wall_s 8.00\n"
           "round 1 fabric: exit 1: ModuleNotFoundError\n")
    rows, failed = bench_peers.from_log(log)
    assert rows["ddplab"][0]["samples_per_s"] == 900.0 and "exit 1" in failed["fabric"]
    assert failed["accelerate"].startswith("not measured")
    page = bench_peers.table(rows, failed)
    assert "| ddplab | 1 | 900.0 (0.90x) | 5.0 (1.25x) | 20.0 (2.00x) | 3.0 (1.50x) | 8.0 (1.60x) |" in page
    assert "| accelerate | 0 | not measured" in page
    assert "unpinned" not in page  # the GPU-only tool, never asked for: no row
    # asked for on a GPU: ddplab with data.pin_memory off, tracked
    argv = bench_peers.command("ddplab-unpinned", argparse.Namespace(
        epochs=1, samples=64, batch=32, threads=1, device="cuda", nproc=1), Path("out.json"))
    assert "data.pin_memory=false" in argv and "tracking.enabled=false" not in argv
    assert bench_peers.available("ddplab-unpinned", "cpu").startswith("a GPU job's")


def test_the_kit_leaves_out_what_the_gpu_machine_has():
    sys.path.insert(0, str(REPO / "tools"))
    import gpu_kit

    for name in ("torch", "nvidia-cublas", "numpy", "matplotlib"):
        assert gpu_kit.MACHINE_HAS.match(name), name
    for name in ("mlflow-skinny", "sqlalchemy", "alembic"):
        assert not gpu_kit.MACHINE_HAS.match(name) and name in gpu_kit.ROOTS
    assert set(gpu_kit.ROOTS) <= set(gpu_kit.pins(REPO / "requirements.lock"))


def test_the_profile_page_counts_a_gpu_traces_kernels_once_and_their_gaps():
    """A GPU's Chrome trace as torch.profiler writes it (none is recorded here): kernels on two
    streams, overlapping, with idle time between; memcpy counts as device work."""
    import profile_page

    def x(name, cat, ts, dur, tid=7):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}

    trace = {"traceEvents": [
        x("ProfilerStep#10", "user_annotation", 0, 1000, tid=1),
        x("ProfilerStep#11", "user_annotation", 1000, 1000, tid=1),
        x("ProfilerStep#10", "gpu_user_annotation", 100, 700),  # the same steps, on the GPU
        x("ProfilerStep#11", "gpu_user_annotation", 1100, 600),
        x("ampere_gemm", "kernel", 100, 400), x("ncclAllReduce", "kernel", 300, 400, tid=8),
        x("ampere_gemm", "kernel", 1100, 400), x("Memcpy HtoD", "gpu_memcpy", 1600, 100),
        x("aten::mm", "cpu_op", 0, 50, tid=1)]}
    got = profile_page.analyse(trace)
    assert got["what"] == "kernels (GPU)" and got["steps"] == 2
    assert got["window_ms"] == pytest.approx(1.6)  # first kernel at 100 us, last ends at 1,700
    assert got["busy_frac"] == pytest.approx((600 + 400 + 100) / 1600)  # the overlap once
    assert got["top"][0] == ("ampere_gemm", 2, pytest.approx(0.8), pytest.approx(800 / 1100))
