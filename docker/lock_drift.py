"""The lock's entries (with hashes) for packages installed at another version than the lock's,
among those a regular expression names (Python's standard library only).

    python lock_drift.py requirements.lock 'triton|cuda-.*|nvidia-.*' > drift.lock

The images' pins cannot hold torch's own dependencies (they would pin the Intel image's older
torch as well), so PyPI's CUDA build of torch brings their newest releases (cuda-pathfinder
1.9.1 where the lock says 1.9.0); pip installs this file to put the lock's versions back.
A local label is not a difference: torch's 2.14.1+cpu is the lock's 2.14.1.
"""

import re
import sys
from importlib import metadata

from lock_subset import entries


def installed(name: str) -> str | None:
    try:
        return metadata.version(name).split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def main(lock: str, names: str) -> int:
    wanted = re.compile(f"(?:{names})$", re.I)
    with open(lock, encoding="utf-8") as f:
        for name, version, lines in entries(f.read()):
            if wanted.match(name) and installed(name) not in (None, version.split("+")[0]):
                print(lines.rstrip().rstrip("\\").rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
