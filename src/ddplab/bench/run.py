"""``ddplab bench collectives``, in the order the data flows: arguments -> launch environment
-> control process group -> the run (rank 0) -> support matrix -> timings -> table, files, run.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import TYPE_CHECKING, Any

from ..errors import BadInput
from . import BACKENDS, OP_NAMES

if TYPE_CHECKING:
    from ..launchers import LaunchEnv
    from .collectives import Plan
    from .output import Report, Silent

ALIASES = {"send/recv": "send_recv", "sendrecv": "send_recv", "allreduce": "all_reduce",
           "allgather": "all_gather", "reducescatter": "reduce_scatter", "alltoall": "all_to_all"}
UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
         "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
MAX_BYTES = 4 << 30


class BenchError(BadInput, ValueError):
    """Bad arguments: one line, exit 2."""


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in UNITS or not 1 <= int(m.group(1)) * UNITS[unit] <= MAX_BYTES:
        raise BenchError(f"--sizes: {text.strip()!r} is not a size from 1 byte to 4G; use bytes "
                         "or K/M/G (1K = 1024 bytes), e.g. --sizes 1K,64M")
    return int(m.group(1)) * UNITS[unit]


def _names(text: str, allowed: list[str], flag: str) -> list[str]:
    if text.strip() == "all":
        return allowed
    names = [ALIASES.get(x.strip().lower(), x.strip().lower()) for x in text.split(",") if x.strip()]
    for name in names:
        if name not in allowed:
            raise BenchError(f"{flag}: {name!r} is not one of {', '.join(allowed)} (or all)")
    if not names:
        raise BenchError(f"{flag}: empty; name at least one of {', '.join(allowed)} (or all)")
    return list(dict.fromkeys(names))


def plan_from(a: argparse.Namespace) -> Plan:
    from .collectives import DTYPES, Plan
    from .ops import OPS

    for flag, value, low in (("--iters", a.iters, 1), ("--warmup", a.warmup, 0)):
        if value < low:
            raise BenchError(f"{flag}: got {value}; must be an integer >= {low}")
    import math

    for flag, value, most in (("--point-time", a.point_time, 3600), ("--timeout", a.timeout, 86400)):
        if not (math.isfinite(value) and 0 < value <= most):
            raise BenchError(f"{flag}: got {value}; must be a number of seconds in (0, {most}]")
    sizes = sorted({parse_size(s) for s in a.sizes.split(",") if s.strip()})
    if not sizes:
        raise BenchError("--sizes: empty; e.g. --sizes 1K,64M")
    return Plan(_names(a.backend, list(BACKENDS), "--backend"),
                [OPS[n] for n in _names(a.ops, list(OP_NAMES), "--ops")], sizes, DTYPES[a.dtype],
                a.device, a.iters, a.warmup, a.point_time)


def _page(name: str) -> Any:
    """Where --page writes (checked before any process group), or None."""
    if not name:
        return None
    from .. import pages
    from ..config import ConfigError

    try:
        return pages.path_for(name)
    except ConfigError as e:
        raise BenchError(str(e)) from None


def _out_folder(out: str) -> None:
    """--out is a folder the results go into: checked before any process group (a file given
    there failed the benchmark at its end, its measurements lost)."""
    if not out:
        return
    from pathlib import Path

    from ..files import folder_problem

    problem = folder_problem(Path(out))
    if problem:
        raise BenchError(f"--out: got {out!r}; {problem} (give a folder for the results)")


def usable_backends(plan: Plan, explicit: bool) -> list[str]:
    """The plan's backends that can run here; an explicitly named one that cannot is an error."""
    import torch

    from ..distributed.choice import available

    out = []
    for name in plan.backends:
        device = "cuda" if (name == "nccl" and plan.device != "cpu") else plan.device
        device = "cpu" if device == "auto" else device
        ok, why = available(device)[name]
        if device == "cuda" and not torch.cuda.is_available():
            ok, why = False, "no CUDA device here"
        if ok:
            out.append(name)
        elif explicit:
            raise BenchError(f"--backend: {name!r} cannot run here: {why}")
    if not out:
        raise BenchError(f"--backend: none of {', '.join(plan.backends)} can run here")
    return out


