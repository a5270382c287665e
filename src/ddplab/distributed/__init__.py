"""How ranks talk: the backend chosen for this machine (gloo, ccl, nccl), the CPU layout
(threads per rank, pinning), the process group and rank-0-only steps shared with every rank.

    layout      plan_layout: the launch steps below in one call, before any data or model
    choice      which backend (gloo, ccl, nccl, mpi) and why; agreed across nodes for auto
    cpu         cores, threads and pinning per rank (affinity, cgroup quota, Slurm, compose)
    oneccl      oneCCL's environment variables
    group       the process group up and down; rank-0-only steps shared with every rank
    host        this machine in one line (cores, memory, CPU model)

How ranks START is launchers/ (torchrun, mpirun, srun, compose nodes); ddplab's own oneCCL
backend is ccl/ (a native extension, built on its own: the CPU image builds it from that folder
alone).
"""
