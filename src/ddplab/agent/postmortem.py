"""What a failed or hung job's ranks left (forensics/watch.py) put into its run, by each node's
delivery process once the job is over: every node its ranks' endings
(``ddplab.forensics.<node>``) and their stacks, crash dumps and errors (``forensics/<node>/``);
the node of global rank 0 the verdict over all of them (``ddplab.verdict``, and
``ddplab.error`` when the cause is another rank than 0: rank 0's own error was only what it
saw of it). ``ddplab diagnose RUN_ID`` reads it back from the run alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..files import write_text_atomic
from ..forensics.watch import Ending, Watch, from_json, to_json, verdict, where
from ..tracking import schema
from ..tracking.schema import SCRIPT_RANKS
from .protocol import META_JSON

WAIT_FOR_NODES_S = 15.0
"""How long rank 0's node waits for the other nodes' endings (theirs end at about the same
time); a node that never reports is named as such."""

KEPT = "postmortem.json"
"""In a node's spool: its postmortem that the server did not take at the job's end (down, or
refusing for a while), for ``ddplab sync`` to deliver (``deliver_kept``) with the rest."""


@dataclass
class Report:
    """A node's postmortem: its ranks' endings, its files (in its spool's forensics/), and on
    rank 0's node what the verdict is made of."""

    node: str
    world_size: int
    holds_rank0: bool
    endings: list[Ending]
    running: list[Ending]  # this node's ranks still alive as the job ended (they wait)
    files: list[str]
    hang_after_s: float
    here: list[int] = field(default_factory=list)  # the ranks of this node: _ranks_here

    def save(self, path: Path) -> None:
        fields = {**asdict(self), "endings": to_json(self.endings, sys.maxsize),
                  "running": to_json(self.running, sys.maxsize)}
        write_text_atomic(path, json.dumps(fields))

    @staticmethod
    def load(path: Path) -> Report:
        fields = json.loads(path.read_text())
        return Report(**{**fields, "endings": from_json(fields["endings"]),
                         "running": from_json(fields["running"])})


def record(client: Any, run_id: str, watch: Watch, node: str, world_size: int,
           holds_rank0: bool, superseded: Callable[[], bool] = lambda: False,
           keep: Path | None = None) -> str:
    """This node's endings and files into the run; on rank 0's node, the verdict (returned).
    Nothing once ``superseded`` says a restarted attempt took the run over (its end is its own).
    What the server does not take is kept in the spool ``keep``, for ``ddplab sync``."""
    endings = watch.endings()
    if not endings or superseded():
        return ""
    # A node whose ranks all ended well records them too, unless it holds rank 0: rank 0 may
    # yet fail (its own evaluation once this node's ranks are gone), and its verdict would wait
    # for these ranks' endings, then call them lost.
    if holds_rank0 and all(e.what == "done" for e in endings):
        return ""
    report = Report(node, world_size, holds_rank0, endings, watch.still_running(),
                    [str(f) for f in watch.files()], watch.hang_after_s, _ranks_here(world_size))
    line, missed = _deliver(client, run_id, report, superseded, WAIT_FOR_NODES_S)
    if missed:
        what = f"the ranks' stacks{' and the verdict' if line else ''}"
        try:
            if keep is None:
                raise OSError("no spool")
            report.save(keep / KEPT)
            said = f"{what} are kept in {keep} for `ddplab sync`: the server did not take them"
        except OSError:  # (a full disk)
            said = f"{what} could not be recorded"
        print(f"ddplab delivery: {said} ({missed})", file=sys.stderr)
    return line


def deliver_kept(client: Any, run_id: str, directory: Path) -> str:
    """``ddplab sync``: the postmortem kept in this spool (``KEPT``), delivered; the verdict
    taken again over every node's endings the run holds by now (sync sends the other nodes'
    first). "" when delivered (or none is kept), else why not (the report stays)."""
    path = directory / KEPT
    if not path.is_file():
        return ""
    if (directory / META_JSON).stat().st_mtime > path.stat().st_mtime:
        path.unlink()  # a restarted attempt took the run over since: its end is its own
        return ""
    _, missed = _deliver(client, run_id, Report.load(path), lambda: False, 0.0)
    if not missed:
        path.unlink()
    return missed


def _deliver(client: Any, run_id: str, report: Report, superseded: Callable[[], bool],
             wait_s: float) -> tuple[str, str]:
    """The report into the run: (the verdict, "" or what failed: ``spool.describe``'s line)."""
    from ..tracking.spool import describe

    missed = ""
    try:
        for f in report.files:
            client.log_artifact(run_id, f, f"forensics/{report.node}")
        client.set_tag(run_id, schema.forensics_tag(report.node),
                       to_json(report.endings))  # whole, in the limit
    except Exception as e:  # noqa: BLE001 - the run's ending still comes; say what is missing
        missed = describe(e)
    done = all(e.what == "done" for e in report.endings)
    if done or not report.holds_rank0:
        return "", missed
    everyone = _everyone(client, run_id, report.node, report.endings + report.running,
                         report.world_size, wait_s, report.here)
    line = verdict(everyone, report.world_size, hang_after_s=report.hang_after_s,
                   here=report.here)
    if line and not superseded():  # (the wait for the other nodes' endings took up to 15 s)
        # The verdict is the postmortem's last word: whoever reads the run once it is there
        # finds ddplab.error naming the cause already, not rank 0's view of it a moment before.
        for write in (lambda: name_the_cause(client, run_id, line),
                      lambda: client.set_tag(run_id, schema.VERDICT, line)):
            try:
                write()
            except Exception as e:  # noqa: BLE001 - the run ends anyway (node.py)
                missed = missed or describe(e)
    return line, missed


def _ranks_here(world_size: int) -> list[int]:
    """The global ranks of this node, by torchrun's numbering (node N holds N x its local
    world size onward), or none where it does not say. This node is alive (it makes the
    report), so one of them that reported nothing was stopped before it could, not lost."""
    try:
        local, node = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["GROUP_RANK"])
    except (KeyError, ValueError):
        return []
    return [r for r in range(node * local, (node + 1) * local) if r < world_size]


