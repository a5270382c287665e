"""Unit: the launcher table, with each launcher's real variables (torchrun's docs, Open MPI's
mpirun(1) "Environment Variables", Slurm's srun(1) "OUTPUT ENVIRONMENT VARIABLES", Intel MPI's
and Kubeflow's env references)."""

from pathlib import Path

import pytest

from ddplab.launchers.detect import LaunchEnv, LaunchError

TORCHRUN_CHILD = {  # what torchrun 2.x sets for its 2nd worker of node 1 in a 2x2 job
    "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1", "ROLE_RANK": "3", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "job1", "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1",
}
OPENMPI = {  # mpirun -np 4 --host a:2,b:2 -x MASTER_ADDR -x MASTER_PORT, 3rd process
    "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    # the rank on this node across *all* jobs: not the node index
    "OMPI_COMM_WORLD_NODE_RANK": "0", "OMPI_UNIVERSE_SIZE": "4",
    "MASTER_ADDR": "a", "MASTER_PORT": "29501",
}
PMI = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4",
       "MASTER_ADDR": "h0", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
         "SLURM_TASKS_PER_NODE": "3(x2)", "SLURM_JOB_ID": "77", "MASTER_ADDR": "n0"}
PYTORCHJOB_WORKER = {  # training operator v1.9 pod env, worker 0 of a Master+2 Workers job
    "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "1",
    "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456", "PET_NNODES": "3",
    "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "1",
}


