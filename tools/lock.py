"""``make lock``: the hashed lock files, regenerated from pyproject.toml and constraints.txt.

- ``requirements-dev.lock``: ddplab's dependencies with its ``gpu``, ``server`` and ``dev`` extras; what
  ``make setup`` installs (pip --require-hashes), so lint and tests run the same tools everywhere.
- ``requirements.lock``: the same pins without the dev tools; what every image installs.

Resolved by uv for Linux x86_64, CPython 3.11 (these machines, and the images' Debian 12),
against PyPI. Each lock starts with the sha256 of its own inputs; tests/test_lock.py fails when
pyproject.toml or constraints.txt changed since (run ``make lock``). The runtime lock's inputs leave
the ``dev`` extra out: a new test tool changes only the dev lock, so no image (which copies
requirements.lock) rebuilds its torch layers for it.

    python tools/lock.py            (make lock)
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCKS = {"requirements-dev.lock": ["--extra", "gpu", "--extra", "server", "--extra", "dev"],
         "requirements.lock": ["--extra", "gpu", "--extra", "server"]}
TARGET = ["--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28",
          "--index-url", "https://pypi.org/simple", "--generate-hashes",
          "--custom-compile-command", "make lock"]
DIGEST_PREFIX = "# inputs-sha256: "


def inputs_digest(lock: str, root: Path = ROOT) -> str:
    """What ``lock`` is made from: the project's dependencies, the extras it takes, the tested pins."""
    import tomllib

    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = set(LOCKS[lock][1::2])
    text = repr((sorted(project["dependencies"]),
                 sorted((k, sorted(v)) for k, v in project["optional-dependencies"].items()
                        if k in extras)))
    text += (root / "constraints.txt").read_text()
    return hashlib.sha256(text.encode()).hexdigest()


def pins(lock: Path) -> str:
    sys.path.insert(0, str(ROOT / "docker"))
    from lock_subset import entries

    return "".join(f"{name}=={version}\n" for name, version, _ in entries(lock.read_text()))


def compile_lock(uv: str, name: str, extra_constraints: list[str]) -> None:
    out = ROOT / name
    cmd = [uv, "pip", "compile", "pyproject.toml", *LOCKS[name], "-c", "constraints.txt",
           *extra_constraints, *TARGET, "-o", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True)
    out.write_text(f"{DIGEST_PREFIX}{inputs_digest(name)}\n" + out.read_text())


def main() -> int:
    uv = str(Path(sys.executable).with_name("uv"))
    compile_lock(uv, "requirements-dev.lock", [])
    # The runtime lock takes the dev lock's versions, so the two can never disagree. (A fixed,
    # ignored path: the lock's annotations name it.)
    scratch = ROOT / "build" / "dev-lock-pins.txt"
    scratch.parent.mkdir(exist_ok=True)
    scratch.write_text(pins(ROOT / "requirements-dev.lock"))
    compile_lock(uv, "requirements.lock", ["-c", "build/dev-lock-pins.txt"])
    scratch.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
