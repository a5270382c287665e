"""Code of ddplab's that runs right after the script imports a module, and only if it does.

An import hook (a ``sys.meta_path`` finder) finds the module with the other finders and runs
each waiting function once the module has executed: so ``import torch`` and ``from mlflow
import start_run`` alike see what ddplab adds, in the script's own order. Importing for the
script instead would change it: torch reads ``OMP_NUM_THREADS`` once, when it is imported, and
the book's chapter 9 scripts set it first (their threads per rank); MLflow costs a second.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_waiting: dict[str, list[Callable[[ModuleType], None]]] = {}


def after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """``then(module)`` once ``name`` is imported: now if it already is."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return
    _waiting.setdefault(name, []).append(then)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str) -> None:
        self.loader, self.name = loader, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The module sees its own loader (resources, source lookups), as without the hook.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        for then in _waiting.pop(self.name, []):
            then(module)
        if not _waiting:  # nothing left to wait for
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
