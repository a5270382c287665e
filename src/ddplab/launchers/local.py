"""``ddplab run``: N ranks on this machine through torchrun, after a preflight in one process.

    ddplab run --nproc-per-node 2 experiments/quickstart.yaml [--set ...]   # what `make run` runs
    ddplab run --nproc-per-node 2 my_train.py -- --epochs 3                 # a script
    ddplab run --nproc-per-node 2 -m pkg.train -- --epochs 3                # a packaged one

Everything that can be known before the ranks start (the config, the script, the layout, the
backend on this machine, the tracking store and its login, the folders) is checked here, once:
a refusal is ONE line and exit 2, instead of one line per rank wrapped in torchrun's failure
banner and its traceback. Then this process runs ``torchrun --standalone`` with the same
arguments (torchrun's own ``run``: its signals and output); a rank's failure is one line
naming the rank, exit 2 for a refusal, else the rank's own code (128 + N for signal N),
instead of torchrun's failure banner (the ranks said what failed, and where the run is).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import first_line
from ..subprocs import own_temp, pausing_with_this_process

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ..config import ExperimentConfig


def parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="N local ranks via torchrun, after a one-process preflight",
                       description=__doc__.split("\n\n")[0].replace("``", ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="your own script's arguments go after --, e.g.\n"
                              "  ddplab run my_train.py --nproc-per-node 2 -- --epochs 3")
    p.add_argument("--nproc-per-node", type=int, default=None,  # $NPROC read by preflight:
                   metavar="N", help="ranks on this machine (default $NPROC or 2)")  # not here
    p.add_argument("experiment", nargs="?", help="experiment YAML or your own training "
                   "script (.py; its arguments go after --)")
    p.add_argument("-m", dest="module", default="", metavar="MODULE",
                   help="a packaged training script, run as python -m runs it (its arguments "
                        "go after --)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (repeatable), as for ddplab train")
    p.add_argument("--summary-out", default="", metavar="PATH",
                   help="also write summary.json here (rank 0), as ddplab train does")


def load_job(experiment: str | None, module: str, overrides: list[str],
             script_args: list[str] | None) -> ExperimentConfig:
    """The job's config: an experiment (YAML or .py), or ``-m MODULE``: a packaged script
    (``script.module``; with an experiment file's
    settings when one is given too), named after the module. The module is found and its file
    compiled here: a refusal is one line before any run."""
    import dataclasses

    from .. import config
    from ..config import ConfigError

    if not module:
        return config.load(experiment, overrides, script_args, environ=os.environ)
    cfg = config.load(experiment, overrides, environ=os.environ, script_job=True)
    if cfg.script.named:
        raise ConfigError(f"-m {module}: the experiment names a script already (script."
                          f"{'module' if cfg.script.module else 'path'} "
                          f"{cfg.script.module or cfg.script.path!r}); give one of them")
    try:
        script = dataclasses.replace(cfg.script, module=module,
                                     args=[*cfg.script.args, *(script_args or [])])
    except ConfigError:
        raise ConfigError(f"-m {module}: not a module name (dotted names, e.g. pkg.train)"
                          ) from None
    file = script.file()  # found as python -m finds it, or one line
    config.check_compiles(file, f"-m {module}: {file}")
    name = cfg.name if cfg.name != config.ExperimentConfig.name else module
    return dataclasses.replace(cfg, name=name, script=script)


def preflight(a: argparse.Namespace) -> None:
    """Every check one process can make for N ranks here; raises ConfigError or BackendError."""
    import torch

    from ..distributed.choice import import_ccl, may_take_ccl, resolve, resolve_device
    from ..distributed.cpu import cores_per_rank
    from ..training import checks
    from .detect import LaunchEnv

    n = a.nproc_per_node = ranks_here(a.nproc_per_node, os.environ)
    cfg = load_job(a.experiment, a.module, a.overrides, a.script_args)
    le = LaunchEnv("torchrun", 0, n, 0, n, 0, "127.0.0.1", 29500)
    if cfg.script.named:
        checks.for_script(cfg, le, a.summary_out)
        return
    cuda = torch.cuda.is_available()
    checks.preflight(cfg, le, a.summary_out, cuda, a.experiment)
    from ..training.checkpoint import not_running

    not_running(cfg.checkpoint.resume, Path(cfg.checkpoint.dir) / cfg.name)
    device = resolve_device(cfg.dist.device, n - 1, cfg.dist.backend).type  # the last rank: enough GPUs?
    cores = cores_per_rank(le, os.environ)
    ccl = import_ccl().name if may_take_ccl(cfg.dist.backend, device, cores, n) else None
    resolve(cfg.dist.backend, device, cfg.dist.allow_backend_fallback, cores_per_rank=cores,
            ccl_impl=ccl, world_size=n)


RANKS_A_CORE = 8
"""Ranks a core may take here (oversubscribed CPU studies run 2 to 4): beyond it, a typo (100000
ranks) started torchrun's ranks until the machine ran out, and left some running when stopped."""


