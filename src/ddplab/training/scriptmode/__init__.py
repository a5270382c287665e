"""Script mode: the user's own training script, as it is, as one tracked ddplab job.

    ddplab train my_train.py -- --epochs 3                        # one process
    torchrun --nproc-per-node 2 -m ddplab train my_train.py -- --epochs 3
    mpirun -np 2 ddplab train my_train.py                         # OMPI_* mapped to RANK, ...
    ddplab train my-script.yaml                                     # an experiment with a script: section

    supervisor  each rank's ddplab process: the run, the script's process, how it ended
    meeting     the ranks' store (torchrun's agent store, or rank 0's) without a process group
    child       the script's process: observes init_process_group, runs the script as __main__
    stand_in/   ddplab's ccl as ``oneccl_bindings_for_pytorch`` where Intel's is not installed

docs/your-own-script.md says what script mode gives beside ddplab's own loop.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for the type checker only: importing it here is what __getattr__ avoids
    from .supervisor import ScriptFailed, train

__all__ = ["ScriptFailed", "train"]


def __getattr__(name: str) -> Any:
    """The supervisor on first use: the script's process (child.py) runs inside this package and
    must not import torch (through the supervisor's imports) before the script does."""
    if name in __all__:
        from . import supervisor

        return getattr(supervisor, name)
    raise AttributeError(name)