def _everyone(client: Any, run_id: str, node: str, mine: list[Ending],
              world_size: int, wait_s: float, here: Sequence[int] = ()) -> list[Ending]:
    deadline = time.monotonic() + wait_s
    while True:
        everyone = list(mine)
        with contextlib.suppress(Exception):
            tags = client.get_run(run_id).data.tags
            for k, v in tags.items():
                if k.startswith(schema.FORENSICS_PREFIX) and k != schema.forensics_tag(node):
                    with contextlib.suppress(ValueError):  # unreadable: that node is "lost"
                        everyone += from_json(v)
        # (this node's own ranks that said nothing never will: no wait for them)
        if {e.rank for e in everyone} | set(here) >= set(range(world_size)) \
                or time.monotonic() > deadline:
            return everyone
        time.sleep(1.0)


def name_the_cause(client: Any, run_id: str, line: str) -> None:
    """Rank 0 ended the run FAILED with what it saw (a peer's closed connection, the launcher's
    SIGTERM): when the verdict names another rank, that is the run's error; rank 0's stays
    beside it. Raises what the server raised (the report is then kept)."""
    if line.startswith("rank 0 "):
        return
    run = client.get_run(run_id)
    if run.info.status != "FAILED":
        return
    own = run.data.tags.get(schema.ERROR, "")
    culprit = line.split(")", 1)[0] + ")"  # "rank 1 (host h)"
    if culprit in own.split("\n", 1)[0]:
        return  # it already names the same rank, with more (a script's traceback)
    client.set_tag(run_id, schema.ERROR, line)
    if own:
        client.set_tag(run_id, schema.ERROR_RANK0, own[:schema.TAG_LIMIT])


