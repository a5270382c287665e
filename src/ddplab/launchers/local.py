"""``ddplab run``: N ranks on this machine through torchrun, after a preflight in one process.

    ddplab run --nproc-per-node 2 experiments/quickstart.yaml [--set ...]   # what `make run` runs
    ddplab run --nproc-per-node 2 my_train.py -- --epochs 3                 # a script

Everything that can be known before the ranks start (the config, the script, the layout, the
backend on this machine, the tracking store and its login, the folders) is checked here, once:
a refusal is ONE line and exit 2, instead of one line per rank wrapped in torchrun's failure
banner and its traceback. Then this process runs ``torchrun --standalone`` with the same
arguments (torchrun's own ``main``: its signals, output and exit code).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback


def parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="N local ranks via torchrun, after a one-process preflight",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, default=int(os.environ.get("NPROC", "2")),
                   metavar="N", help="ranks on this machine (default $NPROC or 2)")
    p.add_argument("experiment", help="experiment YAML or your own training script (.py)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (repeatable), as for ddplab train")
    p.add_argument("--summary-out", default="", metavar="PATH")


def preflight(a: argparse.Namespace) -> None:
    """Every check one process can make for N ranks here; raises ConfigError or BackendError."""
    import torch

    from .. import config
    from ..config import ConfigError
    from ..distributed.choice import resolve, resolve_device
    from ..training import checks
    from .detect import LaunchEnv

    if a.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node: got {a.nproc_per_node}; must be >= 1")
    cfg = config.load(a.experiment, a.overrides, a.script_args, environ=os.environ)
    n = a.nproc_per_node
    le = LaunchEnv("torchrun", 0, n, 0, n, 0, "127.0.0.1", 29500)
    if cfg.script.path:
        checks.for_script(cfg, le, a.summary_out)
        return
    cuda = torch.cuda.is_available()
    checks.preflight(cfg, le, a.summary_out, cuda)
    device = resolve_device(cfg.dist.device, n - 1, cfg.dist.backend).type  # the last rank: enough GPUs?
    resolve(cfg.dist.backend, device, cfg.dist.allow_backend_fallback,
            ccl_impl=None if device != "cpu" else _ccl_impl(), world_size=n)


def _ccl_impl() -> str | None:
    from ..distributed.choice import import_ccl

    impl = import_ccl()
    return impl.name if impl else None


def torchrun_args(a: argparse.Namespace) -> list[str]:
    """torchrun's own arguments for this job (what ``torchrun`` would be typed with): the
    user's own ``--set`` values only; every rank reads ``DDPLAB_SET`` from the environment it
    inherits (config.load), so nothing is applied twice."""
    sets = [x for s in a.overrides for x in ("--set", s)]
    out = ["--summary-out", a.summary_out] if a.summary_out else []
    rest = ["--", *a.script_args] if a.script_args else []
    return ["--standalone", f"--nproc-per-node={a.nproc_per_node}", "-m", "ddplab", "train",
            a.experiment, *sets, *out, *rest]


def run(a: argparse.Namespace) -> int:
    """The preflight, then torchrun's own ``main`` in this process. In this process, not a new
    one: torch is imported already, and importing it again cost each job ~2 s of CPU before its
    ranks started (bench-startup). torchrun's signals, output and exit code stay its own: what
    it raises is printed as a torchrun would print it, exit 1."""
    preflight(a)
    from torch.distributed.run import main as torchrun

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        torchrun(torchrun_args(a))
    except Exception:  # noqa: BLE001 - a rank failed (ChildFailedError) or a signal stopped it
        traceback.print_exc()
        return 1
    return 0
