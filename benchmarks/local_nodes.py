"""NNODES torchrun "nodes" on this host: one agent per node, a static rendezvous on 127.0.0.1.

    python benchmarks/local_nodes.py --nnodes 2 --nproc 2 -- -m ddplab bench collectives
    make bench-collectives BENCH_NODES=2 NPROC=2          (the same)

Each node's ranks see nnodes > 1, so ddplab gives them what it gives several machines (for
ccl: each rank alone on its host to oneCCL, libfabric's tcp provider between the nodes); the
nodes share this host's cores (DDPLAB_NODES_ON_HOST, as the compose files do). Exits with the
first non-zero code of the agents.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(nnodes: int, nproc: int, args: list[str], env: Mapping[str, str], cwd: str | None = None,
              capture: bool = False) -> list[subprocess.CompletedProcess]:
    """Start the nnodes agents together and wait for all; one node is plain `torchrun --standalone`."""
    port = free_port()
    env = {**env, "DDPLAB_NODES_ON_HOST": str(nnodes)}
    procs = []
    for node in range(nnodes):
        where = (["--standalone"] if nnodes == 1 else
                 [f"--nnodes={nnodes}", f"--node-rank={node}", "--master-addr=127.0.0.1",
                  f"--master-port={port}"])
        cmd = [str(BIN / "torchrun"), *where, f"--nproc-per-node={nproc}", *args]
        out = subprocess.PIPE if capture else None
        procs.append((cmd, subprocess.Popen(cmd, env=env, cwd=cwd, text=True, stdout=out,
                                            stderr=out)))
    done = []
    for cmd, p in procs:
        stdout, stderr = p.communicate()
        done.append(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr))
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nnodes", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2, help="ranks per node")
    p.add_argument("args", nargs=argparse.REMAINDER, help="after --: torchrun's script and its arguments")
    a = p.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if a.nnodes < 1 or a.nproc < 1 or not args:
        p.error("need --nnodes >= 1, --nproc >= 1 and, after --, what torchrun runs")
    codes = [c.returncode for c in run_nodes(a.nnodes, a.nproc, args, os.environ)]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
