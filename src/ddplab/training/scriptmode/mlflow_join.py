"""The script's own MLflow calls join the job's one run, whatever pattern the script uses.

child.py calls :func:`install` in the script's process, after the job's ``MLFLOW_RUN_ID`` and
``MLFLOW_TRACKING_URI`` are set and before the script runs. MLflow is not imported for it (that
costs about a second): an import hook patches MLflow when, and if, the script (or a library of
its) imports it, so ``import mlflow`` and ``from mlflow import start_run`` both see the patches.

In a ddplab job, with the job's run in the tracking store the call goes to:

- ``mlflow.set_experiment(name)`` leaves the job's run where it is, creates nothing and does not
  raise: it returns the job run's experiment, and the name asked for becomes the tag
  ``ddplab.script_experiment``;
- ``mlflow.start_run(...)`` (a ``run_name``, an ``experiment_id``, the job's ``run_id``,
  ``nested=True``, or again while the job's run is active) attaches to the job's run: its name
  stays ddplab's, a ``run_name`` becomes the tag ``ddplab.script_run_name``, ``tags`` are set;
- ``mlflow.end_run()`` (and leaving a ``with`` block) only pops the active run: the job's run is
  ended by ddplab, FINISHED or FAILED once every rank has reported;
- ``MlflowClient.create_run(...)`` (Lightning's MLFlowLogger, trackers built on the client)
  returns the job's run, says so in one line on stderr, and ``set_terminated``/``update_run``
  of the job's run keep its status and name;
- a run the script makes through a client of ANOTHER tracking store (``MLFlowLogger(
  tracking_uri="file:./mlruns")``) is made as asked, but linked both ways: it gets the job's run
  id and store as tags, the job's run lists it (``ddplab.script_other_runs``), and one line on
  stderr names it and the fix (leave ``tracking_uri`` out).

Each tag keeps the first value asked for; with several, ``ddplab.script_experiments`` and
``ddplab.script_run_names`` list them all (JSON). Tags and notes come from rank 0's process;
other ranks attach the same way, silently. Anything else (another run's id, another tracking
store, beyond the link) is MLflow's own behaviour.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

from ... import logins
from ...tracking import schema
from ...tracking.naming import users_tag
from .env import report
from .imports import after_import

EXPERIMENT_TAG = schema.SCRIPT_EXPERIMENT
RUN_NAME_TAG = schema.SCRIPT_RUN_NAME
DESCRIPTION_TAG = schema.SCRIPT_RUN_DESCRIPTION
JOINS_OWN = (EXPERIMENT_TAG, RUN_NAME_TAG, DESCRIPTION_TAG, schema.SCRIPT_OTHER_RUNS)
"""The tags this module writes on the job's run itself, through the client it patches."""
NOTE = "ddplab: {library} asked for a new MLflow run; its records go to the job's run {run_id}"
ELSEWHERE = ("ddplab: {library} made its own MLflow run {run_id} in another tracking store ({uri}), "
             "not in the job's run {job}: leave its tracking_uri out (or pass "
             "os.environ['MLFLOW_TRACKING_URI']) for its records to join the job's run")
FLUENT, CLIENT = "mlflow.tracking.fluent", "mlflow.tracking.client"


class _Job:
    """The job's run as this process knows it, and what the script asked for so far."""

    def __init__(self, run_id: str, uri: str, rank0: bool) -> None:
        self.run_id, self.uri, self.rank0 = run_id, uri, rank0
        self.experiment: Any = None  # the job run's Experiment, fetched once
        self.asked: dict[str, list[str]] = {EXPERIMENT_TAG: [], RUN_NAME_TAG: []}
        self.elsewhere: list[dict[str, str]] = []  # runs the script made in other stores
        self.said: set[str] = set()
        self.nested_end = False  # end_run is ending a nested run (joined into the job's)
        self.ended_as = ""  # the status the script ended the job's run with, until it starts one
        self.set_experiment = False  # the script called mlflow.set_experiment
        self.lock = threading.Lock()


_job: _Job | None = None
_patched: set[str] = set()


