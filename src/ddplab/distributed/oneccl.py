"""oneCCL's environment: the variables ddplab sets for the ``ccl`` backend when the user has
not (oneCCL's "Environment Variables" reference, oneapi-src.github.io/oneCCL/env-variables.html).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path

from ..launchers import LaunchEnv
from .choice import CclImpl


def ccl_env_defaults(le: LaunchEnv, pkg_dir: str | None, env: Mapping[str, str]) -> dict[str, str]:
    """The oneCCL variables ddplab sets when the user has not (oneCCL's
    "Environment Variables" reference, oneapi-src.github.io/oneCCL/env-variables.html)."""
    out = {
        # Also under Open MPI, which the bindings may mistake for an Intel MPI launch.
        "CCL_ATL_TRANSPORT": "ofi",
        "CCL_WORKER_COUNT": "1",
        "CCL_ATL_SHM": "1",
        # ddplab starts the ranks; oneCCL must not look for an MPI/PMI launcher of its own.
        "CCL_PROCESS_LAUNCHER": "none",
        # oneCCL's count of the ranks on this host (with launcher none it cannot find out).
        # On several nodes with several ranks each, the true count makes its collectives over
        # tcp crawl, then hang (2 containers x 2 ranks: a 64 KB broadcast 350 ms, 1 MB never
        # done; CCL_ATL_SHM=0 the same), while telling each rank it is alone on its host runs
        # them (1 MB in 46 ms); libfabric still finds the ranks of a host by hostname.
        # (docs/launchers-and-backends.md, "ccl on several nodes"; tests/test_ccl.py)
        "CCL_LOCAL_RANK": str(le.local_rank) if le.nnodes == 1 else "0",
        "CCL_LOCAL_SIZE": str(le.local_world_size) if le.nnodes == 1 else "1",
        # oneCCL warns about every variable set (and that OpenMP collectives need MPI): noise.
        "CCL_LOG_LEVEL": "error",
    }
    if le.nnodes > 1:
        out["FI_PROVIDER"] = "tcp"
    if pkg_dir:
        # Without the package's own libfabric the first collective fails with "could not
        # initialize any transport library" unless setvars.sh was sourced.
        lib = Path(pkg_dir, "opt", "mpi", "libfabric", "lib")
        if (lib / "libfabric.so").exists():
            out["FI_PROVIDER_PATH"] = str(lib / "prov")
            out["CCL_OFI_LIBRARY_PATH"] = str(lib / "libfabric.so")
    return {k: v for k, v in out.items() if k not in env}


def apply_ccl_env(le: LaunchEnv, env: MutableMapping[str, str], impl: CclImpl) -> dict[str, str]:
    defaults = ccl_env_defaults(le, impl.pkg_dir, env)
    env.update(defaults)
    return defaults
