"""``ddplab reproduce RUN_ID [--strict]``: run a recorded run again, the same way, and say
whether it came out the same.

From MLflow it reads the run's resolved config (``config.yaml``), its layout (world size,
ranks per node, nodes, launcher, backend, threads), git sha and package versions; it warns
(``--strict``: refuses) when this checkout or its packages differ; it launches the same layout
on this host into a new run in the same experiment; then it compares the two ``train/loss``
series step by step and the final eval metrics:

    bitwise                     every value identical
    within_tolerance            every value within a relative 1e-4 (the reduction order changed)
    differs                     anything else (a value missing on one side; the job failed)
    nothing logged to compare   the run logged nothing to compare, at most what varies run
                                to run (exit 0)

A value logged NaN on both sides at the same step is the same (a diverged job that diverged
again, bitwise); NaN against a number, or a value one side never logged, differs. The line names
the metric and step of the largest difference; every value is in the new run's
``reproduce/differences.csv``.

A script-mode run (``ddplab train my_train.py``) is reproduced the same way: its script and
arguments run again, and every metric the script logged is compared (``train/loss`` too, which
ddplab observes for scripts) but those that vary run to run (:func:`varies_run_to_run`:
timings, memory, throughput, the machine's load: a seeded Hugging Face Trainer's loss comes back
bitwise, its ``train_runtime`` never does), and of a resumed run not what ddplab observed
(``shifted_keys``); a script whose file changed since the run is named (``--strict``: refused).

A run that FAILED is said to have failed before it runs again; then the verdict is whether the
failure came back: ``failed_again`` (the rerun failed with the same first line of
``ddplab.error``, exit 0) or ``differs``. A study's parent run ran no job: it is refused (exit 2).

The new run carries ``ddplab.reproduces=<run id>``, ``ddplab.reproduce.verdict`` and the
artifact ``reproduce/differences.csv`` (what varies run to run too, marked not compared). Exit 0
unless the verdict is ``differs`` (1).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..config import ConfigError, ScriptConfig
from ..log import logger
from ..subprocs import run_tied, stop_on_termination
from ..tracking import life, schema
from ..tracking.naming import varies_run_to_run

RTOL = 1e-4
COMPARED = ("train/loss", "eval/loss", "eval/accuracy")
NOTHING = "nothing logged to compare"
"""The verdict of a run that logged no value but what varies run to run: it did not differ
(exit 0)."""
FAILED_AGAIN = "failed_again"
"""The verdict on a FAILED run whose rerun failed with the same error (exit 0)."""
CSV = "reproduce/differences.csv"
NOT_COMPARED = "no: varies run to run (timing, memory, throughput)"
"""differences.csv's ``compared`` cell for a value of :func:`varies_run_to_run`."""

Row = tuple[str, int, float | None, float | None]
"""(metric, step, original, new); None: that side logged no value at that step."""


def _series(client: Any, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def compared_keys(run: Any) -> tuple[str, ...]:
    """ddplab's loop: its loss and eval metrics; a script: whatever the script logged (and
    ddplab observed: train/loss), but what varies run to run and what a resume shifted."""
    if run.data.tags.get(schema.MODE) != "script":
        return COMPARED
    shifted = shifted_keys(run)
    return tuple(sorted(k for k in run.data.metrics
                        if not varies_run_to_run(k) and k not in shifted))


def shifted_keys(run: Any) -> tuple[str, ...]:
    """A resumed script run's series that ddplab observed: on ddplab's step axis, which went on
    counting where the failed attempt stopped while the script went back to its own checkpoint
    (its steps since then are on the axis twice as far); a fresh rerun's cannot line up. The
    script's own series stay compared."""
    tags = run.data.tags
    if tags.get(schema.MODE) != "script" or tags.get(schema.RESUMED_FROM, "none") == "none":
        return ()
    observed = [k for k in tags.get(schema.OBSERVED, "").split(",") if k]
    return tuple(sorted(k for k in observed if k in run.data.metrics and not varies_run_to_run(k)))


def varying_keys(run: Any) -> tuple[str, ...]:
    """The run's metrics that vary run to run: reported beside the comparison, never in it."""
    return tuple(sorted(k for k in run.data.metrics if varies_run_to_run(k)))


def _rows(client: Any, original: str, new: str, keys: tuple[str, ...]) -> list[Row]:
    rows: list[Row] = []
    for key in keys:
        a, b = _series(client, original, key), _series(client, new, key)
        rows += [(key, s, a.get(s), b.get(s)) for s in sorted(set(a) | set(b))]
    return rows


def gap(a: float | None, b: float | None) -> float:
    """|a - b|; 0 for two NaN (a diverged job that diverged again, bitwise the same) and for
    two equal infinities; NaN when one side is NaN or logged nothing (no distance: a
    difference)."""
    if a is None or b is None:
        return math.nan
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b)


