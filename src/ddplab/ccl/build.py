"""``make setup-ccl``: oneCCL's CPU runtime and headers from PyPI, and ddplab's c10d backend
compiled against the installed torch, all under ``ddplab.ccl.home()``.

PyPI splits oneCCL 2022.2.0 over three wheels; only what the backend needs is taken:
- ``oneccl-cpu``: ``lib/libccl.so.1``, the CPU runtime (installed with ``--no-deps`` it would
  pull ``libfabric>=2.6``, which is not on PyPI: the transport is Debian's ``libfabric1``);
- ``oneccl``: only ``lib/libccl.so.2``, the plugin loader ``libccl.so.1`` needs (this wheel's own
  ``libccl.so.1`` wants Intel's SYCL runtime);
- ``oneccl-cpu-devel``: ``include/oneapi/`` (its libraries are static only).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

from ..errors import DdplabError
from . import EXT_NAME, ONECCL_VERSION, fabric, home

SOURCE = Path(__file__).with_name("csrc") / f"{EXT_NAME}.cpp"
WHEELS = {  # PyPI name -> {member under <name>-<version>.data/data/ -> path under home()}
    "oneccl-cpu": {"lib/libccl.so.1": "lib/libccl.so.1",
                   "share/doc/ccl/licensing/": "licenses/"},
    "oneccl": {"lib/libccl.so.2": "lib/libccl.so.2"},
    "oneccl-cpu-devel": {"include/": "include/"},
}


class BuildError(DdplabError, RuntimeError):
    pass


def say(msg: str) -> None:
    print(f"setup-ccl: {msg}", flush=True)


def preflight() -> None:
    """Everything a compile needs, checked before downloading 130 MB."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise BuildError("no C++ compiler (c++/g++) on PATH (Debian/Ubuntu: apt-get install g++)")
    include = Path(sysconfig.get_paths()["include"], "Python.h")
    if not include.exists():
        raise BuildError(f"Python's headers are missing ({include}; Debian/Ubuntu: "
                         f"apt-get install python3-dev)")


def fetch(dest: Path, wheel_dir: Path) -> None:
    names = [f"{name}=={ONECCL_VERSION}" for name in WHEELS]
    say(f"downloading {', '.join(names)} from the package index")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                           "--dest", str(wheel_dir), *names], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BuildError(f"pip download of {', '.join(names)} failed: {last}")
    for name, members in WHEELS.items():
        wheel = next(wheel_dir.glob(f"{name.replace('-', '_')}-{ONECCL_VERSION}-*.whl"))
        extract(wheel, f"{name.replace('-', '_')}-{ONECCL_VERSION}.data/data/", members, dest)


def extract(wheel: Path, prefix: str, members: dict[str, str], dest: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if not info.filename.startswith(prefix) or info.is_dir():
                continue
            inner = info.filename[len(prefix):]
            for src, dst in members.items():
                if inner == src or (src.endswith("/") and inner.startswith(src)):
                    out = dest / (dst + inner[len(src):] if src.endswith("/") else dst)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(zf.read(info))
                    out.chmod(0o755 if "/lib/" in f"/{dst}" else 0o644)


def compile_extension(dest: Path, build_dir: Path) -> Path:
    import torch.utils.cpp_extension as ext

    say(f"compiling {SOURCE.name} against torch (a minute or two)")
    # load() imports what it built: the runtime it links must already be loaded.
    ctypes.CDLL(str(dest / "lib" / "libccl.so.1"), mode=ctypes.RTLD_GLOBAL)
    build_dir.mkdir(parents=True, exist_ok=True)  # older torch does not make it
    ext.load(name=EXT_NAME, sources=[str(SOURCE)], build_directory=str(build_dir),
             extra_include_paths=[str(dest / "include")],
             extra_cflags=["-O2"],
             extra_ldflags=[f"-L{dest / 'lib'}", "-l:libccl.so.1"],
             is_python_module=True, verbose=False)
    built = build_dir / f"{EXT_NAME}.so"
    shutil.copy2(built, dest / f"{EXT_NAME}.so")
    return dest / f"{EXT_NAME}.so"


def build(dest: Path) -> None:
    import torch

    preflight()
    started = time.monotonic()
    staging = dest.with_name(dest.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="ddplab-ccl-") as tmp:
        fetch(staging, Path(tmp, "wheels"))
        if ctypes.util.find_library("fabric") is None:  # the transport, where the system has none
            try:
                fabric.fetch(staging, say)
            except fabric.FetchError as e:
                raise BuildError(str(e)) from None
        compile_extension(staging, Path(tmp, "build"))
    (staging / "BUILD.json").write_text(json.dumps(
        {"torch": torch.__version__, "oneccl": ONECCL_VERSION, "source": SOURCE.name,
         "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")
    # Replace the old build only once the new one is complete: a failed build loses nothing.
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)
    say(f"built {dest / (EXT_NAME + '.so')} for torch {torch.__version__} over oneCCL "
        f"{ONECCL_VERSION} in {time.monotonic() - started:.0f} s")


def check(dest: Path) -> None:
    """Load what was built, in a fresh process (the build process already imported it)."""
    code = ("import ddplab.ccl as c, sys; m, why = c.load(); print(why); "
            "sys.exit(0 if m else 1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**__import__("os").environ, "DDPLAB_CCL_HOME": str(dest)})
    if proc.returncode != 0:
        raise BuildError((proc.stdout + proc.stderr).strip().splitlines()[-1])
    say(f"ok: {proc.stdout.strip()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddplab.ccl.build", description=__doc__.split("\n")[0])
    p.add_argument("--dest", type=Path, default=None, help="install here (default: ddplab.ccl.home())")
    args = p.parse_args(argv)
    dest = (args.dest or home()).resolve()
    try:
        build(dest)
        check(dest)
    except BuildError as e:
        print(f"setup-ccl: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - a compiler error: its last lines say what failed
        lines = str(e).strip().splitlines()
        print("setup-ccl: error: the compile failed:\n  " + "\n  ".join(lines[-15:]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
