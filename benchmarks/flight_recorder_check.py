"""The Flight Recorder that ddplab's hang watch reads, dumped on one rank of a real process group:
NCCL's own dump on a GPU (``--device cuda``; it had never run on one), gloo's on a CPU. It
goes through ddplab's reader (distributed/group.py: ``record_collectives`` before the group,
``flight_records`` after), runs a few all-reduces and checks the dump lists them.

    python benchmarks/flight_recorder_check.py [--device cuda|cpu] [--collectives 5]

Prints one line per finding; exit 0 when the dump holds every all-reduce, 1 when not, 2 when the
device is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--collectives", type=int, default=5)
    a = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    from ddplab.distributed import group

    if a.device == "cuda" and not torch.cuda.is_available():
        print("flight_recorder_check: --device cuda: no CUDA device here; allowed: cpu (gloo)",
              file=sys.stderr)
        return 2
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                       "RANK": "0", "WORLD_SIZE": "1"})
    group.record_collectives(os.environ)
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    backend = "nccl" if a.device == "cuda" else "gloo"
    dist.init_process_group(backend, device_id=device if a.device == "cuda" else None)
    try:
        t = torch.ones(1024, device=device)
        for _ in range(a.collectives):
            dist.all_reduce(t)
        if a.device == "cuda":
            torch.cuda.synchronize()
        raw = group.flight_records()
    finally:
        dist.destroy_process_group()
    dump = json.loads(raw)
    entries = dump.get("entries", [])
    names = [str(e.get("profiling_name", "")) for e in entries]
    reduces = [n for n in names if "all_reduce" in n or "allreduce" in n]
    states = sorted({str(e.get("state", "?")) for e in entries})
    print(f"[flight-recorder] {backend} on {device}: dump version {dump.get('version', '?')}, "
          f"{len(entries)} entries ({len(reduces)} all-reduces, states {', '.join(states)}): "
          f"{', '.join(dict.fromkeys(names)) or 'none'}; ddplab's reader: {len(raw):,} bytes")
    if len(reduces) < a.collectives:
        print(f"[flight-recorder] the dump lists {len(reduces)} of the {a.collectives} all-reduces",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