def ranks_here(given: int | None, env: Mapping[str, str]) -> int:
    """``--nproc-per-node``, else ``$NPROC``, else 2: a whole number from 1 to RANKS_A_CORE a core."""
    from ..config import ConfigError

    source, raw = ("--nproc-per-node", str(given)) if given is not None else (
        "$NPROC", env.get("NPROC", "2"))
    try:
        n = int(raw)
    except ValueError:
        raise ConfigError(f"{source}: got {raw!r}; must be a whole number of ranks >= 1") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if n < 1 or n > RANKS_A_CORE * cores:
        raise ConfigError(f"{source}: got {n}; must be from 1 to {RANKS_A_CORE * cores} on this "
                          f"machine ({cores} cores, at most {RANKS_A_CORE} ranks a core)")
    return n


def torchrun_args(a: argparse.Namespace) -> list[str]:
    """torchrun's own arguments for this job (what ``torchrun`` would be typed with): the
    user's own ``--set`` values only; every rank reads ``DDPLAB_SET`` from the environment it
    inherits (config.load), so nothing is applied twice."""
    from .targets import Torchrun, train_job

    out = ["--summary-out", a.summary_out] if a.summary_out else []
    rest = ["--", *a.script_args] if a.script_args else []
    job = train_job(a.experiment or "", a.overrides, module=a.module, extra=[*out, *rest])
    return Torchrun(a.nproc_per_node).args(job)


def run(a: argparse.Namespace) -> int:
    """The preflight, then torchrun's own ``run`` in this process. In this process, not a new
    one: torch is imported already, and importing it again cost each job ~2 s of CPU before its
    ranks started (bench-startup). torchrun's signals and output stay its own; a rank's failure
    is one line (``failed``), anything else torchrun raises is printed as torchrun would, exit 1.
    (torchrun's ``main`` is its ``run`` under ``@record``, whose only addition here would be a
    log line that no error file is defined for this process.)"""
    preflight(a)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    from ..training.jobend import RUN_LINE_ENV

    # Rank 0 leaves its last line (the run's address) here: said again after torchrun's own
    # output when the job failed, so the console ends on the run, as a finished job's does.
    # (named by host and pid as the log dir is, so the next job sweeps one a killed job left)
    last = own_temp("run-line")
    os.environ[RUN_LINE_ENV] = str(last)
    try:
        code = _torchrun(a)
        if code:
            with contextlib.suppress(OSError):
                line = last.read_text().strip()
                if line:
                    from ..log import logger

                    logger().info(line)
        return code
    finally:
        os.environ.pop(RUN_LINE_ENV, None)
        last.unlink(missing_ok=True)


def _torchrun(a: argparse.Namespace) -> int:
    return torchrun_here(torchrun_args(a))