def _close(a: float | None, b: float | None) -> bool:
    d = gap(a, b)
    if d == 0:
        return True
    # An infinity against a number is infinitely far, whatever RTOL times infinity says.
    if not math.isfinite(d) or a is None or b is None:
        return False
    return d <= RTOL * max(abs(a), abs(b), 1e-12)


def compare(client: Any, original: str, new: str, keys: tuple[str, ...] = COMPARED
            ) -> tuple[str, list[Row]]:
    """The verdict and every (metric, step, original, new) compared; a metric among ``keys``
    that varies run to run is not compared, and nothing left to compare is :data:`NOTHING`."""
    rows = _rows(client, original, new, tuple(k for k in keys if not varies_run_to_run(k)))
    if not rows:
        return NOTHING, rows
    if all(gap(a, b) == 0 for _, _, a, b in rows):
        return "bitwise", rows
    return ("within_tolerance" if all(_close(a, b) for _, _, a, b in rows) else "differs"), rows


def _differences(original: dict[str, str]) -> list[str]:
    """What differs between the recorded run and this checkout: code and packages."""
    from ..tracking import capsule

    said = []
    run_sha = original.get(schema.GIT_SHA, "")
    here = capsule.git_sha()
    if run_sha and run_sha != here:
        said.append(f"git sha: the run {run_sha[:12]}, this checkout {here[:12]}")
    for tag, here_now in ((schema.LOCK, capsule.lock_digest()),
                          (schema.TORCH_BUILD, capsule.torch_build())):
        recorded = original.get(tag)
        if recorded and recorded != here_now:
            said.append(f"{tag.removeprefix(schema.PREFIX)}: the run {recorded}, here {here_now}")
    if original.get(schema.GIT_DIRTY) == "true":
        said.append("ddplab's checkout had uncommitted changes when the run was made (its "
                    "git.diff artifact holds them): the sha alone cannot rebuild the ddplab "
                    "that ran (the script is checked by its own sha256)")
    elif capsule.git_dirty()[0] == "true":
        said.append("ddplab's checkout here has uncommitted changes (git status): it is not "
                    f"the ddplab the run's sha {run_sha[:12]} names")
    for name, version in capsule.versions().items():
        recorded = original.get(schema.version_tag(name))
        if recorded and recorded != str(version):
            said.append(f"{name}: the run {recorded}, here {version}")
    changed = _script_changed(original)
    return said + _user_modules(original) + ([changed] if changed else [])


def script_gone(original: dict[str, str]) -> str:
    """Why a script-mode run's script cannot run again here ("" when it can): its file gone, or
    its module not found from the directory it ran in."""
    named = original.get(schema.SCRIPT, "")
    if not named:
        return ""
    cwd = original.get(schema.SCRIPT_CWD, "")
    if named.startswith("-m ") and cwd and not Path(cwd).is_dir():
        return f"script {named}: the run ran it in {cwd}, which is gone here"
    try:
        file = ScriptConfig(path=named).file(Path(cwd) if cwd else None)
    except ConfigError as e:
        return f"script {named}: the run ran it, it is not found here ({e})"
    if not file.is_file():
        return f"script {named}: the run ran it, it is gone here"
    return ""


def _script_changed(original: dict[str, str]) -> str:
    """A script-mode run's script, changed since the run ("" when not)."""
    from ..workload.userparts import sha256

    named, recorded = original.get(schema.SCRIPT), original.get(schema.SCRIPT_SHA256)
    if not named or script_gone(original):
        return ""
    cwd = original.get(schema.SCRIPT_CWD, "")
    now = sha256(ScriptConfig(path=named).file(Path(cwd) if cwd else None))
    if now != recorded:
        return (f"script {named}: changed since the run (sha256 {(recorded or '?')[:12]} then, "
                f"{now[:12]} now)")
    return ""


