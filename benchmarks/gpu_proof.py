"""The CUDA half of ddplab, proven in one command on a bare GPU machine (benchmarks/gpu_proof.sh
installs the kit, then runs this). Each step is a real ddplab command; its log, exit code and
run land under OUT, with the runs' embedded MLflow store, and the results pages to commit.

    python benchmarks/gpu_proof.py OUT [--device cuda|cpu] [--quick] [--cores N] [--only a,b]

--device cpu runs every step that has a CPU meaning on CPU (gloo), and the steps that need
CUDA as they are: each must then fail in ddplab's one line (no traceback), so the script is
exercised in CI and cannot rot. --quick shrinks every job to a few steps (CI).

One GPU only: NCCL cannot put two ranks on one device, so the two-rank steps share it over
gloo (two processes' CUDA placement, DDP with device ids); the nccl steps run one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PAGE_INTRO = ("Each step is a real ddplab command on this machine (benchmarks/gpu_proof.py); its "
              "runs' status, steady samples/s, perf/mfu and memory/peak_allocated_mb are read back "
              "from the embedded MLflow store. One GPU: the two-rank steps share it over gloo; "
              "NCCL refuses two ranks on one device, which the refusal step shows in one line.\n\n")
QUICKSTART = REPO / "experiments" / "quickstart.yaml"
LM = REPO / "experiments" / "lm-tiny.yaml"
MULTIGPU = REPO / "experiments" / "scripts" / "multigpu_torchrun.py"  # pytorch/examples', as it is
TRACEBACK = "Traceback (most recent call last)"


@dataclass
class Step:
    name: str
    proves: str
    argv: list[str]
    cuda_only: bool = False
    """Needs CUDA itself (nccl): on --device cpu it runs unchanged and must fail in one line."""
    timeout_s: int = 240
    expect_refusal: bool = False
    """The step passes when ddplab refuses it in one line (exit 2), on any device."""
    script: bool = False
    """A user's script (script mode): on --device cpu a CUDA-only one fails as the script's own
    error does, its traceback shown and ddplab's line naming it, the run FAILED."""
    result: dict = field(default_factory=dict)


def sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def plan(a: argparse.Namespace, out: Path) -> list[Step]:
    cuda = a.device == "cuda"
    dev = sets(f"dist.device={a.device}")
    one = sets("dist.backend=nccl" if cuda else "dist.backend=gloo")
    q = sets("data.train_samples=256", "data.eval_samples=64", "data.image_size=8",
             "train.max_steps=6", "train.log_every=2") if a.quick else []
    lm_q = sets("train.max_steps=6", "train.log_every=2", "data.seq_len=32",
                "model.args={n_layer: 1, n_head: 2, n_embd: 32}") if a.quick else []
    lm = [str(LM), *sets(f"data.root={REPO / 'docs'}")]
    ck = out / "work" / "resume-ck"
    run = ["ddplab", "run", "--nproc-per-node"]
    qs = str(QUICKSTART)
    compile_on = sets("model.compile=true") if not (a.quick and not cuda) else []
    steps = [
        Step("doctor", "ddplab doctor sees the device, its backend and memory",
             ["ddplab", "doctor", qs, *dev]),
        Step("quickstart-nccl", "the quickstart on nccl, one rank on the GPU, to FINISHED",
             [*run, "1", qs, *sets("dist.device=cuda", "dist.backend=nccl"), *q], cuda_only=True),
        Step("no-sync", "the quickstart's steady steps (bf16, fused SGD, pinned input) under "
             "torch.cuda.set_sync_debug_mode('error') (train.sync_debug): a host wait in "
             "ddplab's step would fail the job",
             [*run, "1", qs, *sets("dist.device=cuda", "dist.backend=nccl", "train.amp=bf16",
                                   "train.sync_debug=error", "train.epochs=2"), *q],
             cuda_only=True),
        Step("flight-recorder", "NCCL's Flight Recorder dumped through ddplab's reader on one "
             "rank after real all-reduces (gloo's on --device cpu)",
             [sys.executable, str(REPO / "benchmarks" / "flight_recorder_check.py"),
              "--device", a.device]),
        Step("nccl-2-ranks-1-gpu", "two nccl ranks on one GPU are refused in one line, not a hang",
             [*run, "2", qs, *sets("dist.device=cuda", "dist.backend=nccl")],
             cuda_only=True, expect_refusal=True),
        Step("gloo-2-ranks", "two processes share the device over gloo: placement, DDP with "
             "device ids, gloo on device tensors", [*run, "2", qs, *dev, *sets("dist.backend=gloo"), *q]),
        Step("fsdp-bf16", "dist.strategy fsdp with bf16 mixed precision (FSDP2) on the GPT",
             [*run, "1", *lm, *dev, *one, *sets("dist.strategy=fsdp", "dist.fsdp.mixed_precision=bf16",
                                                 "train.epochs=2"), *lm_q]),
        Step("dp", "dist.strategy dp (nn.DataParallel over the node's GPUs)",
             [*run, "1", qs, *dev, *one, *sets("dist.strategy=dp", "train.epochs=1"), *q],
             cuda_only=True),
        Step("amp-compile", "train.amp bf16 with torch.compile",
             [*run, "1", qs, *dev, *one, *sets("train.amp=bf16", "train.epochs=2"), *compile_on, *q],
             timeout_s=300),
        Step("checkpoint", "a checkpoint written on the device (the first half of a resume)",
             [*run, "1", qs, *dev, *one, *sets("train.max_steps=40", "train.log_every=5",
                                                f"checkpoint.dir={ck}", "checkpoint.resume=never"),
              *(sets("data.train_samples=256", "data.eval_samples=64", "data.image_size=8")
                if a.quick else [])]),
        Step("resume", "the run goes on from that checkpoint on the device (a new run that names "
             "the one it continues)", []),  # argv filled in once the checkpoint exists
        Step("gpt", "the lm GPT sized to keep the GPU busy for about a minute: MFU, memory, and "
             "5 steady steps profiled (the gpt-profile page: kernel time, gaps, top kernels)",
             [*run, "1", *lm, *dev, *one, *gpt_sets(a)],
             timeout_s=900 if a.gpt_compile_mode.startswith("max-autotune") else 420),
        Step("ch09-cores", f"the book's chapter 9 on {a.cores} cores: 1 process x {a.cores} threads "
             "against more processes with fewer threads (gloo)",
             ["ddplab", "study", "run", str(study_file(a, out)), "--fresh"], timeout_s=600),
        Step("script-cuda", "script mode on CUDA: pytorch/examples' multigpu_torchrun.py, "
             "unedited, one FINISHED run with its training observed (train/loss, samples/s, data "
             "wait and forward from CUDA events)",
             [*run, "1", str(MULTIGPU), "--", "40", "40", "--batch_size", "32"],
             cuda_only=True, script=True),
        Step("bench-script", "script mode's cost on the book's chapter 9 script, unedited: plain "
             "torchrun vs script mode observed, observe=false and untracked, 4 reps in a balanced order "
             "(bench_script.py; its step time within 2% of plain's, on a quiet machine's cores)",
             [sys.executable, str(REPO / "benchmarks" / "bench_script.py"), "--reps", "4",
              "--page", page_name(a, "bench-script"),
              "--page-dir", str(out / "work" / "docs" / "results")], timeout_s=540),
        Step("peers", "ddplab (tracked and not) beside a plain torchrun script, Lightning Fabric and "
             "Accelerate on the same job (bench_peers.py)", peers_argv(a, out), timeout_s=480),
    ]
    return [s for s in steps if not a.only or s.name in a.only.split(",")]


def peers_argv(a: argparse.Namespace, out: Path) -> list[str]:
    # On the GPU: the plain script, ddplab tracked and untracked, Fabric and Accelerate, three
    # interleaved rounds (~25 s a job: ~6 minutes, a call of its own with --only peers).
    on = (["--device", "cuda", "--nproc", "1", "--rounds", str(a.peer_rounds), "--only", a.peers]
          if a.device == "cuda" else
          ["--device", "cpu", "--nproc", "2", "--rounds", "1"])
    quick = ["--only", "plain,ddplab-untracked", "--epochs", "2", "--samples", "512"] if a.quick else []
    return [sys.executable, str(REPO / "benchmarks" / "bench_peers.py"), *on, *quick,
            "--page", page_name(a, "peers"), "--page-dir", str(out / "work" / "docs" / "results")]


def page_name(a: argparse.Namespace, what: str) -> str:
    """gpu-*.md pages from the GPU machine; cpu-proof-*.md from a CPU run of the same script."""
    return f"{'gpu' if a.device == 'cuda' else 'cpu-proof'}-{what}"