def collectives(a: argparse.Namespace) -> int:
    from ..distributed import group
    from ..distributed.choice import BackendChoice, import_ccl
    from ..distributed.oneccl import apply_ccl_env
    from ..launchers import LaunchEnv

    plan = plan_from(a)
    a.page_path = _page(a.page)
    _out_folder(a.out)
    if not a.no_tracking:  # a bad URI is one line before any process group, as for train
        from ..tracking import validated_uri

        a.tracking_uri = validated_uri(a.tracking_uri)
    le = LaunchEnv.from_environ(os.environ)
    backends = usable_backends(plan, a.backend.strip() != "all")
    if "ccl" in backends:  # as a training job does: oneCCL reads them when its group starts
        apply_ccl_env(le, os.environ, import_ccl())
    control = BackendChoice("gloo", "gloo", "the benchmark's control group")
    import torch

    group.init_process_group(control, le, torch.device("cpu"), int(a.timeout))
    try:
        report = _open_report(a, plan, le, backends)
        try:
            return 0 if _measure(a, plan, le, backends, report) == "FINISHED" else 1
        except BaseException as e:
            report.abort("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
            raise
    finally:
        group.destroy_process_group()


def _open_report(a: argparse.Namespace, plan: Plan, le: LaunchEnv,
                 backends: list[str]) -> Report | Silent:
    """Rank 0 opens the run (every rank learns whether that worked); the others stay silent."""
    import torch

    from ..distributed.group import share_from_rank0
    from .output import Report, Silent

    def create() -> Report:
        client = None
        if not a.no_tracking:
            from ..tracking import reachable_client

            client = reachable_client(a.tracking_uri)
        params = {"world_size": le.world_size, "nnodes": le.nnodes, "launcher": le.launcher,
                  "backends": ",".join(backends), "ops": ",".join(o.name for o in plan.ops),
                  "sizes": ",".join(str(s) for s in plan.sizes), "dtype": str(plan.dtype)[6:],
                  "device": plan.device, "iters": plan.iters, "torch": torch.__version__}
        name = f"collectives {','.join(backends)} {le.nnodes}x{le.local_world_size} {le.launcher}"
        return Report(client, a.experiment, name, params, a.out, a.page_path)

    made: list[Report] = []

    def make() -> bool:  # rank 0 keeps the Report; the ranks share only that it was made
        made.append(create())
        return True

    share_from_rank0(make, le.is_rank0, le.world_size)
    return made[0] if made else Silent()


def _measure(a: argparse.Namespace, plan: Plan, le: LaunchEnv, backends: list[str],
             report: Report | Silent) -> str:
    from .collectives import Bench, device_for, devices_here, support

    bench = Bench(plan, le.rank, le.world_size, a.timeout)
    matrix = {} if a.no_support else support(bench, plan.ops)
    if matrix:
        report.say("support matrix probed: " + ", ".join(
            f"{b}/{d} {sum(v == 'yes' for v in col.values())}/{len(col)}"
            for (b, d), col in matrix.items() if d in devices_here()))
    results: list[Any] = []
    wrong: list[str] = []
    for name in backends:
        device = device_for(name, plan.device)
        for op in plan.ops:
            for size in plan.sizes if op.sized else [0]:
                got = bench.measure(name, device, op, size)
                where = f"{name}/{device.type} {op.name} {_size(size) if op.sized else ''}".strip()
                if isinstance(got, str):
                    report.say(f"{where}: not measured ({got})")
                    if got in ("wrong result", "failed on another rank"):
                        wrong.append(f"{where}: {got}")
                    break  # an op that fails at one size is not tried at bigger ones
                results.append(got)
                report.say(f"{where}: p50 {got.p50_s * 1e3:.3f} ms, busbw {got.busbw / 1e9:.3f} "
                           f"GB/s ({got.iters} calls)")
    status = "FAILED" if wrong else "FINISHED"
    report.finish(results, matrix, [o.name for o in plan.ops], status)
    for line in wrong:
        report.say(f"error: {line}")
    return status


def _size(n: int) -> str:
    from .output import human

    return human(n)