def _user_modules(original: dict[str, str]) -> list[str]:
    """The user's own modules (model, data, loss) whose file changed or went since the run."""
    from ..workload.userparts import sha256

    said, seen = [], set()
    for part in ("model", "data", "loss"):
        file, recorded = original.get(schema.user_tag(part, "file")), original.get(
            schema.user_tag(part, "sha256"))
        if not file or file == "none" or file in seen:
            continue
        seen.add(file)
        now = sha256(Path(file))
        if now == "missing":
            said.append(f"{part} module {file}: the run used it, it is gone here")
        elif now != recorded:
            said.append(f"{part} module {file}: changed since the run (sha256 "
                        f"{(recorded or '?')[:12]} then, {now[:12]} now)")
    return said


def _command(tags: dict[str, str], config_path: Path, sets: list[str]) -> list[str]:
    nnodes = int(tags.get(schema.NNODES, "1") or 1)
    if nnodes > 1:
        raise ConfigError(f"{schema.NNODES}={nnodes}: reproduce re-launches on this one host; a "
                          "multi-node run is reproduced by its own launcher (compose, mpirun, "
                          "a cluster) with MLFLOW_RUN_ID set")
    world = int(tags.get(schema.WORLD_SIZE, "1") or 1)
    from ..launchers.targets import train_job

    train = train_job(config_path, sets)
    if world == 1 and tags.get(schema.LAUNCHER) == "none":
        return [sys.executable, *train]
    from ..launchers.targets import Torchrun, local
    from .runner import local_launch

    launcher = tags.get(schema.LAUNCHER) or "torchrun"
    target = local(launcher, world)
    if isinstance(target, Torchrun):
        # torchrun in a process of ddplab's: a failed rank is one line (the verdict follows),
        # not torchrun's traceback and failure banner
        from ..subprocs import python_m

        return [*python_m("ddplab.launchers.local"), *target.args(train)]
    return local_launch(launcher, world, train)


def reproduce(run_id: str, strict: bool) -> int:
    # One small file fetched: no progress bar of MLflow's in the verdict's output.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # The config and the new job's checkpoints are scratch: the new run keeps what matters, and
    # each reproduction would otherwise leave tens of MB in the temporary directory.
    stop_on_termination()  # (kill, a closed terminal: as Ctrl-C, so the scratch is removed too)
    with tempfile.TemporaryDirectory(prefix="ddplab-reproduce-") as work:
        return _reproduce(run_id, strict, Path(work))


JOBS_NAMED = 4
"""A study's parent given to reproduce: this many of its jobs' run ids named instead."""


def _study_parent(client: Any, run: Any) -> str:
    """Why a study's parent run cannot be reproduced (it ran no job), with some of its jobs'
    run ids, or "" for any other run."""
    from .runner import PARENT

    tags = run.data.tags
    if tags.get(schema.STUDY_ROLE) != PARENT:
        return ""
    run_id, file = run.info.run_id, tags.get(schema.STUDY_FILE)
    again = f"`ddplab study run {file}`" if file else "`ddplab study run` on its file"
    jobs = client.search_runs([run.info.experiment_id],
                              f"tags.mlflow.parentRunId = '{run_id}'",
                              max_results=JOBS_NAMED + 1, order_by=["attributes.start_time ASC"])
    named = ", ".join(f"{j.data.tags.get(schema.VARIANT, '?')} r{j.data.tags.get(schema.REPEAT, '?')} "
                      f"{j.info.run_id}" for j in jobs[:JOBS_NAMED])
    more = " ..." if len(jobs) > JOBS_NAMED else ""
    which = f" ({named}{more})" if named else ""
    return (f"run {run_id} is study {tags.get(schema.STUDY, '?')}'s parent run (it ran no job "
            f"itself): reproduce one of its jobs{which} or rerun the study ({again})")


def _unended(run: Any) -> str:
    """Why a run still RUNNING is not reproduced now, or "": its job still trains (a rerun beside
    it races it for the machine and compares with figures it has not logged yet), or it was
    killed outright and `ddplab sync` ends it."""
    if run.info.status != life.RUNNING:
        return ""
    return (f"run {run.info.run_id} is still RUNNING: reproduce it once its job has ended (a job "
            "killed outright leaves its run RUNNING until `ddplab sync` ends it)")


