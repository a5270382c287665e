"""Core benchmark: prints throughput ratios measured side by side in one run.

    make bench                       (= python benchmarks/bench_core.py)
    python benchmarks/bench_core.py --reps 3 --samples 8192

Compares, on the same model (book CNN), data (synthetic 32x32), global batch (64) and threads:
  1. ddplab (tracking on) vs a minimal hand-written DDP loop (benchmarks/bare_ddp.py), 2 ranks;
  2. ddplab tracking on vs off, 2 ranks;
  3. 2 ranks x 1 thread vs 1 rank x 2 threads (ddplab, tracking off), on gloo and, once
     `make setup-ccl` has built it, on ddplab's own ccl;
  4. 2 nodes x 2 ranks (two torchrun "nodes" on this host, benchmarks/local_nodes.py) on both
     backends, against one node's 2 ranks.
``--only tracking`` spends every rep on the on/off pair (the small effect that needs the most
reps); ``--only layout`` on the threads-vs-processes question; ``--only nodes`` on one node
vs two, gloo vs ccl.
Throughput = samples of the last epoch / its wall-clock time (logging, metric reductions and
checkpointing included), so nothing that slows a real run is hidden. Variants run interleaved,
in a rotated order each rep (A B C D, B C D A, ...), and medians are compared, because these
machines are noisy (the same command varies by up to 20% from one minute to the next). Each
ratio is given two ways: the ratio of the medians, and the median of the per-rep ratios (each
rep's two runs ran minutes apart at most, so the machine's slow drift cancels in their ratio),
each with a 95% bootstrap interval over the reps. Beside the noisy throughput ratio, a
noise-free figure: the CPU time tracking used as a share of the job's (summary.json), in all
and after its one-time start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import results as results_page  # benchmarks/ is this script's directory
from local_nodes import run_nodes

REPO = Path(__file__).resolve().parents[1]


def torchrun(nproc: int, args: list[str], env: dict[str, str], nnodes: int = 1) -> None:
    """nproc ranks on each of nnodes torchrun "nodes" on this host (benchmarks/local_nodes.py)."""
    for out in run_nodes(nnodes, nproc, args, env, cwd=env["BENCH_DIR"], capture=True):
        if out.returncode:
            sys.exit(f"benchmark job failed: {' '.join(out.args)}\n{out.stderr[-3000:]}")


CPU: dict[str, list[float]] = {"tracking_cpu_share": [], "tracking_cpu_share_steady": [],
                               "tracking_startup_cpu_s": [], "job_cpu_s": []}  # tracking-on runs


def ddplab(nproc: int, tracking: bool, a: argparse.Namespace, env: dict[str, str],
           extra: tuple[str, ...] = (), nnodes: int = 1) -> float:
    out = Path(env["BENCH_DIR"]) / "summary.json"
    torchrun(nproc, ["-m", "ddplab", "train", str(REPO / "experiments" / "quickstart.yaml"),
                     "--summary-out", str(out),
                     "--set", f"data.train_samples={a.samples}", "--set", f"train.epochs={a.epochs}",
                     "--set", f"data.batch_size={64 // (nproc * nnodes)}", "--set", "optim.scheduler=none",
                     "--set", "optim.warmup_steps=0", "--set", f"tracking.enabled={str(tracking).lower()}",
                     "--set", "checkpoint.resume=never", *extra], env, nnodes)
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


def _boot(stat, n: int = 4000) -> tuple[float, float]:
    rng = random.Random(0)
    values = sorted(stat(rng) for _ in range(n))
    return values[int(0.025 * n)], values[int(0.975 * n) - 1]


def interval(a: list[float], b: list[float]) -> tuple[float, float]:
    """95% bootstrap interval of median(a) / median(b), resampling each side's reps."""
    return _boot(lambda rng: statistics.median(rng.choices(a, k=len(a))) /
                 statistics.median(rng.choices(b, k=len(b))))


def paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median of the per-rep ratios a[i] / b[i] and its 95% bootstrap interval over the reps."""
    r = [x / y for x, y in zip(a, b, strict=True)]
    lo, hi = _boot(lambda rng: statistics.median(rng.choices(r, k=len(r))))
    return statistics.median(r), lo, hi


def ratio(name: str, a: list[float], b: list[float], target: str = "") -> str:
    lo, hi = interval(a, b)
    mid, plo, phi = paired(a, b)
    return (f"  {name:38s} {statistics.median(a) / statistics.median(b):.3f} [{lo:.3f}-{hi:.3f}]"
            f"  paired {mid:.3f} [{plo:.3f}-{phi:.3f}]"
            f"{'  (target ' + target + ')' if target else ''}")


ON, OFF, BARE = "ddplab tracking on, 2r x 1t", "ddplab tracking off, 2r x 1t", "bare DDP loop, 2r x 1t"
THREADS, CCL = "ddplab tracking off, 1r x 2t", "ddplab tracking off, 2r x 1t ccl"
# Two torchrun "nodes" of 2 ranks each on this host: the multi-node path (for ccl, libfabric's
# tcp provider between the nodes), on cores the 4 ranks share.
NODES_GLOO, NODES_CCL = "2 nodes x 2r x 1t, gloo", "2 nodes x 2r x 1t, ccl"
ONLY = {"all": (BARE, ON, OFF, THREADS, CCL, NODES_GLOO, NODES_CCL), "tracking": (ON, OFF),
        "layout": (OFF, THREADS, CCL), "nodes": (OFF, CCL, NODES_GLOO, NODES_CCL)}


def ccl_missing() -> str | None:
    """Why ddplab's own ccl cannot run here (None when it can)."""
    sys.path.insert(0, str(REPO / "src"))
    from ddplab import ccl

    return ccl.missing()