@pytest.mark.parametrize("env, expected", [
    ({}, LaunchEnv("none", 0, 1, 0, 1, 0, "127.0.0.1", 29500)),
    (TORCHRUN_CHILD, LaunchEnv("torchrun", 3, 4, 1, 2, 1, "node0", 29500)),
    (OPENMPI, LaunchEnv("openmpi", 2, 4, 0, 2, 1, "a", 29501)),
    (PMI, LaunchEnv("pmi", 5, 8, 1, 4, 1, "h0", 29500)),
    # no MASTER_PORT: one from the job id (20000 + 77), so jobs sharing a node differ
    (SLURM, LaunchEnv("slurm", 3, 6, 0, 3, 1, "n0", 20077)),
    # a bare `srun ddplab train`: the first host of the allocation is the master
    ({**{k: v for k, v in SLURM.items() if k != "MASTER_ADDR"},
      "SLURM_JOB_NODELIST": "cn[07-09,12]", "MASTER_PORT": "29511"},
     LaunchEnv("slurm", 3, 6, 0, 3, 1, "cn07", 29511)),
    (PYTORCHJOB_WORKER, LaunchEnv("pytorchjob", 1, 3, 0, 1, 1, "job-master-0", 23456)),
    # torchrun inside a PyTorchJob pod: torchrun's variables win over the operator's PET_*
    ({**PYTORCHJOB_WORKER, **TORCHRUN_CHILD}, LaunchEnv("torchrun", 3, 4, 1, 2, 1, "node0", 29500)),
    # torchrun under Slurm (srun torchrun ...): torchrun's ranks, not Slurm's task ids
    ({**SLURM, **TORCHRUN_CHILD}, LaunchEnv("torchrun", 3, 4, 1, 2, 1, "node0", 29500)),
    # single-node mpirun needs no MASTER_ADDR
    ({k: v for k, v in OPENMPI.items() if not k.startswith("MASTER")}
     | {"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, LaunchEnv("openmpi", 2, 4, 0, 4, 0, "127.0.0.1", 29500)),
    # Slurm with the per-node count given directly
    ({**SLURM, "SLURM_NTASKS_PER_NODE": "3"}, LaunchEnv("slurm", 3, 6, 0, 3, 1, "n0", 20077)),
])
def test_launcher_table(env, expected):
    assert LaunchEnv.from_environ(env) == expected


@pytest.mark.parametrize("nodelist, first", [
    ("node1", "node1"), ("node1,node2", "node1"), ("node[07-09,12],gpu1", "node07"),
    ("rack[1-2]-n[01-04]", "rack1-n01"), ("c[3,5-9]x,d1", "c3x")])
def test_first_host_of_a_slurm_hostlist(nodelist, first):
    from ddplab.launchers.detect import first_host

    assert first_host(nodelist) == first


def test_slurm_cpus_per_task_sets_the_threads():
    from ddplab.distributed.cpu import node_cpus

    le = LaunchEnv.from_environ(SLURM)
    assert node_cpus(le, {"SLURM_CPUS_PER_TASK": "1"}) == min(3, node_cpus(le, {}))
    # torchrun under Slurm: SLURM_CPUS_PER_TASK is torchrun's task (the whole node), not a rank's
    le = LaunchEnv.from_environ({**SLURM, **TORCHRUN_CHILD})
    assert node_cpus(le, {"SLURM_CPUS_PER_TASK": "1"}) == node_cpus(le, {})


def test_nodes_sharing_one_host_share_its_cores(monkeypatch):
    """The compose files run NNODES "machines" on one host; each container sees every core."""
    from ddplab.config import ConfigError
    from ddplab.distributed import cpu

    monkeypatch.setattr(cpu, "usable_cpu_count", lambda: 8)
    le = LaunchEnv.from_environ(TORCHRUN_CHILD)
    assert cpu.node_cpus(le, {}) == 8
    assert cpu.node_cpus(le, {"DDPLAB_NODES_ON_HOST": "2"}) == 4
    assert cpu.node_cpus(le, {"DDPLAB_NODES_ON_HOST": "16"}) == 1  # never below one
    with pytest.raises(ConfigError, match="DDPLAB_NODES_ON_HOST: got 'x'"):  # was ignored silently
        cpu.node_cpus(le, {"DDPLAB_NODES_ON_HOST": "x"})
    slurm = LaunchEnv.from_environ(SLURM)
    assert cpu.node_cpus(slurm, {"DDPLAB_NODES_ON_HOST": "2", "SLURM_CPUS_PER_TASK": "1"}) == 3


def test_layout_properties():
    le = LaunchEnv.from_environ(TORCHRUN_CHILD)
    assert (le.nnodes, le.is_rank0, le.is_node_leader) == (2, False, False)


@pytest.mark.parametrize("env, message", [
    ({"LOCAL_RANK": "0", "RANK": "0"}, "RANK=0, LOCAL_RANK=0 set but WORLD_SIZE not"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1, WORLD_SIZE=1 set but LOCAL_RANK not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}, "but LOCAL_RANK not"),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE=abc set but RANK and LOCAL_RANK not"),
    ({"PMI_RANK": "0", "PMI_SIZE": "1", "RANK": "1", "WORLD_SIZE": "2"},
     "pmi gives rank 0 but RANK=1 is also set"),
    ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "0"}, "OMPI_COMM_WORLD_LOCAL_SIZE='0' must be >= 1"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALNRANKS": "0"}, "MPI_LOCALNRANKS='0' must be >= 1"),
    ({**TORCHRUN_CHILD, "RANK": "4"}, r"rank 4 is outside 0..3"),
    ({**TORCHRUN_CHILD, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({**TORCHRUN_CHILD, "LOCAL_RANK": "2"}, r"local rank 2 is outside 0..1"),
    ({**TORCHRUN_CHILD, "MASTER_PORT": "70000"}, "MASTER_PORT 70000 is not a TCP port"),
    ({**OPENMPI, "MASTER_ADDR": ""}, "MASTER_ADDR is not set and the job spans several nodes"),
    ({k: v for k, v in OPENMPI.items() if k != "OMPI_COMM_WORLD_SIZE"},
     "OMPI_COMM_WORLD_SIZE is not set"),
    ({**PYTORCHJOB_WORKER, "PET_NPROC_PER_NODE": "4"}, "start ddplab through torchrun"),
    ({**SLURM, "SLURM_NTASKS_PER_NODE": "9"}, r"local world size 9 is outside 1..6"),
])
def test_incomplete_or_contradictory_variables(env, message):
    with pytest.raises(LaunchError, match=message):
        LaunchEnv.from_environ(env)


# ---- outlive: a container's first process waits for what its command left running ----

def outlive(script: str, tmp_path, bound: str = "30", **popen):
    import subprocess
    import sys

    env = {"PATH": "/usr/bin:/bin", "DDPLAB_OUTLIVE_S": bound}
    return subprocess.Popen([sys.executable, "-m", "ddplab.launchers.outlive", "sh", "-c", script],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True, **popen)


def test_outlive_waits_for_an_orphan_of_its_command_then_exits_with_the_commands_code(tmp_path):
    """The command leaves a process of its own session behind (as local rank 0 leaves its
    node's delivery process) and exits 3: the orphan finishes its work before outlive ends."""
    proc = outlive("setsid sh -c 'sleep 2; echo delivered > end' & exit 3", tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert (tmp_path / "end").read_text() == "delivered\n"
    assert "waiting for what it left running" in err


def test_outlive_is_bounded_and_forwards_a_stop_to_its_command(tmp_path):
    import signal
    import time

    t0 = time.monotonic()
    proc = outlive("setsid sleep 60 >/dev/null 2>&1 & exit 0", tmp_path, bound="1")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and time.monotonic() - t0 < 15, err
    assert "still running after 1 s; leaving it" in err
    # docker stop's SIGTERM reaches the command (a shell: it exits 128 + 15); nothing left.
    proc = outlive("trap 'exit 143' TERM; echo ready > up; while :; do sleep 0.1; done", tmp_path)
    while not (tmp_path / "up").exists() or not _catches(proc.pid, signal.SIGTERM):
        assert proc.poll() is None  # (outlive forwards a stop once its handler is in place)
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and "waiting" not in err, err


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``sig`` (its SigCgt mask)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (sig - 1)))


def test_outlive_says_a_bad_bound_in_one_line(tmp_path):
    proc = outlive("exit 0", tmp_path, bound="soon")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert err.strip() == "ddplab: DDPLAB_OUTLIVE_S: got 'soon'; expected seconds (a number >= 0)"


def test_outlive_on_a_terminal_only_runs_the_command(tmp_path):
    """docker run -it: the terminal's Ctrl-C reaches the command's group itself, so outlive
    becomes the command (the same process) instead of forwarding it a second one."""
    import os
    import pty

    main, terminal = pty.openpty()
    try:
        proc = outlive("echo $$ > pid", tmp_path, stdin=terminal)
        proc.communicate(timeout=30)
    finally:
        os.close(main)
        os.close(terminal)
    assert proc.returncode == 0 and int((tmp_path / "pid").read_text()) == proc.pid


@pytest.mark.parametrize("launcher, survives", [("parent", True), ("gone", False), ("", True)])
def test_a_rank_whose_launcher_died_before_it_tethered_stops(launcher, survives):
    """A hostile pass: `ddplab run --nproc-per-node 100000`, stopped while torchrun was still
    starting ranks, left 20 of them asleep 24 minutes later: each had been reparented before it
    asked for its launcher's death signal, so it tethered itself to init. A real process: its
    parent is this test (DDPLAB_LAUNCHER_PID as `ddplab run` sets it), or a pid that is gone."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "TORCHELASTIC_RUN_ID": "t"}
    env.pop("DDPLAB_LAUNCHER_PID", None)
    if launcher:
        env["DDPLAB_LAUNCHER_PID"] = str(os.getpid() if launcher == "parent" else 2 ** 22 + 1)
    code = ("import time; from ddplab.launchers import tether; import os; "
            "tether.to_launcher(os.environ); time.sleep(0.5); print('trained on')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    if survives:
        assert out.returncode == 0 and "trained on" in out.stdout, out.stderr
    else:
        assert out.returncode == -signal.SIGHUP and "trained on" not in out.stdout, out
