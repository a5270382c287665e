"""Measured figures as pages under docs/results/, each stamped with when, at which commit, on
what machine and by which command it was measured. The docs link to these pages instead of
restating numbers, so a figure is replaced by running its benchmark again, never by hand.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"


def commit(repo: Path = REPO) -> str:
    """The commit measured ("+ local changes" when the tree differs from it)."""
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""

    sha = git("rev-parse", "--short=10", "HEAD") or "unknown"
    return sha + (" + local changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> str:
    """Cores this process may use, the CPU model, memory: what the figures depend on."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
        memory = f", {kib / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        memory = ""
    return f"{len(os.sched_getaffinity(0))} cores ({model}){memory}, {platform.system()}"


def write(name: str, title: str, body: str, argv: list[str] | None = None,
          folder: Path = RESULTS) -> Path:
    """docs/results/<name>.md: the stamp, then ``body`` (markdown)."""
    argv = sys.argv if argv is None else argv
    command = shlex.join(["python", os.path.relpath(argv[0], REPO), *argv[1:]])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    stamp = (f"# {title}\n\n"
             "Written by the benchmark itself; run the command again to replace it.\n\n"
             "| | |\n|---|---|\n"
             f"| measured | {when} |\n| commit | {commit()} |\n| machine | {machine()} |\n"
             f"| command | `{command}` |\n\n")
    folder.mkdir(parents=True, exist_ok=True)
    page = folder / f"{name}.md"
    page.write_text(stamp + body.rstrip() + "\n")
    print(f"\nwrote {os.path.relpath(page)}")
    return page
