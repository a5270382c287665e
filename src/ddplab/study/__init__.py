"""Many jobs -> one comparison: study files (spec), running them (runner), the report
(report), and re-running a recorded run to check it (reproduce)."""

from __future__ import annotations

import os
from pathlib import Path


def tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else the same embedded store `ddplab train` uses."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def reachable_client(uri: str):
    """An MlflowClient for ``uri``, or one TrackingError line at once when the server does not
    answer (MLflow's own client would retry for minutes)."""
    from mlflow import MlflowClient

    from ..tracking import TrackingError, check_reachable

    problem = check_reachable(uri)
    if problem:
        raise TrackingError(f"{problem}: start it, or set MLFLOW_TRACKING_URI")
    return MlflowClient(uri)


def run_study(path: str, overrides: list, fresh: bool, dry_run: bool, repeats: int = 0) -> int:
    # MLflow prints "View run at <tracking URI>" when a run ends: on a cluster an in-network
    # name the browser cannot open. The study prints each address itself (DDPLAB_UI_URL).
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    import dataclasses

    import yaml

    from ..config import ConfigError
    from . import runner, spec

    study = spec.load_study(path, [o if isinstance(o, str) else o[1] for o in overrides])
    if repeats < 0:
        raise ConfigError(f"--repeats: got {repeats}; must be an integer >= 1 (0 = the file's)")
    if repeats:
        study = dataclasses.replace(study, repeats=repeats)
    resolved = yaml.safe_dump({
        "name": study.name, "experiment": str(study.experiment), "set": study.set,
        "repeats": study.repeats, "baseline": study.baseline, "extra_set": list(study.extra),
        "target_accuracy": study.target_accuracy,
        "variants": [{"name": v.name, "nproc": v.nproc, "nnodes": v.nnodes,
                      "launcher": v.launcher, "set": v.set} for v in study.variants]},
        sort_keys=False)
    return runner.run(study, tracking_uri(), fresh, dry_run, resolved)


def show_report(parent_run_id: str) -> int:
    from mlflow.exceptions import MlflowException

    from ..tracking import TrackingError
    from . import report as study_report
    from .runner import PARENT, make_console

    uri = tracking_uri()
    client = reachable_client(uri)
    try:
        role = client.get_run(parent_run_id).data.tags.get("ddplab.study_role")
    except MlflowException as e:
        raise TrackingError(f"run {parent_run_id} in {uri}: {str(e).splitlines()[0]}") from None
    if role != PARENT:
        raise TrackingError(f"run {parent_run_id} is not a study's parent run (no tag "
                            f"ddplab.study_role={PARENT}); `ddplab study run` makes those")
    study_report.build(client, parent_run_id, None, make_console())
    return 0
