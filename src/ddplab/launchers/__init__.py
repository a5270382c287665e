"""How ranks start, on every target.

    detect      LaunchEnv: this process's rank layout, read from whichever launcher started it
                (torchrun, mpirun, srun, a PyTorchJob's operator, or none)
    rendezvous  ``ddplab launch``: one node of a multi-node job (compose, bare machines) finds
                its peers and runs torchrun
    mpi         ``ddplab mpi worker/launch``: Open MPI over ssh between containers or pods
    local       ``ddplab run``: N ranks on this machine by torchrun, after a one-process preflight
    tether      a rank ends with its launcher (torchrun killed outright)
    outlive     a container's first process: its command, then what the command left running
                (the node's tracking delivery) until it ends
"""

from .detect import LaunchEnv, LaunchError

__all__ = ["LaunchEnv", "LaunchError"]
