"""One job = one MLflow run.

Global rank 0 creates the run (or takes ``MLFLOW_RUN_ID`` from a launcher, or the run id of
the checkpoint it resumes) and broadcasts its id; no other rank ever creates one. Rank 0 gets
an ``MlflowTracker``; every other rank a ``NullTracker`` with the same methods, so callers
never ask ``if rank == 0``. Local rank 0 of every node attaches a system-metrics monitor to
the same run under its own node id (``system/node<k>/...``).
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .backend import share_from_rank0
from .config import TrackingConfig
from .launch import LaunchEnv


class TrackingError(RuntimeError):
    """The tracking store cannot be used."""


def resolve_uri(cfg: TrackingConfig, env: dict[str, str] | os._Environ = os.environ) -> str:
    """tracking.uri, else $MLFLOW_TRACKING_URI, else an embedded SQLite store in the working dir."""
    return cfg.uri or env.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def check_reachable(uri: str, timeout_s: float = 5.0) -> str | None:
    """None when the store answers a real API call, else a one-line reason.

    MLflow's own client retries for minutes; a job should say at once that the server is
    down. /health would not do: it answers even when clients get 403 (allowed-hosts).
    """
    if not uri.startswith(("http://", "https://")):
        return None
    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
    headers = {}
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get(
        "MLFLOW_TRACKING_PASSWORD")
    if user and password:
        import base64

        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout_s) as r:
            r.read(1)
        return None
    except urllib.error.HTTPError as e:
        return f"tracking server {uri} answered HTTP {e.code} ({e.reason})"
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return f"tracking server {uri} is unreachable ({reason})"


class NullTracker:
    """What every rank but 0 holds: same interface, does nothing."""

    run_id: str = ""
    experiment_id: str = ""
    uri: str = ""
    busy_s: float = 0.0
    """Seconds the training process spent inside metric logging calls (what tracking costs it)."""

    def log_params(self, params: dict[str, Any]) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_text(self, text: str, name: str) -> None: ...
    def finish(self, status: str, error: str = "") -> None: ...


class MlflowTracker(NullTracker):
    """Rank 0's view of the run: batched, asynchronous metric logging."""

    def __init__(self, client: Any, run_id: str, experiment_id: str, uri: str,
                 async_logging: bool) -> None:
        self.client, self.run_id, self.experiment_id, self.uri = client, run_id, experiment_id, uri
        self.synchronous = not async_logging
        self.pending: list[Any] = []
        self.finished = False
        self.logged_through = -1
        """Steps up to here are already in the run (an earlier attempt's): not logged again."""

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        existing = self.client.get_run(self.run_id).data.params
        # A resumed run already holds its params; MLflow rejects changing a param's value.
        items = [p for p in items if p.key not in existing]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if step <= self.logged_through:
            return
        t0 = time.perf_counter()
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        op = self.client.log_batch(self.run_id, metrics=batch, synchronous=self.synchronous)
        if op is not None:
            self.pending.append(op)
        self.busy_s += time.perf_counter() - t0

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

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

    def flush(self) -> None:
        for op in self.pending:
            op.wait()
        self.pending.clear()

    def finish(self, status: str, error: str = "") -> None:
        """End the run once: FINISHED, FAILED (with the error recorded) or KILLED."""
        if self.finished:
            return
        self.finished = True
        try:
            self.flush()
        finally:
            if error:
                self.client.set_tag(self.run_id, "ddplab.error", error[-4000:])
                self.client.log_text(self.run_id, error, "error.txt")
            self.client.set_terminated(self.run_id, status)


def _delete_artifact(artifact_uri: str, path: str) -> None:
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    try:
        get_artifact_repository(artifact_uri).delete_artifacts(path)
    except Exception as e:  # noqa: BLE001 - some stores cannot delete; the copy stays, said once
        import warnings

        warnings.warn(f"could not remove the earlier attempt's {path} ({type(e).__name__}: {e})",
                      stacklevel=2)


def _create_or_attach(cfg: TrackingConfig, name: str, description: str,
                      resume_run_id: str) -> MlflowTracker:
    from mlflow import MlflowClient

    uri = resolve_uri(cfg)
    problem = check_reachable(uri)
    deadline = time.monotonic() + cfg.wait_s
    while problem and time.monotonic() < deadline:
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        problem = check_reachable(uri)
    if problem:
        waited = f" after waiting {cfg.wait_s:.0f}s (tracking.wait_s)" if cfg.wait_s else ""
        raise TrackingError(f"{problem}{waited}. Start it, fix MLFLOW_TRACKING_URI, or set "
                            "tracking.enabled=false")
    client = MlflowClient(uri)
    run_id = resume_run_id or os.environ.get("MLFLOW_RUN_ID", "")
    if run_id:
        run = client.get_run(run_id)
        client.update_run(run_id, status="RUNNING")
        tracker = MlflowTracker(client, run_id, run.info.experiment_id, uri, cfg.async_logging)
        tracker.take_over(run)
        return tracker
    exp_name = cfg.experiment or name
    exp = client.get_experiment_by_name(exp_name)
    exp_id = exp.experiment_id if exp else client.create_experiment(exp_name)
    tags = {"mlflow.note.content": description} if description else {}
    run = client.create_run(exp_id, run_name=cfg.run_name or None, tags=tags)
    return MlflowTracker(client, run.info.run_id, exp_id, uri, cfg.async_logging)