def install() -> None:
    """Patch MLflow in this process when it is imported (now, if it already is)."""
    global _job
    run_id, uri = os.environ.get("MLFLOW_RUN_ID", ""), os.environ.get("MLFLOW_TRACKING_URI", "")
    if not run_id or not uri or _job is not None:
        return
    _job = _Job(run_id, uri, os.environ.get("RANK", "0") in ("", "0"))
    for name in (CLIENT, FLUENT):  # the client first: fluent's patches use its class
        after_import(name, _PATCHES[name])


# ---- helpers ----

def _same_store(uri: str) -> bool:
    """Whether ``uri`` names the job's tracking store (a local path however it is written)."""
    from ...tracking.store import absolute_store

    return _job is not None and (uri == _job.uri or
                                 absolute_store(uri) == absolute_store(_job.uri))


def _not_ddplabs(key: str) -> str:
    """A tag key for the script's value: one of ddplab's own (``ddplab.mode``, the verdict, the
    lock) is what ddplab recorded, which studies and reproduce read: the script's goes beside
    it (naming.users_tag), said once."""
    kept = users_tag(key, JOINS_OWN)
    if kept != key:
        _say(f"ddplab: tag {key!r} is ddplab's own record: the script's value is kept as "
             f"{kept!r}")
    return kept


def _started_again() -> None:
    """A run started after the script ended one FAILED or KILLED: that was a trial's end (a
    loop of flat trials), not the job's. Not MLflow's own start of a run for a call made with
    none active (``mlflow.set_tag`` after ``end_run(status="FAILED")``, as under plain MLflow,
    opens a new run: the FAILED one stays FAILED)."""
    caller = sys._getframe(2)
    if caller.f_code.co_name == "_get_or_start_run":
        return
    if _job is not None and _job.ended_as:
        report({"asked_status": None})
        _job.ended_as = ""


def _past_a_race(call: Callable[[], Any]) -> Any:
    """A tag written into the job's run, once more when another rank wrote the same key at the
    same moment: MLflow's SQL store reads, then inserts, and the second insert of a key fails
    (UNIQUE constraint). Under plain torchrun each rank had its own run; here they share one."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - MlflowException wraps sqlalchemy's IntegrityError
        if "UNIQUE constraint" not in str(e) and "IntegrityError" not in str(e) and \
                "duplicate key" not in str(e):
            raise
    time.sleep(0.05)
    return call()  # the row is there now: the store updates it


def _called_from(function: str, module: str = "") -> bool:
    """Whether the call into the patched MLflow came, at any depth, from ``function`` (of
    ``module``, when one is named)."""
    frame: FrameType | None = sys._getframe(3)
    while frame is not None:
        if frame.f_code.co_name == function and \
                (not module or frame.f_globals.get("__name__") == module):
            return True
        frame = frame.f_back
    return False


def _in_finalizer() -> bool:
    """Whether the call comes from an object's ``__del__`` (a garbage collector's call)."""
    return _called_from("__del__")


def _left_with_raising() -> bool:
    """Whether MLflow ends the run because an exception leaves its ``with start_run()`` (its
    ActiveRun.__exit__ ends it FAILED): the exception, caught by the script or not, is the
    script's to act on, as under plain MLflow; the job's run ends by how the script ends."""
    return _called_from("__exit__", "mlflow.tracking.fluent")


def _caller_library() -> str:
    """The package that called into MLflow: 'lightning', 'the script', ..."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        top = name.split(".")[0]
        if top not in ("mlflow", "ddplab", "contextlib", "functools", "importlib"):
            return "the script" if name == "__main__" or top == "runpy" else top or "the script"
        frame = frame.f_back
    return "the script"


def _say(line: str, any_rank: bool = False) -> None:
    """One line on stderr, once: rank 0's (the others' would repeat it), or whichever rank it
    concerns (``any_rank``)."""
    if _job is None or not (_job.rank0 or any_rank) or line in _job.said:
        return
    _job.said.add(line)
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def _job_experiment(client: Any) -> Any:
    assert _job is not None
    if _job.experiment is None:
        _job.experiment = client.get_experiment(client.get_run(_job.run_id).info.experiment_id)
    return _job.experiment