def make_variants(a: argparse.Namespace, env: dict[str, str]) -> dict[str, Callable[[], float]]:
    every = {
        BARE: lambda: bare(a, env),
        ON: lambda: ddplab(2, True, a, env),
        OFF: lambda: ddplab(2, False, a, env),
        THREADS: lambda: ddplab(1, False, a, env),
        CCL: lambda: ddplab(2, False, a, env, ("--set", "dist.backend=ccl")),
        NODES_GLOO: lambda: ddplab(2, False, a, env, ("--set", "dist.backend=gloo"), nnodes=2),
        NODES_CCL: lambda: ddplab(2, False, a, env, ("--set", "dist.backend=ccl"), nnodes=2),
    }
    wanted = list(ONLY[a.only])
    why = ccl_missing() if CCL in wanted or NODES_CCL in wanted else None
    if why:
        wanted = [w for w in wanted if w not in (CCL, NODES_CCL)]
        print(f"(no ccl variants: {why})")
    return {k: every[k] for k in wanted}


def run_interleaved(variants: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for rep in range(reps):
        # Rotate the order each rep so no variant always runs first (or after the same one).
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            results[name].append(variants[name]())
            print(f"rep {rep + 1}/{reps} {name:30s} {results[name][-1]:8.1f} samples/s",
                  flush=True)
    return results


def report(results: dict[str, list[float]]) -> list[str]:
    lines = ["median samples/s (last epoch, wall clock):"]
    for k, v in results.items():
        lines.append(f"  {k:30s} {statistics.median(v):8.1f}   (runs: {', '.join(f'{x:.0f}' for x in v)})")
    lines += ["", "ratios (of the medians [95% interval], and paired: the median per-rep ratio):"]
    pairs = [("ddplab / bare loop (tracking on)", ON, BARE, ">= 0.99"),
             ("ddplab / bare loop (tracking off)", OFF, BARE, ">= 0.99"),
             ("tracking on / off", ON, OFF, ">= 0.99"),
             ("2 ranks x 1 thread / 1 rank x 2", OFF, THREADS, ">= 0.95"),
             ("2 ranks x 1 thread on ccl / 1 rank x 2", CCL, THREADS, ">= 0.95"),
             ("ccl / gloo, 2 ranks x 1 thread", CCL, OFF, ""),
             ("ccl / gloo, 2 nodes x 2 ranks", NODES_CCL, NODES_GLOO, ""),
             ("2 nodes x 2 ranks / 1 node x 2, gloo", NODES_GLOO, OFF, ""),
             ("2 nodes x 2 ranks / 1 node x 2, ccl", NODES_CCL, CCL, "")]
    for name, a, b, target in pairs:
        if a in results and b in results:
            lines.append(ratio(name, results[a], results[b], target))
    if CPU["job_cpu_s"]:
        share = statistics.median(CPU["tracking_cpu_share"])
        steady = statistics.median(CPU["tracking_cpu_share_steady"])
        lines += ["", f"tracking's CPU time / the job's (all ranks, the delivery process; noise-free): "
                  f"{100 * share:.2f}% in all, {100 * steady:.2f}% after start-up (target < 1%); "
                  f"start-up {statistics.median(CPU['tracking_startup_cpu_s']):.2f} CPU-s of a "
                  f"{statistics.median(CPU['job_cpu_s']):.1f} CPU-s job "
                  f"(medians of {len(CPU['job_cpu_s'])} runs)"]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--samples", type=int, default=6144)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--only", choices=sorted(ONLY), default="all",
                   help="which comparison to spend the reps on (default: all)")
    p.add_argument("--no-page", action="store_true",
                   help="print only; do not write docs/results/bench-core-<only>.md")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "BENCH_DIR": tmp, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db"}
        results = run_interleaved(make_variants(a, env), a.reps)
    lines = report(results)
    print("\n" + "\n".join(lines))
    if not a.no_page:
        results_page.write(f"bench-core-{a.only}", f"make bench (--only {a.only})",
                           "Throughput of the quickstart CNN on synthetic data, variants interleaved "
                           f"({a.reps} reps, {a.samples} samples x {a.epochs} epochs each):\n\n"
                           "```\n" + "\n".join(lines) + "\n```")


if __name__ == "__main__":
    main()
