"""Many jobs -> one comparison: study files (spec), running them (runner), the report (report:
its rows in table, drawn in plots, written by render with templates/, judged by verdict; page
for docs/results/), and re-running a recorded run to check it (reproduce)."""

from __future__ import annotations

import os

from ..errors import DdplabError
from ..tracking import schema


def run_study(path: str, overrides: list[str], fresh: bool, dry_run: bool, repeats: int = 0,
              variants: str | None = None) -> int:
    # MLflow prints "View run at <tracking URI>" when a run ends: on a cluster an in-network
    # name the browser cannot open. The study prints each address itself (DDPLAB_UI_URL).
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    import dataclasses

    import yaml

    from ..config import ConfigError
    from ..logins import mask
    from ..tracking import validated_uri
    from . import runner, spec

    # The study's own client calls fail fast: MLflow's default retries a dead server for
    # minutes a call (a study once sat silent for 12 minutes, then printed 15 tracebacks).
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    study = spec.load_study(path, list(overrides))
    if not 0 <= repeats <= spec.MAX_REPEATS:
        raise ConfigError(f"--repeats: got {repeats}; must be an integer in [0, "
                          f"{spec.MAX_REPEATS}] (0, the default: the file's repeats)")
    if repeats:
        study = dataclasses.replace(study, repeats=repeats)
    if variants is not None:  # (given empty: refused, not every variant)
        study = spec.only(study, variants)
    resolved = yaml.safe_dump({
        "name": study.name, "description": study.description,
        "experiment": str(study.experiment), "set": study.set,
        "repeats": study.repeats, "baseline": study.baseline,
        "extra_set": [mask(spec.as_text(o)) for o in study.extra],
        "target_accuracy": study.target_accuracy,
        "metric": study.metric, "metric_mode": study.metric_mode,
        "variants": [{"name": v.name, "nproc": v.nproc, "nnodes": v.nnodes,
                      "launcher": v.launcher, "set": v.set} for v in study.variants]},
        sort_keys=False)
    uri = validated_uri()
    try:
        return runner.run(study, uri, fresh, dry_run, resolved)
    except ConfigError:
        raise
    except Exception as e:
        if not _tracking_failure(e):
            raise
        from ..tracking import TrackingError

        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise TrackingError(f"the tracking store {uri} stopped answering ({first}); what was "
                            "recorded stays: rerun the same `ddplab study run` when it is back "
                            "(FINISHED jobs are skipped, and runs left RUNNING are ended)") from None


def _tracking_failure(e: BaseException) -> bool:
    """MLflow's client or its HTTP layer failing (a server gone mid-study)."""
    from mlflow.exceptions import MlflowException

    kinds: tuple[type[BaseException], ...] = (MlflowException, ConnectionError)
    try:
        from requests.exceptions import RequestException

        kinds += (RequestException,)
    except ImportError:  # pragma: no cover - MLflow depends on requests
        kinds += (OSError,)
    return isinstance(e, kinds)


class PageError(DdplabError):
    """A results page that cannot be written where it was asked for."""


def show_report(parent_run_id: str, page_name: str = "") -> int:
    """Rebuild the report from the store; with ``page_name`` also write it as a results page."""
    from mlflow.exceptions import MlflowException

    from .. import pages
    from ..tracking import TrackingError, recorded_run
    from . import report as study_report
    from .runner import PARENT, make_console

    page = pages.path_for(page_name) if page_name else None
    client, parent, uri = recorded_run(parent_run_id)
    if parent.data.tags.get(schema.STUDY_ROLE) != PARENT:
        from ..config import ConfigError

        raise ConfigError(f"run {parent_run_id} is not a study's parent run (no tag "
                          f"{schema.STUDY_ROLE}={PARENT}); `ddplab study run` makes those")
    if page is not None and parent.info.status == "RUNNING":
        from ..config import ConfigError

        raise ConfigError(f"--page: study run {parent_run_id} is still RUNNING (or was stopped "
                          "without ending): a results page records a finished study; wait for it, "
                          "or run `ddplab study run` on its file again to finish it")
    try:
        study_report.build(client, parent_run_id, None, make_console(), uri, page)
    except OSError as e:  # the page's folder is a file, the checkout read-only, a full disk
        where = e.filename or page
        raise PageError(f"report --page: cannot write {where} ({e.strerror or e}); name another "
                        "page, or free or fix that path") from None
    except MlflowException as e:
        from ..tracking.store import _permission_denied

        if not _permission_denied(e):
            raise
        raise TrackingError(
            f"report: the tracking server {uri} refused to record the report on run "
            f"{parent_run_id} (HTTP 403: writing to a run needs EDIT on its experiment; "
            f"{str(e).splitlines()[0][:160]})") from None
    if page is not None:
        print(f"wrote {os.path.relpath(page)} (and its plots in {os.path.relpath(page.with_suffix(''))}/)")
    return 0
