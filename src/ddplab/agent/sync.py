"""``ddplab sync``: deliver what a job's node agent left in its spool, after the job (a server
that was down, a node that went before its agent finished), and end a run its job left
RUNNING. Idempotent: delivered records are not sent again."""

from __future__ import annotations

import contextlib
import fcntl
import sys
import time
from pathlib import Path
from typing import Any

from ..log import logger
from ..tracking import opening, spool
from .protocol import ABANDONED, DELIVERING, DELIVERY_JSON, META_JSON, QUIET_S, fail_fast


def make_client(uri: str, opened: Any = None) -> Any:
    """The delivering client (``opened``: the one that opened the run, reused). Opening the run
    kept MLflow's own retries: the job waits for that answer anyway."""
    fail_fast()
    from mlflow import MlflowClient

    from ..tracking.store import quiet_store_errors

    quiet_store_errors()
    return opened or MlflowClient(uri)


# What went wrong goes through ddplab's logging (stderr, "ddplab sync: warning: ..."); what was
# delivered is the command's result, on stdout.
SYNC_LOG = logger("sync")


def sync(paths: list[str], timeout_s: float, uri: str = "") -> int:
    """``ddplab sync``: deliver every spool under ``paths`` that still holds records, each to
    its run (ended with its recorded status). Idempotent: delivered records are not sent
    again. Returns 0 when everything is delivered everywhere; 1 when records are still left (a
    server that did not answer or refused for now), were set aside (refused as records, or no
    records), or a run is not in the store."""
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        SYNC_LOG.error(f"no such file or directory: {missing[0]}")
        return 2
    found = spool.find([Path(p) for p in paths])
    if not found:
        print(f"ddplab sync: no tracking spool under {' '.join(paths)}: nothing to deliver")
        return 0
    still, delivered = 0, []
    for directory in found:
        try:
            left = _sync_one(directory, timeout_s, uri)
        except (OSError, ValueError, KeyError) as e:  # an unreadable spool: the others go on
            SYNC_LOG.error(f"{directory}: cannot be read ({type(e).__name__}: {e})")
            left = 1
        still += left
        if not left and job_over(directory):
            delivered.append(directory)
    # The postmortems the server did not take at the job's end, once their runs hold the rest
    # (ended, so the verdict can name the cause): rank 0's node's last, its verdict reading the
    # other nodes' endings.
    for directory in sorted(delivered, key=spool.of_rank0):
        still += _sync_postmortem(directory, uri)
    return 1 if still else 0


def _sync_postmortem(directory: Path, uri: str) -> int:
    """The postmortem kept in this spool, delivered (postmortem.deliver_kept); 1 if it stays."""
    from .postmortem import KEPT, deliver_kept

    if not (directory / KEPT).is_file():
        return 0
    meta = spool.Meta.read(directory)
    where = f"run {meta.run_id} ({directory})"
    try:
        missed = deliver_kept(make_client(uri or meta.uri), meta.run_id, directory)
    except (OSError, ValueError, KeyError, TypeError) as e:
        SYNC_LOG.error(f"{where}: {directory / KEPT} cannot be read ({type(e).__name__}: {e})")
        return 1
    if missed:
        SYNC_LOG.warning(f"{where}: the ranks' stacks and the verdict are still not recorded "
                         f"({missed}); kept in {directory / KEPT}")
        return 1
    print(f"{where}: delivered the ranks' stacks and endings"
          f"{' and the verdict' if spool.of_rank0(directory) else ''}, kept since the job's end")
    return 0


def abandoned(directory: Path) -> dict[str, Any]:
    """What the run's spools say of its abandoned end: the node's note (``ABANDONED``, in any
    node's spool of the run), else when the job last recorded anything ({"ts": ms})."""
    import json

    spools = sorted(directory.parent.glob("node*")) or [directory]
    for folder in spools:
        try:
            note = json.loads((folder / ABANDONED).read_text())
            fresh = (folder / ABANDONED).stat().st_mtime >= (folder / META_JSON).stat().st_mtime
            if fresh and isinstance(note, dict) and isinstance(note.get("ts"), int):
                return note  # (not an earlier attempt's, before a restart took the run over)
        except (OSError, ValueError):
            continue
    times = []  # the record streams only: sync itself writes rejected.jsonl
    for folder in spools:
        for name in spool.STREAMS:
            with contextlib.suppress(OSError):
                times.append(spool.Stream(folder, name).path.stat().st_mtime)
    return {"ts": int(max(times) * 1000)} if times else {}


