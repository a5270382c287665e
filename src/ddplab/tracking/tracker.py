"""Rank 0's run (MlflowTracker: every record to the spool) and every other rank's
NullTracker; creating the run, or attaching to a resumed or given one, and telling every rank."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..backend import share_from_rank0
from ..config import TrackingConfig
from ..launchers import LaunchEnv
from ..log import logger
from ..poll import poll
from . import spool
from .store import (
    TrackingError,
    _experiment_refused,
    _permission_denied,
    check_reachable,
    open_client,
    resolve_uri,
)


class NullTracker:
    """What every rank but 0 holds: same interface, does nothing."""

    run_id: str = ""
    experiment_id: str = ""
    uri: str = ""
    busy_s: float = 0.0
    """Seconds the training process spent inside metric logging calls (what tracking costs it)."""
    left: int = 0
    """Records the server had not taken when the job ended (kept in the spool)."""
    delivery: Any = None
    """This node's delivery process, if it has one (its CPU time is tracking's cost)."""
    open_cpu_s: float = 0.0
    """CPU seconds this process spent creating or attaching to the run (rank 0: MLflow's
    import and the first calls to the store)."""

    def log_params(self, params: dict[str, Any]) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_text(self, text: str, name: str) -> None: ...
    def log_file(self, path: str, artifact_dir: str) -> None: ...
    def finish(self, status: str, error: str = "") -> None: ...


class MlflowTracker(NullTracker):
    """Rank 0's view of the run. Every record goes to the spool (a local file) and this node's
    delivery process sends it on: logging never waits on the server, and an outage loses
    nothing (spool.py)."""

    def __init__(self, client: Any, run: Any, uri: str) -> None:
        self.client, self.uri = client, uri
        self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        self.start_ms = run.info.start_time or spool.now_ms()
        self.existing_params = dict(run.data.params)
        self.records: spool.Stream | None = None
        self.finished = False
        self.logged_through = -1
        """Steps up to here are already in the run (an earlier attempt's): not logged again."""

    def open_spool(self, directory: Path) -> None:
        self.records = spool.Stream(directory, "records")

    def _append(self, record: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        assert self.records is not None, "open_spool() first"
        self.records.append({"ts": spool.now_ms(), **record})
        self.busy_s += time.perf_counter() - t0

    def log_params(self, params: dict[str, Any]) -> None:
        # A resumed run already holds its params; MLflow rejects changing a param's value.
        items = [(k, str(v)[:6000]) for k, v in params.items() if k not in self.existing_params]
        for i in range(0, len(items), spool.BATCH_PARAMS):
            self._append({"op": "log", "params": dict(items[i:i + spool.BATCH_PARAMS])})

    def set_tags(self, tags: dict[str, Any]) -> None:
        items = [(k, str(v)[:8000]) for k, v in tags.items()]
        for i in range(0, len(items), spool.BATCH_TAGS):
            self._append({"op": "log", "tags": dict(items[i:i + spool.BATCH_TAGS])})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step > self.logged_through:
            self._append({"op": "log", "step": step,
                          "metrics": {k: float(v) for k, v in metrics.items()}})

    def log_text(self, text: str, name: str) -> None:
        self._append({"op": "text", "name": name, "text": text})

    def log_file(self, path: str, artifact_dir: str) -> None:
        """A copy goes into the spool (the original may be temporary), then to the run."""
        assert self.records is not None, "open_spool() first"
        kept = self.records.keep_file(Path(path))
        self._append({"op": "file", "path": str(kept), "dir": artifact_dir})

    def take_over(self, run: Any) -> None:
        """A resumed attempt continues this run: steps the earlier attempt logged stay as they
        are (one value per step), and its error moves aside, so a run that now finishes does not
        still say it failed."""
        history = self.client.get_metric_history(self.run_id, "train/loss")
        self.logged_through = max((m.step for m in history), default=-1)
        error = run.data.tags.get("ddplab.error")
        if error is None:
            return
        self.client.log_text(self.run_id, error,
                             f"resumes/error-before-step{self.logged_through:08d}.txt")
        self.client.delete_tag(self.run_id, "ddplab.error")
        _delete_artifact(run.info.artifact_uri, "error.txt")

    def finish(self, status: str, error: str = "") -> None:
        """End the run once: FINISHED, FAILED (with the error recorded) or KILLED."""
        if self.finished or self.records is None:
            return
        self.finished = True
        try:
            if error:
                self.set_tags({"ddplab.error": error[-4000:]})
                self.log_text(error, "error.txt")
            self._append({"op": "end", "status": status})
        except OSError as e:  # the spool cannot be written (a full disk): end the run directly
            self._end_directly(status, error, e)
        finally:
            self.records.close()

    def _end_directly(self, status: str, error: str, e: OSError) -> None:
        """The run's end and its real reason straight to the server, when the spool cannot take
        them: a run must never stay RUNNING, nor end blaming the wrong thing."""
        why = f"the tracking spool could not be written ({e.strerror or e}): records after " \
              "that point are not in the run"
        first = error.split("\n", 1)[0] if error else ""
        try:
            self.client.set_tag(self.run_id, "ddplab.error", (f"{first}; " if first else "") + why)
            self.client.set_terminated(self.run_id, "FAILED" if status == "FINISHED" else status)
        except Exception as sent:  # noqa: BLE001 - nothing else can end it: say so, once
            logger().error(f"run {self.run_id} could not be ended ({why}; the server: "
                           f"{type(sent).__name__}: {str(sent)[:200]}); end it with `mlflow runs` "
                           "or the UI")
            return
        logger().error(f"{why}; run {self.run_id} ended FAILED directly")


def _delete_artifact(artifact_uri: str, path: str) -> None:
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    try:
        get_artifact_repository(artifact_uri).delete_artifacts(path)
    except Exception as e:  # noqa: BLE001 - some stores cannot delete; the copy stays, said once
        import warnings

        warnings.warn(f"could not remove the earlier attempt's {path} ({type(e).__name__}: {e})",
                      stacklevel=2)


# Every run's description says which of its two throughputs to quote (docs/tracking.md, "Metrics").
THROUGHPUT_NOTE = (
    "Throughput: quote `perf/samples_per_s`, the steady rate of the whole job (samples over "
    "time in the epochs after the first, so start-up is not counted; with one epoch, its log "
    "intervals after the first). `train/samples_per_s` is each log interval's rate, for the "
    "curve over steps; `train/rank<r>_samples_per_s` is one rank's share.")

# The MLflow UI opens such an experiment in its model-training view (not the GenAI one).
TRAINING_KIND = {"mlflow.experimentKind": "custom_model_development"}


def experiment_id(client: Any, name: str) -> str:
    """The experiment called ``name``, created (in the model-training view) when missing, with
    ddplab's saved view of its runs."""
    from .. import ui_views

    exp = client.get_experiment_by_name(name)
    if exp is None:
        exp = client.get_experiment(client.create_experiment(name, tags=TRAINING_KIND))
    ui_views.ensure_runs_view(client, exp)
    return exp.experiment_id


def _create_or_attach(cfg: TrackingConfig, name: str, description: str,
                      resume_run_id: str, spool_root: Path, run_name: str = "") -> MlflowTracker:
    uri = resolve_uri(cfg)
    problem: list[str | None] = [None]

    def answers() -> bool:
        problem[0] = check_reachable(uri)
        return problem[0] is None

    if not poll(answers, cfg.wait_s, 2.0):
        waited = f" after waiting {cfg.wait_s:.0f}s (tracking.wait_s)" if cfg.wait_s else ""
        raise TrackingError(f"{problem[0]}{waited}. Start it, fix MLFLOW_TRACKING_URI, or set "
                            "tracking.enabled=false")
    client = open_client(uri)
    run_id = resume_run_id or os.environ.get("MLFLOW_RUN_ID", "")
    if run_id:
        # What an earlier attempt left undelivered goes first (its error and end included), so
        # the take-over below sees, and sets aside, everything that attempt recorded.
        for left in spool.find([spool_root / run_id]):
            spool.deliver(left, client, lambda: False, timeout_s=30.0, final=True)
        run = client.get_run(run_id)
        client.update_run(run_id, status="RUNNING")
        tracker = MlflowTracker(client, run, uri)
        tracker.take_over(run)
        return tracker
    exp_name = cfg.experiment or name
    tags = {"mlflow.note.content": f"{description}\n\n{THROUGHPUT_NOTE}".strip()}
    try:
        exp_id = experiment_id(client, exp_name)
        run = client.create_run(exp_id, run_name=cfg.run_name or run_name, tags=tags)
    except Exception as e:
        if _permission_denied(e):
            raise _experiment_refused(exp_name, e) from None
        raise
    return MlflowTracker(client, run, uri)


@dataclass(frozen=True)
class RunRef:
    """What every rank learns about the run from rank 0."""

    run_id: str
    uri: str
    experiment_id: str
    start_ms: int


def open_tracker(cfg: TrackingConfig, le: LaunchEnv, name: str, description: str,
                 resume_run_id: str = "", spool_root: Path = Path("checkpoints"),
                 run_name: str = "", share: Any = share_from_rank0) -> tuple[NullTracker, RunRef]:
    """Collective: rank 0 creates or attaches to the run and every rank learns which
    (``share``: over the process group, or script mode's store when there is none yet)."""
    if not cfg.enabled:
        return NullTracker(), RunRef("", "", "", 0)
    made: list[MlflowTracker] = []

    def create() -> RunRef:
        made.append(_create_or_attach(cfg, name, description, resume_run_id, spool_root,
                                      run_name))
        t = made[0]
        return RunRef(t.run_id, t.uri, t.experiment_id, t.start_ms)

    ref = share(create, le.is_rank0, le.world_size)
    if made:
        return made[0], ref
    tracker = NullTracker()
    tracker.run_id, tracker.uri, tracker.experiment_id = ref.run_id, ref.uri, ref.experiment_id
    return tracker, ref