def _record(client: Any, tags: dict[str, str], **asked: str | None) -> None:
    """Tags for the job's run (rank 0): the script's own, and the names it asked for."""
    assert _job is not None
    if not _job.rank0:
        return
    out = dict(tags)
    with _job.lock:
        for key, value in ((EXPERIMENT_TAG, asked.get("experiment")),
                           (RUN_NAME_TAG, asked.get("run_name"))):
            seen = _job.asked[key]
            if not value or value in seen:
                continue
            seen.append(str(value))
            if len(seen) == 1:
                out[key] = seen[0]
            else:
                out[key + "s"] = json.dumps(seen)[:5000]
    if not out:
        return
    from mlflow.entities import RunTag

    client.log_batch(_job.run_id, tags=[RunTag(k, str(v)) for k, v in out.items()])


def _link_elsewhere(client: Any, run_id: str) -> None:
    """A run the script made in another store: tagged with the job's run, listed on the job's
    run (rank 0), said once. A store that refuses a tag costs the link, never the script."""
    assert _job is not None
    uri = logins.mask(str(client.tracking_uri))
    with contextlib.suppress(Exception):
        client.set_tag(run_id, schema.JOB_RUN_ID, _job.run_id)
        client.set_tag(run_id, schema.JOB_TRACKING_URI, logins.mask(_job.uri))
    if not _job.rank0:
        return
    with _job.lock:
        first_there = all(e["tracking_uri"] != uri for e in _job.elsewhere)
        _job.elsewhere.append({"tracking_uri": uri, "run_id": run_id})
        # Whole entries, the first ones, as many as a tag holds: always valid JSON.
        kept = list(_job.elsewhere)
        while len(json.dumps(kept)) > 5000:
            kept.pop()
    with contextlib.suppress(Exception):
        type(client)(_job.uri).set_tag(_job.run_id, schema.SCRIPT_OTHER_RUNS, json.dumps(kept))
    if first_there:  # once per store: a search making a run per trial is not a line per trial
        _say(ELSEWHERE.format(library=_caller_library(), run_id=run_id, uri=uri, job=_job.run_id))


def _experiment_name(client: Any, experiment_id: Any) -> str | None:
    """The name of an experiment the script named by id, when it is not the job's; none named:
    the one ``MLFLOW_EXPERIMENT_NAME``/``_ID`` names, where MLflow would start the run."""
    if experiment_id is None and _job is not None and not _job.set_experiment:
        # (MLflow's order: set_experiment's, then MLFLOW_EXPERIMENT_NAME's, then _ID's)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        experiment_id = None if name else os.environ.get("MLFLOW_EXPERIMENT_ID")
        if name and name != _job_experiment(client).name:
            _say(f"ddplab: MLFLOW_EXPERIMENT_NAME={name} keeps the job's run in experiment "
                 f"{_job_experiment(client).name!r} (tag {EXPERIMENT_TAG}); --set "
                 f"tracking.experiment={name} files the job there")
            return name
    if experiment_id is None or str(experiment_id) == _job_experiment(client).experiment_id:
        return None
    try:
        return str(client.get_experiment(str(experiment_id)).name)
    except Exception:  # noqa: BLE001 - a missing experiment: the id is what the script asked for
        return f"id {experiment_id}"


def _script_tags(tags: dict[str, Any] | None) -> tuple[dict[str, str], str | None, str | None]:
    """A new run's tags split: the script's own, its run name and description; MLflow's
    system tags (source, user, git: ddplab's own are on the job's run) are left out."""
    own, name, note = {}, None, None
    for key, value in (tags or {}).items():
        if key == "mlflow.runName":
            name = str(value)
        elif key == "mlflow.note.content":
            note = str(value)
        elif not str(key).startswith("mlflow."):
            own[str(key)] = str(value)
    return own, name, note


# ---- MlflowClient ----

