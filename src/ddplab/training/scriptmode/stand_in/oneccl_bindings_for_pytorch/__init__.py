"""ddplab's own ``ccl`` backend standing in for Intel's ``oneccl_bindings_for_pytorch``.

Script mode puts this folder LAST on a script's import path, and only when Intel's package is
not installed (it is not on PyPI, and its last CPU release stops at torch 2.7): a script
written for the bindings (``import oneccl_bindings_for_pytorch`` then
``init_process_group(backend="ccl")``, as the book's chapter 9 script does) then runs on
ddplab's ccl over oneCCL's runtime, unedited. The run records it (``ddplab.ccl_impl``).
"""

from __future__ import annotations

import os

from ddplab import ccl as _ccl
from ddplab.launchers import LaunchEnv as _LaunchEnv

__version__ = "ddplab-stand-in"
cwd = os.path.dirname(os.path.abspath(__file__))

_ok, _why = _ccl.register()
if not _ok:
    raise ImportError(
        "oneccl_bindings_for_pytorch is not installed, and ddplab's own ccl cannot stand in "
        f"for it: {_why} (`make setup-ccl` builds it)")
# oneCCL's variables as ddplab sets them for its own ccl: the ranks exchange oneCCL's address
# through torch's store, so oneCCL must not look for a launcher of its own (a script's
# CCL_PROCESS_LAUNCHER=torch is Intel's bindings' setting).
from ddplab.distributed.oneccl import ccl_env_defaults as _defaults  # noqa: E402

# (one process, no launcher: a world of one without LOCAL_RANK, supervisor.py's env())
_seen = {**({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"} if os.environ.get("WORLD_SIZE") == "1"
            else {}), **os.environ}
_env = _defaults(_LaunchEnv.from_environ(_seen), None, {})
os.environ.update({k: v for k, v in _env.items()
                   if k == "CCL_PROCESS_LAUNCHER" or k not in os.environ})
os.environ["DDPLAB_CCL_STAND_IN"] = "1"
