"""Several nodes x several ranks on ddplab's ccl, run after run: does any hang? (issue 26)

    python benchmarks/bench_ccl_nodes.py [--reps 10] [--nnodes 2] [--nproc 2]   (needs `make images`)

Each rep runs `docker compose -f compose/multinode.yml up` as a user types it, with
DDPLAB_SET="dist.backend=ccl ...", then the same with gloo (interleaved, so both see the same
machine), each in its own project, under a hard deadline: a run that has not ended by then
counts as HUNG. Prints every run (status, backend, world size, wall seconds, steady
samples/s) and the summary: how many ended FINISHED on ccl, how many hung, and the median
ccl/gloo throughput ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import results as results_page  # benchmarks/ is this script's directory
from compose_tracking import admin_password, rest
from local_nodes import free_port

REPO = Path(__file__).resolve().parents[1]
SET = "data.train_samples=2048 train.epochs=2 checkpoint.resume=never"


def one_job(backend: str, nnodes: int, nproc: int, deadline_s: float) -> dict:
    project, port = f"benchccl{uuid.uuid4().hex[:8]}", free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")},
           "NNODES": str(nnodes), "NPROC_PER_NODE": str(nproc), "MLFLOW_PORT": str(port),
           "COMPOSE_PROJECT_NAME": project, "DDPLAB_SET": f"dist.backend={backend} {SET}"}
    compose = ["docker", "compose", "-f", str(REPO / "compose" / "multinode.yml")]
    t0 = time.monotonic()
    up = subprocess.Popen([*compose, "up"], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    result = {"backend": backend, "status": "HUNG", "wall_s": deadline_s}
    try:
        while time.monotonic() - t0 < deadline_s:
            time.sleep(3)
            out = subprocess.run([*compose, "ps", "-a", "--format", "json", "node"], env=env,
                                 cwd=REPO, capture_output=True, text=True)
            rows = [json.loads(x) for x in out.stdout.splitlines() if x.strip()]
            if len(rows) == nnodes and all(r["State"] == "exited" for r in rows):
                result = {"backend": backend, "wall_s": time.monotonic() - t0,
                          **finished_run(compose, env, port)}
                break
    finally:
        up.kill()
        subprocess.run([*compose, "down", "-v", "--remove-orphans"], env=env, cwd=REPO,
                       capture_output=True, timeout=300)
    return result


def finished_run(compose: list[str], env: dict[str, str], port: int) -> dict:
    runs = rest(f"http://127.0.0.1:{port}", "/api/2.0/mlflow/runs/search",
                {"experiment_ids": ["1"]}, admin_password(compose, env)).get("runs", [])
    if not runs:
        return {"status": "NO RUN"}
    run = runs[0]
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    metrics = {m["key"]: m["value"] for m in run["data"].get("metrics", [])}
    return {"status": run["info"]["status"], "ran_on": tags.get("ddplab.backend", "?"),
            "world_size": tags.get("ddplab.world_size", "?"),
            "samples_per_s": metrics.get("perf/samples_per_s", float("nan"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--deadline", type=float, default=600, help="seconds before a run counts as hung")
    p.add_argument("--no-gloo", action="store_true", help="ccl runs only (no ratio)")
    p.add_argument("--no-page", action="store_true",
                   help="print only; do not write docs/results/ccl-nodes.md")
    a = p.parse_args()
    done: list[dict] = []
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    for rep in range(a.reps):
        for backend in ("ccl",) if a.no_gloo else ("ccl", "gloo"):
            r = one_job(backend, a.nnodes, a.nproc, a.deadline)
            done.append(r)
            say(f"rep {rep + 1}/{a.reps} {backend:4s}: {r['status']:8s} ran on {r.get('ran_on', '-')}, "
                f"world size {r.get('world_size', '-')}, {r['wall_s']:.0f} s, "
                f"{r.get('samples_per_s', float('nan')):.0f} samples/s")
    ccl = [r for r in done if r["backend"] == "ccl"]
    ok = [r for r in ccl if r["status"] == "FINISHED" and r.get("ran_on") == "ccl"]
    say("")
    say(f"{a.nnodes} nodes x {a.nproc} ranks on ccl: {len(ok)}/{len(ccl)} FINISHED on ccl, "
        f"{sum(r['status'] == 'HUNG' for r in ccl)} hung (deadline {a.deadline:.0f} s)")
    gloo = [r["samples_per_s"] for r in done if r["backend"] == "gloo" and r["status"] == "FINISHED"]
    if ok and gloo:
        ratio = statistics.median(r["samples_per_s"] for r in ok) / statistics.median(gloo)
        say(f"median steady throughput ccl/gloo: {ratio:.2f}x "
            f"(ccl {statistics.median(r['samples_per_s'] for r in ok):.0f}, "
            f"gloo {statistics.median(gloo):.0f} samples/s)")
    if not a.no_page:
        results_page.write("ccl-nodes", f"ccl on {a.nnodes} nodes x {a.nproc} ranks (compose, as typed)",
                           f"`docker compose -f compose/multinode.yml up` with NNODES={a.nnodes} "
                           f"NPROC_PER_NODE={a.nproc} and DDPLAB_SET=\"dist.backend=<b> {SET}\", rep "
                           "after rep; a run not ended within the deadline counts as hung. All "
                           "nodes share this machine's cores.\n\n```\n" + "\n".join(lines) + "\n```")

if __name__ == "__main__":
    main()
