"""Slurm against compose: the same 2 nodes x 1 rank quickstart, submitted with `sbatch --wait`
to compose/slurm.yml's cluster and started with `docker compose -f compose/multinode.yml up`
(torchrun); interleaved, medians. Prints, per launcher, the time from the command to the first
training step (the timestamp of the run's train/time_to_first_step_s metric) and the steady
throughput (perf/samples_per_s).

    python benchmarks/bench_slurm.py --reps 3        (needs `make image-slurm image-mlflow`)

Writes docs/results/slurm-vs-compose.md (``--no-page``: print only).

Slurm's time counts a running cluster (the scheduler's start-up is a site's, not a job's);
compose's counts starting the node containers (its MLflow server is up first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import results as results_page  # benchmarks/ is this script's directory
from compose_tracking import admin_password, rest

REPO = Path(__file__).resolve().parents[1]


def sh(cmd: list[str], env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def newest_run(p: Project) -> dict:
    base, password = f"http://127.0.0.1:{p.port}", admin_password(p.cmd, p.env)
    ids = [e["experiment_id"] for e in rest(base, "/api/2.0/mlflow/experiments/search",
                                            {"max_results": 100}, password)["experiments"]]
    return rest(base, "/api/2.0/mlflow/runs/search",
                {"experiment_ids": ids, "order_by": ["attributes.start_time DESC"]},
                password)["runs"][0]


def first_step_and_speed(p: Project, t0: float) -> tuple[float, float]:
    run = newest_run(p)
    if run["info"]["status"] != "FINISHED":
        sys.exit(f"the job's run ended {run['info']['status']}")
    m = {x["key"]: x for x in run["data"]["metrics"]}
    return m["train/time_to_first_step_s"]["timestamp"] / 1000 - t0, m["perf/samples_per_s"]["value"]


class Project:
    def __init__(self, file: str, name: str, port: int) -> None:
        self.cmd = ["docker", "compose", "-f", str(REPO / "compose" / file)]
        self.port = port
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
                    "COMPOSE_PROJECT_NAME": name, "MLFLOW_PORT": str(port), "NNODES": "2",
                    "NPROC_PER_NODE": "1"}

    def up(self, *services: str, wait: bool = True) -> None:
        out = sh([*self.cmd, "up", "-d", *(["--wait"] if wait else []), *services], self.env)
        if out.returncode:
            sys.exit(out.stderr[-2000:])

    def nodes_idle(self, want: int, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = sh([*self.cmd, "exec", "-T", "slurmctld", "sinfo", "-h", "-t", "idle", "-o", "%D"],
                     self.env)
            if out.stdout.strip() == str(want):
                return
            time.sleep(2)
        sys.exit(f"the Slurm nodes did not come up within {timeout:.0f} s")

    def down(self) -> None:
        sh([*self.cmd, "down", "-v"], self.env)


def slurm_job(p: Project) -> tuple[float, float]:
    t0 = time.time()
    out = sh([*p.cmd, "exec", "-T", "-u", "ddplab", "slurmctld", "sbatch", "--wait",
              "--output=/jobs/bench-%j.out", "slurm/cpu.sbatch"], p.env)
    if out.returncode:
        sys.exit(f"sbatch failed: {out.stdout}{out.stderr}")
    return first_step_and_speed(p, t0)


def compose_job(p: Project) -> tuple[float, float]:
    t0 = time.time()
    out = sh([*p.cmd, "up", "--no-deps", "--exit-code-from", "node", "node"], p.env)
    if out.returncode:
        sys.exit(f"compose up failed: {out.stdout[-2000:]}")
    return first_step_and_speed(p, t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-page", action="store_true",
                    help="print only; do not write docs/results/slurm-vs-compose.md")
    a = ap.parse_args()
    slurm = Project("slurm.yml", "ddplabbenchslurm", 5091)
    compose = Project("multinode.yml", "ddplabbenchcompose", 5092)
    try:
        slurm.up("slurmctld", "node1", "node2", "mlflow", wait=False)
        compose.up("mlflow")
        slurm.nodes_idle(2)
        results: dict[str, list[tuple[float, float]]] = {"slurm (sbatch, srun)": [],
                                                          "compose (torchrun)": []}
        jobs = {"slurm (sbatch, srun)": lambda: slurm_job(slurm),
                "compose (torchrun)": lambda: compose_job(compose)}
        for rep in range(a.reps):
            for name in (list(jobs) if rep % 2 == 0 else list(jobs)[::-1]):
                results[name].append(jobs[name]())
                first, speed = results[name][-1]
                print(f"rep {rep + 1}/{a.reps} {name:22s} first step after {first:5.1f} s, "
                      f"{speed:7.1f} samples/s", flush=True)
        lines = [f"medians of {a.reps} interleaved reps (2 nodes x 1 rank, quickstart):"]
        lines += [f"  {name:22s} command -> first step {statistics.median(r[0] for r in rs):5.1f} s"
                  f"   steady {statistics.median(r[1] for r in rs):7.1f} samples/s"
                  for name, rs in results.items()]
        print("\n" + "\n".join(lines))
        if not a.no_page:
            results_page.write("slurm-vs-compose", "Slurm vs compose, 2 nodes x 1 rank",
                               "Slurm's time counts a running cluster; compose's counts starting "
                               "the node containers.\n\n```\n" + "\n".join(lines) + "\n```")
    finally:
        slurm.down()
        compose.down()


if __name__ == "__main__":
    main()
