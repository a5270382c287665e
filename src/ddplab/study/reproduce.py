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
    nothing logged to compare   the run logged nothing to compare, timings at most (exit 0)

A script-mode run (``ddplab train my_train.py``) is reproduced the same way: its script and
arguments run again, and every metric the script logged is compared (``train/loss`` too, which
ddplab observes for scripts) but its timings (:func:`is_timing`: ``perf/``, ``system/``,
``*_runtime``, ``*_per_second``...: a seeded Hugging Face Trainer's loss comes back bitwise, its
``train_runtime`` never does); a script whose file changed since the run is named (``--strict``:
refused).

The new run carries ``ddplab.reproduces=<run id>``, ``ddplab.reproduce.verdict`` and the
artifact ``reproduce/differences.csv`` (timings too, marked not compared). Exit 0 unless the
verdict is ``differs`` (1).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..log import logger
from ..tracking import life, schema

RTOL = 1e-4
COMPARED = ("train/loss", "eval/loss", "eval/accuracy")
NOTHING = "nothing logged to compare"
"""The verdict of a run that logged no value but timings: it did not differ (exit 0)."""

_TIMING = re.compile(r"^(perf|system|memory)/|_runtime$|_per_second$|_per_s$|_time|(^|/)time"
                     r"|_busy_s$|_wait_frac$")


def is_timing(metric: str) -> bool:
    """Whether ``metric`` is a timing: how long or how fast, which no rerun repeats however
    deterministic the arithmetic, so reproduce reports it and never compares it. The one rule:
    a name under ``perf/``, ``system/`` or ``memory/`` (ddplab's throughput, wall time, MFU; the
    machine's samples; what the allocator held), or ending in ``_runtime``, ``_per_second`` or
    ``_per_s``, or with ``_time`` or a ``time`` segment in it (Hugging Face Trainer's
    ``train_runtime``, ``train_samples_per_second``, ``eval_steps_per_second``; a script's
    ``epoch_time_s``; ``epoch/time_s``), or a rank's share of its step
    (``train/rank<r>_busy_s``, ``train/data_wait_frac``)."""
    return bool(_TIMING.search(metric))


