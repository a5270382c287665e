"""Measured figures as pages under docs/results/, each stamped with when, at which commit, on
what machine and by which command it was measured. The docs link to these pages instead of
restating numbers, so a figure is replaced by measuring again, never by hand. The benchmarks
(benchmarks/results.py) and `ddplab report PARENT --page NAME` write them.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .config import ConfigError

RESULTS = Path("docs") / "results"
CODE = Path(__file__).resolve().parent  # the checkout this code runs from (its commit)
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,79}")


@dataclass(frozen=True)
class Stamp:
    """What a figure depends on, one line each."""
    measured: str
    commit: str
    machine: str
    command: str


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def commit(repo: Path) -> str:
    """The checkout's commit ("+ local changes" when the tree differs from it). A copy of the
    tree without .git (an image, a GPU machine that was sent the files) is told it in
    DDPLAB_GIT_SHA, as the runs are (tracking/capsule.py)."""
    if os.environ.get("DDPLAB_GIT_SHA"):
        return os.environ["DDPLAB_GIT_SHA"][:10]
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                                 timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    sha = git("rev-parse", "--short=10", "HEAD") or "unknown"
    return sha + (" + local changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def root(start: Path) -> Path:
    """The checkout that holds ``start`` (its git top level), else ``start`` itself: a page
    belongs in the repository's docs/results/ wherever in it the command runs."""
    for folder in (start, *start.parents):
        if (folder / ".git").exists():
            return folder
    return start


def path_for(name: str, start: Path | None = None) -> Path:
    """docs/results/<name>.md of the checkout around ``start`` (the working directory)."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"--page: got {name!r}; must be a page name like ch09-layouts "
                          "(lower-case letters, digits, '.', '_', '-'; written to "
                          "docs/results/<name>.md)")
    return root((start or Path.cwd()).resolve()) / RESULTS / f"{name}.md"


def write(page: Path, title: str, stamp: Stamp, body: str, written_by: str,
          images: list[Path] | tuple[Path, ...] = ()) -> Path:
    """``page``: the title, the stamp, ``body`` (markdown), then ``images``, copied into the
    folder named like the page (whose older PNGs go: a page shows only what it measured)."""
    import shutil

    folder = page.with_suffix("")
    for path in (page, folder):  # written through, a link would put the page anywhere
        if path.is_symlink():
            raise ConfigError(f"--page: {path} is a symbolic link (to {os.readlink(path)}); a "
                              "results page is written in docs/results/ itself: remove the link")
    if folder.is_dir():
        for old in folder.glob("*.png"):
            old.unlink()
    for image in images:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(image, folder / image.name)
        body = body.rstrip() + f"\n\n![{image.stem}]({folder.name}/{image.name})"
    text = (f"# {title}\n\n{written_by}\n\n| | |\n|---|---|\n"
            f"| measured | {stamp.measured} |\n| commit | {stamp.commit} |\n"
            f"| machine | {stamp.machine} |\n| command | `{stamp.command}` |\n\n")
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text + body.strip() + "\n")
    return page
