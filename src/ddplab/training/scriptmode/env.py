"""What a rank's supervisor tells the script's process (child.py) through its environment,
and the one way that process reports back (``report``)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from ...files import write_text_atomic

BOOT = str(Path(__file__).with_name("boot.py"))
"""The file python runs in the script's process (boot.py, child.py)."""
REPORT_ENV = "DDPLAB_SCRIPT_REPORT"
"""The JSON file the script's process reports into: its process group, its failure, its
observed training (observe.py)."""
STACKS_ENV = "DDPLAB_SCRIPT_STACKS"
"""Where the script's process writes every thread's stack on heartbeat.STACK_SIGNAL."""
T0_ENV = "DDPLAB_T0"
"""When the job started (epoch seconds): the start-up times count from it."""
OBSERVE_ENV = "DDPLAB_OBSERVE"
"""Set when ``script.observe`` is on: ``script.flops_per_sample`` (0 = count them); absent =
no observation (observe.py)."""
FORENSICS_ENV = "DDPLAB_FORENSICS"
"""The node's forensics folder, where the script's heartbeat goes (tracked jobs only)."""
STEP_OFFSET_ENV = "DDPLAB_STEP_OFFSET"
"""Rank 0's first step number for what it logs: 0, or one past the steps an earlier attempt of
the same run logged (a resumed attempt's observation counts its steps from 1 again)."""


def report(update: dict[str, Any]) -> None:
    """Keys into the script's report file (REPORT_ENV), which its supervisor reads once the
    script has ended; nothing outside a job."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    try:
        known = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        known = {}
    known.update(update)
    with contextlib.suppress(OSError):  # a full disk: the script goes on, its report short
        write_text_atomic(path, json.dumps(known, default=str))
