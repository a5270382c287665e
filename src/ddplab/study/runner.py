"""``ddplab study run FILE``: every job of a study, each by its real launcher, as one MLflow
parent run with one ordinary ddplab run nested under it per job.

Jobs already FINISHED under the study's parent are not run again (``--fresh`` starts a new
parent); a failed job is recorded and the study goes on; Ctrl-C, SIGTERM or SIGHUP end the
running job and the parent KILLED, leaving no run RUNNING (and a study SIGKILLed takes its job with
it). The report (report.py) is built at the end.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..config import ConfigError
from ..subprocs import own_temp, run_tied, stop_on_termination
from ..tracking import life, schema
from ..tracking.naming import typed_command
from .spec import Study, Variant, as_text

PARENT, CHILD = "parent", "job"


COMPOSE = {"compose": ("multinode.yml", "node"), "compose-mpi": ("mpi.yml", "launcher")}


def checkout(study: Study) -> Path:
    """The ddplab checkout the study belongs to (its compose/ and slurm/ folders): the nearest
    folder above the study file, else above the working directory, else the checkout this
    package was installed from in place (pip install -e), that holds them; else the working
    directory. An installed package's own location (site-packages) holds neither."""
    source = Path(__file__).resolve().parents[3]
    for start in (study.path.resolve().parent, Path.cwd(), source):
        for folder in (start, *start.parents):
            if (folder / "compose" / "multinode.yml").is_file():
                return folder
    return Path.cwd()


CHECKPOINT_DIR = "checkpoint.dir"


def studies_dir(sets: list[str]) -> Path:
    """Where a study keeps its jobs' checkpoints and logs: ``studies/`` in the
    ``checkpoint.dir`` the user gave (the study's ``set``, a variant's, ``$DDPLAB_SET``, the
    command line's ``--set``: the last), else in ``checkpoints/``."""
    import yaml

    given = [text.split("=", 1)[1] for text in sets
             if text.split("=", 1)[0].strip() == CHECKPOINT_DIR]
    return Path(str(yaml.safe_load(given[-1])) if given else "checkpoints") / "studies"


def _sets(study: Study, v: Variant, repeat: int) -> list[str]:
    sets = [as_text(o) for o in v.overrides(study.set, list(study.extra))]
    ck = studies_dir(sets) / study.name / f"{v.name}-r{repeat}"
    return [t for t in sets if t.split("=", 1)[0].strip() != CHECKPOINT_DIR] + [
        f"{CHECKPOINT_DIR}={ck}", "checkpoint.resume=never"]  # a job never resumes another's


def sbatch_script(study: Study) -> Path:
    """The batch script slurm variants submit: $DDPLAB_SBATCH_SCRIPT, else the checkout's
    slurm/cpu.sbatch, else ./slurm/cpu.sbatch (where the images keep it)."""
    chosen = os.environ.get("DDPLAB_SBATCH_SCRIPT", "")
    if chosen:
        return Path(chosen)
    here = checkout(study) / "slurm" / "cpu.sbatch"
    return here if here.is_file() else Path("slurm", "cpu.sbatch").resolve()


def command(study: Study, v: Variant, repeat: int) -> list[str]:
    """The job exactly as a user would type it (the launcher's own CLI)."""
    from ..launchers import targets

    sets = _sets(study, v, repeat)
    if v.launcher == "slurm":
        # Submitted to the cluster this host is a login node of; --wait returns the job's code.
        return targets.Sbatch(v.nnodes, v.nproc, f"ddplab-{study.name}-{v.name}",
                              sbatch_script(study)).argv(study.experiment, sets)
    if v.launcher in COMPOSE:
        file, service = COMPOSE[v.launcher]
        # mpi.yml's workers serve ssh until stopped: the launcher's exit ends the job.
        mpi = v.launcher == "compose-mpi"
        return targets.Compose(checkout(study) / "compose" / file,
                               ["worker", "launcher"] if mpi else [service],
                               "launcher" if mpi else "").argv()
    return local_launch(v.launcher, v.nproc * v.nnodes, targets.train_job(study.experiment, sets))


def local_launch(launcher: str, ranks: int, train: list[str]) -> list[str]:
    """``ranks`` processes of ``python <train>`` on this host, by mpirun or torchrun (or the
    launch environment a run recorded: targets.DETECTED); they get the run and the rendezvous
    from job_env(), and mpirun's ranks the tracking login this process has."""
    from ..credentials import CREDENTIALS
    from ..launchers import targets

    return targets.local(launcher, ranks, [k for k in CREDENTIALS if k in os.environ]).argv(train)


