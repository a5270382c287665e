"""Compose benchmark, same image and experiment, measured side by side (interleaved) in one run:
2 ranks in one container (torchrun) vs 2 node containers x 1 rank launched by torchrun
(compose/multinode.yml) vs the same 2-container layout launched by mpirun (compose/mpi.yml).

    python benchmarks/bench_compose.py [--reps 2] [--no-mpi]     (needs `make images`)

Writes docs/results/compose.md (``--no-page``: print only).

Prints throughput ratios (last epoch, wall clock, from each run's summary.json) and the time
from the launch command (`docker run` / `docker compose up`) to the first training step (the
timestamp of the run's train/time_to_first_step_s metric).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import results as results_page  # benchmarks/ is this script's directory
from compose_tracking import client_env
from mlflow import MlflowClient

REPO = Path(__file__).resolve().parents[1]
SET = "data.train_samples=6144 train.epochs=2 checkpoint.resume=never"


def first_step_and_throughput(client: MlflowClient, run_id: str, t_launch: float,
                              tmp: str) -> tuple[float, float]:
    (m,) = client.get_metric_history(run_id, "train/time_to_first_step_s")
    summary = json.loads(Path(client.download_artifacts(run_id, "summary.json", tmp)).read_text())
    return m.timestamp / 1000 - t_launch, summary["epoch_samples_per_s"][-1]


def one_container(tmp: str) -> tuple[float, float]:
    store = f"sqlite:///{tmp}/single.db"
    t0 = time.time()
    # Same path inside and out, and it is the working dir: MLflow's ./mlruns lands on the host.
    subprocess.run(["docker", "run", "--rm", "--shm-size", "2g", "-v", f"{tmp}:{tmp}", "-w", tmp,
                    "-e", f"MLFLOW_TRACKING_URI={store}", "-e", f"DDPLAB_SET={SET}",
                    "ddplab/cpu-oneccl:latest", "torchrun", "--standalone", "--nproc-per-node=2",
                    "-m", "ddplab", "train", "/workspace/experiments/quickstart.yaml",
                    "--set", f"checkpoint.dir={tmp}/ck"], check=True, capture_output=True)
    client = MlflowClient(store)
    run = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id],
                             order_by=["start_time DESC"])[0]
    return first_step_and_throughput(client, run.info.run_id, t0, tmp)


def compose(tmp: str, file: str = "multinode.yml", service: str = "node") -> tuple[float, float]:
    project, port = f"ddplabbench{uuid.uuid4().hex[:6]}", "5077"
    # Not this shell's MLFLOW_* (a compose file would hand its store to the jobs).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
           "COMPOSE_PROJECT_NAME": project, "MLFLOW_PORT": port, "NNODES": "2",
           "NPROC_PER_NODE": "1", "SLOTS": "1", "DDPLAB_SET": SET}
    cmd = ["docker", "compose", "-f", str(REPO / "compose" / file)]
    subprocess.run([*cmd, "up", "-d", "--wait", "mlflow"], env=env, check=True, capture_output=True)
    try:
        t0 = time.time()
        subprocess.run([*cmd, "up", service], env=env, check=True, capture_output=True)
        os.environ.update(client_env(cmd, env))  # MLflow's client reads the login there
        client = MlflowClient(f"http://127.0.0.1:{port}")
        run = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])[0]
        assert run.info.status == "FINISHED", run.info.status
        return first_step_and_throughput(client, run.info.run_id, t0, tmp)
    finally:
        subprocess.run([*cmd, "down", "-v"], env=env, capture_output=True)


def mpi(tmp: str) -> tuple[float, float]:
    return compose(tmp, "mpi.yml", "launcher")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-mpi", action="store_true", help="skip the mpirun variant")
    p.add_argument("--no-page", action="store_true",
                   help="print only; do not write docs/results/compose.md")
    a = p.parse_args()
    variants = {"one container, 2 ranks": one_container, "compose torchrun, 2 x 1": compose}
    if not a.no_mpi:
        variants["compose mpirun, 2 x 1"] = mpi
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    names = list(variants)
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)  # the image's non-root user writes the store here
        for rep in range(a.reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                res[name].append(variants[name](tmp))
                print(f"rep {rep + 1}: {name:26s} first step after {res[name][-1][0]:5.1f}s, "
                      f"{res[name][-1][1]:7.1f} samples/s", flush=True)
    med = {k: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v))
           for k, v in res.items()}
    single = med["one container, 2 ranks"]
    lines = [f"medians of {a.reps} interleaved reps: launch -> first step, samples/s (last epoch)"]
    lines += [f"  {k:26s} {first:5.1f}s {thr:8.1f}   x{thr / single[1]:.3f} of one container"
              for k, (first, thr) in med.items()]
    lines.append(f"compose torchrun / one container: "
                 f"{med['compose torchrun, 2 x 1'][1] / single[1]:.3f} (target >= 0.90)")
    if "compose mpirun, 2 x 1" in med:
        lines.append(f"mpirun / torchrun (same 2-container layout): "
                     f"{med['compose mpirun, 2 x 1'][1] / med['compose torchrun, 2 x 1'][1]:.3f}")
    print("\n" + "\n".join(lines))
    if not a.no_page:
        results_page.write("compose", "compose: one container vs 2 node containers",
                           "Same image and experiment, 2 ranks in all.\n\n```\n" +
                           "\n".join(lines) + "\n```")

if __name__ == "__main__":
    sys.exit(main())
