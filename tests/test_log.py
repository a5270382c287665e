"""Unit (and one real job): ddplab's logger keeps the console format, names the rank, and lets
only rank 0 print progress."""

import pytest

from ddplab.log import logger


@pytest.mark.parametrize("env, progress, error", [
    ({}, "[ddplab] epoch 1", "ddplab: error: bad"),
    ({"RANK": "0", "WORLD_SIZE": "4"}, "[ddplab] epoch 1", "[rank 0] ddplab: error: bad"),
    ({"RANK": "3", "WORLD_SIZE": "4"}, None, "[rank 3] ddplab: error: bad"),
    ({"OMPI_COMM_WORLD_RANK": "1"}, None, "[rank 1] ddplab: error: bad"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "[ddplab] epoch 1", "ddplab: error: bad"),
])
def test_progress_from_rank_0_only_and_errors_from_every_rank_named(monkeypatch, capsys, env,
                                                                      progress, error):
    for name in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    logger().info("epoch 1")
    logger().error("bad")
    err = capsys.readouterr().err.splitlines()
    assert err == ([progress] if progress else []) + [error]


def test_each_part_and_level_keeps_its_prefix(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    logger("mpi").info("workers up")
    logger("bench").error("no backend")
    logger().warning("records left")
    assert capsys.readouterr().err.splitlines() == [
        "[ddplab mpi] workers up", "ddplab bench: error: no backend", "ddplab: warning: records left"]


def test_an_unknown_log_level_is_said_in_one_line_and_info_kept():
    """DDPLAB_LOG_LEVEL=loud ran as info without a word: a typo looked like the level working."""
    import os
    import subprocess
    import sys

    code = "from ddplab.log import logger; logger().info('epoch 1'); logger().debug('hidden')"
    env = {**os.environ, "DDPLAB_LOG_LEVEL": "loud"}
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.stderr.splitlines() == [
        "ddplab: warning: DDPLAB_LOG_LEVEL: got 'loud'; allowed: debug, info, warning, error "
        "(info used)", "[ddplab] epoch 1"]


@pytest.mark.e2e
def test_a_bad_log_level_is_said_once_a_job_not_by_each_of_its_processes(tmp_path, store):
    """A real 2-rank job: the warning came from every process that logs (`ddplab train`, its
    delivery process, each rank under torchrun)."""
    from tests.conftest import QUICK, REPO, ddplab, job_env

    env = job_env(store, DDPLAB_LOG_LEVEL="loud")
    out = ddplab(["train", str(REPO / "experiments" / "quickstart.yaml"), *QUICK,
                  "--set", "train.max_steps=2"], tmp_path, env, nproc=2)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.count("DDPLAB_LOG_LEVEL: got 'loud'") == 1, out.stderr
