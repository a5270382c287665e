"""``ddplab import``: runs recorded on another machine, into this store. A machine without a
network (the GPU proof kit's) keeps its runs in an embedded store; its archive (store/mlflow.db
and mlruns/, as benchmarks/gpu_proof.py packs them) comes home as a file, and this copies every
run into the local store: params, tags, every metric's whole history, the status and times,
the artifacts, and a study's parent/child links. MLflow has no import of its own (its
mlflow-export-import is a separate tool); the client's own calls do it here.

The archive is someone else's, so nothing in it is trusted (import_source.py reads it: sizes
checked before unpacking, no link followed, artifact locations kept inside its own mlruns/).

Each run comes whole or not at all: it is created tagged ``ddplab.import_incomplete``, which
goes only once everything (its status last) is in; a run whose copy fails or is interrupted is
deleted on the spot, and one left behind anyway (the process killed) is replaced by the next
import. Idempotent: each copy is tagged ``ddplab.imported_from`` with the source run's id (and
``ddplab.imported_origin`` with the first store's); a run is skipped when its id, or the run it
was imported from, is already in this store, so a second import, or a store into itself, adds
nothing. A run still RUNNING where it came from (nothing will ever end the copy) comes in KILLED,
tagged ``ddplab.imported_status=RUNNING``.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DdplabError
from ..log import logger
from . import life, schema
from .import_source import (
    OUTSIDE,
    ArchiveError,
    Source,
    artifact_folder,
    find,
    first_line,
    open_source,
    shown,
    stage,
)
from .opening import get_or_create_experiment
from .store import check_reachable

__all__ = ["ArchiveError", "ImportFailed", "import_runs"]

MARK = schema.IMPORTED_FROM
ORIGIN = schema.IMPORTED_ORIGIN
INCOMPLETE = schema.IMPORT_INCOMPLETE
WAS = schema.IMPORTED_STATUS
OURS = (MARK, ORIGIN, INCOMPLETE, WAS)
SKIP_TAGS = ("mlflow.parentRunId", "mlflow.rootRunId")  # remapped to the new ids
ENDED = ("FINISHED", "FAILED", "KILLED")
BATCH_TAGS, BATCH_METRICS = schema.BATCH_TAGS, schema.BATCH_METRICS


class ImportFailed(DdplabError):
    """Some runs could not be copied (each named in a warning line); the others were."""


@dataclass
class Tally:
    imported: int = 0
    skipped: int = 0
    running: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def import_runs(source: str, dest_uri: str) -> tuple[int, int]:
    """(imported, skipped) runs from ``source`` (a .tar.gz, or a folder with store/mlflow.db)."""
    path = Path(source)
    if not path.exists():
        raise ArchiveError(f"{shown(source)}: no such file or folder (give the store "
                           "archive benchmarks/gpu_proof.py wrote, store.tar.gz, or its folder)")
    if path.is_dir() and _same_file(find(path, "mlflow.db", folder=False), dest_uri):
        logger("import").warning(f"{shown(source)} holds this store itself ({dest_uri}): nothing "
                                 "to import")
        return 0, 0
    with tempfile.TemporaryDirectory(prefix="ddplab-import-") as tmp:
        src = open_source(path, Path(tmp))
        if src.links:
            logger("import").warning(f"{shown(source)}: {src.links} link(s) or device file(s) left "
                                     "out (ddplab import follows no link)")
        return _copy(src, dest_uri, source, Path(tmp))


def _same_file(db: Path | None, uri: str) -> bool:
    if db is None or not uri.startswith("sqlite:///"):
        return False
    target = Path(uri[len("sqlite:///"):].split("?", 1)[0])
    try:
        return target.exists() and db.samefile(target)
    except OSError:
        return False


def _copy(source: Source, dest_uri: str, name: str, tmp: Path) -> tuple[int, int]:
    from mlflow.tracking import MlflowClient

    log = logger("import")
    try:
        src = MlflowClient(f"sqlite:///{source.db}")
        runs = [r for e in _experiments(src) for r in _all_runs(src, e.experiment_id)]
    except Exception as e:  # noqa: BLE001 - a store MLflow cannot read, in one line
        raise ArchiveError(f"{shown(name)}: its store cannot be read ({first_line(e)})") from None
    unreachable = check_reachable(dest_uri)  # at once, not after MLflow's minutes of retries
    if unreachable:
        raise DdplabError(f"{unreachable}; nothing was imported")
    try:
        dst = MlflowClient(dest_uri)
        here = [r for e in _experiments(dst) for r in _all_runs(dst, e.experiment_id)]
    except Exception as e:  # noqa: BLE001 - the store to import into, in one line
        raise DdplabError(f"{dest_uri}: cannot be read ({first_line(e)})") from None
    ids = {r.info.run_id for r in runs}
    stale = [r for r in here if r.data.tags.get(MARK) in ids
             and (INCOMPLETE in r.data.tags or r.info.status not in ENDED)]
    for r in stale:  # left by an import that was killed (or by an older ddplab): replaced
        try:
            dst.delete_run(r.info.run_id)
        except Exception as e:  # noqa: BLE001 - the store's refusal, in one line
            raise DdplabError(f"{dest_uri}: the part copy {r.info.run_id} an earlier import left "
                              f"could not be deleted ({first_line(e)}); nothing was imported") from None
    if stale:
        log.warning(f"{len(stale)} run(s) an earlier import left incomplete "
                    f"({', '.join(r.info.run_id[:8] for r in stale)}): deleted, imported again")
    gone = {r.info.run_id for r in stale}
    known: dict[str, str] = {}  # any id a run here answers to -> its id here
    for r in here:
        if r.info.run_id not in gone:
            for key in (r.info.run_id, r.data.tags.get(MARK), r.data.tags.get(ORIGIN)):
                if key:
                    known[key] = r.info.run_id
    todo, tally = [], Tally()
    for run in _parents_first(runs):
        if _identities(run) & known.keys():
            known[run.info.run_id] = next(known[i] for i in _identities(run) if i in known)
            tally.skipped += 1
        elif INCOMPLETE in run.data.tags:
            log.warning(f"run {_named(run)} is itself a half-made import in {shown(name)}: not imported")
        else:
            todo.append(run)
    _check_experiments(src, dst, todo, dest_uri)
    experiments: dict[str, str] = {}
    for run in todo:
        parent = run.data.tags.get("mlflow.parentRunId")
        if parent and parent in ids and parent not in known:
            log.warning(f"run {_named(run)} not imported: its parent run {parent[:8]} was not")
            tally.failed.append(run.info.run_id)
            continue
        try:
            known[run.info.run_id] = _copy_run(src, dst, run, known, source, experiments, tmp, tally)
        except KeyboardInterrupt:
            log.warning(f"interrupted: run {_named(run)} was not imported (its part copy is deleted); "
                        f"{tally.imported} run(s) were; the same command again imports the rest")
            raise
        except Exception as e:  # noqa: BLE001 - the store refused this run: the others still come
            log.warning(f"run {_named(run)} not imported: {first_line(e)}")
            tally.failed.append(run.info.run_id)
            continue
        tally.imported += 1
    if tally.running:
        log.warning(f"{len(tally.running)} run(s) were still RUNNING where they came from "
                    f"({', '.join(r[:8] for r in tally.running)}): imported as KILLED, tagged {WAS}=RUNNING")
    if tally.failed:
        raise ImportFailed(f"{len(tally.failed)} run(s) not imported (named above); {tally.imported} "
                           f"imported into {dest_uri}, {tally.skipped} already there")
    return tally.imported, tally.skipped


def _identities(run: Any) -> set[str]:
    return {i for i in (run.info.run_id, run.data.tags.get(MARK), run.data.tags.get(ORIGIN)) if i}


def _named(run: Any) -> str:
    return f"{run.info.run_id[:8]} ({shown(run.info.run_name, 60)})"


def _parents_first(runs: list[Any]) -> list[Any]:
    """A study's parent before its children, so that a child can name its parent's new id."""
    parent = {r.info.run_id: r.data.tags.get("mlflow.parentRunId") for r in runs}

    def depth(run_id: str) -> int:
        seen = {run_id}
        while (run_id := parent.get(run_id) or "") in parent and run_id not in seen:
            seen.add(run_id)
        return len(seen)

    return sorted(runs, key=lambda r: depth(r.info.run_id))


def _check_experiments(src: Any, dst: Any, runs: list[Any], dest_uri: str) -> None:
    """Refuse, before any run is copied, an experiment deleted in this store (MLflow would
    refuse each run in it: "must be in the active state")."""
    for exp_id in sorted({r.info.experiment_id for r in runs}):
        found = dst.get_experiment_by_name(src.get_experiment(exp_id).name)
        if found is not None and found.lifecycle_stage != "active":
            raise DdplabError(
                f"experiment {shown(found.name, 60)!r} was deleted in {dest_uri} (id {found.experiment_id}): "
                f"restore it (mlflow experiments restore --experiment-id {found.experiment_id}) or "
                "delete it for good (mlflow gc), then import again; nothing was imported")


def _experiments(client: Any) -> list[Any]:
    out, token = [], None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        out.extend(page)
        token = page.token
        if not token:
            return out


def _all_runs(client: Any, experiment_id: str) -> list[Any]:
    out, token = [], None
    while True:
        page = client.search_runs([experiment_id], max_results=1000, page_token=token)
        out.extend(page)
        token = page.token
        if not token:
            return out


def _copy_run(src: Any, dst: Any, run: Any, known: dict[str, str], source: Source,
              experiments: dict[str, str], tmp: Path, tally: Tally) -> str:
    """Copy one run whole, or leave none: a failure or Ctrl-C deletes the part copy."""
    experiment = src.get_experiment(run.info.experiment_id).name
    if experiment not in experiments:
        experiments[experiment] = get_or_create_experiment(dst, experiment)
    ours = {MARK: run.info.run_id, ORIGIN: run.data.tags.get(ORIGIN) or run.data.tags.get(MARK)
            or run.info.run_id, INCOMPLETE: "an import is copying this run; ddplab import replaces it"}
    new: str = life.create(dst, experiments[experiment], run.info.run_name, ours,
                           start_time=run.info.start_time, made_here=False).info.run_id
    try:
        _fill(src, dst, run, new, known, source, tmp, tally)
    except BaseException:
        with _uninterrupted():
            try:
                dst.delete_run(new)
            except Exception:  # noqa: BLE001 - its incomplete tag has the next import replace it
                pass
        raise
    return new


def _fill(src: Any, dst: Any, run: Any, new: str, known: dict[str, str], source: Source,
          tmp: Path, tally: Tally) -> None:
    from mlflow.entities import Metric, Param, RunTag

    tags = [RunTag(k, v) for k, v in run.data.tags.items() if k not in SKIP_TAGS + OURS]
    parent = run.data.tags.get("mlflow.parentRunId")
    if parent in known:
        tags.append(RunTag("mlflow.parentRunId", known[parent]))
    status, end = run.info.status, run.info.end_time
    metrics = [Metric(m.key, m.value, m.timestamp, m.step)
               for key in run.data.metrics for m in src.get_metric_history(run.info.run_id, key)]
    if status not in ENDED:
        tags.append(RunTag(WAS, status))
        if schema.ERROR not in run.data.tags:
            tags.append(RunTag(schema.ERROR, f"still {status} where it came from when its store "
                                             "was archived: imported KILLED"))
        status = "KILLED"
        end = end or max([m.timestamp for m in metrics] + [run.info.start_time or 0]) or None
        tally.running.append(run.info.run_id)
    params = [Param(k, v) for k, v in run.data.params.items()]
    for i in range(0, len(tags), BATCH_TAGS):
        dst.log_batch(new, tags=tags[i:i + BATCH_TAGS])
    for i in range(0, len(params), BATCH_TAGS):
        dst.log_batch(new, params=params[i:i + BATCH_TAGS])
    for i in range(0, len(metrics), BATCH_METRICS):
        dst.log_batch(new, metrics=metrics[i:i + BATCH_METRICS])
    _copy_artifacts(dst, run, new, source, tmp)
    life.end(dst, new, status, end_time=end)
    dst.delete_tag(new, INCOMPLETE)  # last: from here the copy is whole


def _copy_artifacts(dst: Any, run: Any, new: str, source: Source, tmp: Path) -> None:
    """The run's artifacts, from its folder inside the source's mlruns/ only: plain files, no
    link followed."""
    folder = artifact_folder(run.info.artifact_uri or "", source.artifacts)
    if folder == OUTSIDE:
        logger("import").warning(f"run {_named(run)}: its artifact location "
                                 f"{shown(run.info.artifact_uri)!r} leads out of the archive's "
                                 "mlruns/: its artifacts were not imported")
        return
    if folder is None or source.artifacts is None:
        return
    staged = Path(tempfile.mkdtemp(prefix="artifacts-", dir=tmp))
    try:
        copied, left = stage(folder, source.artifacts, staged)
        if left:
            logger("import").warning(f"run {_named(run)}: {left} link(s) or special file(s) among its "
                                     "artifacts left out (ddplab import follows no link)")
        if copied:
            dst.log_artifacts(new, str(staged))
    finally:
        shutil.rmtree(staged, ignore_errors=True)


@contextmanager
def _uninterrupted() -> Iterator[None]:
    """A second Ctrl-C does not cut the clean-up of the first short."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGINT, before)
