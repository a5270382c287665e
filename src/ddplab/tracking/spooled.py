"""The records of a run that no job writes (a study's parent, a benchmark's run, a
reproduction's verdict) through a spool, as a job's go: an outage loses none of them.

``SpooledClient`` is MLflow's client for everything but writing to its one run: those calls
(tags, params, metrics, texts, artifacts, its end) become spool records in ``folder``
(spool.py: the same records, sender and ``ddplab sync`` as a job's), sent by ``deliver()``.
What the server does not take within its bound stays in the folder, and ``ddplab sync FOLDER``
(or ``ddplab sync`` of the checkpoints folder that holds it) sends it later. Calls about any
other run, and every read, go to the server as they are.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

from . import life, spool
from .schema import BATCH_PARAMS, BATCH_TAGS, PARAM_LIMIT, TAG_LIMIT

#: How long the end of a benchmark or reproduction goes on sending its run's records to a
#: server that does not answer; what is left stays for ``ddplab sync``. (A study's parent takes
#: its jobs' ``tracking.delivery_timeout_s``: Study.delivery_timeout_s.)
DELIVERY_S = 30.0

#: Where a run that no job writes keeps its spool until the server has it all:
#: ``checkpoints/<kind>/<run id>/spool/run/``, found by ``ddplab sync`` of ``checkpoints``.
ROOT = Path("checkpoints")


def home(kind: str, run_id: str) -> Path:
    return ROOT / kind / run_id


def folder(home: Path) -> Path:
    """The spool folder under a run's ``home``."""
    return home / "spool" / "run"


class SpooledClient:
    """``client``, with ``run_id``'s records through the spool kept under ``home``
    (``home/spool/run``)."""

    def __init__(self, client: Any, uri: str, run_id: str, experiment_id: str,
                 home: Path) -> None:
        self.client, self.run_id, self.home = client, run_id, home
        self.folder = folder(home)
        spool.Meta(uri, run_id, experiment_id).write(self.folder)
        self.records = spool.Stream(self.folder, "records")
        self.kept = 0

    def __getattr__(self, name: str) -> Any:  # reads, and writes about other runs
        return getattr(self.client, name)

    # ---- the run's records ----

    def _append(self, record: dict[str, Any]) -> None:
        self.records.append({"ts": spool.now_ms(), **record})

    def set_tag(self, run_id: str, key: str, value: Any) -> None:
        if run_id != self.run_id:
            self.client.set_tag(run_id, key, value)
            return
        self._append({"op": "log", "tags": {key: str(value)[:TAG_LIMIT]}})

    def log_param(self, run_id: str, key: str, value: Any) -> None:
        if run_id != self.run_id:
            self.client.log_param(run_id, key, value)
            return
        self._append({"op": "log", "params": {key: str(value)[:PARAM_LIMIT]}})

    def log_metric(self, run_id: str, key: str, value: float, timestamp: int | None = None,
                   step: int | None = None) -> None:
        if run_id != self.run_id:
            self.client.log_metric(run_id, key, value, timestamp=timestamp, step=step)
            return
        self._append({"op": "log", "step": step or 0, "metrics": {key: float(value)}})

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = (),
                  synchronous: bool | None = None) -> None:
        if run_id != self.run_id:
            self.client.log_batch(run_id, metrics=list(metrics), params=list(params),
                                  tags=list(tags))
            return
        for m in metrics:  # each its own time and step; the sender batches them again
            self._append({"op": "log", "ts": int(m.timestamp), "step": int(m.step),
                          "metrics": {m.key: float(m.value)}})
        for i in range(0, len(params), BATCH_PARAMS):
            self._append({"op": "log", "params": {p.key: str(p.value)[:PARAM_LIMIT]
                                                  for p in params[i:i + BATCH_PARAMS]}})
        for i in range(0, len(tags), BATCH_TAGS):
            self._append({"op": "log", "tags": {t.key: str(t.value)[:TAG_LIMIT]
                                                for t in tags[i:i + BATCH_TAGS]}})

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        if run_id != self.run_id:
            self.client.log_text(run_id, text, artifact_file)
            return
        self._append({"op": "text", "name": artifact_file, "text": text})

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        if run_id != self.run_id:
            self.client.log_artifact(run_id, local_path, artifact_path)
            return
        # A copy in a folder of its own (the original may be temporary; the name is kept).
        self.kept += 1
        into = self.folder / "files" / str(self.kept)
        into.mkdir(parents=True, exist_ok=True)
        kept = shutil.copy2(local_path, into / Path(local_path).name)
        self._append({"op": "file", "path": str(Path(kept).resolve()), "dir": artifact_path})

    def log_artifacts(self, run_id: str, local_dir: str, artifact_path: str | None = None) -> None:
        if run_id != self.run_id:
            self.client.log_artifacts(run_id, local_dir, artifact_path)
            return
        root = Path(local_dir)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            sub = path.parent.relative_to(root).as_posix()
            where = "/".join(x for x in (artifact_path or "", "" if sub == "." else sub) if x)
            self.log_artifact(run_id, str(path), where or None)

    def set_terminated(self, run_id: str, status: str | None = None,
                       end_time: int | None = None) -> None:
        if run_id != self.run_id:
            life.end(self.client, run_id, status or life.FINISHED, end_time=end_time)
            return
        self._append({"op": "end", "status": status or "FINISHED",
                      **({"ts": end_time} if end_time else {})})

    # ---- sending ----

    def deliver(self, timeout_s: float) -> spool.Outcome:
        """Send what is in the spool, for at most ``timeout_s`` after the first failure; what
        is left stays for ``ddplab sync``."""
        return spool.deliver(self.folder, self.client, lambda: False, timeout_s, final=True)

    def close(self, timeout_s: float) -> str:
        """The last delivery. All sent: the spool is removed (nothing to keep) and "" is
        returned; else it stays, and the returned line says where and how to send it."""
        self.records.close()
        out = self.deliver(timeout_s)
        if out.left or out.set_aside:
            left = f"{out.left} records not sent ({out.error})" if out.left else ""
            aside = f"{out.set_aside} refused, kept in {self.folder / spool.REJECTED}" \
                if out.set_aside else ""
            return (f"run {self.run_id}: {'; '.join(x for x in (left, aside) if x)}; they stay "
                    f"in {self.folder}: `ddplab sync {self.folder}` sends them")
        shutil.rmtree(self.home, ignore_errors=True)
        for empty in (self.home.parent, self.home.parent.parent):
            with contextlib.suppress(OSError):
                empty.rmdir()  # only when nothing else is in it
        return ""
