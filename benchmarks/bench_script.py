"""What script mode's observation costs the book's chapter 9 script, side by side.

    make bench-script                     (= python benchmarks/bench_script.py)
    python benchmarks/bench_script.py --reps 5 --samples 2048

Each rep runs, in a balanced order (WILLIAMS), the book's gloo CNN script (`experiments/scripts/
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
from typing import NamedTuple

import psutil
import results as results_page  # benchmarks/ is this script's directory

from ddplab.training.scriptmode.env import BOOT  # the file script mode's child runs

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BOOK = REPO / "experiments" / "scripts" / "gloo_distributed-cnn_cifar10.py"
CLOCK = Path(__file__).resolve().parent / "scripts" / "epoch_clock.py"
BATCH, RANKS = 32, 2
BOOK_THREADS = 8  # the script's own OMP_NUM_THREADS a rank (its first lines)
VARIANTS = ("plain torchrun", "script mode, observed", "script mode, observe=false",
            "script mode, untracked")
NAMES = ("plain", "observed", "observe-off", "untracked")
SHORT = dict(zip(NAMES, VARIANTS, strict=True))
AGAIN = "plain torchrun, again"
"""Plain torchrun's very command once more in each rep (``--variants ...,plain-again``): its
ratio to plain torchrun is what the machine's noise alone makes of two runs of one thing."""
SHORT["plain-again"] = AGAIN


def williams(n: int) -> list[int]:
    """The first rep's order of n variants (n even) in a Williams square: 0, 1, n-1, 2, n-2...
    Rep r runs each of them plus r (mod n): over n reps each variant runs in each place once and
    follows each other variant once, so neither the place in a rep nor the job before weighs on
    one variant more than another (4 variants: 0, 1, 3, 2)."""
    order, low, high = [0], 1, n - 1
    while len(order) < n:
        order.append(low)
        low += 1
        if len(order) < n:
            order.append(high)
            high -= 1
    return order


def command(variant: str, samples: int, work: Path) -> list[str]:
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(RANKS)]
    script = [str(BOOK), "--synthetic", str(samples)]
    if variant in (VARIANTS[0], AGAIN):
        return [*torchrun, str(CLOCK), *script]
    off = {"script mode, observe=false": ["--set", "script.observe=false"],
           "script mode, untracked": ["--set", "tracking.enabled=false"]}.get(variant, [])
    return [*torchrun, "-m", "ddplab", "train", str(CLOCK), "--set", "checkpoint.resume=never",
            "--set", f"checkpoint.dir={work / 'ck'}", *off, "--", *script]


