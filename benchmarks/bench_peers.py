"""ddplab beside the tools a user would pick instead, on the SAME job: the quickstart's model,
synthetic data, global batch, epochs and threads, as a plain torchrun DDP script, Lightning
Fabric, Lightning's Trainer (strategy ddp; with and without its MLFlowLogger), Hugging Face
Accelerate (benchmarks/peers/peer_job.py), and ddplab with tracking on and off (and, asked for on
a GPU, with data.pin_memory off: ``--only ...,ddplab-unpinned``). Rounds are
interleaved (each round runs every tool once, in a rotated order) and medians reported:

- steady samples/s: the epochs after the first, by each tool's epoch wall time (one clock for all);
- rank 0's CPU ms per step over those epochs (its process, every thread);
- the whole job's CPU seconds (every process the launcher started: ranks, torchrun, ddplab's
  tracking delivery) from the launcher's children's rusage;
- time to first step: from the launch command to the end of rank 0's first step;
- wall time of the launch command.

Each as a ratio to the plain script. ``make bench-peers`` installs the peers (the optional
``peers`` extra) and writes docs/results/bench-peers.md.

    python benchmarks/bench_peers.py [--rounds 3] [--nproc 2] [--device cpu|cuda] [--page NAME]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PEER = REPO / "benchmarks" / "peers" / "peer_job.py"
TOOLS = ("plain", "ddplab", "ddplab-untracked", "ddplab-unpinned", "fabric", "trainer", "trainer-mlflow",
         "accelerate")
# Run only when asked, and only on a GPU: what data.pin_memory is worth there (a CPU job pins nothing).
GPU_ONLY = ("ddplab-unpinned",)
NEEDS = {"fabric": "lightning", "trainer": "lightning", "trainer-mlflow": "lightning",
         "accelerate": "accelerate"}


def command(tool: str, a: argparse.Namespace, out: Path) -> list[str]:
    if tool.startswith("ddplab"):
        sets = [f"train.epochs={a.epochs}", f"data.train_samples={a.samples}",
                f"data.batch_size={a.batch}", f"dist.threads_per_rank={a.threads}",
                f"dist.device={a.device}", f"dist.backend={'nccl' if a.device == 'cuda' else 'gloo'}",
                f"train.eval_every_epochs={a.epochs}", "checkpoint.every_steps=0",
                "checkpoint.every_epochs=0", "checkpoint.resume=never", "train.mfu=false",
                *(["tracking.enabled=false"] if tool == "ddplab-untracked" else []),
                *(["data.pin_memory=false"] if tool == "ddplab-unpinned" else [])]
        return [sys.executable, "-m", "ddplab", "run", "--nproc-per-node", str(a.nproc),
                str(REPO / "experiments" / "quickstart.yaml"), "--summary-out", str(out),
                *[x for s in sets for x in ("--set", s)]]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(a.nproc), str(PEER), "--framework", tool, "--out", str(out),
            "--samples", str(a.samples), "--batch", str(a.batch), "--epochs", str(a.epochs),
            "--threads", str(a.threads), "--device", a.device]


def measure(tool: str, a: argparse.Namespace, work: Path) -> dict[str, float] | str:
    out = work / f"{tool}.json"
    out.unlink(missing_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    p = subprocess.run(command(tool, a, out), cwd=work, capture_output=True, text=True,
                       timeout=a.timeout_s, check=False)
    wall = time.time() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0 or not out.exists():
        tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or ["no output"]
        return f"exit {p.returncode}: {tail[0][:200]}"
    r = json.loads(out.read_text())
    if tool.startswith("ddplab"):
        epochs = [{"wall_s": w, "cpu_s": c, "steps": n}
                  for w, c, n in zip(r["epoch_time_s"], r["epoch_cpu_s"], r["epoch_steps"], strict=True)]
    else:
        epochs = r["epochs"]
    steady = epochs[1:] or epochs
    steps = sum(e["steps"] for e in steady)
    return {"samples_per_s": steps * a.batch * a.nproc / sum(e["wall_s"] for e in steady),
            "cpu_ms_per_step": 1000 * sum(e["cpu_s"] for e in steady) / steps,
            "job_cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "first_step_s": r["first_step_at"] - t0, "wall_s": wall}


def available(tool: str, device: str = "cuda") -> str:
    if tool in GPU_ONLY and device != "cuda":
        return "a GPU job's: on CPU there is nothing to pin"
    need = NEEDS.get(tool)
    return "" if not need or importlib.util.find_spec(need) else f"{need} is not installed"


def table(rows: dict[str, list[dict[str, float]]], failed: dict[str, str]) -> str:
    keys = ("samples_per_s", "cpu_ms_per_step", "job_cpu_s", "first_step_s", "wall_s")
    med = {t: {k: statistics.median(r[k] for r in runs) for k in keys} for t, runs in rows.items() if runs}
    base = med.get("plain")
    head = ["| tool | rounds | steady samples/s | rank 0 CPU ms/step | job CPU s | time to first step s "
            "| wall s |", "|---|---|---|---|---|---|---|"]
    for tool in TOOLS:
        if tool not in med:
            if tool in GPU_ONLY and tool not in failed:
                continue
            head.append(f"| {tool} | 0 | {failed.get(tool, 'not run')} | | | | |")
            continue
        m, cells = med[tool], []
        for k in keys:
            ratio = f" ({m[k] / base[k]:.2f}x)" if base and base[k] else ""
            cells.append(f"{m[k]:,.1f}{ratio}")
        n = len(rows[tool])
        note = f" ({failed[tool]})" if tool in failed else ""
        head.append(f"| {tool}{note} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(head) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="per rank (default: cores / nproc)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--samples", type=int, default=6144)
    ap.add_argument("--batch", type=int, default=32, help="per rank")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated tools (default: all)")
    ap.add_argument("--timeout-s", type=int, default=600)
    ap.add_argument("--page", default="bench-peers", help="docs/results/<page>.md ('' = none)")
    ap.add_argument("--page-dir", default="", help="write the page here instead of docs/results")
    ap.add_argument("--from-log", default="",
                    help="no runs: the page from the rounds a (cut-off) run of this script printed")
    a = ap.parse_args()
    a.threads = a.threads or max(1, len(os.sched_getaffinity(0)) // a.nproc)
    tools = [t for t in TOOLS if t in a.only.split(",")] if a.only else [
        t for t in TOOLS if t not in GPU_ONLY]
    failed = {t: why for t in tools if (why := available(t, a.device))}
    rows: dict[str, list[dict[str, float]]] = {t: [] for t in tools if t not in failed}
    if a.from_log:
        rows, failed = from_log(Path(a.from_log).read_text())
        a.rounds = max((len(r) for r in rows.values()), default=0)
    else:
        run_rounds(a, rows, failed)
    body = table(rows, failed)
    print("\n" + body)
    if a.page:
        what = (f"The quickstart's job ({a.samples} samples x {a.epochs} epochs, batch {a.batch} per "
                f"rank, {a.nproc} rank(s) x {a.threads} thread(s), {a.device}) under each tool, "
                f"{a.rounds} interleaved round(s), medians; ratios to the plain torchrun script. "
                "Steady = the epochs after the first. Job CPU: every process the launch started.\n\n")
        results.write(a.page, "ddplab beside its peers, on the same job", what + body,
                      folder=Path(a.page_dir) if a.page_dir else results.RESULTS)
    return 0 if rows and all(rows.values()) else 1


def from_log(text: str) -> tuple[dict[str, list[dict[str, float]]], dict[str, str]]:
    """The rounds as this script printed them (``round 1 plain: samples_per_s 9,543.75, ...``)."""
    rows: dict[str, list[dict[str, float]]] = {}
    failed: dict[str, str] = {}
    for m in re.finditer(r"^round \d+ ([\w-]+): (.*)$", text, flags=re.M):
        tool, rest = m.groups()
        pairs = re.findall(r"(\w+) (-?[\d,]+\.?\d*)", rest)
        if not pairs or rest.startswith("exit"):
            failed[tool] = rest
            continue
        rows.setdefault(tool, []).append({k: float(v.replace(",", "")) for k, v in pairs})
    for tool in TOOLS:
        if tool not in rows and tool not in failed and tool not in GPU_ONLY:
            failed[tool] = "not measured: the run was cut off before it"
    return rows, failed


def run_rounds(a: argparse.Namespace, rows: dict[str, list[dict[str, float]]],
               failed: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        work = Path(tmp)
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{work / 'mlflow.db'}")
        for r in range(a.rounds):
            order = list(rows)[r % len(rows):] + list(rows)[:r % len(rows)] if rows else []
            for tool in order:
                got = measure(tool, a, work)
                if isinstance(got, str):
                    failed[tool] = got
                    print(f"round {r + 1} {tool}: {got}", flush=True)
                    continue
                rows[tool].append(got)
                print(f"round {r + 1} {tool}: " + ", ".join(f"{k} {v:,.2f}" for k, v in got.items()),
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
