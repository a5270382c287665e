"""Rank 0's run (MlflowTracker: every record to the spool) and every other rank's
NullTracker; creating the run, or attaching to a resumed or given one, and telling every rank."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import TrackingConfig
from ..distributed.group import share_from_rank0
from ..launchers import LaunchEnv
from ..log import logger
from . import life, schema, spool
from .naming import typed_command
from .opening import Opened, Request, open_run
from .store import open_client, resolve_uri

Opener = Callable[[Request], "Opened | None"]
"""Asks another process to open the run; None when it cannot (this process opens it)."""


PARAM_LIMIT = schema.PARAM_LIMIT


ERROR_LIMIT = 4000
"""Characters of the error kept in ``ddplab.error`` (error.txt holds it whole)."""
ERROR_CUT = "\n[... the middle is left out here: the run's error.txt holds it whole ...]\n"


def error_tag(error: str, limit: int = ERROR_LIMIT) -> str:
    """The error as its tag: whole when it fits, else its first line (what ``ddplab diagnose``,
    the runs table and a study show) and its end (where it was raised), never a line's middle
    as the first."""
    if len(error) <= limit:
        return error
    first = error.split("\n", 1)[0][:limit // 4]
    return first + ERROR_CUT + error[len(error) - (limit - len(first) - len(ERROR_CUT)):]


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
    logged_through: int = -1
    """Steps up to here are already in the run (an earlier attempt's): not logged again."""
    asked: tuple[str, str] | None = None
    """The status a job that did not fail ends its run with, and why, where its own code asked
    for another than FINISHED (a script's ``mlflow.end_run(status="FAILED")``)."""
    last_step: int = -1
    """The highest step of any metric already in the run (opening.Opened.last_step)."""

    def log_params(self, params: dict[str, Any]) -> None: ...
    def set_tags(self, tags: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int, ts: int = 0) -> None: ...
    def log_text(self, text: str, name: str) -> None: ...
    def log_file(self, path: str, artifact_dir: str) -> None: ...
    def finish(self, status: str, error: str = "") -> None: ...


class MlflowTracker(NullTracker):
    """Rank 0's view of the run. Every record goes to the spool (a local file) and this node's
    delivery process sends it on: logging never waits on the server, and an outage loses
    nothing (spool.py)."""

    def __init__(self, opened: Opened, client: Any = None) -> None:
        self._client, self.uri = client, opened.uri
        self.run_id, self.experiment_id = opened.run_id, opened.experiment_id
        self.start_ms = opened.start_ms
        self.existing_params = dict(opened.existing_params)
        self.records: spool.Stream | None = None
        self.finished = False
        self.logged_through, self.last_step = opened.logged_through, opened.last_step
        self.latest_steps = dict(opened.latest_steps)

    @property
    def client(self) -> Any:
        """MLflow's client, opened here only when needed (the delivery process opened the run)."""
        if self._client is None:
            self._client = open_client(self.uri)
        return self._client

    def open_spool(self, directory: Path) -> None:
        self.records = spool.Stream(directory, "records")

    def _append(self, record: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        assert self.records is not None, "open_spool() first"
        self.records.append({"ts": spool.now_ms(), **record})
        self.busy_s += time.perf_counter() - t0

    def log_params(self, params: dict[str, Any]) -> None:
        # A resumed run already holds its params; MLflow rejects changing a param's value.
        new = {k: str(v) for k, v in params.items() if k not in self.existing_params}
        items = [(k, v[:PARAM_LIMIT]) for k, v in new.items()]
        for i in range(0, len(items), spool.BATCH_PARAMS):
            self._append({"op": "log", "params": dict(items[i:i + spool.BATCH_PARAMS])})
        cut = [f"{k} ({len(v)} characters)" for k, v in new.items() if len(v) > PARAM_LIMIT]
        if cut:  # said in the run, not silently shortened
            self.set_tags({schema.PARAMS_CUT: f"{', '.join(cut)}: cut to {PARAM_LIMIT} "
                           "characters (MLflow's limit for a param); config.yaml holds them whole"})

    def set_tags(self, tags: dict[str, Any]) -> None:
        items = [(k, str(v)[:schema.TAG_LIMIT]) for k, v in tags.items()]
        for i in range(0, len(items), spool.BATCH_TAGS):
            self._append({"op": "log", "tags": dict(items[i:i + spool.BATCH_TAGS])})

    def log_metrics(self, metrics: dict[str, float], step: int, ts: int = 0) -> None:
        """``ts``: the record's own time (ms), where it may be in the spool already (a script's
        last log point, written again by its supervisor): the store keeps it once."""
        # (a resumed run: each metric's steps already in it are not logged again)
        new = {k: float(v) for k, v in metrics.items() if step > self.latest_steps.get(k, -1)}
        if new:
            self._append({"op": "log", "step": step, "metrics": new, **({"ts": ts} if ts else {})})

    def log_text(self, text: str, name: str) -> None:
        self._append({"op": "text", "name": name, "text": text})

    def log_file(self, path: str, artifact_dir: str) -> None:
        """A copy goes into the spool (the original may be temporary), then to the run."""
        assert self.records is not None, "open_spool() first"
        kept = self.records.keep_file(Path(path))
        self._append({"op": "file", "path": str(kept), "dir": artifact_dir})

    def finish(self, status: str, error: str = "") -> None:
        """End the run once: FINISHED, FAILED (with the error recorded) or KILLED."""
        if self.finished or self.records is None:
            return
        self.finished = True
        try:
            if error:
                self.set_tags({schema.ERROR: error_tag(error)})
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
            life.end(self.client, self.run_id, life.FAILED if status == life.FINISHED else status,
                     (f"{first}; " if first else "") + why)
        except Exception as sent:  # noqa: BLE001 - nothing else can end it: say so, once
            logger().error(f"run {self.run_id} could not be ended ({why}; the server: "
                           f"{type(sent).__name__}: {str(sent)[:200]}); end it with `mlflow runs` "
                           "or the UI")
            return
        logger().error(f"{why}; run {self.run_id} ended FAILED directly")


def _create_or_attach(cfg: TrackingConfig, name: str, description: str, resume_run_id: str,
                      spool_root: Path, run_name: str = "", opener: Opener | None = None
                      ) -> MlflowTracker:
    """``opener``: this node's delivery process, which opens the run for rank 0 (opening.py);
    without one, this process opens it."""
    req = Request(uri=resolve_uri(cfg), experiment=cfg.experiment or name,
                  run_name=cfg.run_name or run_name, description=description,
                  run_id=resume_run_id or os.environ.get("MLFLOW_RUN_ID", ""),
                  wait_s=cfg.wait_s, spool_root=str(spool_root), start_ms=_began_ms(),
                  source=typed_command())
    if opener is not None:
        opened = opener(req)
        if opened is not None:
            return MlflowTracker(opened)
    return MlflowTracker(*open_run(req))


def _began_ms() -> int:
    """When this process started (ms since the epoch; 0 when it cannot be told)."""
    try:
        import psutil

        began = psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - the run then starts when it is opened, as before
        return 0
    # (a clock stepped since, or a start in the future: the run starts when it is opened)
    return int(began * 1000) if 0 <= time.time() - began < 86400 else 0


@dataclass(frozen=True)
class RunRef:
    """What every rank learns about the run from rank 0."""

    run_id: str
    uri: str
    experiment_id: str
    start_ms: int


Share = Callable[[Callable[[], RunRef], bool, int], RunRef]
"""Collective: rank 0 produces the run, every rank gets it (group.share_from_rank0 over the
process group, or script mode's store: scriptmode/meeting.py)."""


def open_tracker(cfg: TrackingConfig, le: LaunchEnv, name: str, description: str,
                 resume_run_id: str = "", spool_root: Path = Path("checkpoints"),
                 run_name: str = "", share: Share = share_from_rank0, opener: Opener | None = None
                 ) -> tuple[NullTracker, RunRef]:
    """Collective: rank 0 creates or attaches to the run and every rank learns which
    (``share``: over the process group, or script mode's store when there is none yet;
    ``opener``: rank 0's node's delivery process, see _create_or_attach)."""
    if not cfg.enabled:
        return NullTracker(), RunRef("", "", "", 0)
    made: list[MlflowTracker] = []

    def create() -> RunRef:
        made.append(_create_or_attach(cfg, name, description, resume_run_id, spool_root,
                                      run_name, opener))
        t = made[0]
        return RunRef(t.run_id, t.uri, t.experiment_id, t.start_ms)

    ref = share(create, le.is_rank0, le.world_size)
    if made:
        return made[0], ref
    tracker = NullTracker()
    tracker.run_id, tracker.uri, tracker.experiment_id = ref.run_id, ref.uri, ref.experiment_id
    return tracker, ref
