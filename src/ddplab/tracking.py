"""One job = one MLflow run.

Global rank 0 creates the run (or takes ``MLFLOW_RUN_ID`` from a launcher, or the run id of
the checkpoint it resumes) and broadcasts its id; no other rank ever creates one. Rank 0 gets
an ``MlflowTracker``; every other rank a ``NullTracker`` with the same methods, so callers
never ask ``if rank == 0``. After the run exists, training never talks to the server: rank 0
appends to a local spool, and one low-priority delivery process per node (started by its
local rank 0) sends the spool on and samples the node's system metrics
(``system/node<k>/...``). See spool.py and delivery.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import spool
from .backend import share_from_rank0
from .config import TrackingConfig
from .launch import LaunchEnv


class TrackingError(RuntimeError):
    """The tracking store cannot be used."""


def embedded_store() -> str:
    """The default store of every command: SQLite in the working directory (make: the repo)."""
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def resolve_uri(cfg: TrackingConfig, env: dict[str, str] | os._Environ = os.environ) -> str:
    """tracking.uri, else $MLFLOW_TRACKING_URI, else the embedded store."""
    return cfg.uri or env.get("MLFLOW_TRACKING_URI") or embedded_store()


def ui_address(uri: str, experiment_id: str, run_id: str = "", view: str = "") -> str:
    """Where a browser shows the run (or, without one, the experiment's runs table in the saved
    view ``view``, see ui_views.py): ": <url>", or " in <store>; browse it with ..."."""
    # workflowType: MLflow 3's UI opens in its GenAI view unless told (or the user toggled it).
    query = "workflowType=machine_learning" + (f"&viewStateShareKey={view}" if view else "")
    route = f"#/experiments/{experiment_id}/runs{'/' + run_id if run_id else ''}?{query}"
    # Inside compose or a cluster the tracking URI is an in-network name (http://mlflow:5000)
    # that the user's browser cannot open: DDPLAB_UI_URL says where the browser finds the UI.
    ui = os.environ.get("DDPLAB_UI_URL", "")
    if ui or uri.startswith(("http://", "https://")):
        return f": {(ui or uri).rstrip('/')}/{route}"
    return f" in {uri}; browse it with `make ui`, then http://127.0.0.1:5000/{route}"


# What MLflow's client can open (mlflow.tracking._tracking_service.utils, store registry).
TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "file",
                    "databricks", "databricks-uc", "uc")
# SQLAlchemy's default driver per database (SQLAlchemy 2.1: psycopg 3 for postgresql).
DB_DRIVERS = {"postgresql": ("psycopg", "psycopg[binary]"), "mysql": ("MySQLdb", "mysqlclient"),
              "mssql": ("pyodbc", "pyodbc")}
DRIVER_MODULES = {"psycopg2": "psycopg2-binary", "psycopg": "psycopg[binary]",
                  "pymysql": "pymysql", "mysqldb": "mysqlclient", "pyodbc": "pyodbc",
                  "pg8000": "pg8000", "asyncpg": "asyncpg", "pymssql": "pymssql"}


def uri_problem(value: str) -> str | None:
    """Why MLflow's client could not use this tracking URI, or None (no network involved)."""
    import importlib.util

    scheme, sep, rest = value.partition(":")
    scheme = scheme.lower() if sep else ""
    base, _, driver = scheme.partition("+")
    if base not in TRACKING_SCHEMES:
        return (f"use a tracking server (http://host:5000) or a store URI with one of the "
                f"schemes {', '.join(TRACKING_SCHEMES)}")
    if base == "sqlite" and rest.strip("/") in ("", ":memory:"):
        return ("an in-memory SQLite store vanishes with the process that opened it, before the "
                "run could be read: give a file, sqlite:///path/mlflow.db")
    if base == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
        return ("MLflow 3 refuses the file store unless MLFLOW_ALLOW_FILE_STORE=true; use "
                "sqlite:///path/mlflow.db (the default) or a server")
    if base in DB_DRIVERS:
        module, package = (driver, DRIVER_MODULES.get(driver, driver)) if driver else DB_DRIVERS[base]
        if importlib.util.find_spec(module.lower() if module != "MySQLdb" else module) is None:
            return f"{base} needs its driver: pip install {package} (or name one: {base}+driver://)"
    return None


def validated_uri(explicit: str = "", source: str = "--tracking-uri") -> str:
    """The tracking URI a command uses (``explicit``, else $MLFLOW_TRACKING_URI, else the
    embedded store here), or one ConfigError line naming where the bad one came from."""
    from .config import ConfigError

    value, where = (explicit, source) if explicit else (
        os.environ.get("MLFLOW_TRACKING_URI", ""), "MLFLOW_TRACKING_URI")
    if not value:
        return embedded_store()
    problem = uri_problem(value)
    if problem:
        raise ConfigError(f"{where}: got {value!r}; {problem}")
    return value