def diagnose(run_id: str) -> int:
    """``ddplab diagnose RUN_ID``: the verdict and where each rank's stack is, from the run
    alone (also one synced later from a spool). A script run (script mode) says each rank's
    place too: how its script ended, where (the innermost frame of the user's file), its
    stack and logs. A tag that is missing or garbled is one line, never a traceback."""
    from ..tracking.store import recorded_run

    client, run, _ = recorded_run(run_id)
    tags = run.data.tags
    print(f"run {run_id}: {run.info.status}")
    if tags.get(schema.STUDY_ROLE) == "parent":
        return _study_parent(client, run)
    verdict = any(k in (schema.VERDICT, schema.ERROR) or k.startswith(schema.FORENSICS_PREFIX)
                  for k in tags)
    if run.info.status == "RUNNING" and not verdict:  # ("no rank failed" read as an all-clear)
        print("verdict: none yet: the job is still running, or it was killed before it could end "
              "its run (`ddplab sync` ends such a run from its spool)")
        return 0
    line = tags.get(schema.VERDICT) or tags.get(schema.ERROR, "").split("\n", 1)[0]
    print(f"verdict: {line}" if line else "verdict: no rank failed or hung")
    error = tags.get(schema.ERROR, "").split("\n", 1)[0]
    if error and error != line:
        print(f"error: {error}")
    script = tags.get(schema.MODE) == "script"
    if script:
        _script_ranks(tags, run.info.status)
    for i, key in enumerate(sorted(k for k in tags if k.startswith(schema.FORENSICS_PREFIX))):
        if script and i == 0:
            print("their steps, as ddplab watched them (ddplab.forensics.<node>):")
        try:
            said = [_ending(key, ending) for ending in from_json(tags[key])]
        except Exception as e:  # noqa: BLE001 - garbled (an older ddplab cut it, edited): say so
            why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            said = [f"  {key}: unreadable ({why}; {len(tags[key])} characters)"]
        print("\n".join(said))
    try:
        files = _artifacts(client, run_id, "forensics")
    except Exception as e:  # noqa: BLE001 - the artifact store may be elsewhere, or gone
        print(f"stacks, crash dumps and errors: the run's artifacts cannot be listed "
              f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
        return 0
    if files:
        root = run.info.artifact_uri.rstrip("/")
        earlier = run.info.status == "FINISHED" and not line and \
            tags.get(schema.RESUMED_FROM, "none") != "none"
        print("stacks, crash dumps and errors of an earlier attempt (this run resumed after it; "
              "its ending is in resumes/):" if earlier else
              "stacks, crash dumps and errors (the run's artifacts):")
        for path in files:
            print(f"  {root}/{path}")
    return 0



def _script_ranks(tags: dict[str, str], status: str) -> None:
    """Each rank's place, from what the script run recorded of its ranks' endings."""
    text = tags.get(SCRIPT_RANKS)
    if text is None:
        if status != "FINISHED":
            print(f"the script's ranks: not recorded ({SCRIPT_RANKS} missing: rank 0 ended "
                  "before it could say, or an older ddplab ran it)")
        return
    try:
        entries = json.loads(text)
        if not isinstance(entries, list):
            raise TypeError("not a list")
        lines = [_rank_place(e) for e in entries if isinstance(e, dict)]
    except Exception as e:  # noqa: BLE001 - garbled: one line, the rest of diagnose goes on
        print(f"the script's ranks: {SCRIPT_RANKS} unreadable ({type(e).__name__}: {e})"[:300])
        return
    print("the script's ranks (logs/rank<r>.stdout.txt, .stderr.txt):")
    for place in lines:
        if place:
            print(f"  {place}")


def _rank_place(e: dict[str, Any]) -> str:
    if "rank" not in e:
        ok, unlisted = e.get("ok", 0), e.get("unlisted", 0)
        return (f"{ok} rank(s) exited 0" if ok else "") + \
            (f"{'; ' if ok else ''}{unlisted} more not listed (the tag's size)" if unlisted else "")
    head = f"rank {e['rank']}" + (f" (host {e['host']})" if e.get("host") else "")
    if e.get("missing"):
        return f"{head}: ended without reporting (its process killed outright: SIGKILL, OOM?)"
    code = e.get("code")
    how = (f"killed by {_signal_name(-int(code))}" if isinstance(code, int) and code < 0
           else f"exit code {code}")
    if e.get("stopped"):
        how = f"stopped ({e['stopped']}), {how}"
    why = str(e.get("why", ""))
    why = why if len(why) <= 200 else why[:199] + "…"  # cut, and said so
    place = e.get("raised_at") or e.get("where")
    return (f"{head}: {how}" + (f": {why}" if why and not why.startswith("killed by") else "")
            + (f"; at {place}" if place else "")
            + (f"; stack {e['stack']}" if e.get("stack") else ""))


def _signal_name(n: int) -> str:
    import signal

    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _study_parent(client: Any, run: Any) -> int:
    """A study's parent ran no job: its jobs that did not finish, each with its own diagnose."""
    run_id = run.info.run_id
    jobs = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'",
                              max_results=5000)
    ended = [j for j in jobs if j.info.status not in ("FINISHED", "RUNNING")]
    print(f"run {run_id} is study {run.data.tags.get(schema.STUDY, '?')}'s parent run: it ran no "
          f"job itself; of its {len(jobs)} jobs, " + ("none failed" if not ended else
                                                      f"{len(ended)} did not finish:"))
    for j in sorted(ended, key=lambda j: j.info.start_time):
        t = j.data.tags
        print(f"  {t.get(schema.VARIANT, '?')} repeat {t.get(schema.REPEAT, '0')}: "
              f"{j.info.status}: ddplab diagnose {j.info.run_id}")
    return 0


def _ending(key: str, ending: Ending) -> str:
    first = ending.detail.splitlines()[0][:160] if ending.detail else ""
    node = key.removeprefix(schema.FORENSICS_PREFIX)
    if ending.what == "done":  # (a node whose ranks all ended well, beside a failed one)
        return f"  rank {ending.rank} ({ending.host}, {node}): done"
    return (f"  rank {ending.rank} ({ending.host}, {node}): {ending.what} {where(ending)}"
            + (f": {first}" if first else "")
            + _collective(ending))


def _collective(e: Ending) -> str:
    """What its Flight Recorder said, when the watch read one."""
    if e.waits_in:
        return f"; in collective #{e.entered} ({e.waits_in}), #{e.finished} finished"
    return f"; in no collective, #{e.finished} finished" if e.entered >= 0 else ""


def _artifacts(client: Any, run_id: str, path: str) -> list[str]:
    out: list[str] = []
    for a in client.list_artifacts(run_id, path):
        out += _artifacts(client, run_id, a.path) if a.is_dir else [a.path]
    return out
