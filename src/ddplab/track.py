"""Log from your own code into the job's one MLflow run, through the node's tracking spool.

    from ddplab import track
    track.params({"lr": lr, "batch_size": 32})
    track.log({"loss": loss.item(), "accuracy": acc}, step=step)
    track.tags({"dataset": "cifar10-synthetic"})

Records go to a local file first (the spool, as ddplab's own do) and the node's delivery process
sends them on: a call never waits on the tracking server, and what an outage holds back is
delivered later by ``ddplab sync``. Plain ``mlflow.log_metric`` calls also land in the job's run
(ddplab sets ``MLFLOW_RUN_ID``), but they talk to the server at once and fail when it is down
(docs/your-own-script.md compares the two).

Only global rank 0 records by default, so a script may call these on every rank; pass
``all_ranks=True`` to record from every rank (names get a ``rank<r>/`` prefix). Outside a ddplab
job (plain ``python`` or ``torchrun``) every call does nothing.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from .tracking.naming import users_tag
from .tracking.schema import PARAM_LIMIT, TAG_LIMIT

SPOOL_ENV = "DDPLAB_SPOOL"
"""The node's spool folder, set by ddplab for a script's processes."""
STREAM = "track"
_sink: Any = None
"""ddplab's own loop registers rank 0's tracker here (use()); script mode writes the spool."""
_steps = {"n": 0}
logged: set[str] = set()
"""Metric names this process's code logged itself: script mode's observation never writes
these (training/scriptmode/observe.py)."""


def use(tracker: Any) -> None:
    """ddplab's loop: records go through this run's tracker (None: back to the environment)."""
    global _sink
    _sink = tracker


def _rank() -> int:
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _append(record: dict[str, Any]) -> None:
    folder = os.environ.get(SPOOL_ENV, "")
    if not folder:
        return
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"ts": int(time.time() * 1000), **record}, separators=(",", ":")) + "\n"
    # One write() on an O_APPEND descriptor: the ranks of a node share the file, lines stay whole.
    fd = os.open(path / f"{STREAM}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _named(values: dict[str, Any], all_ranks: bool) -> dict[str, Any] | None:
    if not isinstance(values, dict):
        raise TypeError(f"ddplab.track: expected a dict of names to values, got "
                        f"{type(values).__name__}")
    if all_ranks:
        return {f"rank{_rank()}/{k}": v for k, v in values.items()}
    return dict(values) if _rank() == 0 else None


def log(metrics: dict[str, float], step: int | None = None, all_ranks: bool = False) -> None:
    """Metrics at ``step`` (default: one more than the last call's)."""
    named = _named(metrics, all_ranks)
    logged.update(metrics)
    step = _steps["n"] if step is None else int(step)
    _steps["n"] = step + 1
    if named is None:
        return
    values = {k: float(v) for k, v in named.items()}
    if _sink is not None:
        _sink.log_metrics(values, step)
    else:
        _append({"op": "log", "step": step, "metrics": values})


def params(values: dict[str, Any], all_ranks: bool = False) -> None:
    """Parameters (recorded as text; MLflow refuses to change one once set)."""
    named = _named(values, all_ranks)
    if named is None:
        return
    if _sink is not None:
        _sink.log_params(named)
    else:
        _append({"op": "log", "params": {k: str(v)[:PARAM_LIMIT] for k, v in named.items()}})


def tags(values: dict[str, Any], all_ranks: bool = False) -> None:
    """Tags on the run (one named as ddplab's own records, ``ddplab.*``, kept beside them as
    ``user.<key>``)."""
    named = _named(values, all_ranks)
    if named is None:
        return
    named = {users_tag(str(k)): v for k, v in named.items()}
    if _sink is not None:
        _sink.set_tags(named)
    else:
        _append({"op": "log", "tags": {k: str(v)[:TAG_LIMIT] for k, v in named.items()}})
