"""oneCCL's transport on a machine without Debian's libfabric1: `make setup-ccl` fetches it and
its libraries (apt-get download, no install) and ddplab loads them from beside the backend.
Real packages from Debian's mirror; the loading happens in a fresh process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ddplab.ccl import fabric


@pytest.mark.skipif(shutil.which("apt-get") is None, reason="not a Debian/Ubuntu machine")
def test_fetched_libfabric_and_its_libraries_load_from_the_bundle(tmp_path):
    fabric.fetch(tmp_path, lambda msg: None)
    bundle = tmp_path / fabric.FOLDER
    assert sorted(p.name for p in bundle.iterdir()) == sorted(so for _, so in fabric.PACKAGES)
    code = ("import os, sys; from pathlib import Path; from ddplab.ccl import fabric; "
            "lib = fabric.preload(Path(sys.argv[1])); "
            "maps = open('/proc/self/maps').read(); "
            "print(lib, os.environ['CCL_OFI_LIBRARY_PATH'], lib in maps)")
    # A fresh process in every sense: an earlier test in this pytest process may have loaded
    # ddplab's ccl, which set CCL_OFI_LIBRARY_PATH to the venv's bundle (preload keeps a set one).
    env = {k: v for k, v in os.environ.items() if k not in ("CCL_OFI_LIBRARY_PATH", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         env=env)
    assert out.returncode == 0, out.stderr
    lib, env_path, mapped = out.stdout.split()
    assert lib == env_path == str(bundle / "libfabric.so.1") and mapped == "True"


def test_no_bundle_means_the_systems_libfabric():
    from pathlib import Path

    assert fabric.bundled(Path("/nonexistent")) is None
    assert fabric.preload(Path("/nonexistent")) is None
