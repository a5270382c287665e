"""ddplab's run vocabulary: the one place where every ``ddplab.*`` tag a run carries is named.

Who writes a tag and who reads it (the study table, ``ddplab diagnose``, ``ddplab reproduce``,
the UI's saved views) name it here, never as a string of their own, as MLflow names its own
``mlflow.*`` tags in ``mlflow/utils/mlflow_tags.py``; tests/test_schema.py checks that no
other module spells a ``ddplab.`` name, and that every tag read is one something writes.
MLflow's limits on what a run keeps are here too.

Standard library only, and nothing of ddplab: every layer imports this module (the delivery
process and a user's script among them, which must not pay for torch or mlflow).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

PREFIX = "ddplab."
"""Every tag ddplab writes starts so."""

# --- MLflow's limits ------------------------------------------------------------------------
PARAM_LIMIT = 6000
"""Characters MLflow keeps of a param's value."""
TAG_LIMIT = 8000
"""Characters MLflow keeps of a tag's value."""
BATCH_METRICS, BATCH_PARAMS, BATCH_TAGS = 1000, 100, 100
"""What one ``log_batch`` call takes at most: metrics, params, tags."""

# --- MLflow's own tags that ddplab writes (mlflow/utils/mlflow_tags.py names them) ----------
MLFLOW_USER = "mlflow.user"
"""The UI's "Created by": who ran the job (tracking/life.py)."""
MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE = "mlflow.source.name", "mlflow.source.type"
"""The UI's "Source": the command rank 0 runs (tracking/naming.py's typed_command)."""
MLFLOW_NOTE = "mlflow.note.content"
"""The UI's description."""

# --- Identity: where and what ran (training/job.py and script mode, both by identity_tags) ---
WORLD_SIZE = "ddplab.world_size"
NNODES = "ddplab.nnodes"
NPROC_PER_NODE = "ddplab.nproc_per_node"
LAUNCHER = "ddplab.launcher"
RANK0_HOST = "ddplab.rank0_host"
MACHINE = "ddplab.machine"
GIT_SHA = "ddplab.git_sha"
LOCK = "ddplab.lock"
TORCH_BUILD = "ddplab.torch_build"
IMAGE = "ddplab.image"
RESUMED_FROM = "ddplab.resumed_from"
VERSION_PREFIX = "ddplab.version."  # version_tag: each package's version
SCRIPT_PARAMS_PREFIX = "ddplab."  # a script run's own config params: a script's are plain names
SLURM_PREFIX = "ddplab.slurm_"  # slurm_tag: the batch scheduler's names (tracking/capsule.py)

# --- How it ran: ddplab's own loop (training/job.py), some also script mode's ending ---------
STRATEGY = "ddplab.strategy"
BACKEND = "ddplab.backend"
BACKEND_REQUESTED = "ddplab.backend_requested"
BACKEND_REASON = "ddplab.backend_reason"
CCL_IMPL = "ddplab.ccl_impl"
DEVICE = "ddplab.device"
HOSTS = "ddplab.hosts"
GIT_DIRTY = "ddplab.git_dirty"
THREADS_PER_RANK = "ddplab.threads_per_rank"
PINNED_CORES = "ddplab.pinned_cores"
IPEX = "ddplab.ipex"
GLOBAL_BATCH = "ddplab.global_batch"
DATA_PER_CLASS = "ddplab.data.per_class"
CONTINUES_RUN = "ddplab.continues_run"
RESUME_CHANGES_PREFIX = "ddplab.resume_changes."  # resume_changes_tag: what a resume changed
USER_PREFIX = "ddplab.user."  # user_tag: the user's own parts (workload/userparts.py)
USER_SEARCH_PATH = "ddplab.user.search_path"
PARAMS_CUT = "ddplab.params_cut"  # params longer than PARAM_LIMIT (tracking/tracker.py)
STOPPED_EARLY = "ddplab.stopped_early"  # training/fit.py
STRAGGLER = "ddplab.straggler"  # training/fit.py, script mode's figures

