"""The benchmarks' pages under docs/results/ (ddplab.pages stamps them): each says when, at
which commit, on what machine and by which command its figures were measured.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from ddplab import pages
from ddplab.distributed import host

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / pages.RESULTS


def write(name: str, title: str, body: str, argv: list[str] | None = None,
          folder: Path = RESULTS) -> Path:
    """docs/results/<name>.md: the stamp, then ``body`` (markdown)."""
    argv = sys.argv if argv is None else argv
    stamp = pages.Stamp(measured=pages.now(), commit=pages.commit(REPO), machine=machine(),
                        command=shlex.join(["python", os.path.relpath(argv[0], REPO), *argv[1:]]))
    page = pages.write(folder / f"{name}.md", title, stamp, body,
                       "Written by the benchmark itself; run the command again to replace it.")
    print(f"\nwrote {os.path.relpath(page)}")
    return page


def machine() -> str:
    """The host's cores and memory, led by the GPUs torch sees: a GPU machine's page names its
    device (the H200's pages said only "16 cores (Intel(R) Xeon(R) ...)")."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return (f"{n} x {torch.cuda.get_device_name(0)}, " if n else "") + host.summary()
