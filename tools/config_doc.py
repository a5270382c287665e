"""``make docs``: docs/config-reference.md, every experiment key with its type, default and
docstring, generated from the schema itself (src/ddplab/config.py), so it cannot drift from
the code. ``--check`` exits 1 when the committed page differs (a test runs it).
"""

from __future__ import annotations

import ast
import dataclasses
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddplab import config  # noqa: E402

OUT = ROOT / "docs" / "config-reference.md"


def docstrings(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (attribute docstrings, PEP 257)."""
    tree = ast.parse(Path(config.__file__).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    found, last = {}, None
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            last = stmt.target.id
        elif (last and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
              and isinstance(stmt.value.value, str)):
            found[last] = " ".join(stmt.value.value.split())
            last = None
        else:
            last = None
    return found


def _type(tp: object) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
        return " or ".join(_type(a) for a in typing.get_args(tp))
    text = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
    return text.replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        made = f.default_factory()  # type: ignore[misc]
        return "(section)" if dataclasses.is_dataclass(made) else f"`{made!r}`"
    return "required"


def rows(cls: type, prefix: str) -> list[str]:
    hints, docs, out = typing.get_type_hints(cls), docstrings(cls), []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += rows(tp, f"{prefix}{f.name}.")
            continue
        what = docs.get(f.name, "").replace("|", "\\|")
        out.append(f"| `{prefix}{f.name}` | {_type(tp)} | {_default(f)} | {what} |")
        item = (typing.get_args(tp) or (None,))[0]
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(item):  # each item's keys
            out += rows(item, f"{prefix}{f.name}[].")
    return out


def render() -> str:
    head = ["# Configuration reference", "",
            "Every key of an experiment file, generated from `src/ddplab/config.py` by "
            "`make docs` (a test fails when this page and the code disagree). How the file, "
            "`DDPLAB_SET` and `--set` combine, and what input is refused: "
            "[configuration.md](configuration.md).", "",
            "| key | type | default | what |", "|---|---|---|---|"]
    return "\n".join(head + rows(config.ExperimentConfig, "")) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run `make docs`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({text.count(chr(10)) - 6} keys)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
