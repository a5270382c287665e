"""Unit (lint tier): ddplab's run vocabulary is named once, in tracking/schema.py, and every
tag that is read is one that something writes.

Read from the source with ``ast`` (nothing runs). Two rules:

1. No module but schema.py spells a ``ddplab.`` tag name: a string (or the literal start of an
   f-string) that looks like one (``ddplab.world_size``, ``ddplab.version.``, ``tags.ddplab.x``
   in a search filter) is an error. Prose that only mentions a name (``as its ddplab.error``) is
   not such a string; a module's own dotted name (``python -m ddplab.agent.orphan``) neither.

2. Every schema name is used, and what is read is written. A use of a schema name
   (``schema.ERROR``, a name imported from schema, an alias ``MARK = schema.IMPORTED_FROM``;
   a family's function and its ``*_PREFIX`` count as one name) is a WRITE when it is
     - the name argument of ``set_tag`` / ``delete_tag`` / ``RunTag``,
     - the key assigned in ``x[NAME] = ...``,
     - a key of a dict (display or comprehension) that reaches a writer in its function:
       passed to ``set_tags`` / ``create_run``, returned, merged (``**``, ``.update``, ``|=``)
       into or assigned to a variable that does;
   and a READ anywhere else (``tags.get(NAME)``, ``NAME in tags``, ``startswith``, a search
   filter, a column of the UI's view). A name's use inside a call (``tag(NAME)``,
   ``tags.get(NAME)``) is that call's, so only the forms above write. A read of a name that no
   module writes fails, but for the few written where this reading cannot see (WRITTEN_UNSEEN).
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

from ddplab.tracking import schema

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddplab"
SCHEMA = PACKAGE / "tracking" / "schema.py"

TAG_LIKE = re.compile(r"^ddplab\.[a-z_0-9.]*=?$")  # "ddplab.x", "ddplab.version.", "ddplab.x="
IN_FILTER = re.compile(r"tags\.`?ddplab\.")  # an MLflow search filter naming a tag
NOT_TAGS = {
    ("study/render.py", "ddplab.study"): "jinja2's PackageLoader: the package, not the tag",
}
"""Strings that look like a tag name but are not one, each with why (file, string)."""
WRITTEN_UNSEEN = {
    "SCRIPT_EXPERIMENT": "mlflow_join._record: out[key] = ..., key running over the two names",
    "SCRIPT_RUN_NAME": "mlflow_join._record: out[key] = ..., key running over the two names",
}
"""Tags written in a way rule 2 does not follow, with where."""

WRITE_ARG = {"set_tag": 1, "delete_tag": 1, "RunTag": 0}  # the position of the tag's name
DICT_WRITERS = {"set_tags", "create_run", "create"}  # take the tags as a dict (create: life.create)

TAGS = {n: v for n, v in vars(schema).items()
        if n.isupper() and isinstance(v, str) and v.startswith(schema.PREFIX) and v != schema.PREFIX}
FUNCTIONS = {n: f for n, f in vars(schema).items()
             if inspect.isfunction(f) and f.__module__ == schema.__name__ and not n.startswith("_")}


def family(fn: object) -> str:
    """The ``*_PREFIX`` a family function's names start with (the longest that fits)."""
    assert callable(fn)
    required = [p for p in inspect.signature(fn).parameters.values()
                if p.default is inspect.Parameter.empty]
    sample = fn(*["x"] * len(required))
    return max((n for n, v in TAGS.items() if n.endswith("_PREFIX") and sample.startswith(v)),
               key=lambda n: len(TAGS[n]))


FAMILY = {n: family(f) for n, f in FUNCTIONS.items() if n != "identity_tags"}
KEY = {**{n: n for n in TAGS}, **FAMILY}
"""Each schema name that is a tag (or a family of tags) -> the one name its uses count for."""


def modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def module_names() -> set[str]:
    return {".".join(("ddplab", *p.relative_to(PACKAGE).with_suffix("").parts))
            .removesuffix(".__init__") for p in PACKAGE.rglob("*.py")}


# --- rule 1 ----------------------------------------------------------------------------------
def tag_like_strings(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                TAG_LIKE.match(node.value) or IN_FILTER.search(node.value)):
            yield node.lineno, node.value


def test_no_module_but_the_schema_spells_a_tag_name():
    dotted = module_names() - set(TAGS.values())
    found = [f"{rel}:{line}: {text!r}" for rel, tree in modules() if rel != "tracking/schema.py"
             for line, text in tag_like_strings(tree)
             if text not in dotted and (rel, text) not in NOT_TAGS]
    assert not found, "name these in tracking/schema.py and use the constant:\n" + "\n".join(found)