def _recorded(client: Any, uri: str, run_id: str, work: Path) -> tuple[Any, Path] | None:
    """The run and its config.yaml fetched into ``work``; None (said in one line) when there is
    no such run or it is none a job made."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
        # Before the download: a parent has no config.yaml, and MLflow's error would not say why.
        refused = _study_parent(client, run) or _unended(run)
        if refused:
            logger("reproduce").error(refused)
            return None
    except MlflowException as e:
        logger("reproduce").error(f"run {run_id} in {uri}: {str(e).splitlines()[0]}")
        return None
    try:
        text = client.download_artifacts(run_id, "config.yaml", str(work))
    except MlflowException as e:  # (a job stopped before it recorded its config)
        why = life.error_line(run.data.tags)
        logger("reproduce").error(
            f"run {run_id} ({run.info.status}{': ' + why if why else ''}) has no config.yaml "
            f"to run again: its job ended before recording it ({str(e).splitlines()[0]})")
        return None
    if run.info.status == life.FAILED:
        logger("reproduce").warning(
            f"run {run_id} FAILED ({life.error_line(run.data.tags) or 'no ddplab.error recorded'}): "
            "rerunning it says whether the failure reproduces")
    return run, Path(text)


def _reproduce(run_id: str, strict: bool, work: Path) -> int:
    from ..tracking import validated_uri
    from ..tracking.spooled import DELIVERY_S, SpooledClient, home
    from ..tracking.store import absolute_store, reading_client
    from .runner import job_env

    # absolute: the rerun of a script runs where it ran, not here
    uri = absolute_store(validated_uri())
    client = reading_client(uri, run_id)
    found = _recorded(client, uri, run_id, work)
    if found is None:
        return 2
    run, config = found
    tags = run.data.tags
    gone = script_gone(tags)
    if gone:
        logger("reproduce").error(f"{gone}: nothing to run again")
        return 2
    changed = _differences(tags)
    for line in changed:
        (logger("reproduce").error if strict else logger("reproduce").warning)(line)
    if changed and strict:
        return 2
    sets = [f"tracking.uri={uri}", f"checkpoint.dir={work / 'checkpoints'}",
            "checkpoint.resume=never"]
    if tags.get(schema.MODE) != "script":  # a script chooses its backend itself
        sets.append(f"dist.backend={tags.get(schema.BACKEND, 'auto')}")
    if tags.get(schema.THREADS_PER_RANK):
        sets.append(f"dist.threads_per_rank={tags[schema.THREADS_PER_RANK]}")
    try:
        cmd = _command(tags, config, sets)
    except ConfigError as e:
        logger("reproduce").error(e)
        return 2
    new = life.create(client, run.info.experiment_id,
                      f"reproduce {run.info.run_name or run_id[:8]}",
                      {schema.REPRODUCES: run_id}).info.run_id
    env = job_env(new, uri)
    # The run's config is re-read from a temporary folder: its user modules are found where the
    # original experiment file was.
    search = tags.get(schema.USER_SEARCH_PATH, "none")
    if search != "none":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (search, env.get("PYTHONPATH", "")) if p)
    logger("reproduce").info(f"reproducing {run_id} as {new}: {' '.join(cmd)}")
    # A script runs where it ran: its module is found there, its relative paths start there.
    cwd = tags.get(schema.SCRIPT_CWD) or None
    try:
        code = run_tied(cmd, env, cwd=cwd if cwd and Path(cwd).is_dir() else None)
    except KeyboardInterrupt:  # (the job has ended: its run KILLED, unless it never opened it)
        life.end_if_running(client, new, life.KILLED, "interrupted (Ctrl-C) before its job ended its run")
        raise
    # No reason of ours: the job's own ddplab.error, if it sent one, is the right one.
    life.end_if_running(client, new, life.FAILED)
    # The verdict through a spool, as a job's records: a server gone meanwhile loses none.
    recorder = SpooledClient(client, uri, new, run.info.experiment_id, home("reproduce", new))
    if changed:
        recorder.set_tag(new, schema.REPRODUCE_CHANGED, "\n".join(changed)[:schema.TAG_LIMIT])
    if tags.get(schema.MODE) == "script":  # its snapshots were reproduce's scratch, gone
        recorder.set_tag(new, schema.CHECKPOINT_DIR, "none (reproduce's scratch, removed)")
    script = _script_changed(tags)
    verdict = _judge(recorder, run, new, code, f"; {script}" if script else "")
    kept = recorder.close(DELIVERY_S)
    if kept:
        logger("reproduce").warning(kept)
    return verdict


def _judge(client: Any, run: Any, new: str, code: int, because: str = "") -> int:
    """Record and print the verdict on the new run; exit 1 when it differs (or the job
    failed). What varies run to run is in differences.csv and counted in the line, never
    compared. A FAILED run's verdict is whether its failure came back (_judge_failure)."""
    if run.info.status == life.FAILED:
        return _judge_failure(client, run, new, code, because)
    run_id = run.info.run_id
    verdict, rows = compare(client, run_id, new, compared_keys(run)) if code == 0 \
        else ("differs", [])
    varying = _rows(client, run_id, new, varying_keys(run)) if code == 0 else []
    client.set_tag(new, schema.REPRODUCE_VERDICT, verdict)
    client.log_text(new, _csv(rows, varying), CSV)
    shifted = _shifted(run)
    if verdict == NOTHING:
        what = (f"only values that vary run to run, {len(varying)} reported in {CSV}, never "
                "compared" if varying else "no metric reproduce compares")
        print(f"reproduce {run_id} -> {new}: {NOTHING} (the run logged {what}{shifted})")
    elif code:
        print(f"reproduce {run_id} -> {new}: differs (the job exited {code}: "
              f"{_rerun_error(client, new)}; nothing compared{because})")
    else:
        why = because if verdict == "differs" else ""  # (the script edited since, say)
        print(f"reproduce {run_id} -> {new}: {verdict} ({_summary(rows, varying, new)}{why}"
              f"{shifted})")
    return 0 if verdict != "differs" else 1


