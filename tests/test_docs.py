"""Unit: the README and docs/ name only commands that exist: every `make TARGET` in their code
is a Makefile target, every `ddplab COMMAND ... --flag` is a flag that command takes, and every
benchmarks/ or tools/ script they name is there."""

from __future__ import annotations

import argparse
import re

import pytest

from ddplab import cli
from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_of(text: str) -> list[str]:
    """The page's code: fenced blocks, then inline spans."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def mentions(pattern: str, pages: list | None = None) -> list[tuple[str, str]]:
    found = []
    for page in PAGES if pages is None else pages:
        for code in code_of(page.read_text()):
            for line in code.splitlines():
                found += [(page.name, m) for m in re.findall(pattern, line)]
    return found


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z0-9_-]+):", (REPO / "Makefile").read_text(), re.M))


MAKE = r"(?:^|[\s;&|(])make (?:-[a-zA-Z]+ )*([a-z][a-z0-9-]*)(?![*a-z0-9-])"
SCRIPT = r"\b((?:benchmarks|tools)/[\w-]+\.py)\b"


def missing_targets(pages: list | None = None) -> list[tuple[str, str]]:
    # (`make image-*` is a family, not a target: a name followed by * is left out)
    return sorted({(page, t) for page, t in mentions(MAKE, pages) if t not in make_targets()})


def missing_scripts(pages: list | None = None) -> list[tuple[str, str]]:
    return sorted({(page, p) for page, p in mentions(SCRIPT, pages) if not (REPO / p).is_file()})


def test_every_make_target_the_docs_name_exists():
    assert len(mentions(MAKE)) > 20  # the pattern finds them (the README alone names a dozen)
    assert not missing_targets()


def test_every_script_the_docs_name_exists():
    assert len(mentions(SCRIPT)) > 5  # the pattern finds them
    assert not missing_scripts()


def subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def flags_of(words: list[str]) -> set[str] | None:
    """The flags `ddplab WORDS...` takes (its deepest subcommand's), None if no such command."""
    parser = cli._parser()
    for w in words:
        sub = subparsers(parser)
        if not sub:
            break
        if w not in sub:
            return None
        parser = sub[w]
    return {o for a in parser._actions for o in a.option_strings}


def ddplab_flags(pages: list | None = None) -> list[tuple[str, list[str], str]]:
    """(page, command words, flag) for each `--flag` after a `ddplab COMMAND` in the docs'
    code, up to the next shell separator (what follows ` -- ` goes to the job: left out)."""
    found = []
    for page in PAGES if pages is None else pages:
        for code in code_of(page.read_text()):
            for line in code.splitlines():
                for m in re.finditer(r"\bddplab ((?:[a-z][a-z-]* ?)+)([^;&|#]*)", line):
                    words = [w for w in m.group(1).split() if not w.endswith((".yaml", ".yml"))]
                    rest = m.group(2).split(" -- ")[0]
                    flags = re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", rest)
                    found += [(page.name, words[:2], f) for f in flags]
    return found


def wrong_flags(pages: list | None = None) -> list[tuple[str, str, str]]:
    return [(page, "ddplab " + " ".join(words), flag) for page, words, flag in ddplab_flags(pages)
            if (flags := flags_of(words)) is not None and flag not in flags]


def test_every_ddplab_flag_the_docs_name_exists():
    assert len(ddplab_flags()) > 10  # the pattern finds them
    assert not wrong_flags()


@pytest.mark.parametrize("broken, check, name", [
    ("make no-such-target", missing_targets, "no-such-target"),
    ("ddplab train x.yaml --no-such-flag", wrong_flags, "--no-such-flag"),
    ("python benchmarks/bench_nothing.py", missing_scripts, "benchmarks/bench_nothing.py")])
def test_the_checks_catch_a_wrong_name(broken, check, name, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"Run `{broken}` or `make help` or `ddplab train x.yaml --set a=1` or "
                    "`python benchmarks/bench_core.py`.\n")
    assert [found[-1] for found in check([page])] == [name]