def test_the_exceptions_are_still_there():
    seen = {(rel, text) for rel, tree in modules() for _, text in tag_like_strings(tree)}
    assert set(NOT_TAGS) <= seen, "an exception no longer needed: remove it from NOT_TAGS"


# --- rule 2 ----------------------------------------------------------------------------------
class Uses:
    """Every use of a schema tag name in one module, as (KEY, "read" | "write", line)."""

    def __init__(self, tree: ast.Module, inside_schema: bool = False) -> None:
        self.parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        self.modules: set[str] = set()  # local names of the schema module
        self.names: dict[str, str] = {}  # local name -> schema name
        if inside_schema:
            self.names = {n: n for n in KEY}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("schema"):
                self.names |= {a.asname or a.name: a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                self.modules |= {a.asname or a.name for a in node.names if a.name == "schema"}
        self.aliases: set[ast.AST] = set()
        for stmt in tree.body:  # MARK = schema.IMPORTED_FROM: MARK is that name too
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and \
                    isinstance(stmt.targets[0], ast.Name) and (name := self.name(stmt.value)):
                self.names[stmt.targets[0].id] = name
                self.aliases.add(stmt.value)
        self.sunk: dict[ast.AST, set[str]] = {}

    def name(self, node: ast.AST) -> str | None:
        """The schema name ``node`` refers to, if it does."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id in self.modules:
            return node.attr
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            return self.names.get(node.id)
        return None

    def uses(self, root: ast.AST) -> Iterator[tuple[str, str, int]]:
        for node in ast.walk(root):
            name = self.name(node)
            if name in KEY and node not in self.aliases:
                yield KEY[name], self.role(node), node.lineno

    def role(self, ref: ast.AST) -> str:
        node, parent = self.climb(ref)
        if isinstance(parent, ast.Dict) and node in parent.keys or \
                isinstance(parent, ast.DictComp) and node is parent.key:
            return "write" if self.reaches_a_writer(parent) else "read"
        if isinstance(parent, ast.Subscript) and node is parent.slice:
            return "write" if isinstance(parent.ctx, ast.Store) else "read"
        if isinstance(parent, ast.Call) and (i := WRITE_ARG.get(called(parent), -1)) >= 0:
            return "write" if i < len(parent.args) and parent.args[i] is node else "read"
        return "read"

    def climb(self, ref: ast.AST) -> tuple[ast.AST, ast.AST]:
        """Up from a use through what only builds the name (``+``, an f-string, a family's
        function called): the expression that is the name, and what holds it."""
        node = ref
        while True:
            parent = self.parents[node]
            if isinstance(parent, (ast.BinOp, ast.JoinedStr, ast.FormattedValue)) or \
                    isinstance(parent, ast.Call) and parent.func is node:
                node = parent
            else:
                return node, parent

    def reaches_a_writer(self, expr: ast.AST) -> bool:
        scope = self.scope(expr)
        if scope not in self.sunk:  # the names in this function whose dict reaches a writer
            names: set[str] = set()
            while True:
                more = {n.id for n in ast.walk(scope) if isinstance(n, ast.Name)
                        and isinstance(n.ctx, ast.Load) and self.flows(n, names)}
                if more <= names:
                    break
                names |= more
            self.sunk[scope] = names
        return self.flows(expr, self.sunk[scope])

    def flows(self, expr: ast.AST, sunk: set[str]) -> bool:
        node = expr
        while True:
            parent = self.parents.get(node)
            if isinstance(parent, (ast.IfExp, ast.BoolOp, ast.Tuple, ast.keyword)) or \
                    isinstance(parent, ast.Dict) and node in parent.values and \
                    parent.keys[parent.values.index(node)] is None:  # {**node}
                node = parent
                continue
            if isinstance(parent, ast.Return):
                return True
            if isinstance(parent, ast.Call):
                method = parent.func
                return called(parent) in DICT_WRITERS or called(parent) == "update" and \
                    isinstance(method, ast.Attribute) and isinstance(method.value, ast.Name) and \
                    method.value.id in sunk
            if isinstance(parent, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
                return any(isinstance(t, ast.Name) and t.id in sunk for t in targets)
            return False

    def scope(self, node: ast.AST) -> ast.AST:
        while node in self.parents and not isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node = self.parents[node]
        return node


def called(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def all_uses() -> list[tuple[str, str, str]]:
    """(KEY, role, where) for every use in the package; schema.py's own identity_tags counts."""
    out = []
    for rel, tree in modules():
        if rel == "tracking/schema.py":
            fn = next(f for f in tree.body if isinstance(f, ast.FunctionDef)
                      and f.name == "identity_tags")
            out += [(k, role, f"{rel}:{line}")
                    for k, role, line in Uses(tree, inside_schema=True).uses(fn)]
        else:
            out += [(k, role, f"{rel}:{line}") for k, role, line in Uses(tree).uses(tree)]
    return out


USES = all_uses()


def test_every_tag_read_is_one_something_writes():
    written = {k for k, role, _ in USES if role == "write"} | set(WRITTEN_UNSEEN)
    unwritten = sorted(f"{where}: {k}" for k, role, where in USES
                       if role == "read" and k not in written)
    assert not unwritten, "read, but no module writes it:\n" + "\n".join(unwritten)


def test_every_schema_name_is_used():
    used = {k for k, _, _ in USES}
    dead = sorted(set(KEY.values()) - used)
    assert not dead, f"named in tracking/schema.py, used nowhere: {dead}"
    limits = {n for n, v in vars(schema).items() if n.isupper() and isinstance(v, int)}
    source = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p != SCHEMA)
    assert not {n for n in limits if not re.search(rf"\b{n}\b", source)}