def _series(client: Any, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def compared_keys(run: Any) -> tuple[str, ...]:
    """ddplab's loop: its loss and eval metrics; a script: whatever the script logged (and
    ddplab observed: train/loss), but timings."""
    if run.data.tags.get(schema.MODE) != "script":
        return COMPARED
    return tuple(sorted(k for k in run.data.metrics if not is_timing(k)))


def timing_keys(run: Any) -> tuple[str, ...]:
    """The run's timings (is_timing): reported beside the comparison, never in it."""
    return tuple(sorted(k for k in run.data.metrics if is_timing(k)))


def _rows(client: Any, original: str, new: str, keys: tuple[str, ...]
          ) -> list[tuple[str, int, float, float]]:
    rows: list[tuple[str, int, float, float]] = []
    for key in keys:
        a, b = _series(client, original, key), _series(client, new, key)
        rows += [(key, s, a.get(s, math.nan), b.get(s, math.nan)) for s in sorted(set(a) | set(b))]
    return rows


def compare(client: Any, original: str, new: str, keys: tuple[str, ...] = COMPARED
            ) -> tuple[str, list[tuple[str, int, float, float]]]:
    """The verdict and every (metric, step, original, new) compared; a timing among ``keys``
    is not compared (is_timing), and nothing left to compare is :data:`NOTHING`."""
    rows = _rows(client, original, new, tuple(k for k in keys if not is_timing(k)))
    if not rows:
        return NOTHING, rows
    if any(math.isnan(x) or math.isnan(y) for _, _, x, y in rows):
        return "differs", rows
    if all(x == y for _, _, x, y in rows):
        return "bitwise", rows
    close = all(abs(x - y) <= RTOL * max(abs(x), abs(y), 1e-12) for _, _, x, y in rows)
    return ("within_tolerance" if close else "differs"), rows


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
        said.append("the run was made from a checkout with uncommitted changes (its git.diff "
                    "artifact holds them): the sha alone cannot rebuild what ran")
    elif capsule.git_dirty()[0] == "true":
        said.append("this checkout has uncommitted changes (git status): it is not the code "
                    f"the run's sha {run_sha[:12]} names")
    for name, version in capsule.versions().items():
        recorded = original.get(schema.version_tag(name))
        if recorded and recorded != str(version):
            said.append(f"{name}: the run {recorded}, here {version}")
    return said + _user_modules(original) + _script(original)


def _script(original: dict[str, str]) -> list[str]:
    """A script-mode run's script, changed or gone since the run."""
    from ..workload.userparts import sha256

    file, recorded = original.get(schema.SCRIPT), original.get(schema.SCRIPT_SHA256)
    if not file:
        return []
    now = sha256(Path(file))
    if now == "missing":
        return [f"script {file}: the run ran it, it is gone here"]
    if now != recorded:
        return [f"script {file}: changed since the run (sha256 {(recorded or '?')[:12]} then, "
                f"{now[:12]} now)"]
    return []


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
    from .runner import local_launch

    return local_launch(tags.get(schema.LAUNCHER) or "torchrun", world, train)


def reproduce(run_id: str, strict: bool) -> int:
    # One small file fetched: no progress bar of MLflow's in the verdict's output.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # The config and the new job's checkpoints are scratch: the new run keeps what matters, and
    # each reproduction would otherwise leave tens of MB in the temporary directory.
    with tempfile.TemporaryDirectory(prefix="ddplab-reproduce-") as work:
        return _reproduce(run_id, strict, Path(work))


def _reproduce(run_id: str, strict: bool, work: Path) -> int:
    from mlflow.exceptions import MlflowException

    from ..tracking import reachable_client, validated_uri
    from ..tracking.spooled import DELIVERY_S, SpooledClient, home
    from .runner import job_env

    uri = validated_uri()
    client = reachable_client(uri)
    try:
        run = client.get_run(run_id)
        text = client.download_artifacts(run_id, "config.yaml", str(work))
    except MlflowException as e:
        logger("reproduce").error(f"run {run_id} in {uri}: {str(e).splitlines()[0]}")
        return 2
    tags = run.data.tags
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
        cmd = _command(tags, Path(text), sets)
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
    code = subprocess.run(cmd, env=env, check=False).returncode
    # No reason of ours: the job's own ddplab.error, if it sent one, is the right one.
    life.end_if_running(client, new, life.FAILED)
    # The verdict through a spool, as a job's records: a server gone meanwhile loses none.
    recorder = SpooledClient(client, uri, new, run.info.experiment_id, home("reproduce", new))
    verdict = _judge(recorder, run, new, code)
    kept = recorder.close(DELIVERY_S)
    if kept:
        logger("reproduce").warning(kept)
    return verdict


def _judge(client: Any, run: Any, new: str, code: int) -> int:
    """Record and print the verdict on the new run; exit 1 when it differs (or the job
    failed). Timings are in differences.csv and counted in the line, never compared."""
    run_id = run.info.run_id
    verdict, rows = compare(client, run_id, new, compared_keys(run)) if code == 0 \
        else ("differs", [])
    timings = _rows(client, run_id, new, timing_keys(run)) if code == 0 else []
    client.set_tag(new, schema.REPRODUCE_VERDICT, verdict)
    lines = ["metric,step,original,new,abs_diff,compared"] + [
        f"{k},{s},{a!r},{b!r},{abs(a - b)!r},{said}"
        for said, found in (("yes", rows), ("no: a timing", timings)) for k, s, a, b in found]
    client.log_text(new, "\n".join(lines) + "\n", "reproduce/differences.csv")
    worst = max((abs(a - b) for _, _, a, b in rows if not math.isnan(a - b)), default=0.0)
    reported = f"; {len(timings)} timing values reported, not compared" if timings else ""
    exited = f", the job exited {code}" if code else ""
    if verdict == NOTHING:
        what = (f"only timings, {len(timings)} values reported in reproduce/differences.csv, "
                "never compared" if timings else "no metric reproduce compares")
        print(f"reproduce {run_id} -> {new}: {NOTHING} (the run logged {what})")
    else:
        print(f"reproduce {run_id} -> {new}: {verdict} ({len(rows)} values compared, largest "
              f"difference {worst:.3g}{reported}{exited})")
    return 0 if verdict != "differs" else 1
