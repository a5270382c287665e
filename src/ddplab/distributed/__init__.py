"""How ranks talk: the backend chosen for this machine (gloo, ccl, nccl), the CPU layout
(threads per rank, pinning), the process group and rank-0-only steps shared with every rank.

    backend     choosing the backend, the CPU layout, oneCCL's environment, the process group
    host        this machine in one line (cores, memory, CPU model)

How ranks START is launchers/ (torchrun, mpirun, srun, compose nodes); ddplab's own oneCCL
backend is ccl/ (a native extension, built on its own: the CPU image builds it from that folder
alone).
"""
