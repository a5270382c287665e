"""Part of the hashed lock, for pip inside the images (Python's standard library only).

    python lock_subset.py requirements.lock --skip 'torch|torchvision|nvidia-.*|triton' > rest.lock
    python lock_subset.py requirements.lock --pins > pins.txt      # name==version, for pip -c
    python lock_subset.py requirements.lock --drifted 'cuda-.*|nvidia-.*|triton' > drift.lock

The images install torch from TORCH_INDEX_URL (PyTorch's CPU index where it is reachable, so
its wheel and hashes differ from PyPI's) constrained by the pins, then everything else from the
lock with its hashes (pip --require-hashes --no-deps). The pins cannot hold torch's own
dependencies (they would also pin the Intel image's older torch), so PyPI's CUDA build of torch
brings their newest releases; --drifted lists, with hashes, those installed at another
version than the lock's, for pip to put the lock's back.
"""

import argparse
import re
import sys
from importlib import metadata

ENTRY = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def entries(text: str) -> list[tuple[str, str, str]]:
    """(name, version, the entry's lines) for each pinned requirement."""
    out, current = [], None
    for line in text.splitlines():
        m = ENTRY.match(line)
        if m:
            current = [m.group(1), m.group(2).rstrip("\\").strip(), line]
            out.append(current)
        elif current is not None and line.startswith((" ", "\t")) and not line.strip().startswith("#"):
            current[2] += "\n" + line
        else:
            current = None
    return [tuple(e) for e in out]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("lock")
    p.add_argument("--skip", default="", help="a regular expression of names to leave out")
    p.add_argument("--pins", action="store_true", help="name==version lines, no hashes")
    p.add_argument("--drifted", default="", metavar="REGEX",
                   help="only these names, and only where installed at another version")
    a = p.parse_args()
    skip = re.compile(f"(?:{a.skip})$", re.I) if a.skip else None
    only = re.compile(f"(?:{a.drifted})$", re.I) if a.drifted else None
    with open(a.lock, encoding="utf-8") as f:
        for name, version, lines in entries(f.read()):
            if skip and skip.match(name):
                continue
            if only and not (only.match(name) and installed(name) not in (None, version.split("+")[0])):
                continue
            print(f"{name}=={version}" if a.pins else lines.rstrip().rstrip("\\").rstrip())
    return 0


def installed(name: str) -> str | None:
    try:
        return metadata.version(name).split("+")[0]  # torch's 2.14.1+cpu is the lock's 2.14.1
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
