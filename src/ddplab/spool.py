"""The tracking spool: everything a job means to tell MLflow is first appended to a local
file, then delivered from there, so a tracking outage never stalls training or loses a record.

One spool per node and run, next to the run's checkpoints:

    <checkpoint.dir>/<name>/<run id>/spool/node<k>/
        meta.json        tracking URI, run id, experiment id (what `ddplab sync` needs)
        records.jsonl    rank 0's records (metrics, params, tags, texts, the run's end)
        system.jsonl     this node's system metrics
        *.delivered      how far (bytes) the server has acknowledged each stream
        closed           the job ended: deliver what is left, then stop

Training only appends lines: no network, no waiting. A low-priority delivery process per node
(``ddplab.delivery``) sends them on, and ``ddplab sync`` sends what is left after the job.
Every record carries its own timestamp, so one delivered twice (the server answered, then the
offset could not be saved) lands once: MLflow keeps one copy of an identical metric, and
params, tags, texts and the status are overwrites with the same value (anchor: W&B's offline
mode and ``wandb sync``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STREAMS = ("records", "system")
CLOSED = "closed"  # written by the training process when it will append nothing more
BATCH_METRICS, BATCH_PARAMS, BATCH_TAGS = 1000, 100, 100  # MLflow's log_batch limits


def spool_dir(checkpoint_root: Path, run_id: str, node_rank: int) -> Path:
    return checkpoint_root / run_id / "spool" / f"node{node_rank}"


def now_ms() -> int:
    return int(time.time() * 1000)


class Stream:
    """One append-only JSON-lines file and the offset delivered so far."""

    def __init__(self, directory: Path, name: str) -> None:
        self.path = directory / f"{name}.jsonl"
        self.mark_path = directory / f"{name}.delivered"
        self.fd: int | None = None

    def append(self, record: dict[str, Any]) -> None:
        # One write() of one line on an O_APPEND descriptor: a reader never sees half a record
        # followed by another's bytes, and a crash leaves at most one partial last line.
        if self.fd is None:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def keep_file(self, path: Path) -> Path:
        """A copy of ``path`` beside the stream, for a record that names it."""
        folder = self.path.parent / "files"
        folder.mkdir(exist_ok=True)
        kept = folder / path.name
        shutil.copyfile(path, kept)
        return kept.resolve()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def delivered(self) -> int:
        try:
            return int(self.mark_path.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def mark(self, offset: int) -> None:
        tmp = self.mark_path.with_suffix(".tmp")
        tmp.write_text(str(offset))
        os.replace(tmp, self.mark_path)

    def pending(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(end offset, record) for each complete line not yet delivered."""
        start = self.delivered()
        try:
            with self.path.open("rb") as f:
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            return
        offset = start
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                return  # being written, or cut by a crash: not a record yet
            offset += len(line)
            try:
                yield offset, json.loads(line)
            except ValueError:
                continue  # a line torn by a crash mid-write: skip it, never block on it

    def left(self) -> int:
        """Complete records not yet delivered."""
        return sum(1 for _ in self.pending())


@dataclass(frozen=True)
class Meta:
    uri: str
    run_id: str
    experiment_id: str

    @staticmethod
    def read(directory: Path) -> Meta:
        return Meta(**json.loads((directory / "meta.json").read_text()))

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "meta.json").write_text(json.dumps(self.__dict__, indent=1))


def left_in(directory: Path) -> int:
    return sum(Stream(directory, s).left() for s in STREAMS)


def find(paths: list[Path]) -> list[Path]:
    """Every spool (a folder with meta.json under a ``spool/``) under these paths."""
    found: list[Path] = []
    for root in paths:
        if (root / "meta.json").is_file():
            found.append(root)
            continue
        found += sorted(m.parent for m in root.rglob("spool/*/meta.json"))
    return found


class Permanent(Exception):
    """The server refused a record (4xx): sending it again would be refused again."""


def _is_permanent(e: Exception) -> bool:
    status = getattr(e, "get_http_status_code", lambda: 500)()
    return 400 <= int(status) < 500


