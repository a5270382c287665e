"""The job's one run, open while it trains and ended once whatever happens, and its name."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..agent.handle import start_delivery
from ..agent.protocol import forensics_dir, release_runs
from ..distributed.group import flight_records
from ..errors import DdplabError
from ..forensics import heartbeat
from ..launchers import LaunchEnv
from ..log import logger
from . import spool
from .tracker import MlflowTracker, NullTracker, RunRef, Share, open_tracker

if TYPE_CHECKING:
    from ..agent.handle import Delivery, NoDelivery
    from ..config import ExperimentConfig
    from ..distributed.layout import Layout


class JobSignals(Protocol):
    """How an interrupted job ends: training.jobend.Signals (a room above this one)."""

    def status(self) -> str:
        """The status of a run the first signal stopped."""
        ...

    def shield(self) -> None:
        """From here on no signal interrupts: the run's ending must reach the store."""
        ...

    def cause(self, e: BaseException) -> BaseException:
        """Why the rank ends: the signal's exception when ``e`` came of it, else ``e``."""
        ...


@contextlib.contextmanager
def job_run(cfg: ExperimentConfig, le: LaunchEnv, layout: Layout | None, resume_run_id: str,
            signals: JobSignals, share: Share | None = None, run_name: str = "",
            beats: bool = True) -> Iterator[NullTracker]:
    """The job's one run, open while training: node system metrics beside it, and ended once
    whatever happens: FINISHED, KILLED (Ctrl-C) or FAILED with the error recorded. At the end
    each node's delivery process gets ``tracking.delivery_timeout_s`` to send what is left;
    what the server did not take stays in the spool for ``ddplab sync`` (``run.left``).

    ``signals`` says how an interrupted job ends (``status()``) and, once the ending starts,
    stops further signals from cutting it (``shield()``). An exception may carry its own
    ``status`` (a stopped script: KILLED) and ``detail`` (the error to record instead of
    ddplab's traceback).

    ``share`` and ``run_name``: script mode, which has no process group (the store shares the
    run) and no layout of ddplab's (the name says so). ``beats``: every rank keeps a heartbeat
    its node's delivery process watches (forensics/); in script mode the script's own process
    beats instead, from the observation's hooks (training/scriptmode/observe.py).
    """
    # MLflow prints its own "View run at <tracking URI>" when a run ends; inside compose or a
    # cluster that is an in-network name the browser cannot open. ddplab prints the run's
    # address itself, in the browser's terms (jobend.where, DDPLAB_UI_URL).
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    # Absolute from the start: a job whose folder is deleted under it (cwd and all) still has a
    # path to put its spool back at and end its run by (relative, the run stayed RUNNING).
    spool_root = (Path(cfg.checkpoint.dir) / cfg.name).absolute()
    # A name a person can tell apart in the runs table (unless tracking.run_name is set).
    # (A job without ddplab's layout, script mode, names its run itself: run_name.)
    default_name = run_name or f"{cfg.name} {layout_name(layout) if layout else '?'} {le.launcher}"
    delivery = start_delivery(cfg, le)
    cpu0 = time.process_time()
    try:
        run, ref = open_tracker(cfg.tracking, le, cfg.name, cfg.description, resume_run_id,
                                spool_root, default_name, **({"share": share} if share else {}),
                                opener=delivery.open_run)
        run.open_cpu_s = time.process_time() - cpu0 if le.is_rank0 else 0.0
        delivery.attach(spool.spool_dir(spool_root, ref.run_id, le.node_rank), ref)
    except BaseException as e:
        # Nothing to deliver: it must not outlive the job. A stop (Ctrl-C) ends its run KILLED.
        if signals.status() == "KILLED":
            delivery.cancel("KILLED", _stopped_by(signals.cause(e)))
        elif isinstance(e, OSError) and e.errno in FULL_OR_LOCKED and e.filename and \
                Path(str(e.filename)).resolve().is_relative_to(spool_root.resolve()):
            # (the spool's folder, in checkpoint.dir: a full disk there at the start was a
            # traceback, and the run's error only "see the job's console", a hostile pass)
            said = f"checkpoint.dir {cfg.checkpoint.dir}: {e.strerror} ({e.filename})"
            delivery.cancel("FAILED", said)
            raise FolderUnwritable(said) from None
        else:
            delivery.cancel()
        release_runs()
        raise
    if isinstance(run, MlflowTracker):
        run.open_spool(delivery.directory)
    run.delivery = delivery
    if beats and ref.run_id:
        heartbeat.start(forensics_dir(spool.spool_dir(spool_root, ref.run_id, le.node_rank)),
                        le.rank, le.world_size, flight_records)
    before = _user_code_logs_here(run)
    status, error = "FAILED", ""
    try:
        yield run
        status, error = run.asked or ("FINISHED", "")
    except BaseException as e:
        # The ending begins here. A signal now (torchrun's SIGTERM once a peer died, just as
        # this rank's own collective failed) would cut this block and leave the run FAILED
        # with no error recorded (seen in CI).
        signals.shield()
        e = signals.cause(e)  # (a write the launcher's SIGTERM cut short: the stop, not the write)
        status = getattr(e, "status", None) or signals.status()
        # (ddplab's own errors say what happened in their line: its frames are no help)
        error = getattr(e, "detail", None) or (
            _stopped_by(e) if status == "KILLED"
            else f"{type(e).__name__}: {e}" if isinstance(e, DdplabError)
            else f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        heartbeat.failed(error)
        raise
    finally:
        signals.shield()
        heartbeat.stop("done" if status == "FINISHED" else "failed")
        _restore(before)
        lost = _spool_lost(run, delivery, ref)
        finished = status == "FINISHED"
        if lost and isinstance(run, MlflowTracker):
            status, error = "FAILED" if finished else status, f"{lost}\n\n{error}".strip()
        elif lost:  # another node's spool: rank 0 decides the run's status
            logger().error(lost)
        run.finish(status, error)
        release_runs()  # (the run's folder: another job may resume it now)
        run.left = delivery.close()
        if run.left:
            _say_left(run.left, ref.uri, delivery.directory)
        if lost and isinstance(run, MlflowTracker) and run.left:
            _end_directly(run, lost)
        if status != "FINISHED" and not le.is_rank0 and (le.is_node_leader or le.rank == 1):
            # Watched from a detached process: this rank must exit now (see orphan.py).
            if run.run_id:
                from ..agent import orphan

                orphan.start(run.uri, run.run_id, error.split("\n", 1)[0], orphan.GRACE_S,
                             spool.spool_dir(spool_root, run.run_id, 0))
        if lost and finished and isinstance(run, MlflowTracker):
            raise SpoolLost(lost)  # the job did not fail otherwise: this is why it failed


def _stopped_by(e: BaseException) -> str:
    """A stopped job's error: what stopped it (Ctrl-C, a closed terminal, its launcher's end)."""
    return "interrupted (SIGINT / Ctrl-C)" if isinstance(e, KeyboardInterrupt) else str(e)


FULL_OR_LOCKED = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
"""The errors of a folder that cannot take a file: full, over quota, read-only, not ours."""


class FolderUnwritable(DdplabError):
    """The run's spool could not be written where the job keeps it (checkpoint.dir)."""


class SpoolLost(DdplabError):
    """The run's spool was deleted during the job: the run ended FAILED, saying so."""

    status = "FAILED"


def _spool_lost(run: NullTracker, delivery: Delivery | NoDelivery, ref: RunRef) -> str:
    """What happened when this node's spool was deleted during the job (the script removed
    ``$DDPLAB_SPOOL``, or the whole run folder), else "". The spool is put back (meta.json, and
    rank 0's records from the deleted file, still open here) so the run's end and what follows
    are delivered, the delivery process sees the job close, and ``ddplab sync`` finds it."""
    directory = delivery.directory
    if not ref.run_id or directory == Path():
        return ""
    records = run.records if isinstance(run, MlflowTracker) else None
    if not spool.vanished(directory, records):
        return ""
    kept, dropped = 0, 0
    with contextlib.suppress(OSError):  # a full disk: the run is ended directly (below)
        spool.Meta(ref.uri, ref.run_id, ref.experiment_id).write(directory)
        if records is not None and records.unlinked():
            kept, dropped = records.salvage()
    own = ("ddplab's own records were recovered" if dropped == 0 else
           "ddplab's own records are lost too" if dropped < 0 else
           f"{dropped} of ddplab's own records are lost too (files that went with it)")
    with contextlib.suppress(OSError):  # (the job's folder deleted too: no cwd to resolve by)
        directory = directory.resolve()
    return (f"the run's spool {directory} was deleted during the job (by the script?): what "
            "it held and had not delivered yet is lost (the script's ddplab.track records, "
            f"system metrics); {own}")


def _end_directly(run: MlflowTracker, why: str) -> None:
    """The run's end did not get through the spool put back: end it through MLflow's client,
    as the tracker does when the spool cannot be written. It must not stay RUNNING."""
    from .opening import end_failed

    try:
        if run.client.get_run(run.run_id).info.status == "RUNNING":
            end_failed(run.client, run.run_id, why)
    except Exception as e:  # noqa: BLE001 - the server is down: `ddplab sync` ends it later
        logger().error(f"run {run.run_id} could not be ended FAILED ({type(e).__name__}: "
                       f"{str(e)[:200]}); `ddplab sync` ends it once the server answers")


RUN_ENV = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI")


def _user_code_logs_here(run: NullTracker) -> dict[str, str | None]:
    """User code in this job logs into its one run: ``ddplab.track`` through rank 0's tracker,
    and plain ``mlflow.log_metric`` (MLflow's fluent API attaches to ``MLFLOW_RUN_ID``) instead
    of creating a second run in experiment "Default". Returns what to restore afterwards (a
    process may run several jobs: tests, studies in-process)."""
    from .. import track

    before = {k: os.environ.get(k) for k in RUN_ENV}
    track.use(run if isinstance(run, MlflowTracker) else None)
    if run.run_id:
        os.environ.update(dict(zip(RUN_ENV, (run.run_id, run.uri), strict=True)))
    return before


def _restore(before: dict[str, str | None]) -> None:
    from .. import track

    track.use(None)
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def layout_name(layout: Layout) -> str:
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
        logger().warning(
            f"the tracking server {uri} did not take {left - refused} records within "
            f"tracking.delivery_timeout_s{f' (last: {last})' if last else ''}; they are kept in "
            f"{directory}: deliver them with `ddplab sync {run_dir}`")
    if refused:
        logger().warning(
            f"the tracking server refused {refused} records as invalid; they are kept with its "
            f"reasons in {directory / spool.REJECTED} (`ddplab sync {run_dir}` lists them)")
