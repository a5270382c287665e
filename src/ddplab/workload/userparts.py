"""The user's own parts: a model, datasets, a loss and evaluation metrics given as
``package.module:callable``.

Resolved in the checks step, before any process group or run exists: the experiment file's
folder goes on the import path (a module beside the experiment imports without PYTHONPATH),
each callable is imported and called, and its result checked (a model is an ``nn.Module``,
datasets a pair of map-style datasets, the loss a scalar tensor for one tiny batch). Every
failure is one ConfigError line naming the key, the value and what went wrong.

The run records each part's import path, its module file, the file's sha256 and whether git
has it committed (``ddplab.user.<part>.*`` tags), so ``ddplab reproduce --strict`` can refuse
a module that changed since.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError, ExperimentConfig, is_import_path
from ..tracking import schema

DATA_NAMES = ("root", "seed", "image_size", "channels", "num_classes", "seq_len")
"""data.* values a dataset callable receives when its signature names them."""


# Imported later by ddplab or MLflow (at the run's start, by the delivery process), so not yet
# in sys.modules when the checks run; a file of the same name first on the path breaks them.
LATER_IMPORTS = ("mlflow", "sqlalchemy", "alembic", "sqlite3", "secrets", "psutil", "requests",
                 "flask", "jinja2", "matplotlib", "pandas", "numpy", "rich", "yaml",
                 "torchvision", "urllib3", "packaging", "ddplab")


def add_search_path(experiment: str | Path | None) -> str:
    """Put the experiment file's folder first on sys.path; returns it ('' without a file). A
    module there that would shadow one ddplab or MLflow imports (``mlflow.py``,
    ``sqlite3.py``, ``secrets.py``, ...) is refused first, in one line naming the file."""
    if experiment is None:
        return ""
    folder = Path(experiment).resolve().parent
    _refuse_shadows(folder)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return str(folder)


def _installed_imports() -> set[str]:
    """Top-level modules imported so far from the standard library or site-packages: only what
    is or will be imported can be shadowed (test.py or code.py shadow nothing that runs), and
    a user's own module imported earlier in this process (spirals) is not a library."""
    homes = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    out = set(sys.builtin_module_names)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None) or ""
        if "." not in name and file.startswith(homes):
            out.add(name)
    return out


def _refuse_shadows(folder: Path) -> None:
    taken = _installed_imports() | set(LATER_IMPORTS)
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for entry in sorted(entries):
        name = entry.stem if entry.suffix == ".py" else entry.name
        is_module = entry.suffix == ".py" or (entry / "__init__.py").is_file()
        if is_module and name in taken:
            raise ConfigError(
                f"{entry}: this file beside the experiment shadows the module {name!r} that "
                "ddplab, MLflow or torch import (the experiment's folder goes first on the "
                "import path, for your own parts): rename it")


@contextlib.contextmanager
def still_working(what: str, first_s: float = 5.0, every_s: float = 30.0) -> Iterator[None]:
    """A user's import or call that takes long (a dataset built in memory, a module that blocks)
    says what the checks step is waiting for, instead of a silent terminal: a line after
    ``first_s``, then every ``every_s`` (Ctrl-C still ends it cleanly)."""
    import threading

    from ..log import logger

    done, t0 = threading.Event(), time.monotonic()

    def tell() -> None:
        wait = first_s
        while not done.wait(wait):
            logger().info(f"checks: still {what} ({time.monotonic() - t0:.0f} s)")
            wait = every_s

    threading.Thread(target=tell, daemon=True).start()
    try:
        yield
    finally:
        done.set()


def load_callable(key: str, path: str) -> Callable[..., Any]:
    """``pkg.mod:attr.sub`` -> the object, or one line saying why not."""
    module_name, _, attr = path.partition(":")
    try:
        with still_working(f"importing {module_name} ({key})"):
            obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = f"module {e.name!r} not found" if e.name else str(e)
        raise ConfigError(f"{key}: got {path!r}; {missing} (modules beside the experiment file "
                          "import as they are; others must be installed or on PYTHONPATH)") from None
    except SystemExit as e:  # sys.exit() at import: not a success, and not ddplab's to exit
        raise ConfigError(f"{key}: got {path!r}; importing {module_name} called "
                          f"sys.exit({e.code!r})") from None
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything at import
        raise ConfigError(f"{key}: got {path!r}; importing {module_name} raised "
                          f"{why(e)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: got {path!r}; {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}: got {path!r}; {attr} is a {type(obj).__name__}, not callable")
    found: Callable[..., Any] = obj
    return found