def wait_policy() -> dict[str, str]:
    """``OMP_WAIT_POLICY=PASSIVE`` for every variant alike where the book's threads outnumber
    the cores (2 ranks x 8 on a 2-core machine), unless it is set already: OpenMP threads that
    spin at their barriers there take turns on cores that are never theirs, and each job's step
    time measured the scheduler's luck as much as the script (on this repository's 2-core
    machine, plain torchrun's 8 reps spread over 51.3-58.3 ms spinning, 55.2-57.1 ms passive).
    Where each thread has a core, as on the machine the book wrote it for, nothing is set."""
    if "OMP_WAIT_POLICY" in os.environ or RANKS * BOOK_THREADS <= (os.cpu_count() or 1):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def observe_frac(work: Path) -> float:
    """The newest run's ``observe_frac`` (summary.json): the share of rank 0's steady steps its
    observation's own hooks took, measured inside the script's process."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # not in the log
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
    if BOOT in cmdline:
        return True
    if len(cmdline) > 1 and Path(cmdline[1]).name == "torchrun":
        return False
    if any(a == "-m" and b.split(".")[0] == "ddplab" for a, b in zip(cmdline, cmdline[1:], strict=False)):
        return False  # ddplab's supervisor, its delivery process
    return any(Path(a).name == CLOCK.name for a in cmdline)


def sample_cpu(root: psutil.Process, stop: threading.Event,
               samples: list[tuple[float, dict[int, tuple[float, bool]]]],
               seen: dict[int, psutil.Process]) -> None:
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
            seen.setdefault(proc.pid, proc)
            try:
                if not kinds.get(proc.pid):  # met between fork and exec, a child still has its
                    kinds[proc.pid] = _is_script(proc.cmdline())  # parent's command line
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


class Job(NamedTuple):
    """One job's steady epochs: rank 0's wall time, its own process's CPU time and the time its
    threads waited for a CPU, per step, and what the job's other processes used of the CPU then
    (a share of the script's own CPU)."""
    step_s: float
    cpu_s: float
    wait_s: float
    others: float
    threads: int = 0  # torch's threads in rank 0

    @property
    def machine_cpu_s(self) -> float:
        """The CPU a step costs the machine: the script's own and its share of the launch
        structure's (a rank's CPU per step, scaled by the whole job's)."""
        return self.cpu_s * (1 + self.others)


def one_job(variant: str, samples: int, work: Path) -> Job:
    """Runs one job and measures its steady epochs (2-4) from rank 0's epoch clock."""
    clocks = Path(tempfile.mkdtemp(dir=work))
    env = {**os.environ, **wait_policy(), "BENCH_CLOCK_DIR": str(clocks),
           "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}"}
    proc = subprocess.Popen(command(variant, samples, work), cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stop, cpu, seen = threading.Event(), [], {}  # type: ignore[var-annotated]
    sampler = threading.Thread(target=sample_cpu,
                               args=(psutil.Process(proc.pid), stop, cpu, seen))
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
        # A tracked job's delivery process may still be finishing the run after torchrun is
        # done: the next job starts on a machine it no longer shares.
        psutil.wait_procs(list(seen.values()), timeout=120)
    if proc.returncode != 0:
        sys.exit(f"benchmark job failed ({variant}, exit {proc.returncode}):\n{err[-3000:]}")
    # perf_counter and monotonic are both CLOCK_MONOTONIC on Linux: the marks and the samples
    # share one clock.
    marks = json.loads((clocks / "rank0.json").read_text())
    steps = -(-samples // RANKS // BATCH)
    steady = list(zip(marks, marks[1:], strict=False))[1:]  # epochs 2..4

    def per_step(i: int) -> float:
        return statistics.median(b[i] - a[i] for a, b in steady) / steps

    threads = clocks / "rank0.threads"
    return Job(per_step(0), per_step(1), per_step(2),
               structure_share(cpu, marks[1][0], marks[-1][0]),
               int(threads.read_text()) if threads.exists() else 0)


def _threads(jobs: dict[str, list[Job]]) -> str:
    seen = sorted({j.threads for js in jobs.values() for j in js if j.threads})
    return "/".join(map(str, seen)) or "an unknown number of"


def _column(jobs: dict[str, list[Job]], v: str, field: str) -> tuple[float, str, float]:
    """A variant's median of one figure, each rep's value (ms), and the median of each rep's
    ratio to plain torchrun's (the reps' jobs ran next to each other)."""
    mine = [getattr(j, field) for j in jobs[v]]
    plain = [getattr(j, field) for j in jobs["plain torchrun"]]
    paired = statistics.median(m / p for m, p in zip(mine, plain, strict=True))
    return statistics.median(mine), ", ".join(f"{x * 1000:.1f}" for x in mine), paired


def _table(jobs: dict[str, list[Job]]) -> str:
    rows = ["| how the script ran | steady step time (median) | each rep | vs plain torchrun "
            "(medians) | vs plain torchrun (median of each rep's ratio) | rank 0's own CPU a step "
            "(median) | vs plain torchrun (median of each rep's ratio) | the CPU a step costs "
            "the machine, vs plain torchrun (median of each rep's ratio) | the job's other "
            "processes' CPU over those epochs, a share of the script's own (median) | rank 0's "
            "threads waiting for a CPU a step (median) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    plain = statistics.median(j.step_s for j in jobs["plain torchrun"])
    for v in jobs:
        step, each, paired = _column(jobs, v, "step_s")
        cpu, _, cpu_paired = _column(jobs, v, "cpu_s")
        _, _, machine = _column(jobs, v, "machine_cpu_s")
        others = statistics.median(j.others for j in jobs[v])
        wait = statistics.median(j.wait_s for j in jobs[v])
        rows.append(f"| {v} | {step * 1000:.1f} ms | {each} | {step / plain:.3f}x | "
                    f"{paired:.3f}x | {cpu * 1000:.1f} ms | {cpu_paired:.3f}x | {machine:.3f}x | "
                    f"{others * 100:.2f}% | {wait * 1000:.2f} ms |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=4,
                    help="a multiple of the variants' number balances the order")
    ap.add_argument("--variants", default=",".join(NAMES),
                    help=f"which to run, comma-separated, of {','.join(SHORT)}, plain among "
                         "them (an even number balances the order)")
    ap.add_argument("--samples", type=int, default=1536, help="synthetic images per epoch")
    ap.add_argument("--page", default="bench-script", help="docs/results/<page>.md")
    ap.add_argument("--page-dir", default="", help="write the page here instead of docs/results")
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",")]
    if "plain" not in names or not set(names) <= set(SHORT):
        ap.error(f"--variants: {args.variants!r}; each one of {','.join(SHORT)}, plain among them")
    chosen = [SHORT[n] for n in names]
    if wait_policy():
        print(f"OMP_WAIT_POLICY=PASSIVE for every variant: the script asks for {RANKS} x "
              f"{BOOK_THREADS} threads, more than this machine's {os.cpu_count()} cores",
              flush=True)
    jobs: dict[str, list[Job]] = {v: [] for v in chosen}
    own: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for rep in range(args.reps):
            order = [chosen[(rep + k) % len(chosen)] for k in williams(len(chosen))]
            for variant in order:
                job = one_job(variant, args.samples, work)
                jobs[variant].append(job)
                if variant == VARIANTS[1]:
                    own.append(observe_frac(work))
                print(f"rep {rep + 1}/{args.reps} {variant}: step {job.step_s * 1000:.1f} ms, "
                      f"rank 0's CPU {job.cpu_s * 1000:.1f} ms a step, waiting for a CPU "
                      f"{job.wait_s * 1000:.2f} ms, other processes "
                      f"{job.others * 100:.2f}% of the script's CPU", flush=True)
    table = _table(jobs)
    policy = {**os.environ, **wait_policy()}.get("OMP_WAIT_POLICY", "")
    inside = (f"The observation's own cost, measured inside the script's process (its hooks' "
              f"time over rank 0's steady steps, summary.json `observe_frac`): median "
              f"{statistics.median(own) * 100:.3f}% of a step (each rep: "
              f"{', '.join(f'{x * 100:.3f}%' for x in own)}). The side-by-side step times "
              "above differ from rep to rep by more than that on a shared machine: their "
              "ratios carry the machine's noise, this figure does not.") if own else ""
    others = {v: statistics.median(j.others for j in jobs[v]) for v in jobs}
    extra = {v: others[v] - others[VARIANTS[0]] for v in jobs if v not in (VARIANTS[0], AGAIN)}
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
            f"variants' order a Williams square (over {len(chosen)} reps, each in each place once "
            "and after each other once; each job starts once the last one's processes are gone). Steady "
            "step time: the median of epochs 2-4 over "
            "the steps in an epoch (epoch_clock.py: two clock calls per epoch, in every "
            "variant); the CPU figures are rank 0's own process's CPU seconds over the same "
            "epochs (`time.process_time`), which a busy machine's preemptions do not lengthen, "
            "and that times one plus the share the job's other processes used then: the CPU a "
            "step costs the machine; the wait is the time rank 0's threads spent runnable but "
            "without a CPU (the kernel's schedstat), what other work on the cores took from it."
            + (f" Every variant ran with `OMP_WAIT_POLICY={policy}`"
               + (" (set by the benchmark: the script asks for "
                  f"{RANKS} x {BOOK_THREADS} threads, more than this machine's "
                  f"{os.cpu_count()} cores; spinning threads made the step time the "
                  "scheduler's luck)." if wait_policy() else ".") if policy else "")
            + f" torch ran {_threads(jobs)} thread(s) a rank (the script sets OMP_NUM_THREADS="
            f"{BOOK_THREADS} before its `import torch`; torch takes no more than the cores it "
            "may use)."
            + (f" \"{AGAIN}\" is plain torchrun's command run a second time in each rep: its "
               "ratio to plain torchrun is what this machine's noise alone makes of two runs of "
               "one thing, the yardstick for the other ratios." if AGAIN in jobs else "")
            + "\n\n" + table + "\n\n" + inside + "\n\n" + structure + "\n")
    results_page.write(args.page, "Script mode's observation: what it costs a step", body,
                       folder=Path(args.page_dir) if args.page_dir else results_page.RESULTS)


if __name__ == "__main__":
    main()
