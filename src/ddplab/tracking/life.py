"""A run's life, one owner: every run ddplab makes is created and ended here, whoever makes it
(a job's delivery process, a study, a benchmark, a reproduction, an import) and whoever ends it
(the run's own rank 0 through the spool, a survivor when rank 0 vanished, a study whose job
died before its run ended). The promise these keep: no run ddplab made stays RUNNING, and a run
that failed says why in one place (``ddplab.error``, MLflow's 8000-character tag).

``client`` is MLflow's ``MlflowClient`` (or anything with its ``create_run``, ``set_tag``,
``get_run`` and ``set_terminated``). Torch-free and MLflow-import-free: any room may use it.
"""

from __future__ import annotations

import getpass
import os
import uuid
from collections.abc import Mapping
from typing import Any

from ..logins import mask
from .schema import CREATED_AS, ERROR, MLFLOW_NOTE, MLFLOW_USER, TAG_LIMIT

#: How MLflow names a run's end states.
FINISHED, FAILED, KILLED, RUNNING = "FINISHED", "FAILED", "KILLED", "RUNNING"


def create(client: Any, experiment_id: str, name: str, tags: Mapping[str, str] | None = None,
           start_time: int | None = None, made_here: bool = True) -> Any:
    """A new run of ``experiment_id``, RUNNING, named ``name``: MLflow's Run (``.info.run_id``).
    Who made it is its ``mlflow.user`` (the UI's "Created by"), unless ``tags`` say or it is a
    copy of a run made elsewhere (``made_here`` False: an import keeps the source's, or none).
    Its description (a study's, a job's) is masked: a URL's password never reaches the UI."""
    tags = {**(tags or {}), CREATED_AS: uuid.uuid4().hex}
    if made_here and MLFLOW_USER not in tags and (who := user()):
        tags[MLFLOW_USER] = who
    if MLFLOW_NOTE in tags:
        tags[MLFLOW_NOTE] = mask(tags[MLFLOW_NOTE])
    try:
        run = client.create_run(experiment_id, start_time=start_time, tags=tags, run_name=name)
    except Exception:
        # The server may have made it, its answer lost once MLflow's retries were spent.
        made = _made_as(client, experiment_id, tags[CREATED_AS])
        if not made:
            raise
        run = made[0]
    _end_twins(client, run, experiment_id, tags[CREATED_AS])
    return run


def _made_as(client: Any, experiment_id: str, token: str) -> list[Any]:
    """The runs created with ``token``, the first made first ([] where the store cannot say)."""
    try:
        found = client.search_runs([experiment_id], f"tags.`{CREATED_AS}` = '{token}'",
                                   max_results=10)
    except Exception:  # noqa: BLE001 - a store that cannot search: nothing more is known
        return []
    return sorted(found, key=lambda r: (r.info.start_time or 0, r.info.run_id))


def _end_twins(client: Any, run: Any, experiment_id: str, token: str) -> None:
    """A create whose answer was lost, sent again by MLflow's client (it retries every request):
    the server made two runs. The one answered is the job's; the other, which nothing would
    ever end (RUNNING for ever, a second run of one job), is ended and deleted."""
    for twin in _made_as(client, experiment_id, token):
        if twin.info.run_id != run.info.run_id:
            try:
                end(client, twin.info.run_id, FAILED, f"a second copy of run {run.info.run_id}, "
                    "made when the server's answer to its creation was lost: deleted")
                client.delete_run(twin.info.run_id)
            except Exception:  # noqa: BLE001 - a twin left is untidy, not the job's failure
                pass


def user() -> str:
    """Who runs this: the team server's login (MLFLOW_TRACKING_USERNAME), else the account; ""
    when neither can be told (a container's uid without a passwd entry, no $USER)."""
    try:
        return os.environ.get("MLFLOW_TRACKING_USERNAME") or getpass.getuser()
    except Exception:  # noqa: BLE001 - getpass raises KeyError or OSError by Python version
        return ""


def end(client: Any, run_id: str, status: str, reason: str = "",
        end_time: int | None = None) -> None:
    """End ``run_id`` with ``status``; ``reason`` (why it failed) first, as its ddplab.error."""
    if reason:
        client.set_tag(run_id, ERROR, reason[:TAG_LIMIT])
    client.set_terminated(run_id, status, end_time=end_time)


def end_if_running(client: Any, run_id: str, status: str = FAILED, reason: str = "") -> str:
    """A run whose owner may have died before ending it (a job that never started, a rank 0
    SIGKILLed): end it with ``status`` if it is still RUNNING. Its status now."""
    now = str(client.get_run(run_id).info.status)
    if now != RUNNING:
        return now
    end(client, run_id, status, reason)
    return status


def error_line(tags: dict[str, str]) -> str:
    """The first line of a run's ``ddplab.error`` (the rest is its traceback), "" for none."""
    return next(iter((tags.get(ERROR) or "").strip().splitlines()), "")