def gpt_sets(a: argparse.Namespace) -> list[str]:
    if a.quick:
        return sets("train.max_steps=6", "train.log_every=2", "data.seq_len=32",
                    "model.args={n_layer: 1, n_head: 2, n_embd: 32}", "train.amp=bf16",
                    "profile.enabled=true", "profile.wait=2", "profile.warmup=1",
                    "profile.active=2")
    # GPT-2 small's shape (85 M parameters with a byte vocabulary) on 1,024-byte sequences,
    # bf16 and compiled: about 20 TFLOP a step.
    # tests/ (4 MB of text: ~110 steps an epoch) and no checkpoint per epoch: on docs/ alone
    # (0.18 MB, 5 steps an epoch) a checkpoint of 1 GB every 5 steps took most of the wall time.
    return sets(f"data.root={REPO / 'tests'}", "checkpoint.every_epochs=0",
                "model.args={n_layer: 12, n_head: 12, n_embd: 768, dropout: 0.0}",
                "data.seq_len=1024", "data.batch_size=32", "data.eval_batch_size=32",
                "train.amp=bf16", "model.compile=true", f"model.compile_mode={a.gpt_compile_mode}",
                f"train.max_steps={a.gpt_steps}",
                "train.epochs=100", "train.log_every=25", "train.eval_every_steps=0",
                "train.eval_every_epochs=100", "optim.warmup_steps=50", "optim.lr=0.0006",
                # 5 steps profiled once compiled (profile_page.py: kernels and gaps), in a log
                # interval the steady throughput and MFU leave out (fit._profiled): the
                # profiler's steps and its trace's export cost nothing in perf/mfu
                "profile.enabled=true", "profile.wait=30", "profile.warmup=2", "profile.active=5",
                # max-autotune benchmarks kernels inside the first step for minutes: not a hang
                *(["dist.hang_after_s=1500"] if a.gpt_compile_mode.startswith("max-autotune")
                  else []))