def test_unseen_writes_are_still_unseen():
    seen = {k for k, role, _ in USES if role == "write"}
    assert not set(WRITTEN_UNSEEN) & seen, "now seen written: remove it from WRITTEN_UNSEEN"


def test_the_rule_tells_reads_from_writes():
    code = '''
from ..tracking import schema
from ..tracking.schema import ERROR as E
MARK = schema.IMPORTED_FROM

def write(client, run, tags, d):
    client.set_tag(run, schema.VERDICT, tags.get(schema.STUDY))  # VERDICT written, STUDY read
    out = {schema.HOST: 1, **{schema.version_tag(k): v for k, v in d.items()}}
    tags[E] = 2
    client.create_run("0", tags={MARK: 3, **out})

def read(tags):
    table = {schema.LOCK: "lock"}  # a lookup, not a write
    return [tags.get(schema.KIND), schema.SKIPPED_PREFIX in tags, f"tags.{schema.REPEAT} = 1",
            table[schema.GIT_SHA]]
'''
    tree = ast.parse(code)
    roles = {(k, role) for k, role, _ in Uses(tree).uses(tree)}
    assert roles == {("VERDICT", "write"), ("STUDY", "read"), ("HOST", "write"),
                     ("VERSION_PREFIX", "write"), ("ERROR", "write"), ("IMPORTED_FROM", "write"),
                     ("LOCK", "read"), ("KIND", "read"), ("SKIPPED_PREFIX", "read"),
                     ("REPEAT", "read"), ("GIT_SHA", "read")}


# --- the names themselves ----------------------------------------------------------------------
def test_names_are_ddplabs_and_distinct():
    values = list(TAGS.values())
    assert len(values) == len(set(values))
    assert all(re.fullmatch(r"ddplab\.[a-z_0-9.]+", v) for v in values)
    assert schema.version_tag("torch") == "ddplab.version.torch"
    assert schema.user_tag("model") == "ddplab.user.model"
    assert schema.user_tag("model", "sha256") == "ddplab.user.model.sha256"
    assert schema.slurm_tag("job_id") == "ddplab.slurm_job_id"
    assert schema.resume_changes_tag(40) == "ddplab.resume_changes.step40"
    assert schema.support_tag("gloo", "cpu") == "ddplab.support.gloo.cpu"
    assert (schema.PARAM_LIMIT, schema.TAG_LIMIT) == (6000, 8000)


class _Launch:
    world_size, nnodes, local_world_size, launcher = 4, 2, 2, "torchrun"


def test_identity_tags_are_the_same_for_ddplabs_loop_and_a_script():
    tags = schema.identity_tags(_Launch(), kind="loop", resumed_from="", rank0_host="h", machine="m",
                                git_sha="abc", lock="l", torch_build="t", image=None,
                                versions={"torch": "2.5"}, scheduler={"ddplab.slurm_job_id": "7"})
    assert tags == {
        "ddplab.mode": "loop", "ddplab.world_size": 4, "ddplab.nnodes": 2, "ddplab.nproc_per_node": 2,
        "ddplab.launcher": "torchrun", "ddplab.rank0_host": "h", "ddplab.machine": "m",
        "ddplab.git_sha": "abc", "ddplab.lock": "l", "ddplab.torch_build": "t",
        "ddplab.image": "none", "ddplab.resumed_from": "none", "ddplab.version.torch": "2.5",
        "ddplab.slurm_job_id": "7"}
    for rel in ("training/job.py", "training/scriptmode/supervisor.py"):
        assert "schema.identity_tags(" in (PACKAGE / rel).read_text(), rel


def test_the_schema_imports_nothing_but_the_standard_library():
    tree = ast.parse(SCHEMA.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names} | {(n.module or "").split(".")[0] for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom)}
    assert imported <= {"__future__", "collections", "typing"}
