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

Validated like experiments: every error is one line naming the file, the key, the value and
what is allowed, and every variant's experiment config is resolved (so a bad ``set`` key stops
the study before any job starts).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import (
    NAME_RE,
    ConfigError,
    ExperimentConfig,
    Override,
    is_script,
    load,
    read_yaml_file,
)

LAUNCHERS = ("torchrun", "mpirun", "compose", "compose-mpi", "slurm")
LAYOUT_KEYS = ("nproc", "nnodes", "launcher")
STUDY_KEYS = ("name", "description", "experiment", "set", "repeats", "baseline",
              "target_accuracy", "variants", "grid", "metric", "metric_mode")
VARIANT_KEYS = ("name", *LAYOUT_KEYS, "set")


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


def _fail(where: str, key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{where}: {key}: got {value!r}; {allowed}")


MAX_REPEATS, MAX_RANKS = 1000, 65536


def _positive_int(where: str, key: str, value: Any, most: int = MAX_RANKS) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
        raise _fail(where, key, value, f"must be an integer in [1, {most}]")
    return value


def _mapping(where: str, key: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _fail(where, key, value, "must be a mapping of config keys to values, "
                                       "e.g. {train.max_steps: 200}")
    return value


def _variant(where: str, key: str, raw: Any) -> Variant:
    if not isinstance(raw, dict):
        raise _fail(where, key, raw, "must be a mapping with at least a name")
    unknown = [k for k in raw if k not in VARIANT_KEYS]
    if unknown:
        raise ConfigError(f"{where}: {key}.{unknown[0]}: unknown key; allowed keys: "
                          f"{', '.join(VARIANT_KEYS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise _fail(where, f"{key}.name", name, "must be a name of letters, digits, '.', '_' "
                                                "or '-'")
    launcher = raw.get("launcher", "torchrun")
    if launcher not in LAUNCHERS:
        raise _fail(where, f"{key}.launcher", launcher, f"must be one of {', '.join(LAUNCHERS)}")
    return Variant(name, _positive_int(where, f"{key}.nproc", raw.get("nproc", 1)),
                   _positive_int(where, f"{key}.nnodes", raw.get("nnodes", 1)), launcher,
                   _mapping(where, f"{key}.set", raw.get("set")))


def _grid(where: str, raw: Any) -> list[dict[str, Any]]:
    grid = _mapping(where, "grid", raw)
    if not grid:
        return []
    for k, values in grid.items():
        if not isinstance(values, list) or not values:
            raise _fail(where, f"grid.{k}", values, "must be a non-empty list of values")
    out = []
    for combo in itertools.product(*grid.values()):
        point = dict(zip(grid, combo, strict=True))
        name = "-".join(f"{k.rsplit('.', 1)[-1]}{v}" for k, v in point.items())
        out.append({"name": name, **{k: v for k, v in point.items() if k in LAYOUT_KEYS},
                    "set": {k: v for k, v in point.items() if k not in LAYOUT_KEYS}})
    return out


def parse(path: Path, raw: Any, extra: Sequence[Override] = ()) -> Study:
    where = str(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a mapping (name, experiment, variants)")
    unknown = [k for k in raw if k not in STUDY_KEYS]
    if unknown:
        raise ConfigError(f"{where}: {unknown[0]}: unknown key; allowed keys: {', '.join(STUDY_KEYS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise _fail(where, "name", name, "must be a name of letters, digits, '.', '_' or '-'")
    exp = raw.get("experiment")
    if not isinstance(exp, str) or not (path.parent / exp).is_file():
        raise _fail(where, "experiment", exp, "must be an experiment file, relative to the study")
    listed = raw.get("variants") or []
    if not isinstance(listed, list):
        raise _fail(where, "variants", listed, "must be a list of variants")
    variants = [_variant(where, f"variants[{i}]", v) for i, v in enumerate(listed)]
    variants += [_variant(where, "grid", v) for v in _grid(where, raw.get("grid"))]
    if not variants:
        raise _fail(where, "variants", listed, "a study needs at least one variant (or a grid)")
    names = [v.name for v in variants]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise _fail(where, "variants", dup, "variant names must be unique")
    baseline = raw.get("baseline", names[0])
    if baseline not in names:
        raise _fail(where, "baseline", baseline, f"must name a variant: {', '.join(names)}")
    target = raw.get("target_accuracy", 0.0)
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 <= target <= 1:
        raise _fail(where, "target_accuracy", target, "must be a number in [0, 1]")
    metric, mode = _metric(where, raw, is_script(path.parent / exp))
    study = Study(name, path, (path.parent / exp).resolve(), tuple(variants), baseline,
                  _positive_int(where, "repeats", raw.get("repeats", 1), MAX_REPEATS),
                  _mapping(where, "set", raw.get("set")), float(target),
                  str(raw.get("description", "")), tuple(extra), metric, mode)
    for v in variants:  # every job's config resolves, before any job starts
        try:
            study.config(v)
        except ConfigError as e:
            raise ConfigError(f"{where}: variant {v.name}: {e}") from None
    return study


def _metric(where: str, raw: dict[str, Any], script: bool) -> tuple[str, str]:
    """(the compared metric, max|min): the study's, else the loop's throughput or, for a
    script, its wall time."""
    default = ("perf/wall_s", "min") if script else ("perf/samples_per_s", "max")
    metric = raw.get("metric", default[0])
    if not isinstance(metric, str) or not metric.strip() or len(metric) > 250:
        raise _fail(where, "metric", metric, "must be the name of a metric the jobs log, e.g. "
                                             "train/loss or perf/samples_per_s")
    known = {"perf/wall_s": "min", "perf/samples_per_s": "max"}
    mode = raw.get("metric_mode", known.get(metric, "max") if "metric" in raw else default[1])
    if mode not in ("max", "min"):
        raise _fail(where, "metric_mode", mode, "must be max (higher is better) or min")
    return metric, mode


def load_study(path: str | Path, extra: Sequence[Override] = ()) -> Study:
    p = Path(path)
    return parse(p, read_yaml_file(p, "study"), list(extra))