def reachable_client(uri: str) -> Any:
    """An MlflowClient for ``uri``, or one TrackingError line at once when the server does not
    answer (MLflow's own client would retry for minutes)."""
    problem = check_reachable(uri)
    if problem:
        raise TrackingError(f"{problem}: start it, or set MLFLOW_TRACKING_URI")
    return open_client(uri)


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Jobs started together on a new SQLite store would both run MLflow's schema migrations
    ("duplicate column name"): the first to open it does, the others wait on a file lock."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    import fcntl

    db = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])  # sqlite:////abs or sqlite:///rel
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{db}.ddplab-lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield  # an unwritable folder: MLflow's own error will say so
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def open_client(uri: str) -> Any:
    """An MlflowClient whose store is ready (created and migrated once, under store_lock)."""
    from mlflow import MlflowClient

    with store_lock(uri):
        client = MlflowClient(uri)
        if not uri.startswith(("http://", "https://")):
            client.search_experiments(max_results=1)  # creates and migrates the store now
    return client


def check_reachable(uri: str, timeout_s: float = 5.0) -> str | None:
    """None when the store answers a real API call, else a one-line reason.

    Through MLflow's own client, so every way it authenticates works here too (basic auth,
    MLFLOW_TRACKING_TOKEN, a custom CA, auth plugins), but without its minutes of retries: a
    job should say at once that the server is down. /health would not do: it answers even
    when clients get 403 (allowed-hosts).
    """
    if not uri.startswith(("http://", "https://")):
        return None
    from mlflow import MlflowClient

    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(timeout_s))}
    saved = {k: os.environ.get(k) for k in quick}
    os.environ.update(quick)
    try:
        MlflowClient(uri).search_experiments(max_results=1)
        return None
    except Exception as e:  # noqa: BLE001 - any failure is the one line below
        status = getattr(e, "get_http_status_code", lambda: 0)()
        text = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if status and status != 500 and "Max retries" not in text:
            return f"tracking server {uri} answered HTTP {status} ({text[:200]})"
        return f"tracking server {uri} is unreachable ({text[:200]})"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v




def auth_refusal(uri: str) -> str | None:
    """One line naming what to set when the server refuses this client (401, 403), else None."""
    problem = check_reachable(uri)
    if not problem or " answered HTTP 40" not in problem:
        return None
    user = os.environ.get("MLFLOW_TRACKING_USERNAME", "")
    if " answered HTTP 401" in problem:
        if not user and not os.environ.get("MLFLOW_TRACKING_TOKEN"):
            return (f"MLFLOW_TRACKING_USERNAME: not set; the tracking server {uri} asks for "
                    "credentials (HTTP 401): set MLFLOW_TRACKING_USERNAME and "
                    "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) for it")
        who = f"user {user!r}" if user else "MLFLOW_TRACKING_TOKEN"
        return (f"MLFLOW_TRACKING_PASSWORD: the tracking server {uri} refused the credentials of "
                f"{who} (HTTP 401): check MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                "(or MLFLOW_TRACKING_TOKEN)")
    if " answered HTTP 403" in problem:
        return (f"MLFLOW_TRACKING_URI: the tracking server {uri} answered HTTP 403: its "
                "--allowed-hosts does not list the host:port this job calls it by, or user "
                f"{user or '(none)'} may not read experiments there ({problem.split('(', 1)[-1][:160]}")
    return None


def _permission_denied(e: Exception) -> bool:
    return getattr(e, "get_http_status_code", lambda: 0)() == 403 or "PERMISSION_DENIED" in str(e)


def _experiment_refused(exp_name: str, e: Exception) -> TrackingError:
    user = os.environ.get("MLFLOW_TRACKING_USERNAME", "(no user)")
    return TrackingError(
        f"tracking: user {user} may not create runs in the experiment {exp_name!r} on this server "
        "(HTTP 403: its creator has MANAGE on it, others READ unless granted EDIT): choose another "
        "experiment name (the experiment file's `name:`, or --set tracking.experiment=NAME), or "
        "ask its owner or an admin to grant you EDIT (docs/tracking.md, \"A tracking server "
        "with authentication\")")


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
            print(f"ddplab: error: run {self.run_id} could not be ended ({why}; the server: "
                  f"{type(sent).__name__}: {str(sent)[:200]}); end it with `mlflow runs` or the "
                  "UI", file=sys.stderr, flush=True)
            return
        print(f"ddplab: error: {why}; run {self.run_id} ended FAILED directly", file=sys.stderr,
              flush=True)


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
    from . import ui_views

    exp = client.get_experiment_by_name(name)
    if exp is None:
        exp = client.get_experiment(client.create_experiment(name, tags=TRAINING_KIND))
    ui_views.ensure_runs_view(client, exp)
    return exp.experiment_id


def _create_or_attach(cfg: TrackingConfig, name: str, description: str,
                      resume_run_id: str, spool_root: Path, run_name: str = "") -> MlflowTracker:
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
                 run_name: str = "") -> tuple[NullTracker, RunRef]:
    """Collective: rank 0 creates or attaches to the run and every rank learns which."""
    if not cfg.enabled:
        return NullTracker(), RunRef("", "", "", 0)
    made: list[MlflowTracker] = []

    def create() -> RunRef:
        made.append(_create_or_attach(cfg, name, description, resume_run_id, spool_root,
                                      run_name))
        t = made[0]
        return RunRef(t.run_id, t.uri, t.experiment_id, t.start_ms)

    ref = share_from_rank0(create, le.is_rank0, le.world_size)
    if made:
        return made[0], ref
    tracker = NullTracker()
    tracker.run_id, tracker.uri, tracker.experiment_id = ref.run_id, ref.uri, ref.experiment_id
    return tracker, ref


