"""Rules over the names a run's records carry (tracking/schema.py holds the names themselves):
which a user's code may not take from ddplab, and which vary run to run. Light: imported in a
script's own process (script mode's MLflow patches, ``ddplab.track``)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from ..logins import mask
from .schema import PREFIX

_VARIES = re.compile(r"^(perf|system|memory)/|runtime|throughput|duration|_per_sec(ond)?$"
                     r"|_per_s$|_time|(^|/)time|_busy_s$|_wait_frac$|(^|[/_])mem(ory)?([/_]|$)")


def varies_run_to_run(metric: str) -> bool:
    """Whether ``metric`` is one no rerun repeats however deterministic the arithmetic (how
    long, how fast, how much memory, how loaded the machine): reproduce reports it and never
    compares it, a study judges it with throughput's 5% floor. The one rule: a name under
    ``perf/``, ``system/`` or ``memory/`` (ddplab's throughput, wall time, MFU; the machine's
    samples; what the process held), or with ``runtime``, ``throughput``, ``duration`` or a
    ``mem``/``memory`` word in it, or ending in ``_per_second``, ``_per_sec``, ``_per_s``,
    ``_busy_s`` or ``_wait_frac``, or with ``_time`` in it or a segment that starts with
    ``time`` (Hugging Face Trainer's ``train_runtime``, ``train_samples_per_second``; a
    script's ``epoch_time_s``, ``peak_mem_mb``; ``epoch/time_s``; a rank's share of its step,
    ``train/rank<r>_busy_s``, ``train/data_wait_frac``)."""
    return bool(_VARIES.search(metric))


def users_tag(key: str, own: tuple[str, ...] = ()) -> str:
    """The key a tag the user's code sets (its MLflow calls, ``ddplab.track.tags``) is kept
    under: one of ddplab's own records (``ddplab.*``: what studies, reproduce and diagnose
    read) goes beside it as ``user.<key>``; ``own``: the ddplab tags that code may set (and
    their plurals)."""
    if not key.startswith(PREFIX) or key in own or key.removesuffix("s") in own:
        return key
    return f"user.{key}"


def typed_command() -> str:
    """The command this process runs, as typed, with the DDPLAB_SET it read and every URL's
    password masked (``DDPLAB_SET='train.epochs=1' ddplab train x.yaml --set ...``): a run's
    Source in the UI, a study's command on its results page. torchrun's ``-m ddplab`` gives the
    process ``.../ddplab/__main__.py`` for its name: it is ``ddplab`` here."""
    argv = sys.argv or [""]
    head = Path(argv[0])
    name = "ddplab" if head.name == "ddplab" or head.parts[-2:] == ("ddplab", "__main__.py") \
        else head.name
    ddplab_set = os.environ.get("DDPLAB_SET", "")
    return mask((f"DDPLAB_SET={shlex.quote(ddplab_set)} " if ddplab_set else "") +
                shlex.join([name, *argv[1:]]))
