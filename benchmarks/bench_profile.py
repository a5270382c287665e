"""Where a training step's time goes, per layout: torch.profiler over the quickstart
(`--set profile.enabled=true`), read back from the runs' profile/rank0/* metrics.

    python benchmarks/bench_profile.py [--reps 3] [--active 20]

Variants, interleaved in a rotated order each rep: 1 rank x 2 threads; 2 ranks x 1 thread on
gloo; the same with 0.05 MB DDP buckets (communication starts during the backward pass, so
it can overlap); 2 ranks x 1 thread on ddplab's ccl once `make setup-ccl` has built it.
Per variant, medians over the reps of rank 0's step time and its shares: compute,
communication, the part of it that overlapped compute, and the exposed part (what nothing hid).
Writes docs/results/profile.md (``--no-page``: print only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import results as results_page  # benchmarks/ is this script's directory
from local_nodes import run_nodes

REPO = Path(__file__).resolve().parents[1]
SHARES = ("step_ms", "compute_frac", "comm_frac", "overlap_frac", "exposed_comm_frac")
VARIANTS = {
    "1r x 2t": (1, ("data.batch_size=64",)),
    "2r x 1t gloo": (2, ("dist.backend=gloo",)),
    "2r x 1t gloo, 0.05 MB buckets": (2, ("dist.backend=gloo", "dist.bucket_cap_mb=0.05")),
    "2r x 1t ccl": (2, ("dist.backend=ccl",)),
}


def profile_once(name: str, a: argparse.Namespace, tmp: str) -> dict[str, float]:
    nproc, sets = VARIANTS[name]
    store = f"sqlite:///{tmp}/mlflow.db"
    args = ["-m", "ddplab", "train", str(REPO / "experiments" / "quickstart.yaml"),
            *[x for s in (*sets, "dist.threads_per_rank=" + ("2" if nproc == 1 else "1"),
                          f"data.train_samples={a.samples}", "train.epochs=1",
                          "checkpoint.resume=never", "profile.enabled=true", "profile.wait=2",
                          "profile.warmup=2", f"profile.active={a.active}",
                          "tracking.system_metrics=false") for x in ("--set", s)]]
    (out,) = run_nodes(1, nproc, args, {**os.environ, "MLFLOW_TRACKING_URI": store}, cwd=tmp,
                       capture=True)
    if out.returncode:
        sys.exit(f"{name}: the job failed\n{out.stderr[-3000:]}")
    from mlflow import MlflowClient

    client = MlflowClient(store)
    run = client.search_runs([e.experiment_id for e in client.search_experiments()],
                             order_by=["attributes.start_time DESC"], max_results=1)[0]
    return {k: run.data.metrics[f"profile/rank0/{k}"] for k in SHARES}


def table(results: dict[str, list[dict[str, float]]]) -> str:
    lines = ["| layout | step ms | compute | communication | of it overlapped | exposed communication |",
             "|---|---|---|---|---|---|"]
    for name, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in SHARES}
        # A share of almost no communication says nothing (one rank exchanges nothing).
        overlapped = f"{med['overlap_frac']:.0%}" if med["comm_frac"] >= 0.005 else "-"
        lines.append(f"| {name} | {med['step_ms']:.1f} | {med['compute_frac']:.0%} | "
                     f"{med['comm_frac']:.0%} | {overlapped} | {med['exposed_comm_frac']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--active", type=int, default=20, help="profiled steps per run")
    p.add_argument("--samples", type=int, default=4096, help="training samples (one epoch)")
    p.add_argument("--no-page", action="store_true",
                   help="print only; do not write docs/results/profile.md")
    a = p.parse_args()
    from ddplab import ccl

    names = [n for n in VARIANTS if "ccl" not in n or ccl.build_info()]
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                results[name].append(profile_once(name, a, tmp))
                r = results[name][-1]
                print(f"rep {rep + 1}/{a.reps} {name:30s} step {r['step_ms']:6.1f} ms, exposed "
                      f"communication {r['exposed_comm_frac']:.0%}", flush=True)
    text = table(results)
    print("\n" + text)
    if not a.no_page:
        results_page.write(
            "profile", "Where a step's time goes (torch.profiler, rank 0)",
            f"The quickstart CNN, global batch 64, {a.active} profiled steps a run; medians of "
            f"{a.reps} interleaved runs. Shares are of the step; \"of it overlapped\" is the "
            "share of communication that ran while compute did.\n\n" + text)


if __name__ == "__main__":
    main()