class Delivery:
    """This node's delivery process (delivery.py), started by its local rank 0: it samples the
    node's system metrics and sends the node's spool to the server. Started before the run
    exists, so its start-up (importing MLflow) overlaps the ranks' wait for rank 0 to open the
    run instead of the first epoch; ``attach()`` then names the run's spool. ``close()`` lets
    it finish within ``timeout_s`` and says how many records are still left."""

    def __init__(self, node_rank: int, cfg: TrackingConfig) -> None:
        self.directory, self.timeout_s = Path(), cfg.delivery_timeout_s
        interval = cfg.system_metrics_interval_s if cfg.system_metrics else 0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddplab.delivery", "--timeout", str(cfg.delivery_timeout_s),
             "--system-interval", str(interval), "--node", f"node{node_rank}"],
            # Its own session: the signals meant for the ranks (Ctrl-C, torchrun's killpg of a
            # failed job) must not stop it before the run's ending is delivered. It ends on
            # its own: closed, or its parent gone, then within its timeout.
            stdin=subprocess.PIPE, text=True, close_fds=True, start_new_session=True)

    def attach(self, directory: Path, ref: RunRef) -> None:
        """Deliver this run's spool. (The pipe is closed here, before any DataLoader worker is
        forked, so no other process holds it.)"""
        self.directory = directory
        spool.Meta(ref.uri, ref.run_id, ref.experiment_id).write(directory)
        (directory / spool.CLOSED).unlink(missing_ok=True)  # an earlier attempt's
        (directory / "delivery.json").unlink(missing_ok=True)  # (sync reads both: job over)
        self._tell(json.dumps({"spool": str(directory), "t0_ms": ref.start_ms}) + "\n")

    def cancel(self) -> None:
        """No run was opened: the process exits on the empty stdin."""
        self._tell("")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=15)

    def _tell(self, line: str) -> None:
        assert self.proc.stdin is not None
        if self.proc.stdin.closed:  # told already
            return
        with contextlib.suppress(OSError):  # it died: nothing to deliver through it
            self.proc.stdin.write(line)
        with contextlib.suppress(OSError):
            self.proc.stdin.close()

    def cpu_s(self) -> tuple[float, float]:
        """CPU seconds the delivery process has used so far (what tracking costs the node), and
        how many of them its start-up took (importing MLflow, opening the store)."""
        try:
            import psutil

            t = psutil.Process(self.proc.pid).cpu_times()
            total = t.user + t.system
        except Exception:  # noqa: BLE001 - gone already, or no psutil: unknown
            return 0.0, 0.0
        try:
            startup = json.loads((self.directory / "delivery-startup.json").read_text())["cpu_s"]
        except (OSError, ValueError, KeyError):
            startup = total  # still starting
        return total, min(startup, total)

    def close(self) -> int:
        """Records not delivered: still left, or set aside (refused as records)."""
        with contextlib.suppress(OSError):  # a full disk: the delivery also ends when we do
            (self.directory / spool.CLOSED).write_text(str(spool.now_ms()))
        try:
            self.proc.wait(timeout=self.timeout_s + 15)  # its own bound, plus its start-up
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return spool.left_in(self.directory) + spool.rejected_in(self.directory)