# --- MFU: its basis (training/mfu.py, script mode's figures) --------------------------------
MFU_FLOPS_PER_SAMPLE = "ddplab.mfu.flops_per_sample"
MFU_FLOPS_SOURCE = "ddplab.mfu.flops_source"
MFU_PEAK_TFLOPS = "ddplab.mfu.peak_tflops"
MFU_PEAK_SOURCE = "ddplab.mfu.peak_source"

# --- Script mode (training/scriptmode/) ------------------------------------------------------
MODE = "ddplab.mode"  # the kind of job: "loop" (ddplab's own) or "script" (config: kind)
SCRIPT = "ddplab.script"
SCRIPT_SHA256 = "ddplab.script_sha256"
SCRIPT_GIT = "ddplab.script_git"
SCRIPT_ARGS = "ddplab.script_args"
SCRIPT_CWD = "ddplab.script_cwd"
"""The directory the script ran in (rank 0's): where a module is found (``-m pkg.train``) and
relative paths start; ``ddplab reproduce`` runs it there again."""
CHECKPOINT_DIR = "ddplab.checkpoint_dir"
SCRIPT_WORLD_SIZE = "ddplab.script_world_size"
SCRIPT_CLOCK = "ddplab.script_clock"
"""What timed the observed steps' phases: "cuda events" (a GPU's, read once it passed them) or
"host" (a CPU's clock; observe.py)."""
SCRIPT_RANKS = "ddplab.script_ranks"
"""How each rank's script ended, for ``ddplab diagnose`` (tracking/postmortem.py): a JSON list,
one entry per rank that did not exit 0, ``{"rank", "host", "code", "why", "stopped",
"where"/"raised_at", "stack"}``, or ``{"rank", "missing": true}`` for a rank that never
reported; ``{"ok": N}`` counts the ranks that exited 0."""
# What the script's own MLflow calls asked for (mlflow_join.py); a second, different ask turns
# the tag into its plural, + "s", a JSON list.
SCRIPT_EXPERIMENT = "ddplab.script_experiment"
SCRIPT_RUN_NAME = "ddplab.script_run_name"
SCRIPT_RUN_DESCRIPTION = "ddplab.script_run_description"
# A run the script made in another tracking store, and that run's way back to the job's run.
SCRIPT_OTHER_RUNS = "ddplab.script_other_runs"
OBSERVED_MIXED = "ddplab.observed_mixed"
"""Names under which the observation's values went into the run before the script (any rank)
logged the same name itself: their series holds both (a comma-separated list)."""
OBSERVED = "ddplab.observed"
"""The names under which script mode's observation logged series into the run, on ddplab's own
step axis (its count of the script's optimizer steps), not the script's (a comma-separated
list): a script that resumes from its own checkpoint repeats steps that axis counts on."""
JOB_RUN_ID = "ddplab.job_run_id"
JOB_TRACKING_URI = "ddplab.job_tracking_uri"

# --- A failure: the error and the forensics (tracking/tracker.py, postmortem.py, ...) --------
CREATED_AS = "ddplab.created_as"
"""A token each run is created with (tracking/life.py): a create whose answer was lost and that
MLflow's client sent again made two runs, found and made one by it."""
ERROR = "ddplab.error"
ERROR_RANK0 = "ddplab.error.rank0"  # rank 0's own error, when ERROR names another rank
VERDICT = "ddplab.verdict"
FORENSICS_PREFIX = "ddplab.forensics."  # forensics_tag: each node's ranks' endings

# --- A study (study/runner.py, study/report.py) ----------------------------------------------
STUDY = "ddplab.study"
STUDY_ROLE = "ddplab.study_role"
STUDY_FILE = "ddplab.study_file"
STUDY_COMMAND = "ddplab.study_command"
STUDY_DIGEST_PREFIX = "ddplab.study_digest."  # study_digest_tag: the settings a rerun must match
HOST = "ddplab.host"  # the host that ran the study
VARIANT = "ddplab.variant"
REPEAT = "ddplab.repeat"
REQUESTED_LAUNCHER = "ddplab.requested_launcher"
SKIPPED_PREFIX = "ddplab.skipped."  # skipped_tag: a variant the study did not run, and why
STUDY_BASELINE = "ddplab.study_baseline"
STUDY_TARGET = "ddplab.study_target"
STUDY_METRIC = "ddplab.study_metric"
STUDY_METRIC_MODE = "ddplab.study_metric_mode"
STUDY_BEST = "ddplab.study.best"  # the report's answer, also a column of the UI's study view
STUDY_VERDICT = "ddplab.study.verdict"
STUDY_WARNINGS = "ddplab.study.warnings"

