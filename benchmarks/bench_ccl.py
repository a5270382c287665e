"""oneCCL vs gloo on this machine: prints ratios measured side by side in one run.

    python benchmarks/bench_ccl.py              (after make setup-ccl)
    python benchmarks/bench_ccl.py --reps 5 --samples 6144

Writes docs/results/ccl-one-node.md (``--no-page``: print only).

1. All-reduce bus bandwidth over message sizes, gloo and ddplab's ccl, 2 ranks
   (`ddplab bench collectives`, each result checked).
2. Training throughput of the quickstart (book CNN, global batch 64, tracking off), 2 ranks
   x 1 thread, gloo vs ccl: interleaved reps in a rotated order, medians, a 95% bootstrap
   interval (bench_core's method).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import results as results_page
from bench_core import ddplab, ratio
from local_nodes import BIN


def busbw(sizes: str, env: dict[str, str]) -> str:
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "ddplab", "bench",
           "collectives", "--backend", "gloo,ccl", "--ops", "all_reduce", "--sizes", sizes,
           "--no-tracking", "--no-support"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=env["BENCH_DIR"])
    if out.returncode:
        sys.exit(f"benchmark failed: {' '.join(cmd)}\n{out.stderr[-3000:]}")
    return out.stdout.split("files in")[0].strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--samples", type=int, default=6144)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--sizes", default="1K,64K,1M,16M,64M")
    p.add_argument("--no-page", action="store_true",
                   help="print only; do not write docs/results/ccl-one-node.md")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "BENCH_DIR": tmp, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db"}
        table = busbw(a.sizes, env)
        print("all-reduce, 2 ranks:\n" + table)
        variants = {name: (lambda b=name: ddplab(2, False, a, env, ("--set", f"dist.backend={b}")))
                    for name in ("gloo", "ccl")}
        results: dict[str, list[float]] = {k: [] for k in variants}
        names = list(variants)
        for rep in range(a.reps):
            for name in names[rep % 2:] + names[:rep % 2]:
                results[name].append(variants[name]())
                print(f"rep {rep + 1}/{a.reps} {name:5s} {results[name][-1]:8.1f} samples/s",
                      flush=True)
    lines = ["median samples/s (quickstart, 2 ranks x 1 thread, last epoch):"]
    lines += [f"  {k:5s} {statistics.median(v):8.1f}   (runs: {', '.join(f'{x:.0f}' for x in v)})"
              for k, v in results.items()]
    lines.append(ratio("ccl / gloo", results["ccl"], results["gloo"]))
    print("\n" + "\n".join(lines))
    if not a.no_page:
        results_page.write("ccl-one-node", "ddplab's ccl vs gloo on one node, 2 ranks",
                           "All-reduce (`ddplab bench collectives`, every result checked):\n\n"
                           f"```\n{table}\n```\n\nTraining, interleaved ({a.reps} reps):\n\n"
                           "```\n" + "\n".join(lines) + "\n```")

if __name__ == "__main__":
    main()