class Sender:
    """Replays records to the run through an MlflowClient, batching what log_batch allows."""

    def __init__(self, client: Any, meta: Meta, rejected: Path) -> None:
        self.client, self.meta, self.rejected = client, meta, rejected

    def send(self, stream: Stream) -> int:
        """Deliver everything pending in ``stream``; returns records delivered. Raises on a
        transient failure (server down), after marking what got through."""
        done = 0
        for batch, end in _batches(stream.pending()):
            try:
                self._send(batch)
            except Exception as e:
                if not _is_permanent(e):
                    raise
                self._one_by_one(batch, e)
            stream.mark(end)
            done += len(batch)
        return done

    def _send(self, batch: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        op, run_id = batch[0]["op"], self.meta.run_id
        if op == "log":
            self.client.log_batch(
                run_id,
                metrics=[Metric(k, v, r["ts"], r["step"]) for r in batch
                         for k, v in r.get("metrics", {}).items()],
                params=[Param(k, v) for r in batch for k, v in r.get("params", {}).items()],
                tags=[RunTag(k, v) for r in batch for k, v in r.get("tags", {}).items()],
                synchronous=True)
        elif op == "text":
            self.client.log_text(run_id, batch[0]["text"], batch[0]["name"])
        elif op == "file":
            self.client.log_artifact(run_id, batch[0]["path"], batch[0]["dir"])
        elif op == "end":
            self.client.set_terminated(run_id, batch[0]["status"], end_time=batch[0]["ts"])

    def _one_by_one(self, batch: list[dict[str, Any]], e: Exception) -> None:
        """A refused batch: send its records alone, so one bad record (a param whose value
        changed) does not take its neighbours with it; set aside only what is refused."""
        if len(batch) == 1:
            self._reject(batch, e)
            return
        for record in batch:
            try:
                self._send([record])
            except Exception as one:
                if not _is_permanent(one):
                    raise
                self._reject([record], one)

    def _reject(self, batch: list[dict[str, Any]], e: Exception) -> None:
        with self.rejected.open("a") as f:
            for r in batch:
                f.write(json.dumps({"error": str(e)[:500], "record": r}) + "\n")


def _batches(pending: Iterator[tuple[int, dict[str, Any]]]
             ) -> Iterator[tuple[list[dict[str, Any]], int]]:
    """Consecutive "log" records merged up to log_batch's limits; any other record alone."""
    batch: list[dict[str, Any]] = []
    counts = [0, 0, 0]
    end = 0
    for offset, record in pending:
        sizes = [len(record.get(k, {})) for k in ("metrics", "params", "tags")]
        fits = all(c + s <= limit for c, s, limit in
                   zip(counts, sizes, (BATCH_METRICS, BATCH_PARAMS, BATCH_TAGS), strict=True))
        if batch and (record["op"] != "log" or batch[0]["op"] != "log" or not fits):
            yield batch, end
            batch, counts = [], [0, 0, 0]
        batch.append(record)
        counts = [c + s for c, s in zip(counts, sizes, strict=True)]
        end = offset
    if batch:
        yield batch, end


def deliver(directory: Path, client: Any, producing: Callable[[], bool], timeout_s: float,
            pause_s: float = 3.0) -> int:
    """Send this spool's records while ``producing()`` and, once it says False, until nothing is
    left or ``timeout_s`` has passed. A transient failure (server down) is retried with backoff,
    never dropped. Returns the records still left."""
    sender = Sender(client, Meta.read(directory), directory / "rejected.jsonl")
    streams = [Stream(directory, s) for s in STREAMS]
    backoff, deadline = pause_s, None
    while True:
        if deadline is None and not producing():  # asked BEFORE sending: nothing is missed
            deadline = time.monotonic() + timeout_s
        try:
            for stream in streams:
                sender.send(stream)
            backoff = pause_s
            if deadline is not None:
                return 0
        except Exception:  # noqa: BLE001 - transient (server down): try again later
            # Backing off spares a down server; once the job has ended, the bound is short
            # and every second counts, so retries come faster.
            backoff = min(backoff * 2, 10.0 if deadline is None else 2.0)
            if deadline is not None and time.monotonic() >= deadline:
                return left_in(directory)
        if deadline is None:
            _nap(backoff, producing)
        else:
            time.sleep(max(0.0, min(backoff, deadline - time.monotonic())))


def _nap(seconds: float, producing: Callable[[], bool], slice_s: float = 0.2) -> None:
    """Sleep between deliveries, waking early when the job ends: a few large batches cost
    less CPU than many small ones (measured: sending every 3 s instead of every 1 s halved
    tracking's steady CPU share), and the job's end is not kept waiting for the nap."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and producing():
        time.sleep(min(slice_s, max(0.0, end - time.monotonic())))
