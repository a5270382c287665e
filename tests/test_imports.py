"""Unit (lint tier): the package's modules import each other without a cycle.

Every ``import`` counts, the ones inside functions too: a lazy import only hides a cycle
until the day its function runs first in another order."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddplab"


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (relative and absolute)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                target = f"{base}.{a.name}"
                found |= {target} if target in known else ({base} if base in known else set())
    return found - {name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def graph_of(root: Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imported(name, path, known) for name, path in known.items()}


def test_the_package_has_no_import_cycle():
    graph = graph_of(PACKAGE)
    assert len(graph) > 30
    assert graph["ddplab.training.run"] >= {"ddplab.distributed.layout", "ddplab.tracking"}
    assert cycles(graph) == []


@pytest.mark.parametrize("lazy", [False, True])
def test_a_cycle_is_found_even_through_an_import_inside_a_function(tmp_path, lazy):
    pkg = tmp_path / "ddplab"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    back = "def f():\n    from .. import a\n" if lazy else "from ..a import x\n"
    (pkg / "sub" / "b.py").write_text(back)
    assert cycles(graph_of(pkg)) == [["ddplab.a", "ddplab.sub.b"]]


# The rooms by concern, lowest first: a module may import its own layer's and lower layers'
# modules, never a higher one's (docs/layout.md, "How a job flows"). The longest matching
# prefix names a module's room.
LAYERS = [
    ("ddplab.errors", "ddplab.config", "ddplab.log", "ddplab.poll", "ddplab.files", "ddplab.pages",
     "ddplab.subprocs",
     "ddplab.logins", "ddplab.credentials", "ddplab.track",
     "ddplab.tracking.schema",  # the run's vocabulary, stdlib only: every room names tags
     "ddplab.tracking.naming"),  # its rules (a user's ddplab.* tag; what varies run to run)
    ("ddplab.workload", "ddplab.launchers", "ddplab.launchers.detect", "ddplab.ccl", "ddplab.forensics"),
    ("ddplab.distributed",),
    ("ddplab.tracking", "ddplab.agent"),  # a job's run, and the node agent that delivers it
    ("ddplab.training",),
    ("ddplab.study", "ddplab.bench", "ddplab.doctor", "ddplab.launchers.local",
     "ddplab.launchers.mpi", "ddplab.launchers.rendezvous"),
    ("ddplab", "ddplab.cli", "ddplab.__main__"),
]


def layer(module: str) -> int:
    best = max((p for room in LAYERS for p in room
                if module == p or module.startswith(p + ".")), key=len)
    return next(i for i, room in enumerate(LAYERS) if best in room)


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if b != "ddplab" and layer(b) > layer(a))


def test_no_module_imports_a_higher_room():
    assert upward(graph_of(PACKAGE)) == []


def test_an_upward_import_is_found(tmp_path):
    pkg = tmp_path / "ddplab"
    (pkg / "workload").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "workload" / "__init__.py").write_text("")
    (pkg / "training.py").write_text("")
    (pkg / "workload" / "data.py").write_text("def f():\n    from .. import training\n")
    assert upward(graph_of(pkg)) == ["ddplab.workload.data -> ddplab.training"]


def copied_for_the_ccl_build(dockerfile: Path) -> tuple[set[str], set[str]]:
    """What the CPU image's build stage copies to compile ddplab's ccl (its COPY lines into
    /opt/ddplab/ccl-build): (modules copied as files, packages copied whole)."""
    files: set[str] = set()
    packages: set[str] = set()
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and words[-1].startswith("/opt/ddplab/ccl-build/"):
            for src in words[1:-1]:
                parts = Path(src).relative_to("src").with_suffix("").parts
                if src.endswith(".py"):
                    files.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
                else:
                    packages.add(".".join(parts))
    return files, packages


def test_the_ccl_package_imports_only_what_the_image_copies_to_build_it():
    """docker/cpu-oneccl/Dockerfile compiles ddplab's ccl from ddplab.ccl and errors.py alone
    (a change elsewhere must not recompile it): an import of another room broke `make images`
    at its build check (ModuleNotFoundError: No module named 'ddplab.forensics')."""
    files, packages = copied_for_the_ccl_build(
        PACKAGE.parents[1] / "docker" / "cpu-oneccl" / "Dockerfile")
    assert packages == {"ddplab.ccl"} and "ddplab.errors" in files, (files, packages)
    graph = graph_of(PACKAGE)
    ccl = {m for m in graph if m == "ddplab.ccl" or m.startswith("ddplab.ccl.")}

    def is_copied(module: str) -> bool:
        return module in files or any(module == p or module.startswith(p + ".") for p in packages)

    missing = sorted(f"{m} -> {t}" for m in ccl for t in graph[m] if not is_copied(t))
    assert missing == []