def job_env(run_id: str, uri: str) -> dict[str, str]:
    """A job launched into a run made beforehand (its rank 0 attaches to MLFLOW_RUN_ID)."""
    return {**os.environ, "MLFLOW_RUN_ID": run_id, "MLFLOW_TRACKING_URI": uri,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}


def compose_env(study: Study, v: Variant, repeat: int, uri: str) -> dict[str, str]:
    """What the compose files read: the layout, the experiment as the image holds it, the
    overrides, and the study's tracking server under the name containers reach the host by."""
    sets = _sets(study, v, repeat)
    # Only a study's own dist.backend reaches BACKEND: unset, the experiment's stands.
    backend = next((s.split("=", 1)[1] for s in reversed(sets) if s.startswith("dist.backend=")),
                   "")
    return {"NNODES": str(v.nnodes), "NPROC_PER_NODE": str(v.nproc), "SLOTS": str(v.nproc),
            "EXPERIMENT": str(study.experiment.resolve().relative_to(checkout(study))),
            "BACKEND": backend,
            "DDPLAB_SET": " ".join(shlex.quote(s) for s in sets
                                   if not s.startswith("dist.backend=")),
            "DDPLAB_TRACKING_URI": in_containers(uri), "DDPLAB_UI_URL": uri,
            # The study's server, not compose's own (--no-deps: its login is never made); this
            # process's credentials, if any, reach the jobs through MLFLOW_TRACKING_*.
            "MLFLOW_TRACKING_USERNAME_FILE": "", "MLFLOW_TRACKING_PASSWORD_FILE": "",
            "COMPOSE_PROJECT_NAME": re.sub(r"[^a-z0-9_-]", "",
                                           f"ddplabstudy{os.getpid()}-{v.name.lower()}-{repeat}")}


