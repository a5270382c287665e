"""Study files: a grid of jobs whose comparison is the result.

    name: ch09-threads-vs-processes
    experiment: ../quickstart.yaml       # the base experiment, relative to this file
    set: {train.max_steps: 200}          # overrides for every variant
    repeats: 3                           # each variant this many times, interleaved
    baseline: 1x2                        # speedup and efficiency are relative to it
    variants:
      - {name: 1x2, nproc: 1, set: {dist.threads_per_rank: 2}}
      - {name: 2x1, nproc: 2, set: {dist.threads_per_rank: 1}}
    grid: {nproc: [1, 2], dist.backend: [gloo, ccl]}   # a cross product, names generated
    metric: val/loss                     # the figure compared (default below)
    metric_mode: min                     # max: higher is better; min: lower (else from its name)

The compared figure is ``perf/samples_per_s`` for ddplab's own loop; a study over a script
(``experiment: ../scripts/my_train.py``) compares a metric the script logs (``metric``), or its
wall time (``perf/wall_s``, lower is better) when none is named. Whether higher or lower is
better is ``metric_mode``, else :func:`inferred_mode` from the metric's name (one rule), else the
study is refused. Only throughput (``perf/samples_per_s``) has a speedup and an efficiency.

Validated by the experiments' own schema engine (``config.from_mapping`` over
:class:`StudyFile`): every error is one line naming the file, the key, the value and what is
allowed, and every variant's experiment config is resolved (so a bad ``set`` key stops the
study before any job starts).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from ..config import (
    NAME_RE,
    ConfigError,
    ExperimentConfig,
    Override,
    check_range,
    fail,
    from_mapping,
    load,
    read_yaml_file,
    runs_a_script,
)

Launcher = Literal["torchrun", "mpirun", "compose", "compose-mpi", "slurm"]
LAUNCHERS: tuple[str, ...] = typing.get_args(Launcher)
LAYOUT_KEYS = ("nproc", "nnodes", "launcher")
MAX_REPEATS, MAX_RANKS = 1000, 65536
MAX_JOBS, MOST_JOBS = 1000, 10**6
"""A study's jobs (variants x repeats) are bounded before anything is planned: ``max_jobs`` in
the study file (default MAX_JOBS, at most MOST_JOBS) raises it. A grid is counted as the
product of its axes, never expanded to be counted (100 x 100 x 100 values are 10^6 jobs)."""


# ---- the study file as written: checked by the experiments' own schema engine ----

def _count(obj: Any, name: str, most: int) -> None:
    if not 1 <= getattr(obj, name) <= most:
        fail(name, getattr(obj, name), f"must be an integer in [1, {most}]")


def _named(value: str) -> None:
    if not NAME_RE.fullmatch(value):
        fail("name", value, "must be a name of letters, digits, '.', '_' or '-'")


@dataclass
class VariantFile:
    """A variant as a study file writes it (``variants:`` items, or a point of ``grid:``)."""

    WHAT: ClassVar[str] = "a mapping with at least a name (a variant)"
    name: str = ""
    nproc: int = 1
    nnodes: int = 1
    launcher: Launcher = "torchrun"
    set: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _named(self.name)
        _count(self, "nproc", MAX_RANKS)
        _count(self, "nnodes", MAX_RANKS)


@dataclass
class StudyFile:
    """A study file's keys; what they resolve to (paths, the grid's variants, defaults that
    depend on the experiment) is :class:`Study`."""

    name: str = ""
    description: str = ""
    experiment: str = ""
    set: dict[str, Any] = field(default_factory=dict)
    repeats: int = 1
    baseline: str | None = None
    target_accuracy: float = 0.0
    variants: list[VariantFile] = field(default_factory=list)
    grid: dict[str, Any] = field(default_factory=dict)
    metric: str | None = None
    metric_mode: Literal["max", "min"] | None = None
    max_jobs: int = MAX_JOBS

    def __post_init__(self) -> None:
        _named(self.name)
        _count(self, "repeats", MAX_REPEATS)
        _count(self, "max_jobs", MOST_JOBS)
        check_range(self, "target_accuracy", 0, 1)
        for k, values in self.grid.items():
            if not isinstance(values, list) or not values:
                fail(f"grid.{k}", values, "must be a non-empty list of values")
        axes = [len(values) for values in self.grid.values()]
        grid = math.prod(axes) if axes else 0
        if (len(self.variants) + grid) * self.repeats > self.max_jobs:
            key, got = ("grid", f"{' x '.join(map(str, axes))} = {grid} variants") if grid else \
                ("variants", f"{len(self.variants)} variants")
            fail(key, got, too_many(len(self.variants) + grid, self.repeats, self.max_jobs))
        if self.metric is not None and not (self.metric.strip() and len(self.metric) <= 250):
            fail("metric", self.metric, "must be the name of a metric the jobs log, e.g. "
                                        "train/loss or perf/samples_per_s")


@dataclass(frozen=True)
class Variant:
    name: str
    nproc: int = 1
    nnodes: int = 1
    launcher: str = "torchrun"
    set: dict[str, Any] = field(default_factory=dict)

    def overrides(self, study_set: dict[str, Any], extra: Sequence[Override]) -> list[Override]:
        """The study's set, then the variant's, then $DDPLAB_SET's and the command line's
        (each keeping its source for error messages): later wins, a section given as a mapping
        by both keeping the study's keys the variant's does not set (config._merged)."""
        study = [(k, v) for k, v in study_set.items() if k not in self.set
                 or isinstance(v, dict) and isinstance(self.set[k], dict)]
        return [("set", f"{k}={_yaml_value(v)}") for k, v in study] + [
            (f"variant {self.name}: set", f"{k}={_yaml_value(v)}")
            for k, v in self.set.items()] + list(extra)


@dataclass(frozen=True)
class Study:
    name: str
    path: Path
    experiment: Path
    variants: tuple[Variant, ...]
    baseline: str
    repeats: int = 1
    set: dict[str, Any] = field(default_factory=dict)
    target_accuracy: float = 0.0
    description: str = ""
    extra: tuple[Override, ...] = ()
    """``$DDPLAB_SET`` and ``ddplab study run FILE --set k=v``: every variant, last."""
    metric: str = "perf/samples_per_s"
    """The figure the report compares (its table's column, the verdict, the best variant)."""
    metric_mode: str = "max"
    """max: higher is better (a rate); min: lower is better (a loss, a time)."""
    mode_source: str = "default"
    """Where metric_mode came from: "metric_mode" (the file), "its name" (inferred_mode) or
    "default" (the default metric's own)."""
    max_jobs: int = MAX_JOBS
    """The most jobs (variants x repeats) the study may plan: the file's ``max_jobs``."""

    @property
    def direction(self) -> str:
        """What the plan and the report say of the compared figure: "val/loss, lower is better
        (inferred from its name; metric_mode: max or min sets it)"."""
        said = {"metric_mode": f"metric_mode: {self.metric_mode}",
                "its name": "inferred from its name; metric_mode: max or min sets it",
                "default": "the default figure; metric and metric_mode name another"}
        return f"{self.metric}, {better(self.metric_mode)} ({said[self.mode_source]})"

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def config(self, v: Variant) -> ExperimentConfig:
        return load(self.experiment, v.overrides(self.set, list(self.extra)))

    def delivery_timeout_s(self) -> float:
        """How long the parent run's end goes on sending to a server that does not answer: its
        baseline job's ``tracking.delivery_timeout_s`` (the study's ``set`` reaches both)."""
        return self.config(self.variant(self.baseline)).tracking.delivery_timeout_s

    def plan(self) -> list[tuple[Variant, int]]:
        """Every (variant, repeat), repeats interleaved and rotated: repeat r starts at variant
        r, so a noisy machine's drift spreads over all variants instead of favouring one.
        Refused in one line over ``max_jobs`` (``--repeats`` may raise the file's repeats)."""
        n = len(self.variants)
        if n * self.repeats > self.max_jobs:
            raise ConfigError(f"{self.path}: repeats: got {self.repeats}; "
                              f"{too_many(n, self.repeats, self.max_jobs)}")
        return [(self.variants[(r + i) % n], r) for r in range(self.repeats) for i in range(n)]


def too_many(variants: int, repeats: int, most: int) -> str:
    """What a refusal over ``max_jobs`` says is allowed, and how to allow more."""
    return (f"{variants} variants x {repeats} repeats = {variants * repeats} jobs, and a study "
            f"plans at most max_jobs: {most} (set max_jobs: N in the study file, up to "
            f"{MOST_JOBS}, to allow more)")


def _yaml_value(v: Any) -> str:
    """The value as YAML text that reads back as the same value (the job reads --set as YAML):
    a string such as "speed: fast" or "1e-3" is quoted, so it stays a string."""
    import json

    from ..config import _read_yaml

    if isinstance(v, (dict, list, bool)) or v is None:
        return json.dumps(v)
    text = str(v)
    if isinstance(v, str):
        try:
            same = _read_yaml(text) == v
        except Exception:  # noqa: BLE001 - not valid YAML unquoted: quote it
            same = False
        return text if same else json.dumps(v)
    return text


def as_text(item: Override) -> str:
    """An override as the ``key=value`` a job's ``--set`` takes."""
    return item if isinstance(item, str) else item[1]


def _grid(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The cross product of ``grid:`` as variants, each named by its values."""
    out = []
    for combo in itertools.product(*grid.values()):
        point = dict(zip(grid, combo, strict=True))
        name = "-".join(f"{k.rsplit('.', 1)[-1]}{v}" for k, v in point.items())
        out.append({"name": name, **{k: v for k, v in point.items() if k in LAYOUT_KEYS},
                    "set": {k: v for k, v in point.items() if k not in LAYOUT_KEYS}})
    return out


# An empty section is no section (``set:`` with nothing under it reads as null).
EMPTY_OK = ("description", "set", "variants", "grid")


def parse(path: Path, raw: Any, extra: Sequence[Override] = ()) -> Study:
    where = str(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a mapping (name, experiment, variants)")
    if not raw:
        raise ConfigError(f"{where}: empty; a study is a YAML mapping (name, experiment, variants)")
    if not {"variants", "grid", "experiment"} & set(raw) and {"script", "model", "train"} & set(raw):
        raise ConfigError(f"{where}: an experiment file, not a study (a study names one: "
                          f"experiment: FILE, and its variants); run it with: ddplab train {where}")
    if raw.get("grid") == {}:
        raise ConfigError(f"{where}: grid: got {{}}; a grid needs at least one key with a list "
                          "of values (grid: {dist.backend: [gloo, ccl]})")
    try:
        written = from_mapping(StudyFile, {k: v for k, v in raw.items()
                                           if v is not None or k not in EMPTY_OK})
        study = _resolve(path, written, extra)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    for v in study.variants:  # every job's config resolves, before any job starts
        try:
            cfg = study.config(v)
        except ConfigError as e:
            # (a key a set gives names its own source: the variant's, or the study's for all)
            said = str(e) if str(e).startswith(("set ", "variant ", "--set ", "DDPLAB_SET")) \
                else f"variant {v.name}: {e}"
            raise ConfigError(f"{where}: {said}") from None
        if cfg.kind == "script":
            _only_what_a_script_reads(where, study, v)
    _no_set_over_what_a_variant_varies(where, study)
    return study


def _no_set_over_what_a_variant_varies(where: str, study: Study) -> None:
    """``--set`` and ``$DDPLAB_SET`` come after every variant's own ``set``: over a key the
    variants set differently (a grid's axis), each job ran the command line's value under its
    variant's name (a hostile pass: `--set script.flags.lr=0.3` over a grid of lr, every job lr
    0.3, the table comparing them as 0.2 and 0.05). Refused, naming the variant and its key; a
    key every variant sets alike is no difference to erase, nor is what only describes a job or
    says where it is recorded (``description``, ``tracking``): it computes the same."""
    from ..config import _source, flatten, parse_override

    for o in study.extra:
        key = ".".join(parse_override(o)[0])
        if key.split(".")[0] in ("description", "tracking"):
            continue
        sets = {v.name: {k: repr(x) for k, x in flatten(v.set).items()
                         if k == key or k.startswith(key + ".") or key.startswith(k + ".")}
                for v in study.variants}
        if len({tuple(sorted(given.items())) for given in sets.values()}) < 2:
            continue
        name, given = next((n, g) for n, g in sets.items() if g)
        raise ConfigError(
            f"{where}: {_source(o)[0]} {key!r}: variant {name} sets {next(iter(given))} "
            f"itself, and {_source(o)[0]} comes after it: every variant would run the same value "
            "under its own name; vary it in the study file, or leave it out here")


def _only_what_a_script_reads(where: str, study: Study, v: Variant) -> None:
    """A study over a script varies what the script reads: a dist key the script's own
    init_process_group and DDP(...) decide (backend, device, strategy) would make jobs alike
    but for a key nothing reads (and an nccl variant was skipped for want of a GPU)."""
    from ..config import SCRIPT_DIST, flatten, parse_override

    given = {**{".".join(parse_override(o)[0]): o[0] if isinstance(o, tuple) else "--set"
                for o in study.extra},
             **dict.fromkeys(flatten(study.set), "set"),
             **dict.fromkeys(flatten(v.set), f"variant {v.name}: set")}
    for key, source in given.items():
        section, _, leaf = key.partition(".")
        if section == "dist" and leaf.split(".")[0] not in SCRIPT_DIST:
            raise ConfigError(
                f"{where}: {source} {key!r}: a script job reads only dist."
                f"{', dist.'.join(SCRIPT_DIST)}; its backend, device and DDP settings are the "
                "script's own: vary them through its arguments (script.flags.NAME)")


def _resolve(path: Path, f: StudyFile, extra: Sequence[Override]) -> Study:
    """The file's keys as a plan: the experiment's path, listed and grid variants, the
    baseline and the compared metric with their defaults."""
    if not f.experiment:
        fail("experiment", f.experiment, "must be an experiment file, relative to the study")
    if not (path.parent / f.experiment).is_file():
        fail("experiment", f.experiment, f"not found: {(path.parent / f.experiment).absolute()} "
             "(relative to the study's folder)")
    listed = [Variant(v.name, v.nproc, v.nnodes, v.launcher, _no_login(v.set)) for v in f.variants]
    grid = [from_mapping(VariantFile, v, "grid.") for v in _grid(f.grid)] if f.grid else []
    variants = listed + [Variant(v.name, v.nproc, v.nnodes, v.launcher, _no_login(v.set))
                         for v in grid]
    if not variants:
        fail("variants", [], "a study needs at least one variant (or a grid)")
    names = [v.name for v in variants]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        fail("variants", dup, "variant names must be unique")
    baseline = names[0] if f.baseline is None else f.baseline
    if baseline not in names:
        fail("baseline", baseline, f"must name a variant: {', '.join(names)}")
    metric, mode, source = _metric(f, runs_a_script(path.parent / f.experiment))
    return Study(f.name, path, (path.parent / f.experiment).resolve(), tuple(variants), baseline,
                 f.repeats, _no_login(f.set), f.target_accuracy, f.description,
                 tuple(_no_login_in(o) for o in extra), metric, mode, source, f.max_jobs)


def _without_login(key: str, value: Any) -> Any:
    """A ``tracking.uri`` (or ``tracking: {uri: ...}``) set by a study, its login taken out at
    once (logins.take_login: into MLFLOW_TRACKING_USERNAME/PASSWORD, which every job inherits),
    as a job does with its own: no plan, command line, study.yaml or parent-run param of the
    study holds the password."""
    from ..logins import take_login

    if key == "tracking.uri" and isinstance(value, str):
        return take_login(value)
    if key == "tracking" and isinstance(value, dict) and isinstance(value.get("uri"), str):
        return {**value, "uri": take_login(value["uri"])}
    return value


def _no_login(sets: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_login(k, v) for k, v in sets.items()}


def _no_login_in(item: Override) -> Override:
    """A ``$DDPLAB_SET`` or ``--set`` item of the study, a tracking URI's login taken out."""
    from ..config import parse_override

    source = "--set" if isinstance(item, str) else item[0]
    keys, value = parse_override(item)
    clean = _without_login(".".join(keys), value)
    if clean == value:
        return item
    return (source, f"{'.'.join(keys)}={_yaml_value(clean)}")


THROUGHPUT = "perf/samples_per_s"
"""The one compared figure that is a throughput: its ratios are speedups, per resources an
efficiency. Any other metric is compared as itself (its change vs the baseline, in %)."""

# inferred_mode's rule, in words (its refusal quotes it; docs/studies.md states it).
_RATE = re.compile(r"per_s(ec(ond)?)?$|throughput")
_LOWER = re.compile(r"loss|error|perplexity|(^|[^a-z])(err|ppl)([^a-z]|$)|_s$|time$")
_HIGHER = re.compile(r"accuracy|(^|[^a-z])(acc|mfu|f1|auc)([^a-z]|$)")
RULE = ("lower is better: a name containing loss, error, err, perplexity or ppl, or ending in _s "
        "or time; higher: acc, accuracy, a rate (*_per_s, *_per_second, throughput), mfu, f1, auc; "
        "a name with words of both, such as errors_per_s, says neither")


def inferred_mode(metric: str) -> str | None:
    """Whether higher (max) or lower (min) of ``metric`` is better, from its name alone: THE
    rule (:data:`RULE`) for a study that names a metric without ``metric_mode``. Lower: a loss,
    an error, a perplexity, a time (``loss``, ``error``, ``err``, ``perplexity``, ``ppl``; a
    name ending in ``_s`` or ``time``); higher: an accuracy, a rate, a score (``acc``,
    ``accuracy``, ``samples_per_s`` and any ``*_per_s``/``*_per_second``, ``throughput``,
    ``mfu``, ``f1``, ``auc``). The short words count as words (``val/acc``, ``top1_acc``, not
    ``grad_accum``); a rate is higher-is-better though it ends in ``_s``. None when the name
    says neither, or both (``acc_loss``; a rate of errors or losses, ``errors_per_s``): the
    study must say."""
    name = metric.strip().lower()
    stem = _RATE.sub("", name)  # what the rate is of (samples_per_s: samples)
    lower = bool(_LOWER.search(stem))
    higher = bool(_RATE.search(name)) or bool(_HIGHER.search(stem))
    return None if lower == higher else "min" if lower else "max"


def better(mode: str) -> str:
    return "lower is better" if mode == "min" else "higher is better"


def _metric(f: StudyFile, script: bool) -> tuple[str, str, str]:
    """(the compared metric, max|min, where the mode came from): the study's, else the loop's
    throughput or, for a script, its wall time."""
    if f.metric is None:
        metric, its = ("perf/wall_s", "min") if script else (THROUGHPUT, "max")
        if f.metric_mode and f.metric_mode != its:
            # A wall time where higher is better, a throughput where lower is: a slip, surely.
            raise ConfigError(f"metric_mode: {f.metric_mode!r} without a metric: the default, "
                              f"{metric}, is compared as {better(its)}; name the metric "
                              "you mean (metric: NAME)")
        return metric, its, "metric_mode" if f.metric_mode else "default"
    if f.metric != f.metric.strip() or not f.metric:
        raise ConfigError(f"metric: got {f.metric!r}; a metric's name, as the runs log it, "
                          "without spaces around it")
    if f.metric == THROUGHPUT and f.metric_mode == "min":
        # (its words are a speed's: "b is 1.11x a, slower" named b the best)
        raise ConfigError(f"metric_mode: got 'min' for {THROUGHPUT}, a throughput: higher is "
                          "better; leave metric_mode out, or name the metric you mean")
    if f.metric_mode:
        return f.metric, f.metric_mode, "metric_mode"
    mode = inferred_mode(f.metric)
    if mode is None:
        raise ConfigError(f"metric_mode: not set, and the name of metric {f.metric!r} does not say "
                          f"whether higher or lower is better ({RULE}): set metric_mode: max or min")
    return f.metric, mode, "its name"


def load_study(path: str | Path, extra: Sequence[Override] = ()) -> Study:
    p = Path(path)
    return parse(p, read_yaml_file(p, "study"), list(extra))


def only(study: Study, names: str) -> Study:
    """``study run --variants a,b``: those variants alone (a quick look, or a rerun of some).
    The baseline stays when it is among them; otherwise the first of them is the baseline."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = [v.name for v in study.variants]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise ConfigError(f"--variants: got {names!r}; must name variants of {study.path}, "
                          f"comma-separated: {', '.join(known)}")
    chosen = tuple(v for v in study.variants if v.name in wanted)
    baseline = study.baseline if study.baseline in wanted else chosen[0].name
    return dataclasses.replace(study, variants=chosen, baseline=baseline)

