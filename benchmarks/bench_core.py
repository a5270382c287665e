"""Core benchmark: prints throughput ratios measured side by side in one run.

    make bench                       (= python benchmarks/bench_core.py)
    python benchmarks/bench_core.py --reps 3 --samples 8192

Compares, on the same model (book CNN), data (synthetic 32x32), global batch (64) and threads:
  1. ddplab (tracking on) vs a minimal hand-written DDP loop (benchmarks/bare_ddp.py), 2 ranks;
  2. ddplab tracking on vs off, 2 ranks;
  3. 2 ranks x 1 thread vs 1 rank x 2 threads (ddplab, tracking off).
Throughput = samples of the last epoch / its wall-clock time (logging, metric reductions and
checkpointing included), so nothing that slows a real run is hidden. Variants run interleaved,
in a rotated order each rep (A B C D, B C D A, ...), and medians are compared, because these
machines are noisy (the same command varies by up to 20% from one minute to the next); each
ratio comes with a 95% bootstrap interval over the reps. Beside the noisy throughput ratio, a
noise-free figure: the CPU time tracking used as a share of the job's (summary.json), in all
and after its one-time start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def torchrun(nproc: int, args: list[str], env: dict[str, str]) -> None:
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=env["BENCH_DIR"])
    if out.returncode:
        sys.exit(f"benchmark job failed: {' '.join(cmd)}\n{out.stderr[-3000:]}")


CPU: dict[str, list[float]] = {"tracking_cpu_share": [], "tracking_cpu_share_steady": [],
                               "tracking_startup_cpu_s": [], "job_cpu_s": []}  # tracking-on runs


def ddplab(nproc: int, tracking: bool, a: argparse.Namespace, env: dict[str, str],
           extra: tuple[str, ...] = ()) -> float:
    out = Path(env["BENCH_DIR"]) / "summary.json"
    torchrun(nproc, ["-m", "ddplab", "train", str(REPO / "experiments" / "quickstart.yaml"),
                     "--summary-out", str(out),
                     "--set", f"data.train_samples={a.samples}", "--set", f"train.epochs={a.epochs}",
                     "--set", f"data.batch_size={64 // nproc}", "--set", "optim.scheduler=none",
                     "--set", "optim.warmup_steps=0", "--set", f"tracking.enabled={str(tracking).lower()}",
                     "--set", "checkpoint.resume=never", *extra], env)
    summary = json.loads(out.read_text())
    if tracking:
        for key, values in CPU.items():
            values.append(summary[key])
    return summary["epoch_samples_per_s"][-1]


def bare(a: argparse.Namespace, env: dict[str, str]) -> float:
    out = Path(env["BENCH_DIR"]) / "bare.json"
    torchrun(2, [str(REPO / "benchmarks" / "bare_ddp.py"), "--samples", str(a.samples),
                 "--epochs", str(a.epochs), "--batch", "32", "--out", str(out)], env)
    return json.loads(out.read_text())["epoch_samples_per_s"][-1]


def interval(a: list[float], b: list[float], n: int = 4000) -> tuple[float, float]:
    """95% bootstrap interval of median(a) / median(b), resampling each side's reps."""
    rng = random.Random(0)
    ratios = sorted(statistics.median(rng.choices(a, k=len(a))) /
                    statistics.median(rng.choices(b, k=len(b))) for _ in range(n))
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def ratio(name: str, a: list[float], b: list[float], target: str = "") -> None:
    lo, hi = interval(a, b)
    print(f"  {name:34s} {statistics.median(a) / statistics.median(b):.3f}  "
          f"[95% interval {lo:.3f}-{hi:.3f}]{'  (target ' + target + ')' if target else ''}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--samples", type=int, default=6144)
    p.add_argument("--epochs", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "BENCH_DIR": tmp, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db"}
        variants = {
            "bare DDP loop, 2x1": lambda: bare(a, env),
            "ddplab tracking on, 2x1": lambda: ddplab(2, True, a, env),
            "ddplab tracking off, 2x1": lambda: ddplab(2, False, a, env),
            "ddplab tracking off, 1x2": lambda: ddplab(1, False, a, env),
        }
        results: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for rep in range(a.reps):
            # Rotate the order each rep so no variant always runs first (or after the same one).
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                fn = variants[name]
                results[name].append(fn())
                print(f"rep {rep + 1}/{a.reps} {name:26s} {results[name][-1]:8.1f} samples/s",
                      flush=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    print("\nmedian samples/s (last epoch, wall clock):")
    for k, v in med.items():
        print(f"  {k:26s} {v:8.1f}   (runs: {', '.join(f'{x:.0f}' for x in results[k])})")
    on, off = results["ddplab tracking on, 2x1"], results["ddplab tracking off, 2x1"]
    bare_runs, threads = results["bare DDP loop, 2x1"], results["ddplab tracking off, 1x2"]
    print("\nratios of medians:")
    ratio("ddplab / bare loop (tracking on)", on, bare_runs, ">= 0.99")
    ratio("ddplab / bare loop (tracking off)", off, bare_runs, ">= 0.99")
    ratio("tracking on / off", on, off, ">= 0.99")
    ratio("2 ranks x 1 thread / 1 rank x 2", off, threads, ">= 0.95")
    share = statistics.median(CPU["tracking_cpu_share"])
    steady = statistics.median(CPU["tracking_cpu_share_steady"])
    print(f"\ntracking's CPU time / the job's (all ranks, the delivery process; noise-free): "
          f"{100 * share:.2f}% in all, {100 * steady:.2f}% after start-up (target < 1%); "
          f"start-up {statistics.median(CPU['tracking_startup_cpu_s']):.2f} CPU-s of a "
          f"{statistics.median(CPU['job_cpu_s']):.1f} CPU-s job (medians of {len(on)} runs)")


if __name__ == "__main__":
    main()
