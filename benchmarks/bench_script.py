"""What script mode's observation costs the book's chapter 9 script, side by side.

    make bench-script                     (= python benchmarks/bench_script.py)
    python benchmarks/bench_script.py --reps 5 --samples 2048

Each rep runs, in a rotated order, the book's gloo CNN script (`experiments/scripts/
gloo_distributed-cnn_cifar10.py`, unedited, 2 ranks, 5 epochs of `--synthetic N` images) four
ways: under plain `torchrun`; under `torchrun -m ddplab train` (script mode, tracked, its
training observed through torch's hooks); the same with `--set script.observe=false`; and with
`--set tracking.enabled=false` (observed, no run: no delivery process beside the ranks). The
steady step time is the median of epochs 2-4 (between the script's `set_epoch` calls: the
first epoch warms up, the last ends in the script's own test) over the steps in an epoch;
medians over the reps, and the ratio to plain torchrun; and, for the observed runs, what the
observation's own hooks took of the steady steps, measured inside the script's process
(summary.json ``observe_frac``), which the machine's noise does not blur. The page:
docs/results/bench-script.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import results as results_page  # benchmarks/ is this script's directory

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BOOK = REPO / "experiments" / "scripts" / "gloo_distributed-cnn_cifar10.py"
CLOCK = Path(__file__).resolve().parent / "scripts" / "epoch_clock.py"
BATCH, RANKS = 32, 2
VARIANTS = ("plain torchrun", "script mode, observed", "script mode, observe=false",
            "script mode, untracked")


def command(variant: str, samples: int, work: Path) -> list[str]:
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(RANKS)]
    script = [str(BOOK), "--synthetic", str(samples)]
    if variant == "plain torchrun":
        return [*torchrun, str(CLOCK), *script]
    off = {"script mode, observe=false": ["--set", "script.observe=false"],
           "script mode, untracked": ["--set", "tracking.enabled=false"]}.get(variant, [])
    return [*torchrun, "-m", "ddplab", "train", str(CLOCK), "--set", "checkpoint.resume=never",
            "--set", f"checkpoint.dir={work / 'ck'}", *off, "--", *script]


def observe_frac(work: Path) -> float:
    """The newest run's ``observe_frac`` (summary.json): the share of rank 0's steady steps its
    observation's own hooks took, measured inside the script's process."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                order_by=["attributes.start_time DESC"], max_results=1)
    path = client.download_artifacts(run.info.run_id, "summary.json", str(work))
    return float(json.loads(Path(path).read_text()).get("observe_frac") or 0.0)


def _is_script(cmdline: list[str]) -> bool:
    """The script's own process: script mode's child, or a plain torchrun worker (which runs
    the clock itself, not torchrun and not ``python -m ddplab``), told apart by its arguments,
    not by names a checkout's path may hold too."""
    if "ddplab.training.scriptmode.child" in cmdline:
        return True
    if len(cmdline) > 1 and Path(cmdline[1]).name == "torchrun":
        return False
    if any(a == "-m" and b.split(".")[0] == "ddplab" for a, b in zip(cmdline, cmdline[1:], strict=False)):
        return False  # ddplab's supervisor, its delivery process
    return any(Path(a).name == CLOCK.name for a in cmdline)


def sample_cpu(root: psutil.Process, stop: threading.Event,
               samples: list[tuple[float, dict[int, tuple[float, bool]]]]) -> None:
    """Every 0.25 s: each process of the job's tree, its CPU seconds so far and whether it is
    the script's own; the rest (torchrun's agent, ddplab's supervisors and delivery process)
    is what a launch structure costs the machine."""
    kinds: dict[int, bool] = {}
    while not stop.is_set():
        now, snap = time.monotonic(), {}
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        for proc in procs:
            try:
                if proc.pid not in kinds:
                    kinds[proc.pid] = _is_script(proc.cmdline())
                t = proc.cpu_times()
                snap[proc.pid] = (t.user + t.system, kinds[proc.pid])
            except psutil.Error:
                continue
        samples.append((now, snap))
        stop.wait(0.25)


def structure_share(samples: list[tuple[float, dict[int, tuple[float, bool]]]],
                    start: float, end: float) -> float:
    """CPU seconds the job's processes other than the script's own used between ``start`` and
    ``end`` (time.monotonic), as a share of the script's own CPU seconds then."""
    def at(t: float) -> dict[int, tuple[float, bool]]:
        return min(samples, key=lambda s: abs(s[0] - t))[1]
    first, last = at(start), at(end)
    used = {True: 0.0, False: 0.0}
    for pid, (cpu, script) in last.items():
        used[script] += cpu - first.get(pid, (0.0, script))[0]
    return used[False] / used[True] if used[True] else 0.0


