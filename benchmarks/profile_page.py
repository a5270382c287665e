"""Where a profiled run's steady steps went, on a stamped page: the device's kernel time against
its gaps (the time the GPU sat idle between kernels), and the top kernels. It reads rank 0's
trace from the run (``profile.enabled``: the artifact ``profile/*rank0.pt.trace.json.gz``).

    python benchmarks/profile_page.py RUN_ID [--tracking-uri URI] [--page NAME] [--page-dir DIR]

On a CPU trace (no kernels) the same table is of the training thread's outermost aten ops, and
the gaps are the time between them (Python, the data loader, waiting in collectives).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402

DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
TOP = 12

Span = tuple[float, float]


def union_length(spans: list[Span]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def outermost(events: list[dict]) -> list[dict]:
    """The events not inside another of the list on the same thread (an op's children would
    count its time twice)."""
    kept: list[dict] = []
    ends: dict[object, float] = {}
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] + e["dur"] <= ends.get(e.get("tid"), float("-inf")):
            continue
        ends[e.get("tid")] = e["ts"] + e["dur"]
        kept.append(e)
    return kept


def analyse(trace: dict) -> dict:
    """The profiled steps: their window, the busy time in it, the gaps, the top names."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    # the host's step ranges (the trace repeats each on the GPU's streams as gpu_user_annotation)
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep")
             and e.get("cat") != "gpu_user_annotation"]
    device = [e for e in events if e.get("cat") in DEVICE_KINDS]
    if device:
        work, what = device, "kernels (GPU)"
    else:
        main = steps[0].get("tid") if steps else None
        work = outermost([e for e in events if e.get("cat") == "cpu_op" and e.get("tid") == main
                          and str(e.get("name", "")).startswith("aten::")])
        what = "outermost aten ops of the training thread (CPU)"
    if not work:
        return {}
    start = min(e["ts"] for e in work)
    end = max(e["ts"] + e["dur"] for e in work)
    window = end - start
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in work])
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in work:
        by_name[str(e["name"])].append(float(e["dur"]))
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:TOP]
    return {"what": what, "steps": len(steps), "window_ms": window / 1e3,
            "step_ms": window / 1e3 / max(len(steps), 1), "busy_frac": busy / window if window else 0.0,
            "top": [(name, len(d), sum(d) / 1e3, sum(d) / busy if busy else 0.0) for name, d in top]}


def body(run_id: str, run: dict, a: dict) -> str:
    lines = [f"Run `{run_id}` ({run.get('name', '')}): {a['steps']} profiled steps, "
             f"{a['what']}. perf/mfu of the run: {run.get('mfu', '-')}.", "",
             "| | |", "|---|---|",
             f"| window (first to last {'kernel' if 'GPU' in a['what'] else 'op'}) | "
             f"{a['window_ms']:.1f} ms, {a['step_ms']:.1f} ms a step |",
             f"| busy | {a['busy_frac']:.1%} |", f"| gaps (idle between them) | {1 - a['busy_frac']:.1%} |",
             "", "| name | calls | total ms | share of busy |", "|---|---|---|---|"]
    for name, calls, ms, share in a["top"]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {calls} | {ms:.2f} | {share:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_id")
    ap.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", ""))
    ap.add_argument("--page", default="", help="docs/results/<page>.md ('' = print only)")
    ap.add_argument("--page-dir", default="", help="write the page here instead of docs/results")
    a = ap.parse_args(argv)
    from mlflow import MlflowClient

    client = MlflowClient(a.tracking_uri or None)
    run = client.get_run(a.run_id)
    traces = [f.path for f in client.list_artifacts(a.run_id, "profile")
              if f.path.endswith("rank0.pt.trace.json.gz")]
    if not traces:
        print(f"profile_page: run {a.run_id} has no rank 0 trace (profile/*rank0.pt.trace.json.gz): "
              "run it with --set profile.enabled=true", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        local = client.download_artifacts(a.run_id, traces[0], tmp)
        trace = json.loads(gzip.decompress(Path(local).read_bytes()))
    found = analyse(trace)
    if not found:
        print(f"profile_page: {traces[0]}: no kernels or ops in the profiled steps", file=sys.stderr)
        return 1
    info = {"name": run.info.run_name, "mfu": run.data.metrics.get("perf/mfu")}
    text = body(a.run_id, info, found)
    print(text)
    if a.page:
        results.write(a.page, "Where the profiled steps went: kernel time, gaps, top kernels", text,
                      folder=Path(a.page_dir) if a.page_dir else results.RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
