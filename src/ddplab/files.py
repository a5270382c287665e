"""Files another process reads while this one writes them (a spool's meta and mark, a job's
identity, a rank's report, the run's last line): whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


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