def _patch_client(module: ModuleType) -> None:
    if CLIENT in _patched:
        return
    _patched.add(CLIENT)
    cls = module.MlflowClient
    create_run, set_terminated, update_run = cls.create_run, cls.set_terminated, cls.update_run
    log_param, log_batch, set_tag = cls.log_param, cls.log_batch, cls.set_tag

    def joined(self: Any) -> bool:
        return _job is not None and _same_store(self.tracking_uri)

    def create_run_joined(self: Any, experiment_id: str, start_time: int | None = None,
                          tags: dict[str, Any] | None = None, run_name: str | None = None) -> Any:
        if not joined(self):
            run = create_run(self, experiment_id, start_time=start_time, tags=tags,
                             run_name=run_name)
            if _job is not None:
                _link_elsewhere(self, run.info.run_id)
            return run
        assert _job is not None
        _started_again()
        own, name, note = _script_tags(tags)
        if note:
            own[DESCRIPTION_TAG] = note
        _record(self, own, experiment=_experiment_name(self, experiment_id),
                run_name=run_name or name)
        _say(NOTE.format(library=_caller_library(), run_id=_job.run_id))
        return self.get_run(_job.run_id)

    def set_terminated_joined(self: Any, run_id: str, status: str | None = None,
                              end_time: int | None = None) -> None:
        if _job is None or run_id != _job.run_id:
            set_terminated(self, run_id, status=status, end_time=end_time)  # MLflow's: None
            return None
        if status in ("FAILED", "KILLED") and not _job.nested_end and not _left_with_raising():
            # the script's verdict on its run, as it leaves its outermost one: the run's end
            # (a failed trial's nested `with start_run(nested=True)` is not the job's), until
            # it starts one again (a loop of flat trials)
            report({"asked_status": status})
            _job.ended_as = status
            _say(ASKED.format(library=_caller_library(), status=status), any_rank=True)
        # ddplab ends the job's run once every rank has reported; what was logged
        # asynchronously is sent now, as MLflow's own end of a run would.
        with contextlib.suppress(Exception):
            self._tracking_client.store.flush_async_logging()
        return None

    def update_run_joined(self: Any, run_id: str, status: str | None = None,
                          name: str | None = None) -> None:
        if _job is None or run_id != _job.run_id:
            update_run(self, run_id, status=status, name=name)  # MLflow's: None
            return None
        if name:
            _record(self, {}, run_name=name)
        return None

    def ours(self: Any, run_id: str) -> bool:
        return joined(self) and _job is not None and run_id == _job.run_id

    def log_param_joined(self: Any, run_id: str, key: str, value: Any,
                         synchronous: bool | None = None) -> Any:
        if not ours(self, run_id):
            return log_param(self, run_id, key, value, synchronous=synchronous)
        from mlflow.entities import Param

        sync = _synchronous(synchronous)
        sent = _unclashed(self, [Param(str(key), str(value))],
                          lambda ps: log_batch(self, run_id, params=ps, synchronous=sync))
        return value if sync else sent  # as MLflow's: the value, or its operations

    def log_batch_joined(self: Any, run_id: str, metrics: Any = (), params: Any = (),
                         tags: Any = (), synchronous: bool | None = None) -> Any:
        if not ours(self, run_id):
            return log_batch(self, run_id, metrics, params, tags, synchronous=synchronous)
        from mlflow.entities import RunTag

        tags = [RunTag(_not_ddplabs(t.key), t.value) for t in tags or ()]
        names = [t.value for t in tags if t.key == "mlflow.runName"]
        if names:  # the job's run keeps ddplab's name: the script's becomes a tag
            _record(self, {}, run_name=str(names[-1]))
            tags = [t for t in tags if t.key != "mlflow.runName"]
        sync = _synchronous(synchronous)
        sent = []
        if params:
            sent.append(_unclashed(self, list(params), lambda ps: log_batch(
                self, run_id, params=ps, synchronous=sync)))
        if metrics or tags:
            sent.append(_past_a_race(lambda: log_batch(self, run_id, metrics, (), tags,
                                                       synchronous=sync)))
        return None if sync else _operations(sent)

    def set_tag_joined(self: Any, run_id: str, key: str, value: Any, *args: Any,
                       **kwargs: Any) -> Any:
        if key == "mlflow.runName" and ours(self, run_id):
            _record(self, {}, run_name=str(value))
            return None if _synchronous(kwargs.get("synchronous", args[0] if args else None)) \
                else _operations([])
        if not ours(self, run_id):
            return set_tag(self, run_id, key, value, *args, **kwargs)
        key = _not_ddplabs(str(key))
        return _past_a_race(lambda: set_tag(self, run_id, key, value, *args, **kwargs))

    _swap(cls, create_run, create_run_joined)
    _swap(cls, set_terminated, set_terminated_joined)
    _swap(cls, update_run, update_run_joined)
    _swap(cls, log_param, log_param_joined)
    _swap(cls, log_batch, log_batch_joined)
    _swap(cls, set_tag, set_tag_joined)


