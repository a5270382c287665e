"""oneCCL's ofi transport needs libfabric.so.1 at run time. Where the system has none (a fresh
machine without Debian's ``libfabric1``), ``make setup-ccl`` brings its own: the Debian packages
of libfabric and the libraries it links are fetched with ``apt-get download`` (no root needed
where the package lists exist; as root the lists are refreshed first) and unpacked into
``<ccl home>/fabric/``. At load time those libraries are opened first, in link order, and
oneCCL is pointed at that libfabric with ``CCL_OFI_LIBRARY_PATH`` (oneCCL 2022.2 reads it).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import DdplabError

# (Debian package, the shared object it carries), in link order: each needs only those above
# it or the C runtime.
PACKAGES = (
    ("libnl-3-200", "libnl-3.so.200"), ("libnl-route-3-200", "libnl-route-3.so.200"),
    ("libnuma1", "libnuma.so.1"), ("libatomic1", "libatomic.so.1"),
    ("libibverbs1", "libibverbs.so.1"), ("librdmacm1", "librdmacm.so.1"),
    ("ibverbs-providers", "libefa.so.1"), ("libpsm2-2", "libpsm2.so.2"),
    ("libpsm-infinipath1", "libinfinipath.so.4"), ("libpsm-infinipath1", "libpsm_infinipath.so.1"),
    ("libfabric1", "libfabric.so.1"),
)
FOLDER = "fabric"


class FetchError(DdplabError, RuntimeError):
    pass


def bundled(home: Path) -> Path | None:
    lib = home / FOLDER / "libfabric.so.1"
    return lib if lib.exists() else None


def preload(home: Path) -> str | None:
    """Open the bundled libraries (RTLD_GLOBAL, link order) and point oneCCL at them; returns
    the libfabric path, or None when there is no bundle."""
    lib = bundled(home)
    if lib is None:
        return None
    for _, soname in PACKAGES:
        path = home / FOLDER / soname
        if path.exists():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    os.environ.setdefault("CCL_OFI_LIBRARY_PATH", str(lib))
    return str(lib)


def fetch(dest: Path, say: Callable[[str], None]) -> None:
    """Download and unpack the packages into ``dest/fabric``."""
    apt = shutil.which("apt-get")
    if apt is None or shutil.which("dpkg-deb") is None:
        raise FetchError("libfabric.so.1 is not installed and this is not a Debian/Ubuntu system "
                         "(no apt-get/dpkg-deb): install libfabric (1.x) with your package manager")
    names = list(dict.fromkeys(p for p, _ in PACKAGES))
    say(f"libfabric.so.1 not installed: fetching Debian's {', '.join(names)} (apt-get download)")
    with tempfile.TemporaryDirectory(prefix="ddplab-fabric-") as tmp:
        _download(apt, names, Path(tmp))
        root = Path(tmp, "root")
        for deb in Path(tmp).glob("*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, capture_output=True)
        out = dest / FOLDER
        out.mkdir(parents=True, exist_ok=True)
        for _, soname in PACKAGES:
            # The file may carry a longer version (libpsm_infinipath.so.1.16, which Debian links
            # to its soname through update-alternatives at install time).
            found = sorted(p for p in root.rglob(f"{soname}*") if p.resolve().is_file())
            if not found:
                raise FetchError(f"{soname} is not in the downloaded packages")
            shutil.copy2(found[0].resolve(), out / soname)


def _download(apt: str, names: list[str], where: Path) -> None:
    def download() -> subprocess.CompletedProcess[str]:
        return subprocess.run([apt, "download", *names], cwd=where, capture_output=True, text=True)
    proc = download()
    if proc.returncode != 0 and os.geteuid() == 0:  # a fresh machine may have no package lists
        subprocess.run([apt, "update", "-qq"], capture_output=True, text=True)
        proc = download()
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise FetchError(f"apt-get download {' '.join(names)} failed ({last}); install "
                         "libfabric1 (apt-get install libfabric1), or run make setup-ccl as root once")
