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
    metric: train/loss                   # the figure compared (default below), min or max:
    metric_mode: min                     #   "max" for a rate, "min" for a loss or a time

The compared figure is ``perf/samples_per_s`` for ddplab's own loop; a study over a script
(``experiment: ../scripts/my_train.py``) compares a metric the script logs (``metric``), or its
wall time (``perf/wall_s``, lower is better) when none is named.

Validated by the experiments' own schema engine (``config.from_mapping`` over
:class:`StudyFile`): every error is one line naming the file, the key, the value and what is
allowed, and every variant's experiment config is resolved (so a bad ``set`` key stops the
study before any job starts).
"""

from __future__ import annotations

import dataclasses
import itertools
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
    is_script,
    load,
    read_yaml_file,
)

Launcher = Literal["torchrun", "mpirun", "compose", "compose-mpi", "slurm"]
LAUNCHERS: tuple[str, ...] = typing.get_args(Launcher)
LAYOUT_KEYS = ("nproc", "nnodes", "launcher")
MAX_REPEATS, MAX_RANKS = 1000, 65536


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

    def __post_init__(self) -> None:
        _named(self.name)
        _count(self, "repeats", MAX_REPEATS)
        check_range(self, "target_accuracy", 0, 1)
        for k, values in self.grid.items():
            if not isinstance(values, list) or not values:
                fail(f"grid.{k}", values, "must be a non-empty list of values")
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
        (each keeping its source for error messages): later wins."""
        merged = {**study_set, **self.set}
        return [("set", f"{k}={_yaml_value(v)}") for k, v in merged.items()] \
            + list(extra)


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
    """The figure the report compares (speedup, verdict)."""
    metric_mode: str = "max"
    """max: higher is better (a rate); min: lower is better (a loss, a time)."""

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def config(self, v: Variant) -> ExperimentConfig:
        return load(self.experiment, v.overrides(self.set, list(self.extra)))

    def plan(self) -> list[tuple[Variant, int]]:
        """Every (variant, repeat), repeats interleaved and rotated: repeat r starts at variant
        r, so a noisy machine's drift spreads over all variants instead of favouring one."""
        n = len(self.variants)
        return [(self.variants[(r + i) % n], r) for r in range(self.repeats) for i in range(n)]


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
    try:
        written = from_mapping(StudyFile, {k: v for k, v in raw.items()
                                           if v is not None or k not in EMPTY_OK})
        study = _resolve(path, written, extra)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    for v in study.variants:  # every job's config resolves, before any job starts
        try:
            study.config(v)
        except ConfigError as e:
            raise ConfigError(f"{where}: variant {v.name}: {e}") from None
    return study


def _resolve(path: Path, f: StudyFile, extra: Sequence[Override]) -> Study:
    """The file's keys as a plan: the experiment's path, listed and grid variants, the
    baseline and the compared metric with their defaults."""
    if not f.experiment or not (path.parent / f.experiment).is_file():
        fail("experiment", f.experiment, "must be an experiment file, relative to the study")
    listed = [Variant(v.name, v.nproc, v.nnodes, v.launcher, v.set) for v in f.variants]
    grid = [from_mapping(VariantFile, v, "grid.") for v in _grid(f.grid)] if f.grid else []
    variants = listed + [Variant(v.name, v.nproc, v.nnodes, v.launcher, v.set) for v in grid]
    if not variants:
        fail("variants", [], "a study needs at least one variant (or a grid)")
    names = [v.name for v in variants]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        fail("variants", dup, "variant names must be unique")
    baseline = names[0] if f.baseline is None else f.baseline
    if baseline not in names:
        fail("baseline", baseline, f"must name a variant: {', '.join(names)}")
    metric, mode = _metric(f, is_script(path.parent / f.experiment))
    return Study(f.name, path, (path.parent / f.experiment).resolve(), tuple(variants), baseline,
                 f.repeats, f.set, f.target_accuracy, f.description, tuple(extra), metric, mode)


def _metric(f: StudyFile, script: bool) -> tuple[str, str]:
    """(the compared metric, max|min): the study's, else the loop's throughput or, for a
    script, its wall time."""
    default = ("perf/wall_s", "min") if script else ("perf/samples_per_s", "max")
    if f.metric is None:
        return default[0], f.metric_mode or default[1]
    known = {"perf/wall_s": "min", "perf/samples_per_s": "max"}
    return f.metric, f.metric_mode or known.get(f.metric, "max")


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

