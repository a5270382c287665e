"""Unit: the README and docs/ name only commands that exist: every `make TARGET` in their code
is a Makefile target, and every `ddplab COMMAND ... --flag` is a flag that command takes."""

from __future__ import annotations

import argparse
import re
import sys

import pytest

from ddplab import cli
from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def code_of(text: str) -> list[str]:
    """The page's code: fenced blocks, then inline spans."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def mentions(pattern: str) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for code in code_of(page.read_text()):
            for line in code.splitlines():
                found += [(page.name, m) for m in re.findall(pattern, line)]
    return found


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z0-9_-]+):", (REPO / "Makefile").read_text(), re.M))


def test_every_make_target_the_docs_name_exists():
    # (`make image-*` is a family, not a target: a name followed by * is left out)
    named = mentions(r"(?:^|[\s;&|(])make (?:-[a-zA-Z]+ )*([a-z][a-z0-9-]*)(?![*a-z0-9-])")
    assert len(named) > 20  # the pattern finds them (the README alone names a dozen)
    missing = sorted({(page, t) for page, t in named if t not in make_targets()})
    assert not missing, missing


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


def ddplab_flags() -> list[tuple[str, list[str], str]]:
    """(page, command words, flag) for each `--flag` after a `ddplab COMMAND` in the docs'
    code, up to the next shell separator (what follows ` -- ` goes to the job: left out)."""
    found = []
    for page in PAGES:
        for code in code_of(page.read_text()):
            for line in code.splitlines():
                for m in re.finditer(r"\bddplab ((?:[a-z][a-z-]* ?)+)([^;&|#]*)", line):
                    words = [w for w in m.group(1).split() if not w.endswith((".yaml", ".yml"))]
                    rest = m.group(2).split(" -- ")[0]
                    flags = re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", rest)
                    found += [(page.name, words[:2], f) for f in flags]
    return found


def test_every_ddplab_flag_the_docs_name_exists():
    named = ddplab_flags()
    assert len(named) > 10  # the pattern finds them
    wrong = [(page, "ddplab " + " ".join(words), flag) for page, words, flag in named
             if (flags := flags_of(words)) is not None and flag not in flags]
    assert not wrong, wrong


@pytest.mark.parametrize("broken", ["make no-such-target", "ddplab train x.yaml --no-such-flag"])
def test_the_checks_catch_a_wrong_name(broken, monkeypatch, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"Run `{broken}`.\n")
    monkeypatch.setattr(sys.modules[__name__], "PAGES", [page])
    check = (test_every_make_target_the_docs_name_exists if broken.startswith("make")
             else test_every_ddplab_flag_the_docs_name_exists)
    with pytest.raises(AssertionError):
        check()
