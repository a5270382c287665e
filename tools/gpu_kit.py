"""make gpu-kit: the wheels a bare GPU machine without network lacks to run ddplab's proof
(benchmarks/gpu_proof.sh), downloaded here for CPython 3.12 on manylinux x86_64.

The machine brings PyTorch and CUDA (and numpy, matplotlib, psutil, rich: any PyTorch image
has them); the kit brings MLflow's client side with its SQL store (mlflow-skinny,
mlflow-tracing, SQLAlchemy, Alembic and what they need) at the versions of requirements.lock,
and setuptools to build ddplab itself there. Nothing of torch or CUDA: the kit stays small
enough to travel with the working tree (the device tool sends at most 64 MiB).

    python tools/gpu_kit.py [--dest .gpu-kit] [--python-version 3.12]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("mlflow-skinny", "mlflow-tracing", "sqlalchemy", "alembic", "setuptools")
# What the machine's PyTorch stack brings; pip would otherwise fetch these as dependencies.
MACHINE_HAS = re.compile(r"^(torch|torchvision|triton|nvidia-.*|cuda-.*|numpy|pandas|pyarrow|"
                         r"scipy|scikit-learn|matplotlib|pillow|sympy|networkx|mpmath|jinja2|"
                         r"markupsafe|fsspec|filelock|psutil|rich|pyyaml)$")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
LIMIT_MIB = 60


def pins(lock: Path) -> dict[str, str]:
    """name -> version, from a hashed lock's `name==version \\` lines."""
    found = re.findall(r"^([A-Za-z0-9_.-]+)==([^ \\\n]+)", lock.read_text(), flags=re.M)
    return {name.lower(): version for name, version in found}


def download(dest: Path, python_version: str) -> list[Path]:
    locked = pins(REPO / "requirements.lock")
    missing = [r for r in ROOTS if r not in locked]
    if missing:
        sys.exit(f"gpu-kit: requirements.lock has no pin for {', '.join(missing)} (make lock)")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        old.unlink()
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    # Dependencies one level at a time: each wheel's own requirements, minus what the machine
    # has, pinned by the lock (pip's resolver cannot be told "already there" for another machine).
    wanted, seen = [f"{r}=={locked[r]}" for r in ROOTS], set(ROOTS)
    while wanted:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", python_version,
                        "--implementation", "cp", *platform_args, "-d", str(dest), *wanted],
                       check=True)
        wanted = []
        for name in _requires(dest):
            if name not in seen and not MACHINE_HAS.match(name) and name in locked:
                seen.add(name)
                wanted.append(f"{name}=={locked[name]}")
    return sorted(dest.glob("*.whl"))


def _requires(dest: Path) -> set[str]:
    """The unconditional requirements (no extras, no markers for other Pythons) of every wheel."""
    import zipfile

    names: set[str] = set()
    for wheel in dest.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if not line.startswith("Requires-Dist:") or "extra ==" in line:
                    continue
                if "python_version" in line and "<" in line.split(";", 1)[-1]:
                    continue  # a backport for older Pythons than the machine's 3.12
                name = re.split(r"[ ;<>=!~\[(]", line.split(":", 1)[1].strip(), maxsplit=1)[0]
                names.add(name.lower().replace("_", "-"))
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=str(REPO / ".gpu-kit"))
    ap.add_argument("--python-version", default="3.12")
    a = ap.parse_args()
    dest = Path(a.dest)
    wheels = download(dest, a.python_version)
    (dest / "MANIFEST.txt").write_text("".join(f"{w.name}\n" for w in wheels))
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"gpu-kit: {len(wheels)} wheels, {mib:.1f} MiB in {dest} (limit {LIMIT_MIB} MiB)")
    if mib > LIMIT_MIB:
        print(f"gpu-kit: over {LIMIT_MIB} MiB: it would not travel with the working tree",
              file=sys.stderr)
        return 1
    shutil.copy2(REPO / "requirements.lock", dest / "requirements.lock")  # what it was built from
    return 0


if __name__ == "__main__":
    sys.exit(main())
