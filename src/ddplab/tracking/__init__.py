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
    delivery  the per-node process that sends the spool on (and ``ddplab sync``), its handle
    orphan    the detached watcher that ends a run whose rank 0 was lost
    runs      ``job_run``: the run open while the job trains, ended once whatever happens
"""

from __future__ import annotations

import importlib
from typing import Any

# The package's names, each from its module, imported on first use (PEP 562): the delivery
# and orphan processes import this package too, and must not pay for torch (tracker, runs).
_HOME = {
    "TrackingError": "store", "embedded_store": "store", "resolve_uri": "store",
    "ui_address": "store", "uri_problem": "store", "validated_uri": "store",
    "reachable_client": "store", "open_client": "store", "check_reachable": "store",
    "auth_refusal": "store", "recorded_run": "store",
    "NullTracker": "tracker", "MlflowTracker": "tracker", "RunRef": "tracker",
    "open_tracker": "tracker", "experiment_id": "opening",
    "Delivery": "delivery", "NoDelivery": "delivery", "start_delivery": "delivery",
    "job_run": "runs", "layout_name": "runs",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