def job_over(directory: Path) -> bool:
    """The job that wrote this spool has ended: it closed the spool, or its delivery process
    finished (it outlives the job, and attach() clears both for a new attempt), or that process
    is gone without a word (killed outright with the whole job: an OOM, a lost node)."""
    return (directory / spool.CLOSED).exists() or (directory / DELIVERY_JSON).exists() \
        or _delivery_gone(directory)


def _delivery_gone(directory: Path) -> bool:
    """The agent's lock is free (no process holds it) and nothing in the spool has changed
    for QUIET_S; False where the spool has no lock (an older ddplab's) or locks fail."""
    lock = directory / DELIVERING
    try:
        if not lock.is_file():
            return False
        changed = max(p.stat().st_mtime for p in directory.iterdir() if p.is_file())
        if time.time() - changed < QUIET_S:
            return False
        with lock.open("a") as held:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (released as it closes)
    except OSError:
        return False
    return True


def _being_delivered(directory: Path) -> bool:
    """Its job's delivery process runs (it holds the agent's lock while it lives)."""
    try:
        with (directory / DELIVERING).open("r") as held:
            fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no lock (an older ddplab's spool), or locks fail
        return False
    return False


def _sync_one(directory: Path, timeout_s: float, uri: str) -> int:
    meta = spool.Meta.read(directory)
    target = uri or meta.uri
    over = job_over(directory)
    todo = sum(s.left(over) for s in (spool.Stream(directory, n) for n in spool.STREAMS))
    where = f"run {meta.run_id} ({directory})"
    if _being_delivered(directory):
        # (two senders raced on its delivered-offset file: a hostile pass)
        print(f"{where}: being delivered by its job's delivery process ({todo} records to go); "
              "nothing sent from here")
        return 0
    client = make_client(target)
    try:
        client.get_run(meta.run_id)
    except Exception as e:  # noqa: BLE001 - no run, or no answer: say which, keep everything
        if spool.status_of(e) == 404:
            SYNC_LOG.error(f"{where}: {target} has no run {meta.run_id} (the job tracked to "
                           f"{meta.uri}); sync to that store, or --tracking-uri the one that "
                           "holds the run")
        else:
            SYNC_LOG.warning(f"{where}: {target} {spool.describe(e)}; {todo} records "
                             "kept in the spool")
        return max(todo, 1)
    before = spool.rejected_in(directory)
    ends = [r["status"] for s in spool.STREAMS for _, r in spool.Stream(directory, s).pending(over)
            if r.get("op") == "end"]
    out = spool.Outcome()
    if todo:
        out = spool.deliver(directory, client, lambda: False, timeout_s, final=over)
        if out.left:
            SYNC_LOG.warning(f"{where}: {target} {out.error} within {timeout_s:.0f} s: "
                             f"{out.left} of {todo} records still left in the spool")
        else:
            print(f"{where}: delivered {todo - out.set_aside} records"
                  + (f"; run ended {ends[-1]}" if ends else ""))
    else:
        print(f"{where}: up to date")
    refused = spool.rejected_in(directory)
    if refused:
        new = f", {refused - before} of them now" if refused > before else ""
        SYNC_LOG.warning(f"{where}: {refused} records set aside{new} (refused by the server as "
                         f"records, or no records), kept with the reasons in "
                         f"{directory / spool.REJECTED}")
    if over and not out.left:
        end_if_abandoned(client, meta, where, directory=directory)
    return out.left + refused


def end_if_abandoned(client: Any, meta: spool.Meta, where: str, why: str = "",
                     directory: Path | None = None) -> bool:
    """Everything the job recorded is in, the job is over, and the run still says RUNNING: its
    end was never recorded (killed outright, or its last line torn). End it FAILED, saying so:
    ``why``, else what the node's delivery process saw of it (``ABANDONED``), at the time the
    job ended, not now (a sync minutes later read as minutes more of the job). False when the
    server did not take it."""
    seen = abandoned(directory) if directory is not None else {}
    try:
        info = client.get_run(meta.run_id).info
        if info.status != "RUNNING":
            return True
        opening.end_failed(client, meta.run_id, why or seen.get("why") or (
            "the job ended without recording its end (killed outright, or its last record "
            "torn); ended by ddplab sync"),
            end_time=max(seen["ts"], info.start_time or 0) if "ts" in seen else None)
    except Exception as e:  # noqa: BLE001
        print(f"{where}: could not end the run ({spool.describe(e)})", file=sys.stderr)
        return False
    print(f"{where}: the job had ended without recording the run's end: ended it FAILED")
    return True