ASKED = ("ddplab: {library} ended the job's run {status} (mlflow.end_run(status='{status}')): "
         "it ends {status} with the job")
CLASH = ("ddplab: param {key!r} was logged to the job's run already with another value (the job's "
         "one run holds every rank's and every nested run's records; MLflow keeps a param's "
         "first value): {value!r} kept as {kept!r}")


def _synchronous(asked: bool | None) -> bool:
    """A log call's ``synchronous`` as MLflow resolves it (None: MLFLOW_ENABLE_ASYNC_LOGGING)."""
    if asked is not None:
        return bool(asked)
    from mlflow.environment_variables import MLFLOW_ENABLE_ASYNC_LOGGING

    return not MLFLOW_ENABLE_ASYNC_LOGGING.get()


def _operations(sent: list[Any]) -> Any:
    """An asynchronous call's answer: every part's operations as one (MLflow's RunOperations)."""
    from mlflow.utils.async_logging.run_operations import RunOperations, get_combined_run_operations

    parts = [s for s in sent if isinstance(s, RunOperations)]
    return get_combined_run_operations(parts) if parts else RunOperations([])


def _unclashed(client: Any, params: list[Any], send: Callable[[list[Any]], Any]) -> Any:
    """The script's params sent to the job's run, each one whose key holds another value there
    already (another rank's ``local_rank``, a nested run's ``lr``, a key of ddplab's) under
    ``KEY.2``, ``KEY.3``... instead, said once per key: where plain torchrun made a run per rank
    or per nested run, MLflow would refuse the change and end the script. A rank racing others
    for the same key tries again with what the run holds then (each race has one winner: as
    many tries as ranks)."""
    from mlflow.entities import Param

    assert _job is not None
    world = os.environ.get("WORLD_SIZE", "")
    tries = int(world) + 2 if world.isdigit() else 3
    for attempt in range(tries):
        held = dict(client.get_run(_job.run_id).data.params)
        kept: list[Any] = []
        for p in params:
            key, value, n = str(p.key), str(p.value), 1
            while key in held and held[key] != value:
                n += 1
                key = f"{p.key}.{n}"
            if key != p.key:
                _say(CLASH.format(key=p.key, value=value[:100], kept=key), any_rank=True)
            held[key] = value
            kept.append(Param(key, value))
        try:
            return send(kept)
        except Exception:  # MLflow's refusal, or a store's unique key another rank took first
            if attempt == tries - 1:
                raise
    return None


# ---- the fluent API (mlflow.start_run, ...) ----

