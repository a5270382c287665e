"""Teardown stress: N short 2-rank jobs in a row beside a CPU hog; does every finished job exit 0?

    python benchmarks/bench_teardown.py                 # 50 jobs, one CPU hog
    python benchmarks/bench_teardown.py --jobs 20 --hogs 2

Each job is the quickstart cut short, under `torchrun --standalone --nproc-per-node 2`, into
one embedded MLflow store. A busy machine is where the end of a job races: one rank leaving
while rank 0 still writes the final checkpoint, summary and run status, or a rank aborting at
interpreter exit ("terminate called without an active exception", SIGABRT). Printed per job
and in total:
  clean          torchrun exited 0 and the run is FINISHED
  crashed_exit   the run is FINISHED but torchrun reported a failure (a rank died at exit)
  failed_run     training completed (summary written) but the run ended FAILED
  other          anything else (the job itself failed)
Goal: every job clean.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SHORT = ["--set", "data.train_samples=768", "--set", "data.eval_samples=256",
         "--set", "train.epochs=1", "--set", "train.log_every=4", "--set", "checkpoint.every_steps=0",
         "--set", "checkpoint.resume=never", "--set", "tracking.system_metrics_interval_s=1"]


def hog() -> None:
    while True:
        pass


def one_job(work: Path, store: str, i: int) -> tuple[str, float, str]:
    summary = work / f"summary-{i}.json"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "ddplab", "train",
           str(REPO / "experiments" / "quickstart.yaml"), *SHORT,
           "--set", f"checkpoint.dir={work / 'ck'}", "--summary-out", str(summary)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": store}
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=work, timeout=600)
    return verdict(out, summary, store), time.monotonic() - t0, out.stderr


def verdict(out: subprocess.CompletedProcess, summary: Path, store: str) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(store)
    exps = [e.experiment_id for e in client.search_experiments()]
    newest = client.search_runs(exps, order_by=["attributes.start_time DESC"], max_results=1)
    status = newest[0].info.status if newest else "NONE"
    if out.returncode == 0 and status == "FINISHED":
        return "clean"
    if status == "FINISHED":
        return "crashed_exit"
    if summary.exists() and status == "FAILED":
        return "failed_run"
    return "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--hogs", type=int, default=1, help="busy-looping processes beside the jobs")
    a = p.parse_args()
    hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(a.hogs)]
    for h in hogs:
        h.start()
    counts = {"clean": 0, "crashed_exit": 0, "failed_run": 0, "other": 0}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            store = f"sqlite:///{work / 'mlflow.db'}"
            for i in range(a.jobs):
                result, secs, stderr = one_job(work, store, i)
                counts[result] += 1
                print(f"job {i + 1:3d}/{a.jobs}: {result:12s} {secs:5.1f}s", flush=True)
                if result != "clean":
                    print("   " + "\n   ".join(stderr.strip().splitlines()[-8:]), flush=True)
    finally:
        for h in hogs:
            h.kill()
    print(f"\n{a.jobs} jobs beside {a.hogs} CPU hog(s): " +
          ", ".join(f"{k} {v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