def study_file(a: argparse.Namespace, out: Path) -> Path:
    """The book's chapter 9 study for this machine's cores: N ranks x cores/N threads, global
    batch 64 each, gloo, from one process with every core to as many processes as leave 2
    threads each (on 2 cores: 2 x 1)."""
    n, layouts, ranks = a.cores, [], 1
    while ranks <= max(2, n // 2) and ranks <= n:  # on 2 cores the book's own pair: 1x2, 2x1
        layouts.append(ranks)
        ranks *= 2
    epochs = "train.max_steps: 6" if a.quick else "train.epochs: 3"
    lines = [f"name: ch09-{n}-cores", f"experiment: {QUICKSTART}",
             f"set: {{{epochs}, dist.device: cpu, dist.backend: gloo}}",
             "repeats: 1", f"baseline: 1r-{n}t", "variants:"]
    for r in layouts:
        lines.append(f"  - {{name: {r}r-{n // r}t, nproc: {r}, set: {{dist.threads_per_rank: "
                     f"{n // r}, data.batch_size: {64 // r}}}}}")
    path = out / "work" / f"ch09-{n}-cores.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def run_step(step: Step, a: argparse.Namespace, out: Path, env: dict[str, str]) -> None:
    log = out / "logs" / f"{step.name}.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        f.write(f"$ {' '.join(step.argv)}\n")
        f.flush()
        proc = subprocess.Popen(step.argv, cwd=out / "work", env=env, stdout=f,
                                stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            # SIGTERM as a scheduler would send it: ddplab ends its runs KILLED, leaves none
            # RUNNING (a SIGKILL, subprocess.run's, left a study's parent RUNNING on the H100)
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = 124
    text = log.read_text(errors="replace")
    wall = time.perf_counter() - t0
    last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")
    needs_cuda = step.cuda_only and no_cuda(a, step)
    if needs_cuda and step.script:
        ok = code == 1 and "ddplab: error: the script failed on rank 0" in text
        status = "failed as the script's own error" if ok else "NOT the script's error, named"
    elif step.expect_refusal or needs_cuda:
        ok = code != 0 and TRACEBACK not in text and code != 124
        status = "refused in one line" if ok else "NOT a clean refusal"
    else:
        ok = code == 0
        status = "ok" if ok else ("timed out" if code == 124 else f"exit {code}")
    runs = re.findall(r"(?:MLflow run |runs/|parent run )([0-9a-f]{32})", text)
    step.result = {"status": status, "ok": ok, "exit": code, "wall_s": round(wall, 1),
                   "last_line": last[-300:], "run_ids": sorted(set(runs))}
    print(f"[proof] {step.name}: {status} in {wall:.0f}s  {last[-160:]}", flush=True)


def no_cuda(a: argparse.Namespace, step: Step) -> bool:
    """Whether this CUDA-only step meets no GPU: a ddplab job by --device; a script by the
    machine (it picks its device itself)."""
    if not step.script:
        return a.device != "cuda"
    import torch

    return not torch.cuda.is_available()


def check_clock(steps: list[Step], runs: dict[str, dict]) -> None:
    """A script's run on a GPU must have timed its phases with CUDA events, not the host."""
    for step in steps:
        if not (step.script and step.result.get("ok") and step.result.get("exit") == 0):
            continue
        clocks = {runs.get(r, {}).get("clock") for r in step.result.get("run_ids", [])}
        if clocks != {"cuda events"}:
            step.result.update(ok=False, status=f"ok, but its phases were timed by {clocks}")


def fill_resume(step: Step, out: Path, prior: Step) -> None:
    """The resume step's command: the checkpoint step's newest checkpoint, 40 steps more."""
    found = sorted((out / "work" / "resume-ck").rglob("step-*.pt"))
    if not found:
        step.argv = ["false"]
        return
    argv = list(prior.argv)
    i = argv.index("train.max_steps=40")
    argv[i] = "train.max_steps=80"
    argv[argv.index("checkpoint.resume=never")] = f"checkpoint.resume={found[-1]}"
    step.argv = argv


def check_runs(steps: list[Step], uri: str) -> dict[str, dict]:
    """Each step's runs as the store has them: status, memory, MFU, throughput."""
    from mlflow.tracking import MlflowClient

    client, seen = MlflowClient(uri), {}
    for step in steps:
        for run_id in step.result.get("run_ids", []):
            try:
                r = client.get_run(run_id)
            except Exception as e:  # noqa: BLE001 - a run the store lacks is reported, not fatal
                seen[run_id] = {"step": step.name, "status": f"not in the store ({e})"}
                continue
            m, t = r.data.metrics, r.data.tags
            seen[run_id] = {"step": step.name, "status": r.info.status,
                            "name": r.info.run_name,
                            "samples_per_s": m.get("perf/samples_per_s"),
                            "mfu": m.get("perf/mfu"),
                            "peak_allocated_mb": m.get("memory/peak_allocated_mb"),
                            "peak_rss_mb": m.get("memory/peak_rss_mb"),
                            "eval_loss": m.get("eval/loss"),
                            "train_loss": m.get("train/loss"),
                            "clock": t.get("ddplab.script_clock"),
                            "data_wait_frac": m.get("train/data_wait_frac"),
                            "backend": t.get("ddplab.backend"), "device": t.get("ddplab.device"),
                            "world": t.get("ddplab.world_size"),
                            "peak_source": t.get("ddplab.mfu.peak_source"),
                            "continues_run": t.get("ddplab.continues_run"),
                            "system_metrics": sorted({k.split("/")[1] for k in m
                                                      if k.startswith("system/")})[:6]}
    return seen


def machine() -> dict[str, str]:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda_build": str(torch.version.cuda), "cores": str(os.cpu_count())}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30, check=False).stdout.strip()
            info["driver, memory"] = smi
        except OSError:
            pass
    else:
        info["device"] = "cpu (" + platform.processor() + ")"
    return info


def page(steps: list[Step], runs: dict[str, dict], info: dict[str, str], a: argparse.Namespace) -> str:
    lines = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in info.items()), "",
             "| step | what it proves | result | wall s | run(s): status, samples/s, MFU, "
             "peak CUDA MB |", "|---|---|---|---|---|"]
    for s in steps:
        cells = []
        for run_id in s.result.get("run_ids", []):
            r = runs.get(run_id, {})
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
            sps = f"{r['samples_per_s']:,.0f}" if r.get("samples_per_s") else "-"
            mem = f"{r['peak_allocated_mb']:,.0f}" if r.get("peak_allocated_mb") else "-"
            cells.append(f"{run_id[:8]} {r.get('status', '?')}, {sps}, {mfu}, {mem}")
        result = s.result.get("status", "not run")
        if not s.result.get("ok", False) or "refused" in result:
            result += ": " + s.result.get("last_line", "").replace("|", "/")[-200:]
        lines.append(f"| {s.name} | {s.proves} | {result} | {s.result.get('wall_s', '-')} | "
                     f"{'; '.join(cells) or '-'} |")
    return "\n".join(lines) + "\n"


def pack(out: Path) -> None:
    """What comes back from a machine that returns few files: the store with its artifacts,
    the logs, the results pages (checkpoints stay behind: they are not results)."""
    def tar(name: str, members: list[tuple[Path, str]]) -> None:
        with tarfile.open(out / name, "w:gz") as t:
            for path, arc in members:
                if path.exists():
                    t.add(path, arcname=arc)

    tar("store.tar.gz", [(out / "store", "store"), (out / "work" / "mlruns", "mlruns")])
    tar("logs.tar.gz", [(out / "logs", "logs")])
    tar("pages.tar.gz", [(out / "work" / "docs" / "results", "results")])