def why(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def call(key: str, path: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """Call a user's callable; any exception becomes one line."""
    try:
        with still_working(f"calling {path} ({key})"):
            return fn(**kwargs)
    except SystemExit as e:
        raise ConfigError(f"{key}: got {path!r}; calling it called sys.exit({e.code!r})") \
            from None
    except Exception as e:  # noqa: BLE001 - the user's code may raise anything
        raise ConfigError(f"{key}: got {path!r}; calling it raised {why(e)}") from None


TARGET = "_target_"


def instantiate(key: str, value: Any) -> Any:
    """Arguments that describe objects, built first (Hydra's ``_target_`` convention):
    ``config: {_target_: "transformers:GPT2Config", n_layer: 2}`` is ``GPT2Config(n_layer=2)``,
    so a class that takes a config object (every Hugging Face model) needs no wrapper."""
    if isinstance(value, list):
        return [instantiate(f"{key}[{i}]", v) for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    built = {k: instantiate(f"{key}.{k}", v) for k, v in value.items() if k != TARGET}
    if TARGET not in value:
        return built
    where, path = f"{key}.{TARGET}", value[TARGET]
    if not (isinstance(path, str) and is_import_path(path)):
        raise ConfigError(f"{where}: got {path!r}; expected 'package.module:callable'")
    return call(where, path, load_callable(where, path), built)


# What a MODEL callable taking **kwargs gets without naming it: torchvision's and timm's model
# builders take num_classes that way, and without it train a 1000-way head on 10 classes.
THROUGH_KWARGS = ("num_classes",)


def offered(fn: Callable[..., Any], given: dict[str, Any], available: dict[str, Any],
            through_kwargs: tuple[str, ...] = ()) -> dict[str, Any]:
    """``given`` plus those of ``available`` that the signature names (or, for
    ``through_kwargs``, takes as **kwargs) and ``given`` lacks."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return dict(given)
    kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {**{k: v for k, v in available.items() if k not in given and (
        k in params or (kwargs and k in through_kwargs))}, **given}


def provenance(path: str) -> dict[str, str]:
    """The module file behind an import path, its sha256, and where it comes from: its state in
    git, or for an installed library (timm, transformers) its distribution and version."""
    name = path.partition(":")[0]
    file = getattr(sys.modules.get(name), "__file__", None)
    if not file:
        return {"file": "none", "sha256": "none", "git": "not a file"}
    p = Path(file).resolve()
    dist = distribution(name)
    if dist or {"site-packages", "dist-packages"} & set(p.parts):
        return {"file": str(p), "sha256": sha256(p), "git": "installed (site-packages)",
                "dist": dist or "unknown"}
    return {"file": str(p), "sha256": sha256(p), "git": git_state(p)}


@functools.cache
def _distributions() -> Mapping[str, list[str]]:
    from importlib.metadata import packages_distributions

    return packages_distributions()


def distribution(module: str) -> str:
    """"timm 1.0.15": the installed distribution a module belongs to, or "" (not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in _distributions().get(module.split(".")[0], []):
        with contextlib.suppress(PackageNotFoundError):
            return f"{dist} {version(dist)}"
    return ""


def module_file(path: str, folder: str = "") -> Path | None:
    """The source file an import path's module ("pkg.module:callable") loads from, found as
    the import would find it (``folder``, the experiment's, first), without importing it;
    None when there is none (a module that is not there, a compiled one)."""
    from importlib.machinery import PathFinder

    search, spec = ([folder] if folder else []) + sys.path, None
    for name in path.partition(":")[0].split("."):
        spec = PathFinder.find_spec(name, search)
        if spec is None:
            return None
        search = list(spec.submodule_search_locations or [])
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and origin.endswith(".py") else None


def sha256(p: Path) -> str:
    try:
        return hashlib.sha256(p.read_bytes()).hexdigest()
    except OSError:
        return "missing"


def git_state(p: Path) -> str:
    """committed | modified | untracked | not in git."""
    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(p.parent), *args], capture_output=True, text=True,
                              check=False, timeout=30)
    try:
        if git("rev-parse", "--is-inside-work-tree").returncode != 0:
            return "not in git"
        if git("ls-files", "--error-unmatch", p.name).returncode != 0:
            return "untracked"
        return "committed" if git("diff", "--quiet", "HEAD", "--", p.name).returncode == 0 \
            else "modified"
    except (OSError, subprocess.TimeoutExpired):
        return "not in git"


@dataclass
class Parts:
    """The resolved user parts; built-in ones are None and ddplab's own code builds them."""

    model: Callable[..., Any] | None = None
    datasets: tuple[Any, Any] | None = None
    loss: Callable[..., Any] | None = None
    search_path: str = ""
    paths: dict[str, str] = field(default_factory=dict)
    """part -> import path, for the parts the user gave."""

    def tags(self) -> dict[str, str]:
        if not self.paths:
            return {}
        tags = {schema.USER_SEARCH_PATH: self.search_path or "none"}
        for part, path in self.paths.items():
            tags[schema.user_tag(part)] = path
            tags |= {schema.user_tag(part, k): v for k, v in provenance(path).items()}
        return tags


def resolve(cfg: ExperimentConfig, experiment: str | Path | None) -> Parts:
    """Import and call the user's parts (checks step); built-in parts stay None."""
    parts = Parts(search_path=add_search_path(experiment))
    if is_import_path(cfg.data.dataset):
        parts.paths["data"] = cfg.data.dataset
        parts.datasets = _datasets(cfg)
    if is_import_path(cfg.model.name):
        parts.paths["model"] = cfg.model.name
        parts.model = load_callable("model.name", cfg.model.name)
    if is_import_path(cfg.train.loss):
        parts.paths["loss"] = cfg.train.loss
        parts.loss = load_callable("train.loss", cfg.train.loss)
    for m in cfg.train.metrics:
        parts.paths[f"metric.{m.name}"] = m.fn
    return parts


def build_metrics(cfg: ExperimentConfig, sizes: dict[str, Any], device: Any = None) -> dict[str, Any]:
    """train.metrics, each a new object: its class imported and called with its args (and
    the data's ``num_classes`` when it takes one and the args lack it), on ``device``."""
    out = {}
    for i, m in enumerate(cfg.train.metrics):
        key = f"train.metrics[{i}].fn"
        cls = load_callable(key, m.fn)
        # Only by name: a torchmetrics metric's **kwargs are the base class's options.
        metric = call(key, m.fn, cls, offered(cls, m.args, sizes))
        if not (callable(getattr(metric, "update", None)) and callable(getattr(metric, "compute", None))):
            raise ConfigError(f"{key}: got {m.fn!r}; what it made ({type(metric).__name__}) is "
                              "not a metric: it needs update(preds, target) and compute() (a "
                              "torchmetrics metric has both)")
        to = getattr(metric, "to", None)
        out[m.name] = to(device) if device is not None and callable(to) else metric
    return out


def _datasets(cfg: ExperimentConfig) -> tuple[Any, Any]:
    d, key = cfg.data, "data.dataset"
    fn = load_callable(key, d.dataset)
    available = {"root": d.root, "seed": cfg.train.seed, "image_size": d.image_size,
                 "channels": d.channels, "num_classes": d.num_classes, "seq_len": d.seq_len}
    sets = call(key, d.dataset, fn, offered(fn, d.args, available))
    if not (isinstance(sets, (tuple, list)) and len(sets) == 2):
        raise ConfigError(f"{key}: got {d.dataset!r}; it returned {type(sets).__name__}, expected "
                          "(train_dataset, eval_dataset)")
    for name, s in zip(("train", "eval"), sets, strict=True):
        _map_style(key, d.dataset, name, s)
    return sets[0], sets[1]


def _map_style(key: str, path: str, name: str, ds: Any) -> None:
    if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
        raise ConfigError(f"{key}: got {path!r}; its {name} dataset ({type(ds).__name__}) is not "
                          "map-style (needs __len__ and __getitem__)")
    try:
        n, first = len(ds), ds[0] if len(ds) else None
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{key}: got {path!r}; reading its {name} dataset raised {why(e)}") from None
    if n < 1:
        raise ConfigError(f"{key}: got {path!r}; its {name} dataset is empty")
    if isinstance(first, dict):  # Hugging Face's style: data.input_keys / data.target_key
        return
    if not (isinstance(first, (tuple, list)) and len(first) == 2):
        raise ConfigError(f"{key}: got {path!r}; a sample of its {name} dataset is "
                          f"{type(first).__name__}, expected (input, target) or a dict "
                          "(data.input_keys, data.target_key)")