def torchrun_here(args: list[str]) -> int:
    """torchrun with ``args``, in this process; a rank's failure as ddplab's one line, not
    torchrun's traceback and failure banner (``python -m ddplab.launchers.local ARGS``: how
    ``ddplab reproduce`` starts its torchrun job)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    from .tether import LAUNCHER_ENV

    config = parse_args(args)
    ours = _log_dir(config)
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks' parent: torchrun's agent is here
    try:
        with pausing_with_this_process():  # Ctrl-Z: its ranks, in sessions of their own, too
            torchrun(config)
    except ChildFailedError as e:
        return failed(e)
    except SignalException as e:  # Ctrl-C or SIGTERM: torchrun stopped the ranks
        from ..log import logger

        logger().warning(f"stopped by {signal.Signals(e.sigval).name}")
        return 128 + int(e.sigval)
    except Exception:  # noqa: BLE001 - torchrun's own failure (its rendezvous, ...)
        traceback.print_exc()
        return 1
    finally:
        os.environ.pop(LAUNCHER_ENV, None)
        if ours:
            shutil.rmtree(ours, ignore_errors=True)
    return 0


def _log_dir(config: argparse.Namespace) -> str:
    """A folder of ours for torchrun's log dir, removed when the job ends; "" where the user
    named one (--log-dir, PET_LOG_DIR) or asked for logs in it (--redirects, --tee). Without
    one, torchrun makes /tmp/torchelastic_* for the ranks' error files and leaves it: CI's
    runs left 287 of them."""
    if config.log_dir or any(str(std or "0") != "0" for std in (config.redirects, config.tee)):
        return ""
    ours = str(own_temp("torchrun", folder=True))
    config.log_dir = ours
    return ours


def failed(e: ChildFailedError) -> int:
    """torchrun's ChildFailedError as ddplab's one line: the rank torchrun saw fail first (the
    ranks' error files say which: cli._tell_torchrun) and its error; its exit code (2: the rank
    refused the job's input; 128 + N: killed by signal N)."""
    from ..log import logger

    rank, first = e.get_first_failure()
    code = first.exitcode
    why = _said(first)
    if code < 0:
        name = first.signal_name()
        # (a hang's verdict, printed by the delivery process, names the rank the others waited
        # for; this line, after it, read as blaming the rank the watch killed first)
        hint = " (ddplab's hang watch stops a hung job's ranks so: a verdict line above names " \
            "the rank waited for; else the OOM killer or a kill -9)" if name == "SIGKILL" else ""
        logger().error(f"rank {rank} was killed by {name}"
                       f"{f' ({why})' if why and name not in why else hint}")
        return 128 - code
    # Every rank that failed alike, as the verdict above it says ("ranks 0,1 ... each failed"),
    # not only the one torchrun saw first; not one that exited with the same code for another
    # reason (stopped by torchrun's SIGTERM after this one failed).
    alike = sorted({rank, *(r for r, f in e.failures.items()
                            if f.exitcode == code and _said(f) == why)})
    who = f"rank {rank}" if len(alike) == 1 else f"ranks {','.join(map(str, alike))}"
    if rank == 0 and why.startswith(("the script failed: ", "the job ")):
        # rank 0's account of the whole job (script mode: a rank that left early, a hang), not
        # a failure of its own: "rank 0 failed (exit code 1): ... rank 0 exited 0" contradicted it
        logger().error(why)
        return code
    origin = _rank0s(why)
    if origin:  # they only passed rank 0's failure on, and ended before rank 0 did
        logger().error(f"rank 0 failed: {origin}; {who} stopped after it (exit code {code})")
        return code
    logger().error(f"{who} {'refused the job' if code == 2 else 'failed'} (exit code "
                   f"{code}){f': {why}' if why else ''}")
    return code


def _rank0s(why: str) -> str:
    """Rank 0's error, where a rank's is only rank 0's passed on (a Rank0Error), else ""."""
    from ..distributed.group import RANK0_FAILED

    head = f"Rank0Error: {RANK0_FAILED}"
    return why[len(head):] if why.startswith(head) else ""


def _said(failure: ProcessFailure) -> str:
    """The first line of what a rank said of its failure (its error file), "" if nothing."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    said = first_line(str(message or ""))
    return "" if said.startswith("To enable traceback") else said


if __name__ == "__main__":
    sys.exit(torchrun_here(sys.argv[1:]))
