"""STAND-IN for Intel's oneccl_bindings_for_pytorch, for wiring tests only.

The real bindings cannot be installed on these machines (Intel's wheel index only). Like the
real package, importing this registers a torch.distributed backend named "ccl" and exposes
``cwd``; underneath it is plain gloo. Tests put this folder on PYTHONPATH to prove that ddplab
picks ccl when the bindings import, sets the oneCCL variables and records the choice.
It proves nothing about oneCCL itself.
"""

import os

import torch.distributed as dist

__version__ = "0.0+stand-in"
cwd = os.path.dirname(os.path.abspath(__file__))


def _create(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


if "ccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("ccl", _create, devices=["cpu"])