# --- ddplab reproduce (study/reproduce.py) --------------------------------------------------
REPRODUCES = "ddplab.reproduces"
REPRODUCE_VERDICT = "ddplab.reproduce.verdict"
REPRODUCE_CHANGED = "ddplab.reproduce.changed"
"""What differed from the recorded run before the rerun (its code, packages, script), one line
each: what a "differs" may come from."""

# --- ddplab import (tracking/importer.py) ---------------------------------------------------
IMPORTED_FROM = "ddplab.imported_from"  # the source run's id
IMPORTED_ORIGIN = "ddplab.imported_origin"  # the first store's id of the run (import of import)
IMPORT_INCOMPLETE = "ddplab.import_incomplete"  # there until the copy is whole
IMPORTED_STATUS = "ddplab.imported_status"  # its status where it came from, when not an end

# --- ddplab bench (bench/output.py) ---------------------------------------------------------
KIND = "ddplab.kind"
SUPPORT_PREFIX = "ddplab.support."  # support_tag: which ops a backend supports on a device


# --- Families: one tag per package, part, node, ... -----------------------------------------
def version_tag(name: str) -> str:
    return VERSION_PREFIX + name


def slurm_tag(name: str) -> str:
    return SLURM_PREFIX + name


def user_tag(part: str, key: str | None = None) -> str:
    """``ddplab.user.<part>`` (its import path), ``ddplab.user.<part>.<key>`` (its provenance)."""
    return f"{USER_PREFIX}{part}" + (f".{key}" if key is not None else "")


def resume_changes_tag(step: int) -> str:
    return f"{RESUME_CHANGES_PREFIX}step{step}"


def forensics_tag(node: str) -> str:
    return FORENSICS_PREFIX + node


def study_digest_tag(key: str) -> str:
    return STUDY_DIGEST_PREFIX + key


def skipped_tag(variant: str) -> str:
    return SKIPPED_PREFIX + variant


def support_tag(backend: str, device: str) -> str:
    return f"{SUPPORT_PREFIX}{backend}.{device}"


class Launch(Protocol):
    """What identity_tags reads of a launch (launchers.LaunchEnv)."""

    @property
    def world_size(self) -> int: ...
    @property
    def nnodes(self) -> int: ...
    @property
    def local_world_size(self) -> int: ...
    @property
    def launcher(self) -> str: ...


def identity_tags(le: Launch, *, kind: str, resumed_from: str | None, rank0_host: str, machine: str,
                  git_sha: str, lock: str, torch_build: str, image: str | None,
                  versions: Mapping[str, Any], scheduler: Mapping[str, str]) -> dict[str, Any]:
    """The tags every run carries, of ddplab's loop and of a script alike: the launch, the
    host, the code and environment (an image or a resume absent: "none"), each package's
    version and the batch scheduler's names (``scheduler``: capsule.scheduler_tags()); and
    which kind of job it was (``kind``: config.ExperimentConfig.kind, "loop" or "script")."""
    return {
        MODE: kind, WORLD_SIZE: le.world_size, NNODES: le.nnodes, NPROC_PER_NODE: le.local_world_size,
        LAUNCHER: le.launcher, RANK0_HOST: rank0_host, MACHINE: machine, GIT_SHA: git_sha,
        LOCK: lock, TORCH_BUILD: torch_build, IMAGE: image or "none",
        RESUMED_FROM: resumed_from or "none",
        **{version_tag(k): v for k, v in versions.items()},
        **scheduler,
    }
