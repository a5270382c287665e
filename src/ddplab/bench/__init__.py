"""Measurements that are not training: the collectives benchmark and this machine's support
matrix (``ddplab bench collectives``). This module stays light: the CLI reads it to parse
arguments before torch is imported."""

from __future__ import annotations

from typing import Any

BACKENDS = ("gloo", "ccl", "nccl", "mpi")
OP_NAMES = ("all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
            "reduce_scatter", "all_to_all", "barrier", "send_recv")
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M,256M"


def parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="measurements that are not training")
    bs = b.add_subparsers(dest="bench_command", required=True)
    c = bs.add_parser("collectives", help="time and check every collective on every backend; "
                      "print this machine's support matrix; one MLflow run")
    c.add_argument("--backend", default="all", metavar="LIST",
                   help=f"comma list of {', '.join(BACKENDS)}, or all (= those usable here)")
    c.add_argument("--ops", default="all", metavar="LIST", help="comma list of "
                   f"{', '.join(OP_NAMES)} (send/recv too), or all")
    c.add_argument("--sizes", default=DEFAULT_SIZES, metavar="LIST",
                   help="comma list of buffer sizes; K/M/G are 1024-based (default: %(default)s)")
    c.add_argument("--dtype", default="float32", choices=list(DTYPE_NAMES))
    c.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: nccl on the GPU, every other backend on the CPU")
    c.add_argument("--iters", type=int, default=50, help="timed calls per point, at most")
    c.add_argument("--warmup", type=int, default=3, help="untimed calls per point")
    c.add_argument("--point-time", type=float, default=1.0, metavar="S",
                   help="time budget per point: big sizes get fewer calls (at least 3)")
    c.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="how long a rank waits for the others in one collective")
    c.add_argument("--no-support", action="store_true", help="skip the support matrix probe")
    c.add_argument("--no-tracking", action="store_true", help="print only; no MLflow run")
    c.add_argument("--tracking-uri", default="", metavar="URI",
                   help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here")
    c.add_argument("--experiment", default="bench-collectives", help="MLflow experiment name")
    c.add_argument("--out", default="", metavar="DIR",
                   help="also keep results.csv, support.csv, support.md, busbw.png here")
    c.add_argument("--page", default="", metavar="NAME",
                   help="also write the table and the support matrix as docs/results/NAME.md "
                        "(stamped: when, commit, machine, command), busbw.png beside it")
