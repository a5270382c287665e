"""``ddplab import``: runs recorded on another machine, into this store. A machine without a
network (the GPU proof kit's) keeps its runs in an embedded store; its archive (store/mlflow.db
and mlruns/, as benchmarks/gpu_proof.py packs them) comes home as a file, and this copies every
run into the local store: params, tags, every metric's whole history, the status and times,
the artifacts, and a study's parent/child links. MLflow has no import of its own (its
mlflow-export-import is a separate tool); the client's own calls do it here.

Idempotent: each copy is tagged ``ddplab.imported_from`` with the source run's id, and a run
already imported is skipped, so a second import of the same archive adds nothing.
"""

from __future__ import annotations

import tarfile
import tempfile
from pathlib import Path
from typing import Any

from ..errors import DdplabError

MARK = "ddplab.imported_from"
SKIP_TAGS = ("mlflow.parentRunId", "mlflow.rootRunId")  # remapped to the new ids


class ArchiveError(DdplabError):
    """An archive or store that cannot be read; one line."""


def import_runs(source: str, dest_uri: str) -> tuple[int, int]:
    """(imported, skipped) runs from ``source`` (a .tar.gz, or a folder with store/mlflow.db)."""
    path = Path(source)
    if not path.exists():
        raise ArchiveError(f"{source}: no such file or folder (give the store "
                           "archive benchmarks/gpu_proof.py wrote, store.tar.gz, or its folder)")
    with tempfile.TemporaryDirectory(prefix="ddplab-import-") as tmp:
        root = _unpack(path, Path(tmp)) if path.is_file() else path
        db = next(iter(sorted(root.rglob("mlflow.db"))), None)
        if db is None:
            raise ArchiveError(f"{source}: holds no mlflow.db (an embedded store)")
        return _copy(f"sqlite:///{db}", dest_uri, _artifact_root(root))


def _unpack(archive: Path, into: Path) -> Path:
    try:
        with tarfile.open(archive) as t:
            t.extractall(into, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise ArchiveError(f"{archive}: not a readable archive ({e})") from None
    return into


def _artifact_root(root: Path) -> Path | None:
    found = sorted(p for p in root.rglob("mlruns") if p.is_dir())
    return found[0] if found else None


def _copy(src_uri: str, dest_uri: str, artifacts: Path | None) -> tuple[int, int]:
    from mlflow.tracking import MlflowClient

    src, dst = MlflowClient(src_uri), MlflowClient(dest_uri)
    runs = [r for e in src.search_experiments() for r in _all_runs(src, e.experiment_id)]
    # parents first, so a child can name its parent's new id
    runs.sort(key=lambda r: "mlflow.parentRunId" in r.data.tags)
    done = {r.data.tags[MARK]: r.info.run_id for e in dst.search_experiments()
            for r in _all_runs(dst, e.experiment_id) if MARK in r.data.tags}
    imported = skipped = 0
    for run in runs:
        if run.info.run_id in done:
            skipped += 1
            continue
        done[run.info.run_id] = _copy_run(src, dst, run, done, artifacts)
        imported += 1
    return imported, skipped


def _all_runs(client: Any, experiment_id: str) -> list[Any]:
    out, token = [], None
    while True:
        page = client.search_runs([experiment_id], max_results=1000, page_token=token)
        out.extend(page)
        token = page.token
        if not token:
            return out


def _copy_run(src: Any, dst: Any, run: Any, ids: dict[str, str], artifacts: Path | None) -> str:
    from mlflow.entities import Metric, Param

    experiment = src.get_experiment(run.info.experiment_id).name
    found = dst.get_experiment_by_name(experiment)
    exp_id = found.experiment_id if found else dst.create_experiment(experiment)
    tags = {k: v for k, v in run.data.tags.items() if k not in SKIP_TAGS}
    parent = run.data.tags.get("mlflow.parentRunId")
    if parent in ids:
        tags["mlflow.parentRunId"] = ids[parent]
    tags[MARK] = run.info.run_id
    new = dst.create_run(exp_id, start_time=run.info.start_time, tags=tags,
                         run_name=run.info.run_name).info.run_id
    dst.log_batch(new, params=[Param(k, v) for k, v in run.data.params.items()])
    metrics = [Metric(m.key, m.value, m.timestamp, m.step)
               for key in run.data.metrics for m in src.get_metric_history(run.info.run_id, key)]
    for i in range(0, len(metrics), 1000):  # MLflow's log_batch limit
        dst.log_batch(new, metrics=metrics[i:i + 1000])
    folder = _run_artifacts(run, artifacts)
    if folder is not None:
        dst.log_artifacts(new, str(folder))
    dst.set_terminated(new, status=run.info.status, end_time=run.info.end_time)
    return new


def _run_artifacts(run: Any, artifacts: Path | None) -> Path | None:
    """The run's artifact folder inside the archive: its recorded URI pointed into another
    machine's mlruns/ (``file:///tmp/proof/work/mlruns/<exp>/<run>/artifacts``)."""
    uri = run.info.artifact_uri or ""
    if artifacts is None or "mlruns/" not in uri:
        return None
    folder = artifacts / uri.split("mlruns/", 1)[1]
    return folder if folder.is_dir() and any(folder.iterdir()) else None