def _patch_fluent(fluent: ModuleType) -> None:
    if FLUENT in _patched:
        return
    _patched.add(FLUENT)
    start_run, end_run, set_experiment = fluent.start_run, fluent.end_run, fluent.set_experiment
    start_sig = inspect.signature(start_run)

    def store_uri() -> str:
        from mlflow.tracking._tracking_service.utils import get_tracking_uri

        return str(get_tracking_uri())

    def stack() -> list[Any]:
        runs: list[Any] = fluent._active_run_stack.get()
        return runs

    def set_experiment_joined(experiment_name: str | None = None, experiment_id: str | None = None,
                              *args: Any, **kwargs: Any) -> Any:
        if _job is None or args or kwargs.get("trace_location") is not None or \
                (experiment_name is None) == (experiment_id is None) or \
                not _same_store(store_uri()):
            return set_experiment(experiment_name, experiment_id, *args, **kwargs)
        client = fluent.MlflowClient()
        _job.set_experiment = True
        experiment = _job_experiment(client)
        asked = experiment_name if experiment_name is not None else \
            _experiment_name(client, experiment_id)
        if asked and asked != experiment.name:
            _record(client, {}, experiment=asked)
            _say(f"ddplab: mlflow.set_experiment({asked!r}) keeps the job's run in experiment "
                 f"{experiment.name!r} (tag {EXPERIMENT_TAG}); --set tracking.experiment="
                 f"{asked} files the job there")
        setattr(fluent, "_active_experiment_id", experiment.experiment_id)  # noqa: B010
        return experiment

    def start_run_joined(*args: Any, **kwargs: Any) -> Any:
        try:
            call = start_sig.bind(*args, **kwargs)
        except TypeError:
            return start_run(*args, **kwargs)
        a = call.arguments
        active = stack()
        if _job is None or a.get("run_id") not in (None, "", _job.run_id) or \
                a.get("parent_run_id") not in (None, "", _job.run_id) or \
                (active and active[-1].info.run_id != _job.run_id) or \
                not _same_store(store_uri()):
            if a.get("run_id") or _same_store(store_uri()):
                return start_run(*args, **kwargs)  # another run: MLflow's own behaviour
            with _job_run_unset():  # (MLflow would resume the job's run id in that store)
                return start_run(*args, **kwargs)
        client = fluent.MlflowClient()
        _started_again()
        own, name, note = _script_tags(a.get("tags"))
        if a.get("description") or note:
            own[DESCRIPTION_TAG] = str(a.get("description") or note)
        _record(client, own, experiment=_experiment_name(client, a.get("experiment_id")),
                run_name=a.get("run_name") or name)
        run = fluent.ActiveRun(client.get_run(_job.run_id))
        active.append(run)
        return run

    def end_run_joined(*args: Any, **kwargs: Any) -> None:
        active = stack()
        ours = _job is not None and bool(active) and active[-1].info.run_id == _job.run_id
        if ours and _in_finalizer():
            # A library's __del__ ending whatever run is active (Hugging Face's MLflowCallback,
            # which MLFLOW_RUN_ID made start one): the script's own `with start_run()` stays.
            return None
        if ours and _job is not None:
            _job.nested_end = sum(r.info.run_id == _job.run_id for r in active) > 1
        try:
            end_run(*args, **kwargs)  # pops it; set_terminated of the job's run is patched away
        finally:
            if _job is not None:
                _job.nested_end = False
        if ours and _job is not None:
            # MLflow forgets MLFLOW_RUN_ID when a run ends; the job goes on (subprocesses of
            # the script still attach to its run).
            os.environ["MLFLOW_RUN_ID"] = _job.run_id

    package = sys.modules.get("mlflow")  # MLflow imported before install(): its names too
    for name, new in (("set_experiment", set_experiment_joined), ("start_run", start_run_joined),
                      ("end_run", end_run_joined)):
        old = getattr(fluent, name)
        _swap(fluent, old, new)
        if package is not None and getattr(package, name, None) is old:
            setattr(package, name, new)


@contextlib.contextmanager
def _job_run_unset() -> Any:
    """MLFLOW_RUN_ID out of the environment meanwhile: a run the script starts in another
    store is a new run there, as under plain torchrun."""
    value = os.environ.pop("MLFLOW_RUN_ID", None)
    try:
        yield
    finally:
        if value is not None:
            os.environ["MLFLOW_RUN_ID"] = value


def _swap(owner: Any, old: Any, new: Any) -> None:
    """``new`` in place of ``old`` on ``owner``, looking like it (name, doc, __wrapped__)."""
    functools.update_wrapper(new, old)
    setattr(owner, old.__name__, new)


_PATCHES: dict[str, Callable[[ModuleType], None]] = {CLIENT: _patch_client, FLUENT: _patch_fluent}
