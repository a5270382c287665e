"""Opening the job's run: creating it, or attaching to a resumed or given one.

MLflow only, no torch: the node's delivery process does this for rank 0 (delivery.py). It has
MLflow imported and the store opened while the ranks are still importing torch, so a tracked
job's start-up no longer pays for MLflow twice, once on rank 0's critical path (measured: 3.6 s
of a 2-rank quickstart's 6 s to the first step, docs/results/bench-startup.md). Rank 0 keeps
this path in-process only where it has no delivery process to ask (tests that call
``run.train`` directly, a delivery process that died).
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..poll import poll
from . import life, schema, spool
from .store import TrackingError, _experiment_refused, _permission_denied, check_reachable, open_client

# Every run's description says which of its two throughputs to quote (docs/tracking.md, "Metrics").
THROUGHPUT_NOTE = (
    "Throughput: quote `perf/samples_per_s`, the steady rate of the whole job (samples over "
    "the steps' time in the log intervals after the first, so neither start-up nor "
    "evaluations and checkpoints are counted; a script job's: the script's own where it logs "
    "`perf/samples_per_s`, else its observed steps after the first). "
    "`train/samples_per_s` is each log interval's rate, for the curve over steps; "
    "`train/rank<r>_samples_per_s` is one rank's share.")

# The MLflow UI opens such an experiment in its model-training view (not the GenAI one).
TRAINING_KIND = {"mlflow.experimentKind": "custom_model_development"}


@dataclass(frozen=True)
class Request:
    """What rank 0 asks for (JSON between the processes)."""

    uri: str
    experiment: str
    run_name: str
    description: str
    run_id: str = ""
    """Attach to this run (a resumed checkpoint's, or $MLFLOW_RUN_ID); "" creates one."""
    wait_s: float = 0.0
    spool_root: str = "checkpoints"
    start_ms: int = 0
    """When the job began (ms; rank 0's process start): a new run starts then, so the UI's
    duration is the job's, its start-up included, not from its run's opening on (0: now)."""
    source: str = ""
    """The command rank 0 runs (``ddplab train experiments/quickstart.yaml``): the UI's Source."""


@dataclass(frozen=True)
class Opened:
    """The run as rank 0's tracker needs it."""

    run_id: str
    experiment_id: str
    uri: str
    start_ms: int
    existing_params: dict[str, str] = field(default_factory=dict)
    logged_through: int = -1
    """Steps up to here are already in the run (an earlier attempt's): not logged again."""
    last_step: int = -1
    """The highest step any of the run's metrics is at (system metrics, whose steps are
    seconds, left out): a resumed script's figures go after it (scriptmode's step offset)."""
    latest_steps: dict[str, int] = field(default_factory=dict)
    """Each metric's latest step in the run (a resumed attempt's): one value per step in each
    metric's history, but a metric the earlier attempt never reached at a step (its eval and
    throughput, when it died after its last step's checkpoint) is logged there now."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def experiment_id(client: Any, name: str) -> str:
    """The experiment called ``name``, created (in the model-training view) when missing, with
    ddplab's saved view of its runs."""
    from . import ui_views

    exp = client.get_experiment(get_or_create_experiment(client, name, TRAINING_KIND))
    ui_views.ensure_runs_view(client, exp)
    return str(exp.experiment_id)


def get_or_create_experiment(client: Any, name: str, tags: dict[str, str] | None = None) -> str:
    """The id of the experiment called ``name``, created when missing. Two jobs started together
    on a fresh store both find it missing and both create it: the loser's "already exists" means
    the winner's experiment is there, so it is looked up again rather than failing the job."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return str(exp.experiment_id)
    try:
        return str(client.create_experiment(name, tags=tags))
    except Exception:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return str(exp.experiment_id)


def wait_for(uri: str, wait_s: float) -> None:
    """The store answers (within ``wait_s``, tracking.wait_s), or one TrackingError line."""
    problem: list[str | None] = [None]

    def answers() -> bool:
        problem[0] = check_reachable(uri)
        return problem[0] is None

    if not poll(answers, wait_s, 2.0):
        waited = f" after waiting {wait_s:.0f}s (tracking.wait_s)" if wait_s else ""
        raise TrackingError(f"{problem[0]}{waited}. Start it, fix MLFLOW_TRACKING_URI, or set "
                            "tracking.enabled=false")


def open_run(req: Request, client: Any = None) -> tuple[Opened, Any]:
    """Create the run, or attach to ``req.run_id``; returns it and the client that opened it."""
    wait_for(req.uri, req.wait_s)
    client = client or open_client(req.uri)
    if req.run_id:
        return _attach(client, req), client
    try:
        exp_id = experiment_id(client, req.experiment)
        run = life.create(client, exp_id, req.run_name, _described(req),
                          start_time=req.start_ms or None)
    except Exception as e:
        if _permission_denied(e):
            raise _experiment_refused(req.experiment, e) from None
        raise
    return _opened(run, req.uri), client


def _described(req: Request) -> dict[str, str]:
    """A job's run's description (which throughput to quote) and Source (rank 0's command)."""
    tags = {schema.MLFLOW_NOTE: f"{req.description}\n\n{THROUGHPUT_NOTE}".strip()}
    if req.source:
        tags.update({schema.MLFLOW_SOURCE_NAME: req.source[:schema.TAG_LIMIT],
                     schema.MLFLOW_SOURCE_TYPE: "JOB"})
    return tags


def _opened(run: Any, uri: str, logged_through: int = -1) -> Opened:
    latest = _latest_steps(run)
    return Opened(run.info.run_id, run.info.experiment_id, uri,
                  run.info.start_time or spool.now_ms(), dict(run.data.params), logged_through,
                  max([logged_through, *latest.values()]), latest)


def _latest_steps(run: Any) -> dict[str, int]:
    # Each metric's latest value comes with its step (MLflow's RunData keeps them whole).
    latest = getattr(run.data, "_metric_objs", None) or []
    return {m.key: int(m.step) for m in latest if not m.key.startswith("system/")}


def _attach(client: Any, req: Request) -> Opened:
    """A resumed attempt continues its run: what an earlier attempt left undelivered goes first
    (its error and end included), then the steps it logged stay as they are (one value per
    step), and what it said of its end moves aside (its error, the verdict, each node's ranks'
    endings, a straggler), so a run that now finishes does not still say it failed."""
    _in_this_store(client, req)
    for left in spool.find([Path(req.spool_root) / req.run_id]):
        spool.deliver(left, client, lambda: False, timeout_s=30.0, final=True)
    run = client.get_run(req.run_id)
    # A run made for the job elsewhere (a study's child, a reproduction, $MLFLOW_RUN_ID) had no
    # description nor Source in the UI; what it already says is kept.
    for key, value in _described(req).items():
        if not run.data.tags.get(key):
            client.set_tag(req.run_id, key, value)
    client.update_run(req.run_id, status="RUNNING")
    history = client.get_metric_history(req.run_id, "train/loss")
    through = max((m.step for m in history), default=-1)
    _move_aside_its_end(client, run, through, req.uri)
    return _opened(run, req.uri, through)


def _in_this_store(client: Any, req: Request) -> None:
    """The run a checkpoint resumes is in this store; else one line naming the store its spool
    was made for (a rerun with another MLFLOW_TRACKING_URI failed on rank 0 with "Run ... not
    found" and two tracebacks, a hostile pass)."""
    from ..logins import mask

    try:
        client.get_run(req.run_id)
        return
    except Exception as e:
        if getattr(e, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
            raise
    folder = Path(req.spool_root) / req.run_id
    made = set()
    for node in sorted(folder.glob("spool/node*")):
        try:
            made.add(spool.Meta.read(node).uri)
        except (OSError, ValueError):
            continue
    there = f"; it was recorded in {', '.join(sorted(mask(u) for u in made))}" if made - {req.uri} else ""
    raise TrackingError(
        f"checkpoint.resume: the run {req.run_id} this job resumes (its checkpoints in {folder}) "
        f"is not in the store {mask(req.uri)}{there}: point MLFLOW_TRACKING_URI at its store, or "
        "start a new run with --set checkpoint.resume=never")


def _move_aside_its_end(client: Any, run: Any, through: int, uri: str) -> None:
    """The earlier attempt's ending, from its tags into ``resumes/error-before-step<N>.txt``
    (its error first, as it was), its nodes' files into ``resumes/forensics-before-step<N>/``."""
    _move_artifacts(client, run, uri, "forensics", f"resumes/forensics-before-step{through:08d}")
    tags = run.data.tags
    ended = [k for k in (schema.ERROR, schema.ERROR_RANK0, schema.VERDICT, schema.STRAGGLER)
             if k in tags] + sorted(k for k in tags if k.startswith(schema.FORENSICS_PREFIX))
    if not ended:
        return
    error = tags.get(schema.ERROR)
    rest = "\n\n".join(f"{k}: {tags[k]}" for k in ended if k != schema.ERROR)
    text = "\n\n".join(t for t in (error, rest) if t)
    client.log_text(run.info.run_id, text, f"resumes/error-before-step{through:08d}.txt")
    for k in ended:
        client.delete_tag(run.info.run_id, k)
    if error is not None:
        _delete_artifact(run.info.artifact_uri, uri, "error.txt")


def _move_artifacts(client: Any, run: Any, uri: str, path: str, to: str) -> None:
    """The earlier attempt's files under ``path`` (each node's ranks' errors and stacks) go to
    ``to`` (``to-2``, ... after an attempt that failed at the same step): a run that now finishes
    keeps them, but not where its own ending would be read. A store that cannot move them
    leaves them, said once: the resumed job goes on."""
    run_id = run.info.run_id
    try:
        if not client.list_artifacts(run_id, path):
            return
        taken = {a.path for a in client.list_artifacts(run_id, str(Path(to).parent))}
        aside = next(f"{to}-{n}" if n > 1 else to for n in range(1, 1000)
                     if (f"{to}-{n}" if n > 1 else to) not in taken)
        with tempfile.TemporaryDirectory(prefix="ddplab-aside-") as tmp:
            local = client.download_artifacts(run_id, path, tmp)
            client.log_artifacts(run_id, local, aside)
    except Exception as e:  # noqa: BLE001 - an artifact store's failure, said, not the job's
        import warnings

        warnings.warn(f"could not move the earlier attempt's {path}/ aside ({spool.describe(e)})",
                      stacklevel=2)
        return
    _delete_artifact(run.info.artifact_uri, uri, path)


def _delete_artifact(artifact_uri: str, uri: str, path: str) -> None:
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    try:
        # (the tracking URI: an mlflow-artifacts:/ location resolves through it)
        get_artifact_repository(artifact_uri, tracking_uri=uri).delete_artifacts(path)
    except Exception as e:  # noqa: BLE001 - some stores cannot delete; the copy stays, said once
        import warnings

        warnings.warn(f"could not remove the earlier attempt's {path} ({type(e).__name__}: {e})",
                      stacklevel=2)


def end_failed(client: Any, run_id: str, why: str, end_time: int | None = None) -> None:
    """End a run FAILED with ``why`` as its ddplab.error (the one way a process other than the
    job's rank 0 ends a run: a job stopped early, a rank 0 lost, a spool synced late), at
    ``end_time`` (ms; now when None)."""
    life.end(client, run_id, life.FAILED, why, end_time=end_time)


def end_unclaimed(client: Any, opened: Opened | None, status: str = life.FAILED,
                  why: str = "") -> None:
    """The job stopped after its run was opened but before it said where to deliver: the run
    must not stay RUNNING. ``why``: how it was stopped (Ctrl-C: KILLED), when the job said."""
    if opened is None:
        return
    try:
        life.end(client, opened.run_id, status, f"{why}, after its run was opened, before it "
                 "started training" if why else "the job stopped after its run was opened, "
                 "before it started training (see the job's console)")
    except Exception as e:  # noqa: BLE001 - the console says it; nothing else can
        print(f"ddplab delivery: could not end run {opened.run_id} ({spool.describe(e)})",
              file=sys.stderr)