def _shifted(run: Any) -> str:
    keys = shifted_keys(run)
    return (f"; not compared, as the run was resumed: ddplab's observed {', '.join(keys)}, on "
            "a step axis the script's own resume shifted" if keys else "")


def _csv(rows: list[Row], varying: list[Row]) -> str:
    """differences.csv: every value compared and every one reported; "" where a side logged
    nothing at that step."""
    import csv
    import io

    out = io.StringIO()
    write = csv.writer(out, lineterminator="\n").writerow
    write(["metric", "step", "original", "new", "abs_diff", "compared"])
    for said, found in (("yes", rows), (NOT_COMPARED, varying)):
        for k, s, a, b in found:
            write([k, s, "" if a is None else repr(a), "" if b is None else repr(b),
                   repr(gap(a, b)), said])
    return out.getvalue()


def _summary(rows: list[Row], varying: list[Row], new: str) -> str:
    """The verdict's parenthesis: how many values, the largest difference and where, where
    the full list is."""
    apart = [(k, s) for k, s, a, b in rows if math.isnan(gap(a, b))]
    d, k, s = max(((gap(a, b), k, s) for k, s, a, b in rows if not math.isnan(gap(a, b))),
                  key=lambda t: t[0], default=(0.0, "", 0))
    where = f" at {k} step {s}" if d else ""
    values = f"{len(rows)} value{'' if len(rows) == 1 else 's'} compared"
    said = f"{values}, largest difference {d:.3g}{where}"
    if apart:
        other = f", largest other difference {d:.3g}{where}" if d else ""
        said = (f"{values}: {len(apart)} missing or NaN on one side (the "
                f"first: {apart[0][0]} step {apart[0][1]}){other}")
    reported = f"; {len(varying)} values that vary run to run reported, not compared" \
        if varying else ""
    return f"{said}{reported}; every value: {CSV} in run {new}'s artifacts"


def _rerun_error(client: Any, new: str) -> str:
    # Read once the job ended: its ddplab.error is in the store by then.
    return life.error_line(client.get_run(new).data.tags) or "no ddplab.error recorded"


def _judge_failure(client: Any, run: Any, new: str, code: int, because: str = "") -> int:
    """A FAILED run reproduced is one whose rerun failed with the same error (its first line:
    the rest is a traceback, whose line numbers a harmless edit moves)."""
    run_id, was = run.info.run_id, life.error_line(run.data.tags) or "no ddplab.error recorded"
    failed = code != 0 or client.get_run(new).info.status == life.FAILED
    now = _rerun_error(client, new) if failed else ""
    again = failed and now == was
    client.set_tag(new, schema.REPRODUCE_VERDICT, FAILED_AGAIN if again else "differs")
    if again:
        print(f"reproduce {run_id} -> {new}: reproduced (it failed again: {was})")
        return 0
    rerun = f"the rerun failed: {now}" if failed else "the rerun finished"
    print(f"reproduce {run_id} -> {new}: differs (the original failed: {was}; {rerun}"
          f"{because})")
    return 1
