"""Part of the hashed lock, for pip inside the images (Python's standard library only).

    python lock_subset.py requirements.lock --skip 'torch|torchvision|nvidia-.*|triton' > rest.lock
    python lock_subset.py requirements.lock --pins > pins.txt      # name==version, for pip -c

The images install torch from TORCH_INDEX_URL (PyTorch's CPU index where it is reachable, so
its wheel and hashes differ from PyPI's) constrained by the pins, then everything else from the
lock with its hashes (pip --require-hashes --no-deps).
"""

import argparse
import re
import sys

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
    a = p.parse_args()
    skip = re.compile(f"(?:{a.skip})$", re.I) if a.skip else None
    with open(a.lock, encoding="utf-8") as f:
        for name, version, lines in entries(f.read()):
            if skip and skip.match(name):
                continue
            print(f"{name}=={version}" if a.pins else lines.rstrip().rstrip("\\").rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