def one_job(variant: str, samples: int, work: Path) -> tuple[float, float]:
    """The steady step time (s) of one job, and what its processes other than the script's own
    used of the CPU over those steady epochs (a share of the script's own CPU)."""
    clocks = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, "BENCH_CLOCK_DIR": str(clocks),
           "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
    proc = subprocess.Popen(command(variant, samples, work), cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop, cpu = threading.Event(), []  # type: ignore[var-annotated]
    sampler = threading.Thread(target=sample_cpu, args=(psutil.Process(proc.pid), stop, cpu))
    sampler.start()
    try:
        _, err = proc.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        stop.set()
        sampler.join()
    if proc.returncode != 0:
        sys.exit(f"benchmark job failed ({variant}, exit {proc.returncode}):\n{err[-3000:]}")
    # perf_counter and monotonic are both CLOCK_MONOTONIC on Linux: the marks and the samples
    # share one clock.
    marks = json.loads((clocks / "rank0.json").read_text())
    epochs = [b - a for a, b in zip(marks, marks[1:], strict=False)][1:]  # epochs 2..4
    steps = -(-samples // RANKS // BATCH)
    return statistics.median(epochs) / steps, structure_share(cpu, marks[1], marks[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1536, help="synthetic images per epoch")
    ap.add_argument("--page", default="bench-script", help="docs/results/<page>.md")
    ap.add_argument("--page-dir", default="", help="write the page here instead of docs/results")
    args = ap.parse_args()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    others: dict[str, list[float]] = {v: [] for v in VARIANTS}
    own: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rep in range(args.reps):
            order = VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]
            for variant in order:
                step, other = one_job(variant, args.samples, work)
                times[variant].append(step)
                others[variant].append(other)
                if variant == "script mode, observed":
                    own.append(observe_frac(work))
                print(f"rep {rep + 1}/{args.reps} {variant}: step {step * 1000:.1f} ms, "
                      f"other processes {other * 100:.2f}% of the script's CPU", flush=True)
    plain = statistics.median(times["plain torchrun"])
    rows = ["| how the script ran | steady step time (median) | each rep | vs plain torchrun "
            "(medians) | vs plain torchrun (median of each rep's ratio) | the job's other processes' CPU "
            "over those epochs, a share of the script's own (median) |",
            "|---|---|---|---|---|---|"]
    for v in VARIANTS:
        med = statistics.median(times[v])
        paired = statistics.median(t / p for t, p in zip(times[v], times["plain torchrun"],
                                                          strict=True))
        rows.append(f"| {v} | {med * 1000:.1f} ms | "
                    f"{', '.join(f'{t * 1000:.1f}' for t in times[v])} | {med / plain:.3f}x | "
                    f"{paired:.3f}x | {statistics.median(others[v]) * 100:.2f}% |")
    table = "\n".join(rows)
    inside = (f"The observation's own cost, measured inside the script's process (its hooks' "
              f"time over rank 0's steady steps, summary.json `observe_frac`): median "
              f"{statistics.median(own) * 100:.3f}% of a step (each rep: "
              f"{', '.join(f'{x * 100:.3f}%' for x in own)}). The side-by-side step times "
              "above differ from rep to rep by more than that on a shared machine: their "
              "ratios carry the machine's noise, this figure does not.")
    extra = {v: statistics.median(others[v]) - statistics.median(others["plain torchrun"])
             for v in VARIANTS[1:]}
    structure = ("What script mode's own processes (a supervisor per rank, the node's delivery "
                 "process) take beside the script, counted from each process's CPU seconds "
                 "(psutil, every 0.25 s) over the same steady epochs, less what torchrun's own "
                 "agent takes under plain torchrun: "
                 + ", ".join(f"{v}: {x * 100:+.2f}%" for v, x in extra.items())
                 + " of the script's own CPU: the CPU a launch structure takes from the script's "
                   "cores, which the machine's noise does not blur either.")
    print("\n" + table + "\n\n" + inside + "\n\n" + structure)
    body = (f"The book's chapter 9 gloo script, unedited, {RANKS} ranks, batch {BATCH}, "
            f"{args.samples} synthetic images per epoch, 5 epochs; {args.reps} reps, the "
            "variants' order rotated each rep. Steady step time: the median of epochs 2-4 over "
            "the steps in an epoch (epoch_clock.py: one clock call per epoch, in every "
            "variant).\n\n" + table + "\n\n" + inside + "\n\n" + structure + "\n")
    results_page.write(args.page, "Script mode's observation: what it costs a step", body,
                       folder=Path(args.page_dir) if args.page_dir else results_page.RESULTS)


if __name__ == "__main__":
    main()
