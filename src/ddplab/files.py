"""Files another process reads while this one writes them (a spool's meta and mark, a job's
identity, a rank's report, the run's last line): whole or not at all."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .log import logger


def write_text_atomic(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file beside it and a rename, so a reader
    (another process, ``ddplab sync``, a restarted attempt) meets the old file or the new one,
    never half of one. The temporary's name holds the pid: two writers never share it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also leave the temporary behind
        raise


def finite_json(value: Any) -> str:
    """``value`` as indented JSON that stays JSON: NaN and infinities as null (json.dumps writes
    bare NaN, which JSON readers refuse: a script's NaN loss in its summary.json)."""
    return json.dumps(_finite(value), indent=2, allow_nan=False, default=str)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def save_copy(path: str, text: str) -> None:
    """``--summary-out``'s file; one that cannot be written now (checked before the job began)
    is a warning: the run has summary.json, and a local copy lost fails no job."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    except OSError as e:
        logger().warning(f"--summary-out: could not write {path} ({e.strerror or e}); the "
                         "run's summary.json has it")


def folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a folder this user writes into (made where missing: its nearest
    existing ancestor must be one), else None."""
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user"
    return None


def named_or_id(given: str, root: Path) -> Path:
    """What ``checkpoint.resume`` names, one rule for both kinds of job: the path given (``~``
    expanded) where it exists, else a run id's folder in the experiment's (``root``)."""
    path = Path(given).expanduser()
    return path if path.exists() else root / given