def open_tracker(cfg: TrackingConfig, le: LaunchEnv, name: str, description: str,
                 resume_run_id: str = "") -> NullTracker:
    """Collective: rank 0 creates or attaches to the run and every rank learns its id."""
    if not cfg.enabled:
        return NullTracker()
    made: list[MlflowTracker] = []

    def create() -> tuple[str, str]:
        made.append(_create_or_attach(cfg, name, description, resume_run_id))
        return made[0].run_id, made[0].uri

    run_id, uri = share_from_rank0(create, le.is_rank0, le.world_size)
    if made:
        return made[0]
    tracker = NullTracker()
    tracker.run_id, tracker.uri = run_id, uri
    return tracker


class SystemMetrics:
    """Per-node CPU, memory, disk, network (and GPU) metrics into the job's run.

    Started on local rank 0 of every node; a no-op elsewhere or when disabled.
    """

    def __init__(self, run_id: str, uri: str, node_rank: int, interval_s: float,
                 resume: bool, active: bool) -> None:
        self.monitor = None
        if not (active and run_id):
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self.monitor = SystemMetricsMonitor(run_id, sampling_interval=interval_s,
                                            resume_logging=resume, node_id=f"node{node_rank}",
                                            tracking_uri=uri)
        self.monitor.start()

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.finish()
            self.monitor = None


@contextlib.contextmanager
def job_run(cfg: TrackingConfig, le: LaunchEnv, name: str, description: str,
            resume_run_id: str, signals: Any) -> Iterator[NullTracker]:
    """The job's one run, open while training: node system metrics beside it, and ended once
    whatever happens: FINISHED, KILLED (Ctrl-C) or FAILED with the error recorded.

    ``signals`` says how an interrupted job ends (``status()``) and, once the ending starts,
    stops further signals from cutting it (``shield()``).
    """
    # MLflow prints its own "View run at <tracking URI>" when a run ends; inside compose or a
    # cluster that is an in-network name the browser cannot open. ddplab prints the run's
    # address itself, in the browser's terms (run._where, DDPLAB_UI_URL).
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    run = open_tracker(cfg, le, name, description, resume_run_id)
    system = SystemMetrics(run.run_id, run.uri, le.node_rank, cfg.system_metrics_interval_s,
                           resume=bool(resume_run_id),
                           active=cfg.system_metrics and le.is_node_leader)
    status, error = "FAILED", ""
    try:
        yield run
        status = "FINISHED"
    except BaseException as e:
        status = signals.status()
        error = ("interrupted (SIGINT / Ctrl-C)" if status == "KILLED"
                 else f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        raise
    finally:
        signals.shield()
        system.stop()
        run.finish(status, error)
        if status != "FINISHED" and not le.is_rank0 and (le.is_node_leader or le.rank == 1):
            end_orphan(run.uri, run.run_id, error.split("\n", 1)[0])


ORPHAN_GRACE_S = 20.0
"""How long a surviving rank lets global rank 0 end the run itself. torchrun gives ranks it
stops 30 s between SIGTERM and SIGKILL; this must fit inside that."""


def end_orphan(uri: str, run_id: str, why: str, grace_s: float = ORPHAN_GRACE_S) -> bool:
    """Run by survivors of a failed job: if the run is still RUNNING after ``grace_s``, global
    rank 0 is gone (SIGKILL, OOM) and can no longer end it: end it FAILED. True if it did."""
    if not run_id:
        return False
    from mlflow import MlflowClient

    try:
        client = MlflowClient(uri)
        deadline = time.monotonic() + grace_s
        while client.get_run(run_id).info.status == "RUNNING":
            if time.monotonic() >= deadline:
                client.set_tag(run_id, "ddplab.error", f"global rank 0 lost; this rank saw: {why}")
                client.set_terminated(run_id, "FAILED")
                return True
            time.sleep(1.0)
    except Exception as e:  # noqa: BLE001 - best effort on the way out; never mask the failure
        import warnings

        warnings.warn(f"could not check run {run_id} after the failure: {e}", stacklevel=2)
    return False