def out_problem(out: Path) -> str:
    """Why OUT cannot hold the proof (its logs, store, work folders), "" when it can (then
    they are made)."""
    if out.exists() and not out.is_dir():
        return ("an existing file; allowed: a folder (new or existing) for the proof's logs, "
                "store and pages")
    try:
        for d in ("logs", "store", "work"):
            (out / d).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot make it ({e.strerror or e}); allowed: a folder that can be made and written"
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="a few steps per job (CI)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2,
                    help="cores for the chapter 9 study (default: all)")
    ap.add_argument("--gpt-steps", type=int, default=600)
    ap.add_argument("--gpt-compile-mode", default="default",
                    choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                    help="the GPT's model.compile_mode (a call each, to choose by measurement)")
    ap.add_argument("--only", default="", help="comma-separated step names")
    ap.add_argument("--peers", default="plain,ddplab,ddplab-untracked,fabric,accelerate",
                    help="the peers step's tools on cuda (bench_peers.py --only)")
    ap.add_argument("--peer-rounds", type=int, default=3, help="the peers step's interleaved rounds")
    ap.add_argument("--budget-s", type=int, default=480,
                    help="stop starting steps after this long, so the results are still packed")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()  # relative to where it runs (gpu_proof.sh passes it absolute)
    problem = out_problem(out)
    if problem:
        print(f"gpu_proof: OUT: got {str(out)!r}: {problem}", file=sys.stderr, flush=True)
        return 2
    uri = f"sqlite:///{out / 'store' / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONUNBUFFERED": "1"}
    info = machine()
    print(f"[proof] {json.dumps(info)}", flush=True)
    steps = plan(a, out)
    by_name = {s.name: s for s in steps}
    t0 = time.perf_counter()
    for step in steps:
        if time.perf_counter() - t0 > a.budget_s - 20:
            step.result = {"status": f"not run: the {a.budget_s}s budget was spent", "ok": False,
                           "exit": None, "wall_s": 0, "last_line": "", "run_ids": []}
            print(f"[proof] {step.name}: {step.result['status']}", flush=True)
            continue
        step.timeout_s = int(min(step.timeout_s, max(30, a.budget_s - (time.perf_counter() - t0))))
        if step.name == "resume":
            if "checkpoint" not in by_name:
                continue
            fill_resume(step, out, by_name["checkpoint"])
        run_step(step, a, out, env)
        if step.name == "gpt" and step.result["ok"] and step.result["run_ids"]:
            made = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profile_page.py"),
                                   step.result["run_ids"][0], "--page", page_name(a, "gpt-profile"),
                                   "--page-dir", str(out / "work" / "docs" / "results")],
                                  cwd=out / "work", env=env, capture_output=True, text=True,
                                  check=False)
            (out / "logs" / "gpt-profile.log").write_text(made.stdout + made.stderr)
        if step.name == "ch09-cores" and step.result["ok"]:
            parent = re.findall(r"parent run ([0-9a-f]{32})", (out / "logs" / "ch09-cores.log").read_text())
            if parent:
                subprocess.run(["ddplab", "report", parent[-1], "--page",
                                page_name(a, f"ch09-{a.cores}-cores")],
                               cwd=out / "work", env=env, capture_output=True, check=False)
    runs = check_runs(steps, uri)
    check_clock(steps, runs)
    body = page(steps, runs, info, a)
    summary = {"machine": info, "device": a.device, "quick": a.quick,
               "wall_s": round(time.perf_counter() - t0, 1),
               "steps": {s.name: {**s.result, "argv": s.argv} for s in steps}, "runs": runs}
    (out / "proof.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "proof.md").write_text(body)
    results.write(page_name(a, "proof"), f"The GPU proof kit on {info['device']}", PAGE_INTRO + body,
                  folder=out / "work" / "docs" / "results")
    pack(out)
    print(body)
    bad = [s.name for s in steps if s.result and not s.result["ok"]]
    failing = {s.name for s in steps if s.script and s.cuda_only and no_cuda(a, s)}
    unfinished = [f"{v['step']}:{k[:8]}" for k, v in runs.items()
                  if v["status"] != "FINISHED" and v["step"] not in failing]
    print(f"[proof] {len(steps) - len(bad)}/{len(steps)} steps as expected in "
          f"{summary['wall_s']:.0f}s; runs not FINISHED: {', '.join(unfinished) or 'none'}",
          flush=True)
    return 1 if bad or unfinished else 0


if __name__ == "__main__":
    sys.exit(main())
