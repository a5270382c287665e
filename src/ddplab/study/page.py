"""`ddplab report PARENT --page NAME`: the study's report as docs/results/NAME.md, stamped from
what its child runs recorded (when they ran, the commit, the machine) and the command that ran
the study, with the report's plots beside it in docs/results/NAME/.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from .. import pages
from ..tracking import schema


def _when(ms: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc)


def measured(children: list[Any]) -> str:
    """From the first child's start to the last one's end."""
    starts = [c.info.start_time for c in children if c.info.start_time]
    ends = [c.info.end_time for c in children if c.info.end_time] or starts
    if not starts:
        return "no runs"
    first, last = _when(min(starts)), _when(max(ends))
    end = last.strftime("%H:%M" if last.date() == first.date() else "%Y-%m-%d %H:%M")
    return f"{first:%Y-%m-%d %H:%M} - {end} UTC ({len(children)} runs)"


def _distinct(children: list[Any], tag: str, missing: str, width: int = 200) -> str:
    """Each value of ``tag`` among the runs that have it (a job that failed before its first
    step has none), in order."""
    seen = dict.fromkeys(c.data.tags.get(tag, "")[:width] for c in children)
    return ", ".join(v for v in seen if v) or missing


def stamp(parent: Any, children: list[Any], name: str) -> pages.Stamp:
    dirty = any(c.data.tags.get(schema.GIT_DIRTY) == "true" for c in children)
    command = parent.data.tags.get(schema.STUDY_COMMAND) or \
        f"ddplab study run {parent.data.tags.get(schema.STUDY_FILE, '?')}"
    return pages.Stamp(
        measured=measured(children),
        commit=_distinct(children, schema.GIT_SHA, "unknown", 10) +
        (" + local changes" if dirty else ""),
        machine=_distinct(children, schema.MACHINE, "not recorded by these runs"),
        command=f"{command} && ddplab report {parent.info.run_id} --page {name}")


def write(page: Path, parent: Any, children: list[Any], md: str, pngs: list[Path]) -> Path:
    """``page`` and its plots (``page``'s name without .md, as a folder)."""
    title, _, body = md.partition("\n")
    return pages.write(page, title.removeprefix("# "), stamp(parent, children, page.stem), body,
                       "Written by `ddplab report --page`; run the command again to replace it.",
                       pngs)