def in_containers(uri: str) -> str:
    """This host's address as compose's containers reach it (compose: host-gateway)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if parts.hostname in ("127.0.0.1", "localhost", "0.0.0.0"):
        netloc = "host.docker.internal" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return uri


def _check_compose(study: Study, v: Variant, uri: str) -> None:
    where = f"{study.path}: variant {v.name}: launcher {v.launcher}"
    repo = checkout(study)
    if not (repo / "compose" / COMPOSE[v.launcher][0]).is_file():
        raise ConfigError(f"{where}: compose variants run from a ddplab checkout (its compose/ "
                          "folder above the study file or the working directory); none found")
    if not uri.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: the jobs run in containers and need a tracking SERVER "
                          f"(MLFLOW_TRACKING_URI={uri} is a local store): start `mlflow server "
                          "--host 0.0.0.0 --allowed-hosts host.docker.internal:PORT,localhost:PORT` "
                          "and set MLFLOW_TRACKING_URI=http://localhost:PORT")
    try:
        study.experiment.resolve().relative_to(repo / "experiments")
    except ValueError:
        raise ConfigError(f"{where}: the experiment {study.experiment} is not under "
                          f"{repo / 'experiments'}, so the image does not hold it") from None
    if not shutil.which("docker") or subprocess.run(
            ["docker", "info"], capture_output=True, check=False).returncode:
        raise ConfigError(f"{where}: needs a running Docker engine (`docker info` must answer)")


def _check_slurm(study: Study, v: Variant, uri: str) -> None:
    where = f"{study.path}: variant {v.name}: launcher slurm"
    if not shutil.which("sbatch"):
        raise ConfigError(f"{where}: sbatch is not on PATH: run the study on a Slurm login node")
    if not sbatch_script(study).is_file():
        raise ConfigError(f"{where}: no batch script at {sbatch_script(study)} (set "
                          "DDPLAB_SBATCH_SCRIPT, or run from a ddplab checkout)")
    if not uri.startswith(("http://", "https://")):
        raise ConfigError(f"{where}: the jobs run on compute nodes and need a tracking SERVER "
                          f"(MLFLOW_TRACKING_URI={uri} is a local store): point "
                          "MLFLOW_TRACKING_URI at the site's MLflow server")


def check_launchers(study: Study, uri: str) -> None:
    """Everything the plan needs is here, before anything starts."""
    for v in study.variants:
        if v.launcher in COMPOSE:
            _check_compose(study, v, uri)
        if v.launcher == "torchrun" and v.nnodes > 1:
            raise ConfigError(f"{study.path}: variant {v.name}: nnodes {v.nnodes} with torchrun "
                              "on one host: use launcher mpirun, or one node")
        if v.launcher == "slurm":
            _check_slurm(study, v, uri)
        if v.launcher == "mpirun" and not shutil.which("mpirun"):
            raise ConfigError(f"{study.path}: variant {v.name}: launcher mpirun, but mpirun is "
                              "not installed here (Debian: apt-get install openmpi-bin)")


LOCAL_LAUNCHERS = ("torchrun", "mpirun")


def check_variants(study: Study) -> None:
    """Each variant passes the checks its job would run, before any run exists: a variant that
    cannot run (fp16 without CUDA, a batch that does not add up) is one line, not a FAILED
    child found later."""
    import torch

    cuda = torch.cuda.is_available()
    for v in study.variants:
        if cannot_run_here(study, v):
            continue  # skipped with its reason when its turn comes
        from ..training import checks

        try:
            checks.for_variant(study.config(v), v.nproc * v.nnodes, v.launcher in LOCAL_LAUNCHERS,
                               cuda, study.experiment)
        except ConfigError as e:
            raise ConfigError(f"{study.path}: variant {v.name}: {e}") from None


def settings_digest(study: Study) -> dict[str, str]:
    """What makes a study's jobs comparable with each other: the settings and the experiment
    file (not the number of repeats, which a rerun may raise)."""
    import hashlib
    import json

    def digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"set": digest([study.set, [as_text(o) for o in study.extra]]),
            "variants": digest([(v.name, v.nproc, v.nnodes, v.launcher, v.set) for v in study.variants]),
            "experiment": digest(study.experiment.read_text(errors="replace")),
            **{kind: digest(files) for kind, files in _own_code(study).items()}}


def _own_code(study: Study) -> dict[str, list[str]]:
    """The user's code each variant runs, by content (sha256): the script (an experiment
    file's ``script.path``, or a variant's own), or the loop's own model, data and loss
    modules (``package.module:callable``; not an installed library's). Either edited since
    made a rerun's new jobs run other code than the FINISHED ones it skipped (a hostile pass)."""
    from ..config import is_import_path
    from ..workload.userparts import module_file, sha256

    folder = str(study.experiment.resolve().parent)
    scripts, modules = set(), set()
    for v in study.variants:
        cfg = study.config(v)
        if cfg.kind == "script":
            scripts.add(cfg.script.file())
            continue
        for part in (cfg.model.name, cfg.data.dataset, cfg.train.loss):
            file = module_file(part, folder) if is_import_path(part) else None
            if file is not None and not {"site-packages", "dist-packages"} & set(file.parts):
                modules.add(file)
    # By content alone: the same code checked out elsewhere, or found from another folder, is
    # the same study.
    return {kind: sorted({sha256(f) for f in files})
            for kind, files in (("scripts", scripts), ("modules", modules))}


def cannot_run_here(study: Study, v: Variant) -> str:
    """Why this host cannot run the variant at all ("" if it can): a GPU variant needs one
    visible GPU per rank."""
    cfg = study.config(v)
    if cfg.kind == "script":  # its own init_process_group chooses (dist.backend: not read)
        return ""
    if cfg.dist.device != "cuda" and cfg.dist.backend != "nccl":
        return ""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = v.nproc * v.nnodes
    return "" if need <= visible else f"needs {need} GPU(s), {visible} visible here"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Tracker:
    """The study's parent run and its children, through MLflow's client; the parent's own
    records through a spool (tracking/spooled.py), as a job's are: a server gone at the end
    loses none of them, and ``ddplab sync`` sends what it did not take."""

    def __init__(self, uri: str, study: Study) -> None:
        from ..tracking import experiment_id, reachable_client

        # Read once, at the start: the study's end must not depend on the experiment file still
        # loading hours later (an edit meanwhile would leave the parent RUNNING, undelivered).
        self.delivery_s = study.delivery_timeout_s()
        self.client: Any = reachable_client(uri)
        self.uri, self.study = uri, study
        self.exp_id = experiment_id(self.client, study.name)

    def parent(self, fresh: bool, resolved: str) -> str:
        """The parent run (continued, or new); from here its records go through its spool."""
        from ..tracking import spooled

        run_id = self._parent(fresh, resolved)
        self.client = spooled.SpooledClient(self.client, self.uri, run_id, self.exp_id,
                                            self._home(run_id))
        return run_id

    def _home(self, run_id: str) -> Path:
        """Where the parent's spool waits for the server (tracking/spooled.py)."""
        from ..tracking import spooled

        return spooled.home("studies", f"{self.study.name}/parent-{run_id}")

    def _parent(self, fresh: bool, resolved: str) -> str:
        found = [] if fresh else self.client.search_runs(
            [self.exp_id], f"tags.{schema.STUDY_ROLE} = '{PARENT}'", order_by=["start_time DESC"],
            max_results=1)
        digest = {schema.study_digest_tag(k): v for k, v in settings_digest(self.study).items()}
        if found:
            run_id: str = found[0].info.run_id
            self._same_settings(found[0], digest)
            self._deliver_left(run_id)
            self.client.update_run(run_id, status="RUNNING")
            # The study as it is now (its metric, its file may have changed since), not as
            # the run that made the parent had it.
            for k, v in {**digest, schema.STUDY_COMMAND: typed_command(),
                         schema.STUDY_FILE: str(self.study.path)}.items():
                self.client.set_tag(run_id, k, v)
            from ..logins import mask

            self.client.log_text(run_id, mask(resolved), "study.yaml")
            self._end_stale_children(run_id)
            return run_id
        from ..logins import mask
        from ..tracking import capsule

        tags = {**digest, schema.STUDY: self.study.name, schema.STUDY_ROLE: PARENT,
                schema.STUDY_FILE: str(self.study.path), schema.GIT_SHA: capsule.git_sha(),
                schema.HOST: socket.gethostname(), schema.STUDY_COMMAND: typed_command(),
                "mlflow.note.content": self.study.description or f"study {self.study.name}"}
        run = life.create(self.client, self.exp_id, f"study {self.study.name}", tags)
        self.client.log_text(run.info.run_id, mask(resolved), "study.yaml")
        return str(run.info.run_id)

    def _deliver_left(self, run_id: str) -> None:
        """What an earlier `ddplab study run` of this parent could not send (its server went):
        sent first, its end included, before this one continues the parent."""
        from ..tracking import TrackingError, spool, spooled

        folder = spooled.folder(self._home(run_id))
        if (folder / "meta.json").is_file():
            out = spool.deliver(folder, self.client, lambda: False,
                                self.delivery_s, final=True)
            if out.left:
                raise TrackingError(f"{folder}: {out.left} records of the parent run, left by an "
                                    f"earlier run of this study, could not be sent ({out.error})")

    def _same_settings(self, parent: Any, digest: dict[str, str]) -> None:
        """A rerun continues its parent only with the same settings: otherwise its FINISHED
        jobs (skipped now) and the new ones would be compared as if they were alike."""
        changed = [k.rsplit(".", 1)[1] for k, v in digest.items()
                   if parent.data.tags.get(k, v) != v]
        if changed:
            # (--variants makes a study of some variants, a quick look's --set other settings)
            how = " (--variants or --set choose them too)" if "variants" in changed or \
                "set" in changed else ""
            raise ConfigError(
                f"{self.study.path}: the study's {', '.join(changed)} changed since its parent run "
                f"{parent.info.run_id}{how}: its FINISHED jobs would be mixed with jobs of other "
                "settings. Run with --fresh to start a new parent run (the old one stays)")

    def _end_stale_children(self, parent_id: str) -> None:
        """Children an earlier study process left RUNNING (it was killed outright): end them, so
        they run again and nothing stays RUNNING."""
        for c in self.children(parent_id):
            if c.info.status == "RUNNING":
                self.close_child(c.info.run_id, "left RUNNING when an earlier `ddplab study run` "
                                 "was killed; ended by the next one, which runs the job again")

    def children(self, parent_id: str) -> list[Any]:
        runs: list[Any] = self.client.search_runs(
            [self.exp_id], f"tags.mlflow.parentRunId = '{parent_id}'", max_results=5000)
        return runs

    def child(self, parent_id: str, v: Variant, repeat: int) -> str:
        tags = {"mlflow.parentRunId": parent_id, schema.STUDY: self.study.name,
                schema.STUDY_ROLE: CHILD, schema.VARIANT: v.name,
                schema.REPEAT: str(repeat), schema.REQUESTED_LAUNCHER: v.launcher}
        run_id: str = life.create(self.client, self.exp_id, f"{v.name} r{repeat}", tags).info.run_id
        return run_id

    def name_child(self, run_id: str, v: Variant, repeat: int, tags: dict[str, str]) -> None:
        """The child's name says what ran, in the one layout vocabulary (nodes x ranks x
        threads), and a backend that fell back says so: "2r-1t-ccl r0: gloo (fell back from
        ccl) 1n x 2r x 1t"."""
        if schema.BACKEND not in tags:
            return  # the job never started: the name stays the variant's
        backend, asked = tags[schema.BACKEND], tags.get(schema.BACKEND_REQUESTED, "auto")
        if asked not in ("auto", backend):
            backend = f"{backend} (fell back from {asked})"
        layout = (f"{tags.get(schema.NNODES, '?')}n x {tags.get(schema.NPROC_PER_NODE, '?')}r x "
                  f"{tags.get(schema.THREADS_PER_RANK, '?')}t")
        self.client.set_tag(run_id, "mlflow.runName", f"{v.name} r{repeat}: {backend} {layout}")

    def close_child(self, run_id: str, why: str, status: str = "FAILED") -> str:
        """A job that died before ending its run (bad input, a launcher failure): end it."""
        return life.end_if_running(self.client, run_id, status, why)


def _run_job(cmd: list[str], env: dict[str, str], log: Path) -> int:
    # torchrun's log dir a folder of ours, gone with the job: without one torchrun makes and
    # leaves a /tmp/torchelastic_* for every job (two per 2-job study, a hostile pass)
    logs = None if "PET_LOG_DIR" in env else own_temp("torchrun", folder=True)
    with log.open("w") as out:
        try:
            return run_tied(cmd, {**env, "PET_LOG_DIR": str(logs)} if logs else env, stdout=out)
        finally:
            if logs:
                shutil.rmtree(logs, ignore_errors=True)
            if cmd[:2] == ["docker", "compose"]:  # containers and volumes go with the job
                subprocess.run([*cmd[:4], "down", "-v", "--remove-orphans"], env=env,
                               stdout=out, stderr=subprocess.STDOUT, check=False)


def make_console() -> Any:
    """Rich on a terminal; wide plain lines in a pipe or log (rich would fold the table to 80)."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True,
                   width=None if sys.stdout.isatty() else 200)


def run(study: Study, uri: str, fresh: bool, dry_run: bool, resolved: str) -> int:
    from ..logins import mask

    console = make_console()
    plan = study.plan()
    if dry_run:
        console.print(f"study {study.name}: {len(plan)} jobs ({len(study.variants)} variants x "
                      f"{study.repeats} repeats), nothing run (--dry-run)")
        console.print(f"compares {study.direction}; baseline {study.baseline}", soft_wrap=True)
        for v, r in plan:
            env = (" ".join(f"{k}={shlex.quote(x)}" for k, x in compose_env(study, v, r, uri).items())
                   + " " if v.launcher in COMPOSE else "")
            # Through the one credential filter: a URL's password in a set (a database URI's,
            # which no job takes out) is printed as ***.
            console.print(mask(f"  {v.name} r{r}: {env}{' '.join(command(study, v, r))}"),
                          soft_wrap=True, markup=False)
        return 0
    check_launchers(study, uri)
    check_variants(study)
    tracker = Tracker(uri, study)
    parent_id = tracker.parent(fresh, resolved)
    done = {(c.data.tags.get(schema.VARIANT), c.data.tags.get(schema.REPEAT))
            for c in tracker.children(parent_id) if c.info.status == "FINISHED"}
    study_sets = [as_text(o) for o in Variant(name="", set={}).overrides(study.set,
                                                                         list(study.extra))]
    logs = studies_dir(study_sets) / study.name / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    from ..tracking import ui_address
    from ..tracking.ui_views import STUDY_VIEW, save_study_view
    from .report import answer_key

    save_study_view(tracker.client, tracker.exp_id, [v.name for v in study.variants],
                    answer_key(study.metric), study.metric)
    console.print(f"study {study.name}: parent run {parent_id}; its jobs, one row each, as "
                  f"they finish{ui_address(uri, tracker.exp_id, view=STUDY_VIEW)}", soft_wrap=True)
    console.print(f"compares {study.direction}; baseline {study.baseline}", soft_wrap=True)
    status = "FAILED"
    try:
        stop_on_termination()
        _run_all(study, plan, tracker, parent_id, done, logs, console)
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        console.print("interrupted: the study's parent run ends KILLED")
    finally:
        from . import report

        try:
            tracker.client.deliver(5.0)  # what the report reads back (skipped variants)
            report.build(tracker.client, parent_id, study, console, uri,
                         interrupted=status == "KILLED")
        except KeyboardInterrupt:  # (while the report was made: it would end FINISHED without it)
            status = "KILLED" if status == "FINISHED" else status
            console.print("interrupted while its report was made: the study's parent run ends "
                          "KILLED; run the study again to make it (its jobs are not run again)")
        finally:
            life.end(tracker.client, parent_id, status)
            kept = tracker.client.close(tracker.delivery_s)
            if kept:
                console.print(f"WARNING: the study's parent {kept}", soft_wrap=True)
    return 0 if status == "FINISHED" else 130 if status == "KILLED" else 1


def _run_all(study: Study, plan: list[tuple[Variant, int]], tracker: Tracker, parent_id: str,
             done: set[tuple[str, str]], logs: Path, console: Any) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    # The ETA comes from the jobs this study has run (rich's own estimate looks at its last 30 s,
    # and every job is longer than that: it showed -:--:-- for a whole study).
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"))
    durations: list[float] = []
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(study.name, total=len(plan), eta="after the first job")
        for i, (v, r) in enumerate(plan):
            if durations:
                left = sum(durations) / len(durations) * (len(plan) - i)
                progress.update(task, eta=time.strftime("%H:%M:%S", time.gmtime(left)))
            progress.update(task, description=f"{v.name} r{r}")
            reason = cannot_run_here(study, v)
            if reason:
                console.print(f"{v.name} r{r}: skipped: {reason}")
                tracker.client.set_tag(parent_id, schema.skipped_tag(v.name), reason)
                progress.advance(task)
                continue
            if (v.name, str(r)) in done:
                console.print(f"{v.name} r{r}: already FINISHED in this study, skipped")
                progress.advance(task)
                continue
            t0 = time.monotonic()
            console.print(_one_job(study, v, r, tracker, parent_id, logs))
            durations.append(time.monotonic() - t0)
            progress.advance(task)


def _one_job(study: Study, v: Variant, r: int, tracker: Tracker, parent_id: str,
             logs: Path) -> str:
    run_id = tracker.child(parent_id, v, r)
    env = job_env(run_id, tracker.uri)
    if v.launcher in COMPOSE:
        env |= compose_env(study, v, r, tracker.uri)
    if v.launcher == "slurm":  # the ranks find their master in the allocation, not here
        env = {k: x for k, x in env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    # One file per attempt, named by its run: a rerun of a failed job, or a --fresh study, wrote
    # over the file the earlier run's error and the study's printed line point to.
    log = logs / f"{v.name}-r{r}-{run_id[:8]}.log"
    t0 = time.monotonic()
    try:
        code = _run_job(command(study, v, r), env, log)
    except KeyboardInterrupt:
        tracker.close_child(run_id, "interrupted (Ctrl-C) during the study", "KILLED")
        raise
    status = tracker.close_child(run_id, f"the job exited {code} before ending its run; "
                                         f"its output: {log}")
    done = tracker.client.get_run(run_id)
    tracker.name_child(run_id, v, r, done.data.tags)
    line = (f"{v.name} r{r}: {status} in {time.monotonic() - t0:.0f} s, "
            f"{job_figures(study, done.data.metrics)}")
    if status == "FINISHED":
        return line
    from ..tracking.life import error_line

    error = error_line(done.data.tags)  # (the job's own, not "the job exited N" said above)
    why = f": {error[:300]}" if error and not error.startswith("the job exited") else ""
    return f"{line}{why} (exit {code}; log {log})"


def job_figures(study: Study, m: dict[str, float]) -> str:
    """What a job's result line says of it: the compared figure (throughput in samples/s,
    another metric by its name), and eval accuracy where the job logged one; what it did not
    log is said, never shown as 0 or nan (a script logs neither samples/s nor eval/accuracy)."""
    from .table import is_throughput

    value = m.get(study.metric)
    if is_throughput(study.metric):
        value = m.get("train/samples_per_s") if value is None else value  # a job that died early
        said = f"{value:,.0f} samples/s" if value is not None else "no samples/s logged"
    else:
        said = f"{study.metric} {value:.4g}" if value is not None else f"{study.metric} not logged"
    if "eval/accuracy" in m and study.metric != "eval/accuracy":
        said += f", eval accuracy {m['eval/accuracy']:.4f}"
    return said
