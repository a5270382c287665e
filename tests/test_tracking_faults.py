"""End to end: tracking outages against a real `mlflow server` on a free loopback port.

A job never hangs on a dead server and never loses a metric: records wait in the spool next to
the checkpoints, the job ends within tracking.delivery_timeout_s, and `ddplab sync` delivers
the rest once the server is back, exactly once. The losses a job printed are the independent
record of what it logged.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddplab.tracking import spool
from tests.conftest import QUICK, REPO, job_env
from tests.helpers import Server, faulty_experiment, printed_losses

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent
QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path)
    s.start()
    yield s
    s.kill()


def start_job(tmp_path: Path, server: Server, epochs: int = 3,
              delivery_timeout_s: float = 8) -> subprocess.Popen:
    args = [QUICKSTART, *QUICK, "--set", f"train.epochs={epochs}", "--set", "train.log_every=2",
            "--set", f"checkpoint.dir={tmp_path / 'ck'}",
            "--set", f"tracking.delivery_timeout_s={delivery_timeout_s}"]
    return subprocess.Popen([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m",
                             "ddplab", "train", *args], cwd=tmp_path,
                            env=job_env(server.uri), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def kill_after_first_loss(tmp_path: Path, server: Server) -> None:
    """Kill the server once the job has logged its first loss (to its spool: a local file,
    so this does not depend on how fast delivery is)."""
    wait_for_first_loss(tmp_path)
    server.kill()


def wait_for_first_loss(tmp_path: Path) -> None:
    deadline = time.monotonic() + 180
    while not any(b'"train/loss"' in f.read_bytes()
                  for f in (tmp_path / "ck").rglob("spool/node0/records.jsonl")):
        assert time.monotonic() < deadline, "no loss logged"
        time.sleep(0.2)


def delivered_losses(server: Server, run_id: str) -> list[tuple[int, float]]:
    return sorted((m.step, round(m.value, 4))
                  for m in server.client().get_metric_history(run_id, "train/loss"))


def sync(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ddplab"), "sync", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180, env=job_env(""))


def test_server_killed_mid_run_and_never_back_the_job_ends_and_sync_delivers_all(tmp_path, server):
    """The job outlives the dead server; `ddplab sync` while it is still dead keeps every record
    and says so in one line; once it is back, sync delivers them all, exactly once. (One job:
    the dead-server sync had a job of its own.) The delivery bound is only waited out here:
    the server never answers within it, so 3 s shows the same as 8 s."""
    job = start_job(tmp_path, server, delivery_timeout_s=3)
    kill_after_first_loss(tmp_path, server)
    run_id = the_run_id_from_spool(tmp_path)
    t_kill = time.monotonic()
    out, _ = job.communicate(timeout=300)
    exit_after = time.monotonic() - t_kill
    assert job.returncode == 0, out[-3000:]  # the training finished; the records are safe
    assert "ddplab sync" in out and "tracking.delivery_timeout_s" in out, out[-2000:]
    printed = printed_losses(out)
    assert len(printed) >= 6

    # Sync against the still dead server: exit 1, one line, and the records stay in the spool
    # (the sync below, once the server is back, delivers every printed loss: nothing was lost).
    left = sync(tmp_path, str(tmp_path / "ck"), "--timeout", "2")
    assert left.returncode == 1 and "did not answer" in left.stderr, left.stdout + left.stderr
    assert "Traceback" not in left.stderr
    (spooled,) = (tmp_path / "ck").rglob("spool/node0")
    assert spool.left_in(spooled) > 0

    server.start()  # back, with the same store
    first = sync(tmp_path, str(tmp_path / "ck"))
    assert first.returncode == 0, first.stdout + first.stderr
    assert "run ended FINISHED" in first.stdout
    run = server.client().get_run(run_id)
    assert run.info.status == "FINISHED"
    got = delivered_losses(server, run_id)
    assert got == sorted((s, round(v, 4)) for s, v in printed.items())  # every one, once
    assert "eval/accuracy" in run.data.metrics and run.data.params["train.epochs"] == "3"

    again = sync(tmp_path)  # default: ./checkpoints does not exist here -> say so, exit 2
    assert again.returncode == 2 and "no such file" in again.stderr
    again = sync(tmp_path, str(tmp_path / "ck"))
    assert again.returncode == 0 and "up to date" in again.stdout
    assert delivered_losses(server, run_id) == got  # idempotent: nothing twice
    print(f"job exited {exit_after:.1f} s after the server died; "
          f"{len(got)}/{len(printed)} losses delivered by sync")


def test_a_job_failing_with_the_server_down_has_its_verdict_and_stacks_delivered_by_sync(
        tmp_path, server):
    """A hostile pass: rank 1 fails while the server is down. The run's end waited in the
    spool for `ddplab sync`, but the ranks' endings, their stacks and the verdict went
    straight to the server at the job's end and were lost ("the ranks' stacks could not be
    recorded"). They are kept in the spool now, and sync delivers them after the run's end."""
    fire = tmp_path / "fire"
    exp = faulty_experiment(tmp_path)
    job = subprocess.Popen(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "ddplab", "train",
         str(exp), "--set", "train.epochs=100", "--set", f"checkpoint.dir={tmp_path / 'ck'}",
         "--set", "tracking.delivery_timeout_s=3"], cwd=tmp_path,
        env=job_env(server.uri, FAULT="raise", FAULT_WHEN=str(fire)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    kill_after_first_loss(tmp_path, server)
    run_id = the_run_id_from_spool(tmp_path)
    fire.touch()  # rank 1 raises at its next step, the server down
    out, _ = job.communicate(timeout=300)
    assert job.returncode != 0, out[-3000:]
    (spooled,) = (tmp_path / "ck").rglob("spool/node0")
    assert f"ddplab delivery: the ranks' stacks and the verdict are kept in {spooled} for `ddplab " \
        "sync`: the server did not take them (" in out, out[-3000:]

    server.start()
    synced = sync(tmp_path, str(tmp_path / "ck"))
    assert synced.returncode == 0, synced.stdout + synced.stderr
    assert "delivered the ranks' stacks and endings and the verdict" in synced.stdout, synced.stdout
    run = server.client().get_run(run_id)
    tags = run.data.tags
    assert run.info.status == "FAILED", tags
    assert tags.get("ddplab.verdict", "").startswith("rank 1 (host "), tags
    assert "sample broken on purpose" in tags["ddplab.verdict"]
    assert tags["ddplab.error"] == tags["ddplab.verdict"]  # the cause named, rank 0's beside it
    assert "ddplab.error.rank0" in tags and "ddplab.forensics.node0" in tags
    assert {a.path for a in server.client().list_artifacts(run_id, "forensics/node0")}
    again = sync(tmp_path, str(tmp_path / "ck"))  # delivered once: nothing kept any more
    assert again.returncode == 0 and "stacks" not in again.stdout, again.stdout + again.stderr


def test_rank_0_killed_with_the_server_down_is_ended_by_sync_with_its_reason_and_time(
        tmp_path, server):
    """A hostile pass: rank 0 SIGKILLed while the server was down. Its node's delivery process
    knew why ("global rank 0 lost: its process died ..."), but could not say it; `ddplab sync`
    later ended the run with its generic line, at the sync's time (minutes of a job that was
    over). The node's note in the spool now gives sync both."""
    fire = tmp_path / "fire"
    job = subprocess.Popen(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "ddplab", "train",
         str(faulty_experiment(tmp_path)), "--set", "train.epochs=100", "--set",
         f"checkpoint.dir={tmp_path / 'ck'}", "--set", "tracking.delivery_timeout_s=3"],
        cwd=tmp_path, env=job_env(server.uri, FAULT="kill", FAULT_RANK="0", FAULT_WHEN=str(fire)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_after_first_loss(tmp_path, server)
    run_id = the_run_id_from_spool(tmp_path)
    fire.touch()  # rank 0 SIGKILLs itself at its next step, the server down
    out, _ = job.communicate(timeout=300)
    ended = time.time()
    assert job.returncode != 0, out[-3000:]
    time.sleep(3)
    server.start()
    synced = sync(tmp_path, str(tmp_path / "ck"))
    assert synced.returncode == 0, synced.stdout + synced.stderr
    run = server.client().get_run(run_id)
    assert run.info.status == "FAILED", run.data.tags
    assert run.data.tags["ddplab.error"].startswith("global rank 0 lost: its process (pid "), \
        run.data.tags["ddplab.error"]
    assert run.info.end_time / 1000 <= ended, (run.info.end_time / 1000, ended)


def the_run_id_from_spool(tmp_path: Path) -> str:
    deadline = time.monotonic() + 30
    while not list((tmp_path / "ck").rglob("spool/node0/meta.json")):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return next((tmp_path / "ck").rglob("spool/node0/meta.json")).parent.parent.parent.name


def test_server_down_a_while_and_back_loses_nothing_and_repeats_nothing(tmp_path, server):
    job = start_job(tmp_path, server, epochs=16)
    kill_after_first_loss(tmp_path, server)
    run_id = the_run_id_from_spool(tmp_path)
    time.sleep(5)
    server.start()
    assert job.poll() is None, "the job ended before the server was back: make it longer"
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out[-3000:]
    assert "ddplab sync" not in out, out[-2000:]  # delivered before the job ended: nothing left
    run = server.client().get_run(run_id)
    assert run.info.status == "FINISHED"
    printed = printed_losses(out)
    assert delivered_losses(server, run_id) == sorted((s, round(v, 4)) for s, v in printed.items())
    system = server.client().get_metric_history(run_id, "system/node0/cpu_utilization_percentage")
    steps = [m.step for m in system]
    assert steps and len(steps) == len(set(steps))  # sampled through the outage, each once



def test_a_job_killed_outright_agent_and_all_is_ended_failed_by_sync(tmp_path, server):
    """Every process of the job SIGKILLed at once (a node's OOM, a lost machine): nothing was
    left to write ``closed`` or ``delivery.json``, and ``ddplab sync`` delivered the records but
    left the run RUNNING for good. The agent's lock, free once it is gone, and a spool that no
    longer changes, say the job is over."""
    import os
    import signal

    import psutil

    job = start_job(tmp_path, server, epochs=16)
    wait_for_first_loss(tmp_path)
    run_id = the_run_id_from_spool(tmp_path)
    every = [job.pid] + [p.pid for p in psutil.Process(job.pid).children(recursive=True)]
    assert any("ddplab.agent" in " ".join(psutil.Process(p).cmdline()) for p in every)
    # At once: each stopped first, so none sees another die and ends the run itself (the
    # agent noticing rank 0's death did, on a loaded CI machine, between the kills)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in every:
            os.kill(pid, sig)
    job.communicate(timeout=60)
    psutil.wait_procs([p for p in map(_process, every) if p is not None], timeout=30)
    (spooled,) = (tmp_path / "ck").rglob("spool/node0")

    soon = sync(tmp_path, str(tmp_path / "ck"))  # the spool changed a moment ago: maybe alive
    assert soon.returncode == 0, soon.stdout + soon.stderr
    assert server.client().get_run(run_id).info.status == "RUNNING"
    for f in spooled.iterdir():  # an hour later
        os.utime(f, (time.time() - 3600, time.time() - 3600))
    synced_at = time.time()
    later = sync(tmp_path, str(tmp_path / "ck"))
    assert later.returncode == 0 and "ended it FAILED" in later.stdout, later.stdout + later.stderr
    run = server.client().get_run(run_id)
    # ended when the job last recorded (here: no earlier than its start), not at the sync
    assert run.info.start_time <= run.info.end_time < synced_at * 1000, run.info
    assert run.info.status == "FAILED" and "killed outright" in run.data.tags["ddplab.error"], \
        run.data.tags
    assert "train/loss" in run.data.metrics  # what the job logged before, delivered


def test_a_frozen_delivery_process_is_killed_and_its_spool_delivered_by_the_job(tmp_path, server):
    """The delivery process SIGSTOPped mid-job: the job waited its whole bound (75 s), said the
    server had not taken 45 records, and left the run RUNNING with no loss in the store (a
    hostile pass). It is killed once found stopped, and rank 0 delivers its spool: FINISHED,
    every loss in, the job's end not held by the bound (delivery_timeout_s 60 here)."""
    import os
    import signal

    import psutil

    job = start_job(tmp_path, server, epochs=3, delivery_timeout_s=60)
    wait_for_first_loss(tmp_path)
    run_id = the_run_id_from_spool(tmp_path)
    (agent,) = [p for p in psutil.Process(job.pid).children(recursive=True)
                if "ddplab.agent" in " ".join(p.cmdline())]
    os.kill(agent.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out[-3000:]
    assert time.monotonic() - stopped_at < 60, out[-3000:]
    assert f"delivery process (pid {agent.pid}) was stopped (SIGSTOP" in out, out[-3000:]
    assert "did not take" not in out, out[-3000:]  # the store is not blamed
    run = server.client().get_run(run_id)
    assert run.info.status == "FINISHED", run.data.tags
    assert [s for s, _ in delivered_losses(server, run_id)] == list(range(2, 49, 2))  # 16 an epoch
    assert not psutil.pid_exists(agent.pid) or agent.status() == psutil.STATUS_ZOMBIE


def _process(pid: int):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