class NoDelivery:
    """Ranks that are not their node's leader, and untracked jobs."""

    directory = Path()

    def attach(self, directory: Path, ref: RunRef) -> None: ...
    def cancel(self) -> None: ...

    def cpu_s(self) -> tuple[float, float]:
        return 0.0, 0.0

    def close(self) -> int:
        return 0


def start_delivery(cfg: TrackingConfig, le: LaunchEnv) -> Delivery | NoDelivery:
    if not (cfg.enabled and le.is_node_leader):
        return NoDelivery()
    return Delivery(le.node_rank, cfg)


@contextlib.contextmanager
def job_run(cfg: Any, le: LaunchEnv, layout: Any, resume_run_id: str, signals: Any
            ) -> Iterator[NullTracker]:
    """The job's one run, open while training: node system metrics beside it, and ended once
    whatever happens: FINISHED, KILLED (Ctrl-C) or FAILED with the error recorded. At the end
    each node's delivery process gets ``tracking.delivery_timeout_s`` to send what is left;
    what the server did not take stays in the spool for ``ddplab sync`` (``run.left``).

    ``signals`` says how an interrupted job ends (``status()``) and, once the ending starts,
    stops further signals from cutting it (``shield()``).
    """
    # MLflow prints its own "View run at <tracking URI>" when a run ends; inside compose or a
    # cluster that is an in-network name the browser cannot open. ddplab prints the run's
    # address itself, in the browser's terms (run._where, DDPLAB_UI_URL).
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    spool_root = Path(cfg.checkpoint.dir) / cfg.name
    # A name a person can tell apart in the runs table (unless tracking.run_name is set).
    default_name = f"{cfg.name} {layout_name(layout)} {le.launcher}"
    delivery = start_delivery(cfg.tracking, le)
    cpu0 = time.process_time()
    try:
        run, ref = open_tracker(cfg.tracking, le, cfg.name, cfg.description, resume_run_id,
                                spool_root, default_name)
        run.open_cpu_s = time.process_time() - cpu0 if le.is_rank0 else 0.0
        delivery.attach(spool.spool_dir(spool_root, ref.run_id, le.node_rank), ref)
    except BaseException:
        delivery.cancel()  # nothing to deliver: it must not outlive the failed job
        raise
    if isinstance(run, MlflowTracker):
        run.open_spool(delivery.directory)
    run.delivery = delivery
    status, error = "FAILED", ""
    try:
        yield run
        status = "FINISHED"
    except BaseException as e:
        # The ending begins here. A signal now (torchrun's SIGTERM once a peer died, just as
        # this rank's own collective failed) would cut this block and leave the run FAILED
        # with no error recorded (seen in CI).
        signals.shield()
        status = signals.status()
        error = ("interrupted (SIGINT / Ctrl-C)" if status == "KILLED"
                 else f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        raise
    finally:
        signals.shield()
        run.finish(status, error)
        run.left = delivery.close()
        if run.left:
            _say_left(run.left, ref.uri, delivery.directory)
        if status != "FINISHED" and not le.is_rank0 and (le.is_node_leader or le.rank == 1):
            # Watched from a detached process: this rank must exit now (see orphan.py).
            if run.run_id:
                from . import orphan

                orphan.start(run.uri, run.run_id, error.split("\n", 1)[0], orphan.GRACE_S)


def layout_name(layout: Any) -> str:
    """One vocabulary for layouts everywhere: nodes x ranks per node x threads per rank, and the
    backend that ran (saying so when it is not the one asked for), e.g. "gloo 1n x 2r x 1t" or
    "gloo (fell back from ccl) 2n x 1r x 2t"."""
    choice, le = layout.choice, layout.le
    backend = f"{choice.name} (fell back from {choice.requested})" if choice.fell_back else choice.name
    return f"{backend} {le.nnodes}n x {le.local_world_size}r x {layout.threads}t"


def _say_left(left: int, uri: str, directory: Path) -> None:
    """The job's last lines: what the server has not taken, why, and where it is kept."""
    run_dir = directory.parent.parent
    refused = spool.rejected_in(directory)
    try:
        last = json.loads((directory / "delivery.json").read_text()).get("error", "")
    except (OSError, ValueError):
        last = ""
    if left > refused:
        print(f"ddplab: warning: the tracking server {uri} did not take {left - refused} records "
              f"within tracking.delivery_timeout_s{f' (last: {last})' if last else ''}; they are "
              f"kept in {directory}: deliver them with `ddplab sync {run_dir}`",
              file=sys.stderr, flush=True)
    if refused:
        print(f"ddplab: warning: the tracking server refused {refused} records as invalid; they "
              f"are kept with its reasons in {directory / spool.REJECTED} (`ddplab sync "
              f"{run_dir}` lists them)", file=sys.stderr, flush=True)
