"""Script mode against a script that is not careful: one that deletes its checkpoint folder, the
run's spool or the whole run folder, and one that only shares another's file name.

The run's spool and ddplab's own records are not under the script's ``DDPLAB_CHECKPOINT_DIR``;
a spool deleted anyway ends the run FAILED, saying so, and the console's last line says the
run's real status. A run is resumed only by the same job (script, sha256, arguments), or when
``checkpoint.resume`` names it. Tiny scripts, few jobs: CI time is tight.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ddplab import config
from ddplab.training.scriptmode import supervisor

from .conftest import ddplab, job_env, runs

# Rank 0 deletes what argv[1] names after step 2's record; both ranks record 6 steps in all.
HOSTILE = '''
import os, shutil, sys, torch.distributed as dist
from ddplab import track
dist.init_process_group("gloo")
rank = dist.get_rank()
ckpt = os.environ["DDPLAB_CHECKPOINT_DIR"]
open(os.path.join(ckpt, "snap.txt"), "w").write("mine")
for step in range(6):
    track.log({"score": float(step)}, step=step)
    if step == 2 and rank == 0:  # as `rm -rf` would: rank 1's records land there meanwhile
        shutil.rmtree({"checkpoints": ckpt, "spool": os.environ["DDPLAB_SPOOL"],
                       "run": os.path.dirname(ckpt), "cwd": os.getcwd()}[sys.argv[1]],
                      ignore_errors=True)
    dist.barrier()
dist.destroy_process_group()
'''

# Saves its step each time; a first attempt fails at step 1 (a crash, no argument).
SNAPSHOT = '''
import os, torch, torch.distributed as dist
from ddplab import track
MARK = {mark}
dist.init_process_group("gloo")
rank = dist.get_rank()
snap = os.path.join(os.environ["DDPLAB_CHECKPOINT_DIR"], "snap.pt")
start = torch.load(snap)["step"] + 1 if os.path.exists(snap) else 0
dist.barrier()  # every rank has read it before rank 0 writes it again
print(f"rank {{rank}} from step {{start}}")
for step in range(start, 4):
    track.log({{"score": 10.0 * step + MARK}}, step=step)
    if rank == 0:
        torch.save({{"step": step}}, snap)
    dist.barrier()
    if step == 1 and start == 0:
        raise RuntimeError("the first attempt fails")
dist.destroy_process_group()
'''


def _said(res) -> list[tuple[str, str]]:
    """Every "MLflow run <id> <STATUS>" the job printed."""
    return re.findall(r"MLflow run ([0-9a-f]{32}) ([A-Z]+)", res.stdout + res.stderr)


def _scores(store: str, run_id: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(store).get_metric_history(run_id, "score"))


def _left(root: Path, run_id: str) -> str:
    """What the run's spool still holds, for a failure's message: each file's last lines."""
    said = []
    for path in sorted((root / "checkpoints").glob(f"*/{run_id}/spool/**/*")):
        if path.is_file() and path.suffix in (".jsonl", ".json", ".delivered", ""):
            said.append(f"{path.name}: {path.read_text(errors='replace')[-600:]}")
    return "\n".join(said) or "no spool left"


@pytest.mark.e2e
def test_a_script_deleting_its_folder_or_the_spool_never_leaves_a_run_running(tmp_path, store):
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE)
    seen: set[str] = set()
    # "cwd": the job's whole folder, its relative checkpoint.dir with it (the run stayed RUNNING
    # with nothing in it: its spool's path was relative, a hostile pass)
    for what in ("checkpoints", "spool", "run", "cwd"):
        work = tmp_path / "work" if what == "cwd" else tmp_path
        work.mkdir(exist_ok=True)
        res = ddplab(["train", str(script), "--set", "checkpoint.resume=never", "--", what],
                     work, job_env(store), nproc=2)
        (run,) = [r for r in runs(store) if r.info.run_id not in seen]
        seen.add(run.info.run_id)
        run_id, status = run.info.run_id, run.info.status
        assert _said(res) == [(run_id, status)], (what, res.stdout[-2000:], res.stderr[-3000:])
        if what == "checkpoints":  # the script's own folder: the spool is not in it
            assert res.returncode == 0 and status == "FINISHED", res.stderr[-3000:]
            assert _scores(store, run_id) == [(s, float(s)) for s in range(6)]
            run_dir = tmp_path / "checkpoints" / "hostile" / run_id
            assert (run_dir / supervisor.FINISHED_MARK).exists()
            assert json.loads((run_dir / "job.json").read_text())["args"] == ["checkpoints"]
            continue
        assert res.returncode != 0 and status == "FAILED", (what, res.stderr[-3000:])
        error = run.data.tags["ddplab.error"]
        assert "spool" in error and "was deleted during the job (by the script?)" in error, error
        assert "was deleted during the job" in res.stderr
        # What came after the deletion, and ddplab's own end records, still got in.
        assert [s for s, _ in _scores(store, run_id)][-3:] == [3, 4, 5], (
            _left(tmp_path, run_id), res.stderr[-3000:])
        assert "perf/wall_s" in run.data.metrics and run.data.tags["ddplab.mode"] == "script"
    assert not [r for r in runs(store) if r.info.status == "RUNNING"]


