"""One job = one MLflow run.

Global rank 0 creates the run (or takes ``MLFLOW_RUN_ID`` from a launcher, or the run id of
the checkpoint it resumes) and broadcasts its id; no other rank ever creates one. Rank 0 gets
an ``MlflowTracker``; every other rank a ``NullTracker`` with the same methods, so callers
never ask ``if rank == 0``. After the run exists, training never talks to the server: rank 0
appends to a local spool, and one low-priority delivery process per node (started by its
local rank 0) sends the spool on and samples the node's system metrics
(``system/node<k>/...``).

    store     the tracking URI, the client, whether the server answers and admits this client
    tracker   MlflowTracker (rank 0) and NullTracker; every rank learns the run
    opening   creating the run or attaching to one (in the delivery process, without torch)
    spool     the local append-only files every record goes through
    runs      ``job_run``: the run open while the job trains, ended once whatever happens
    life      the one owner of a run's creation and end, for jobs, studies, bench, reproduce
              and imports alike
    schema    every ``ddplab.*`` tag name and MLflow's limits: the run's vocabulary
    spooled   the records of a run no job writes (a study's parent, a benchmark's, a
              reproduction's verdict) through a spool, as a job's go
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as the type checker sees them; at run time __getattr__ imports each
    from .opening import experiment_id as experiment_id
    from .runs import job_run as job_run
    from .runs import layout_name as layout_name
    from .store import TrackingError as TrackingError
    from .store import auth_refusal as auth_refusal
    from .store import check_reachable as check_reachable
    from .store import check_uri as check_uri
    from .store import embedded_store as embedded_store
    from .store import open_client as open_client
    from .store import reachable_client as reachable_client
    from .store import recorded_run as recorded_run
    from .store import resolve_uri as resolve_uri
    from .store import ui_address as ui_address
    from .store import uri_problem as uri_problem
    from .store import validated_uri as validated_uri
    from .tracker import MlflowTracker as MlflowTracker
    from .tracker import NullTracker as NullTracker
    from .tracker import RunRef as RunRef
    from .tracker import open_tracker as open_tracker

# The package's names, each from its module, imported on first use (PEP 562): the node agent
# (ddplab.agent) imports this package too, and must not pay for torch (tracker, runs).
_HOME = {
    "TrackingError": "store", "embedded_store": "store", "resolve_uri": "store",
    "ui_address": "store", "uri_problem": "store", "validated_uri": "store",
    "reachable_client": "store", "open_client": "store", "check_reachable": "store",
    "auth_refusal": "store", "recorded_run": "store", "check_uri": "store",
    "NullTracker": "tracker", "MlflowTracker": "tracker", "RunRef": "tracker",
    "open_tracker": "tracker", "experiment_id": "opening",
    "job_run": "runs", "layout_name": "runs",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
