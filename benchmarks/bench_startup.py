"""Start-up and teardown of a short job, tracked against untracked, side by side.

    make bench-startup                    (= python benchmarks/bench_startup.py)
    python benchmarks/bench_startup.py --reps 7

Each rep runs, in a rotated order, the quickstart (2 ranks, gloo, 4 steps) under
`torchrun --standalone --nproc-per-node 2 -m ddplab train` with tracking on (a fresh run in an
embedded SQLite store that earlier reps already created) and with tracking off, and reads the
job's console as it streams:
  set-up     from starting the command to ddplab's "starting:" line (the first step follows it)
  teardown   from the "done in" line (the last step and eval are over) to the command's exit
  whole      the command, start to exit
Most of CI's time is such short jobs, so what tracking adds here is paid ~100 times a run.
Medians over the reps, and the median of each rep's tracked-minus-untracked difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results as results_page  # benchmarks/ is this script's directory

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SHORT = ["--set", "data.train_samples=256", "--set", "data.eval_samples=64",
         "--set", "train.epochs=1", "--set", "checkpoint.resume=never"]


def one_job(tracking: bool, work: Path) -> dict[str, float]:
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "ddplab", "train",
           str(REPO / "experiments" / "quickstart.yaml"), *SHORT,
           "--set", f"tracking.enabled={str(tracking).lower()}",
           "--set", f"checkpoint.dir={work / 'ck'}"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
    t0 = time.monotonic()
    marks: dict[str, float] = {}
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-30:]
        if "[ddplab] starting:" in line:
            marks.setdefault("started", time.monotonic())
        elif "[ddplab] done in" in line:
            marks.setdefault("done", time.monotonic())
    end = time.monotonic()
    if proc.wait() != 0 or len(marks) != 2:
        sys.exit(f"benchmark job failed ({proc.returncode}):\n{''.join(tail)}")
    return {"set-up": marks["started"] - t0, "teardown": end - marks["done"], "whole": end - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-page", action="store_true", help="print only; no docs/results page")
    a = p.parse_args()
    names = {True: "tracked", False: "untracked"}
    got: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        one_job(True, Path(tmp))  # creates and migrates the store: not what a job pays each time
        for rep in range(a.reps):
            for tracking in ((True, False) if rep % 2 == 0 else (False, True)):
                got[tracking].append(one_job(tracking, Path(tmp)))
                t = got[tracking][-1]
                print(f"rep {rep + 1}/{a.reps} {names[tracking]:9s} " +
                      "  ".join(f"{k} {v:5.2f}s" for k, v in t.items()), flush=True)
    lines = [f"median seconds over {a.reps} interleaved reps (2 ranks, gloo, quickstart, 4 steps):",
             f"  {'':10s} {'set-up':>8s} {'teardown':>9s} {'whole':>8s}"]
    for tracking in (True, False):
        med = {k: statistics.median(r[k] for r in got[tracking]) for k in got[tracking][0]}
        lines.append(f"  {names[tracking]:10s} {med['set-up']:8.2f} {med['teardown']:9.2f} "
                     f"{med['whole']:8.2f}")
    diff = {k: statistics.median(t[k] - u[k] for t, u in zip(got[True], got[False], strict=True))
            for k in got[True][0]}
    lines.append(f"  {'difference':10s} {diff['set-up']:8.2f} {diff['teardown']:9.2f} "
                 f"{diff['whole']:8.2f}   (median of the per-rep differences; "
                 f"target: set-up + teardown within 1.5 s)")
    print("\n" + "\n".join(lines))
    if not a.no_page:
        results_page.write("bench-startup", "make bench-startup",
                           "What tracking adds to a short job's start and end:\n\n```\n"
                           + "\n".join(lines) + "\n```")


if __name__ == "__main__":
    main()