@pytest.mark.e2e
def test_a_train_py_of_another_folder_starts_its_own_run_leaving_the_first_as_it_was(tmp_path, store):
    a, b = tmp_path / "a" / "train.py", tmp_path / "b" / "train.py"
    for path, mark in ((a, "0.0"), (b, "0.5")):
        path.parent.mkdir()
        path.write_text(SNAPSHOT.format(mark=mark))
    first = ddplab(["train", str(a)], tmp_path, job_env(store), nproc=2)
    assert first.returncode != 0
    (failed,) = runs(store)
    run_dir = (tmp_path / "checkpoints" / "train" / failed.info.run_id).resolve()
    snap = run_dir / "script" / "snap.pt"
    before = (snap.read_bytes(), snap.stat().st_mtime_ns, _scores(store, failed.info.run_id))
    assert before[2] == [(0, 0.0), (1, 10.0)]

    other = ddplab(["train", str(b)], tmp_path, job_env(store), nproc=2)
    assert "rank 0 from step 0" in other.stdout, other.stdout[-2000:]
    line = (f"ddplab: not resuming run {failed.info.run_id} ({a.resolve()}): another script; "
            f"starting a new run; --set checkpoint.resume={run_dir} resumes it anyway")
    assert line in other.stderr, other.stderr[-3000:]
    new = next(r for r in runs(store) if r.info.run_id != failed.info.run_id)
    assert new.data.tags["ddplab.resumed_from"] == "none"
    kept = next(r for r in runs(store) if r.info.run_id == failed.info.run_id)
    assert kept.info.status == "FAILED"
    assert (snap.read_bytes(), snap.stat().st_mtime_ns, _scores(store, kept.info.run_id)) == before

    assert _scores(store, new.info.run_id) == [(0, 0.5), (1, 10.5)]  # its own, from step 0
    # The same job's rerun resumes its own run: test_script_mode.py's
    # test_a_rerun_of_a_failed_script_job_resumes_its_snapshot_in_the_same_run, and below.


# ---- in-process: which run a job resumes ----

def _cfg(script: Path, tmp_path: Path, args: list[str], resume: str = "auto"):
    return config.load(script, [f"checkpoint.dir={tmp_path / 'ck'}", f"checkpoint.resume={resume}"],
                       args)


def _left_by(script: Path, tmp_path: Path, args: list[str], run_id: str) -> Path:
    """A run folder as a failed job of ``script`` with ``args`` leaves it."""
    cfg = _cfg(script, tmp_path, args)
    run_dir = tmp_path / "ck" / cfg.name / run_id
    (run_dir / "script").mkdir(parents=True)
    (run_dir / "script" / "snap.pt").write_text("x")
    supervisor.write_identity(run_dir, supervisor.job_identity(cfg), run_id)
    return run_dir


