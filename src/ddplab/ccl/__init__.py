"""ddplab's own c10d backend ``ccl`` over oneCCL's CPU runtime, for a torch that Intel's
``oneccl_bindings_for_pytorch`` no longer serves.

``make setup-ccl`` (``python -m ddplab.ccl.build``) puts oneCCL's runtime and headers from
PyPI under :func:`home` and compiles ``csrc/ddplab_ccl.cpp`` against the installed torch.
:func:`load` imports that build (never raising) and :func:`register` makes it torch's ``ccl``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from .handlers import crash_handlers_kept

ONECCL_VERSION = "2022.2.0"
EXT_NAME = "ddplab_ccl"

_loaded: dict[Path, tuple[ModuleType | None, str]] = {}


def home() -> Path:
    """Where the runtime, headers and the built backend live (``DDPLAB_CCL_HOME`` moves it)."""
    return Path(os.environ.get("DDPLAB_CCL_HOME") or Path(sys.prefix, "lib", "ddplab-ccl"))


def build_info(where: Path | None = None) -> dict[str, Any]:
    try:
        info: dict[str, Any] = json.loads(((where or home()) / "BUILD.json").read_text())
        return info
    except (OSError, ValueError):
        return {}


def libfabric(where: Path | None = None) -> str | None:
    """oneCCL's ofi transport loads libfabric.so.1 at run time: the system's (Debian:
    libfabric1), else the one ``make setup-ccl`` fetched beside the backend (ccl/fabric.py)."""
    from .fabric import bundled

    mine = bundled(where or home())
    return str(mine) if mine else ctypes.util.find_library("fabric")


def missing(where: Path | None = None) -> str | None:
    """Why the built backend cannot load here, or None."""
    import torch

    where = where or home()
    ext = where / f"{EXT_NAME}.so"
    if not ext.exists():
        return f"ddplab's ccl backend is not built (no {ext}; run: make setup-ccl)"
    built_for = build_info(where).get("torch")
    if built_for != torch.__version__:
        return (f"ddplab's ccl backend was built for torch {built_for}, this is torch "
                f"{torch.__version__} (run: make setup-ccl)")
    if libfabric(where) is None:
        return ("oneCCL's ofi transport needs libfabric.so.1, not found (run make setup-ccl, "
                "which fetches it, or apt-get install libfabric1)")
    return None


def load() -> tuple[ModuleType | None, str]:
    """(the extension module, why) - the module is None when it cannot load; never raises."""
    where = home()
    if where not in _loaded:
        _loaded[where] = _load(where)
    return _loaded[where]


def _load(where: Path) -> tuple[ModuleType | None, str]:
    why = missing(where)
    if why:
        return None, why
    try:
        with crash_handlers_kept():  # libfabric's Omni-Path libraries take SIGSEGV when loaded
            module = _open(where)
    except Exception as e:  # noqa: BLE001 - any failure means "not available", with the reason
        return None, f"ddplab's ccl backend does not load ({type(e).__name__}: {e})"
    return module, f"ddplab's own backend over oneCCL {module.oneccl_version()}"


def _open(where: Path) -> ModuleType:
    from .fabric import preload

    preload(where)  # a libfabric of our own, where the system has none
    # The extension NEEDs libccl.so.1 by name: load it from here first (it finds its
    # plugin loader libccl.so.2 beside itself through its $ORIGIN run path).
    ctypes.CDLL(str(where / "lib" / "libccl.so.1"), mode=ctypes.RTLD_GLOBAL)
    spec = importlib.util.spec_from_file_location(
        EXT_NAME, where / f"{EXT_NAME}.so",
        loader=importlib.machinery.ExtensionFileLoader(EXT_NAME, str(where / f"{EXT_NAME}.so")))
    if spec is None or spec.loader is None:
        raise ImportError(f"no module spec for {where / f'{EXT_NAME}.so'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def register() -> tuple[bool, str]:
    """Make ``ccl`` torch's name for ddplab's backend; (registered, why)."""
    import torch.distributed as dist

    module, why = load()
    if module is None:
        return False, why
    if "ccl" not in dist.Backend.backend_list:
        # c10d calls it as (store, rank, size, timeout): the extension's function as it is.
        dist.Backend.register_backend("ccl", module.create_backend, devices=["cpu"])
    return True, why


def release_shm(shm: Path = Path("/dev/shm"), pid: int | None = None) -> int:
    """Unlink the shared-memory regions libfabric's shm transport (CCL_ATL_SHM=1) made for this
    process; returns how many. libfabric removes them only in its library destructor or its
    signal handler, which a rank ending by ``os._exit`` (cli.entry, a script's process in
    script mode) never runs: each region left (``/dev/shm/<pid>:<n>:<n>``) kept about 20 MB of
    RAM, 64 MB reserved, until reboot, so a few hundred ccl ranks filled /dev/shm. Removing the
    name is safe at the end: peers that mapped the region keep their mapping. Whichever oneCCL
    made them (ddplab's build, Intel's bindings a script imported): only this process's names,
    or ``pid``'s: a rank that died outright, whose node's delivery process cleans up after it."""
    mine = str(pid or os.getpid())
    gone = 0
    for name in [n for n, owner in _shm_regions(shm) if owner == mine]:
        try:
            (shm / name).unlink()
            gone += 1
        except OSError:
            pass
    return gone


def stale_shm(shm: Path = Path("/dev/shm")) -> tuple[int, int]:
    """(count, bytes of RAM) of shm regions whose rank is gone (SIGKILLed ranks leave them).
    Only reported (``ddplab doctor``), never removed: a process in another PID namespace
    that shares this /dev/shm would look gone from here."""
    count = used = 0
    for name, owner in _shm_regions(shm):
        if not Path("/proc", owner).exists():
            try:
                used += (shm / name).stat().st_blocks * 512
                count += 1
            except OSError:
                pass
    return count, used


def _shm_regions(shm: Path) -> list[tuple[str, str]]:
    """(name, owner pid) of libfabric shm regions: ``<pid>:<n>:<n>``."""
    try:
        names = [e.name for e in os.scandir(shm)]
    except OSError:
        return []
    return [(n, n.split(":", 1)[0]) for n in names if _REGION.fullmatch(n)]


_REGION = re.compile(r"\d+:\d+:\d+")