def test_other_arguments_or_a_changed_script_start_a_new_run_and_say_why(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    run_dir = _left_by(script, tmp_path, ["--lr", "0.1"], "r1").resolve()
    said: list[str] = []
    assert supervisor.resumable_run(_cfg(script, tmp_path, ["--lr", "0.1"]), say=said.append) == "r1"
    assert said == []
    assert supervisor.resumable_run(_cfg(script, tmp_path, ["--lr", "0.2"]), say=said.append) == ""
    assert said[-1] == (f"ddplab: not resuming run r1 ({script.resolve()}): other arguments; "
                        f"starting a new run; --set checkpoint.resume={run_dir} resumes it anyway")
    script.write_text("print('changed')\n")
    assert supervisor.resumable_run(_cfg(script, tmp_path, ["--lr", "0.1"]), say=said.append) == ""
    assert "): the script changed (sha256); starting a new run" in said[-1]
    # Named, it is resumed all the same (by its folder or its id), saying so.
    for chosen in (str(run_dir), "r1"):
        cfg = _cfg(script, tmp_path, ["--lr", "0.3"], resume=chosen)
        assert supervisor.resumable_run(cfg, say=said.append) == "r1"
        assert said[-1].startswith(f"ddplab: resuming run r1 ({script.resolve()}) as "
                                   "checkpoint.resume asks, though not the same job: ")
        assert said[-1].endswith("the script changed (sha256) and other arguments")
    with pytest.raises(config.ConfigError, match="is no run of"):
        supervisor.resumable_run(_cfg(script, tmp_path, [], resume="nope"), say=said.append)


def test_the_same_job_resumes_its_own_run_though_another_jobs_is_newer(tmp_path):
    import os

    a, b = tmp_path / "a" / "train.py", tmp_path / "b" / "train.py"
    for path in (a, b):
        path.parent.mkdir()
        path.write_text(f"print({str(path)!r})\n")
    mine = _left_by(a, tmp_path, [], "mine")
    newer = _left_by(b, tmp_path, [], "newer")
    os.utime(mine, (1, 1))
    os.utime(mine / "script", (1, 1))
    said: list[str] = []
    assert supervisor.resumable_run(_cfg(a, tmp_path, []), say=said.append) == "mine"
    assert supervisor.resumable_run(_cfg(b, tmp_path, []), say=said.append) == "newer"
    (newer / supervisor.FINISHED_MARK).write_text("newer")
    (mine / "script" / "snap.pt").unlink()  # left no files: nothing to resume
    assert supervisor.resumable_run(_cfg(a, tmp_path, []), say=said.append) == "" and said == []


def test_a_run_of_the_earlier_layout_is_resumed_by_its_own_job(tmp_path):
    """Before script/, the script's files lay in the run's folder beside the spool, and the job
    was known from the tags the spool recorded: the same job still resumes it."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    cfg = _cfg(script, tmp_path, ["--epochs", "2"])
    run_dir = tmp_path / "ck" / cfg.name / "old"
    (run_dir / "spool" / "node0").mkdir(parents=True)
    (run_dir / "snap.pt").write_text("x")
    ident = supervisor.job_identity(cfg)
    tags = {"ddplab.script": cfg.script.path, "ddplab.script_sha256": ident["sha256"],
            "ddplab.script_args": json.dumps(ident["args"])}
    (run_dir / "spool" / "node0" / "records.jsonl").write_text(
        json.dumps({"op": "log", "ts": 1, "tags": tags}) + "\n")
    said: list[str] = []
    other = _cfg(script, tmp_path, ["--epochs", "3"])
    assert supervisor.resumable_run(other, say=said.append) == "" and "other arguments" in said[0]
    assert (run_dir / "snap.pt").exists()  # not resumed: left as it was
    assert supervisor.resumable_run(cfg, say=said.append) == "old" and len(said) == 1
    assert (run_dir / "script" / "snap.pt").read_text() == "x"  # where the script now looks


# Unbuffered (as every script's supervisor runs it), print writes its text and its newline
# apart; the pause between them is where another rank's line landed.
SPLIT_PRINTS = '''
import sys, time
for word in ("rank 0 sum 3.0", "rank 0 done"):
    sys.stdout.write(word); sys.stdout.flush(); time.sleep(0.05)
    sys.stdout.write("\\n"); sys.stdout.flush()
for _ in range(20):  # a second of dots, each sooner than the hold's 0.2 s
    sys.stdout.write("."); sys.stdout.flush(); time.sleep(0.05)
sys.stdout.write("\\rprogress 100%"); sys.stdout.flush()
'''


def test_the_console_gets_a_scripts_lines_whole_and_an_open_one_within_a_moment(tmp_path):
    """Every rank's supervisor writes to the one console: a hostile pass saw "rank 0 sum 3.0rank
    1 sum 3.0" from a two-rank all_reduce script. Each write to the console is now whole lines;
    an open line (progress dots) still shows while the script pauses, and the last one at the
    end. A real process over a real pipe, each write to the console recorded."""
    import subprocess
    import sys
    import threading
    import time

    class Console:
        def __init__(self):
            self.writes, self.at = [], []

        def write(self, data):
            self.writes.append(bytes(data))
            self.at.append(time.monotonic())

        def flush(self):
            pass

    console = Console()
    tail = supervisor.Tail(console, 4096)
    proc = subprocess.Popen([sys.executable, "-c", SPLIT_PRINTS], stdout=subprocess.PIPE)
    started = time.monotonic()
    pump = threading.Thread(target=tail.pump, args=(proc.stdout,))
    pump.start()
    proc.wait()
    ended = time.monotonic()
    pump.join(10)
    assert b"".join(console.writes) == b"rank 0 sum 3.0\nrank 0 done\n" + b"." * 20 + \
        b"\rprogress 100%"
    assert console.writes[:2] in ([b"rank 0 sum 3.0\n", b"rank 0 done\n"],
                                  [b"rank 0 sum 3.0\nrank 0 done\n"]), console.writes
    dots = next(i for i, w in enumerate(console.writes) if w.startswith(b"."))
    assert started < console.at[dots] < ended - 0.5, (console.at, ended)  # shown as they came
    assert console.writes[-1] == b"\rprogress 100%"  # a progress bar's update whole
    assert tail.text().endswith("progress 100%")
