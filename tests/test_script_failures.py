"""Failures as well reported as successes (script mode, and ddplab's loop where it shares the
code): the failed run's address last, torchrun's banner showing the user's error, each rank's
place in ``ddplab diagnose``, and packaged scripts (``ddplab train -m pkg.train``)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddplab import cli, subprocs
from ddplab.launchers import local

from .conftest import REPO, ddplab, job_env, runs
from .helpers import BIN, artifact_text, free_port, omni_path_library, wait_all
from .test_script_mode import FAULTY

# What torchrun's agent logs itself ("E1127 09:19:57.948000 10559 torch/...] ...").
TORCHRUN_LOG = re.compile(r"^[DIWEC]\d{4} \d")


def _ours(stderr: str) -> list[str]:
    """The ranks' own lines (ddplab's and the script's), before torchrun's failure banner."""
    head = stderr.split("Traceback (most recent call last):\n  File \"" +
                        str(BIN / "torchrun"), 1)[0]
    return [x for x in head.splitlines() if x.strip() and not TORCHRUN_LOG.match(x)]


@pytest.mark.e2e
def test_a_failed_script_job_says_its_run_last_torchrun_shows_the_users_error_and_diagnose_each_rank(
        tmp_path, store, monkeypatch, capsys):
    """One failing job (rank 1 raises at step 5; rank 0 then fails in its all-reduce), many
    looks at it."""
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    out = ddplab(["train", str(script), "--", "--fault", "raise"], tmp_path, job_env(store),
                 nproc=2)
    assert out.returncode == 1
    (run,) = runs(store)
    run_id = run.info.run_id
    assert run.info.status == "FAILED"
    # 1. Rank 0's last line says where the run is, after its error line, as a finished job's does.
    ours = _ours(out.stderr)
    error = next(i for i, x in enumerate(ours) if x.startswith("[rank 0] ddplab: error: the "
                                                                 "script failed on rank 1"))
    assert ours[-1].startswith(f"[ddplab] MLflow run {run_id} FAILED in {store}"), ours[-6:]
    assert error < len(ours) - 1, ours[-6:]
    # 3. torchrun's banner: the user's traceback from each rank's error file, not ddplab's frames;
    # the root cause is rank 1.
    banner = out.stderr[out.stderr.index("ChildFailedError"):]
    root = banner[banner.index("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in root, banner
    assert 'faulty.py", line 18, in <module>' in root and "ValueError: bad batch at step 5" in root
    assert not re.search(r"ddplab/(cli|training)", banner), banner  # no ddplab frame anywhere
    # 4. Nothing collected while it still ran (the orphan watcher's Popen, dropped at once).
    assert "ResourceWarning" not in out.stderr, out.stderr[-3000:]
    # 2. diagnose: each rank's place (how its script ended, where, its stack), from the run.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    capsys.readouterr()
    assert cli.main(["diagnose", run_id]) == 0
    said = capsys.readouterr().out
    assert re.search(r"rank 1 \(host [^)]+\): exit code 1: ValueError: bad batch at step 5; at "
                     r"faulty\.py:18 in <module>", said), said
    assert re.search(r"rank 0 \(host [^)]+\): .*exit code 1.*; at faulty\.py:1[0-9] in <module>",
                     said), said
    assert "the script's ranks" in said and "error: the script failed on rank 1" in said
    # ... and a garbled tag is one line, the rest still said.
    from mlflow import MlflowClient

    client = MlflowClient(store)
    client.set_tag(run_id, "ddplab.script_ranks", '[{"rank": 1, "code": "x"')
    client.set_tag(run_id, "ddplab.forensics.node9", '[{"rank": "what"}]')
    assert cli.main(["diagnose", run_id]) == 0
    garbled = capsys.readouterr()
    assert "ddplab.script_ranks unreadable" in garbled.out and "node9: unreadable" in garbled.out
    assert "Traceback" not in garbled.out + garbled.err and "verdict:" in garbled.out


CRASHES = '''
import ctypes, sys
import torch, torch.distributed as dist
if len(sys.argv) > 1:  # a native library the script loads itself first (Intel's bindings would)
    ctypes.CDLL(sys.argv[1])
import oneccl_bindings_for_pytorch  # noqa: F401 - as the book's oneCCL script does
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    if step == 5 and dist.get_rank() == 1:
        ctypes.string_at(0)  # SIGSEGV
    loss = model(torch.randn(8, 4)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
'''


@pytest.mark.e2e
@pytest.mark.parametrize("loads", ["", "omni-path"], ids=["oneccl", "oneccl-and-its-own-load"])
def test_a_script_that_crashes_after_loading_oneccl_is_said_to_have_crashed(tmp_path, store, loads):
    """oneCCL's transport, Debian's libfabric (ddplab's ccl stands in for Intel's bindings),
    links Omni-Path's libraries, which take SIGSEGV when loaded and exit(1) with a C backtrace:
    the run said "failed: python(_start+0x21)[0x5585...]" and "died outright (SIGKILL...)".
    The crash is a crash: its signal in the error, the verdict and the rank's stack; also when
    the script loads such a library itself, outside ddplab's reach, before its process group."""
    script = tmp_path / "crashes.py"
    script.write_text(CRASHES)
    own = [omni_path_library() or ""] if loads else []
    out = ddplab(["train", str(script), "--", *own], tmp_path, job_env(store), nproc=2)
    assert out.returncode == 1
    (run,) = runs(store)
    tags = run.data.tags
    assert run.info.status == "FAILED"
    assert tags["ddplab.error"].startswith("the script failed on rank 1 (host ") and \
        ": killed by SIGSEGV; then rank(s) 0 failed or were stopped" in tags["ddplab.error"], tags
    # (no DataLoader fed its steps: ddplab cannot tell its data loading from its other code)
    assert re.match(r"rank 1 \(host [^)]+\) died \(Segmentation fault\) at step 6 in data loading "
                    r"or other code between steps; rank 0 stopped after it$",
                    tags["ddplab.verdict"]), tags["ddplab.verdict"]
    from mlflow import MlflowClient

    client = MlflowClient(store)
    crash = client.download_artifacts(run.info.run_id, "forensics/node0/rank-1.crash.txt",
                                      str(tmp_path))
    line = next(i for i, x in enumerate(CRASHES.splitlines(), 1) if "string_at(0)" in x)
    assert f'crashes.py", line {line} in <module>' in open(crash).read()


PACKAGE = {
    "__init__.py": "",
    "helper.py": "WORDS = 'from the package'\n",
    "train.py": '''import argparse, sys
from .helper import WORDS  # a relative import: it runs as a module of its package
p = argparse.ArgumentParser()
p.add_argument("--n", type=int)
a = p.parse_args()
print(f"{__name__} {WORDS} n={a.n} argv0={sys.argv[0]} path0={sys.path[0]}")
''',
}


def _two_nodes(tmp_path, store, script, *args: str
               ) -> tuple[list[subprocess.Popen], list[str]]:
    """The script under two torchrun nodes of one rank each, on this host: their processes and
    outputs, once both have ended."""
    port, procs = free_port(), []
    for node in (0, 1):
        procs.append(subprocess.Popen(
            [str(BIN / "torchrun"), "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
             "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "ddplab", "train",
             str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}", *args],
            cwd=tmp_path, env=job_env(store), text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True))
    return procs, wait_all(procs, timeout=300)


@pytest.mark.e2e
def test_rank_0_failing_after_the_other_nodes_ended_well_is_the_verdict_no_node_lost(
        tmp_path, store, monkeypatch, capsys):
    """Two torchrun nodes of one rank each; node 1's rank ends well, then rank 0 fails on its
    own. Node 1 is no lost node: the verdict names rank 0 alone (it said "rank 1 reported
    nothing (their node lost?)" after waiting 15 s for node 1's endings), diagnose says rank 1
    was done."""
    script = tmp_path / "faulty.py"
    script.write_text(FAULTY)
    procs, outs = _two_nodes(tmp_path, store, script, "--", "--fault", "late")
    assert procs[0].returncode == 1, outs[0][-3000:]
    (run,) = runs(store)
    verdict = run.data.tags["ddplab.verdict"]
    assert verdict.startswith("rank 0 (host ") and "RuntimeError: evaluation failed" in verdict
    assert "reported nothing" not in verdict and "rank 1" not in verdict, verdict
    assert "after its training (step 8, its process group destroyed)" in verdict, verdict
    assert f"ddplab: {verdict} (every rank's stack" in outs[0]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    capsys.readouterr()
    assert cli.main(["diagnose", run.info.run_id]) == 0
    said = capsys.readouterr().out
    assert re.search(r"rank 1 \([^,]+, node1\): done$", said, re.M), said


@pytest.mark.e2e
def test_a_packaged_script_runs_with_dash_m_to_one_finished_run(tmp_path, store):
    (tmp_path / "pkg").mkdir()
    for name, text in PACKAGE.items():
        (tmp_path / "pkg" / name).write_text(text)
    out = ddplab(["train", "-m", "pkg.train", "--", "--n", "3"], tmp_path, job_env(store))
    assert out.returncode == 0, out.stderr[-3000:]
    train_py = tmp_path / "pkg" / "train.py"
    assert (f"__main__ from the package n=3 argv0={train_py} path0={tmp_path}"
            in out.stdout), out.stdout
    (run,) = runs(store)
    tags = run.data.tags
    assert run.info.status == "FINISHED" and tags["ddplab.script"] == "-m pkg.train"
    assert tags["ddplab.script_sha256"] == hashlib.sha256(train_py.read_bytes()).hexdigest()
    assert json.loads(tags["ddplab.script_args"]) == ["--n", "3"]
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"[ddplab] MLflow run {run.info.run_id} FINISHED")
    assert tags["ddplab.script_cwd"] == str(tmp_path)
    # Reproduced from another directory: it runs where it ran (it said "it is gone here", then
    # refused its own config's "-m pkg.train" as no .py file).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = ddplab(["reproduce", run.info.run_id], elsewhere, job_env(store))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "gone" not in again.stderr and "n=3" in again.stdout, again.stderr[-2000:]
    new = next(r for r in runs(store) if r.info.run_id != run.info.run_id)
    assert new.info.status == "FINISHED" and new.data.tags["ddplab.script"] == "-m pkg.train"
    # An experiment file names the module as -m does.
    (elsewhere / "job.yaml").write_text("name: packaged\nscript: {module: pkg.train, args: [--n, "
                                        "'5']}\n")
    out = ddplab(["train", str(elsewhere / "job.yaml")], tmp_path, job_env(store))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"__main__ from the package n=5 argv0={train_py}" in out.stdout, out.stdout


@pytest.mark.parametrize("command", ["train", "run"])
def test_a_module_that_is_not_there_is_one_line_exit_2_before_any_run(
        tmp_path, store, monkeypatch, capsys, command):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert cli.main([command, "-m", "nosuch.module", "--", "--n", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "ddplab: error: -m nosuch.module: no module named 'nosuch' (from the current directory "
        f"{tmp_path}"), err
    assert runs(store) == []


def test_ddplab_run_passes_dash_m_on_and_says_a_failed_rank_in_one_line(tmp_path, monkeypatch,
                                                                        capsys):
    """``ddplab run``: torchrun's ChildFailedError becomes one line naming the rank and its
    error (what the rank wrote in its error file), exit its code; not torchrun's banner."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddplab.distributed.group import Rank0Error
    from ddplab.training.scriptmode.supervisor import ScriptFailed

    a = argparse.Namespace(nproc_per_node=2, experiment=None, module="pkg.train", overrides=[],
                           summary_out="", script_args=["--n", "3"])
    assert local.torchrun_args(a)[2:] == ["-m", "ddplab", "train", "-m", "pkg.train", "--",
                                          "--n", "3"]
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    tb = 'Traceback (most recent call last):\n  File "t.py", line 3\nValueError: bad batch'
    cli._tell_torchrun(ScriptFailed("rank 1 (host h): ValueError: bad batch", tb,
                                    "ValueError: bad batch", 100.0))
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(error_file))
    e = ChildFailedError("ddplab", {1: failure})
    assert "ValueError: bad batch" in str(e) and 'File "t.py", line 3' in str(e)
    assert local.failed(e) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ddplab: error: rank 1 failed (exit code 1): ValueError: bad batch"]
    # Both ranks failing alike: the line names both, as the verdict printed above it does
    both = ChildFailedError("ddplab", {1: failure, 0: ProcessFailure(0, 2, 1, str(error_file))})
    assert local.failed(both) == 1
    assert capsys.readouterr().err.strip().startswith("ddplab: error: ranks 0,1 failed (exit code 1)")
    # Rank 0 exits 1 too, stopped by torchrun's SIGTERM after rank 1 failed: not blamed with it
    stopped_file = tmp_path / "stopped.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(stopped_file))
    cli._tell_torchrun(ScriptFailed("rank 0 (host h): terminated by SIGTERM", "",
                                    "terminated by SIGTERM (a peer rank failed)", 101.0))
    stopped = ChildFailedError("ddplab", {1: failure, 0: ProcessFailure(0, 2, 1, str(stopped_file))})
    assert local.failed(stopped) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ddplab: error: rank 1 failed (exit code 1): ValueError: bad batch"], err
    # Rank 1 only passed rank 0's failure on, and ended first (CI saw it): the line is rank 0's
    passed_file = tmp_path / "passed.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(passed_file))
    cli._tell_torchrun(Rank0Error("rank 0 failed: OSError: disk full"))
    passed = ChildFailedError("ddplab", {1: ProcessFailure(1, 2, 1, str(passed_file))})
    assert local.failed(passed) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ddplab: error: rank 0 failed: OSError: disk full; rank 1 stopped after it "
                   "(exit code 1)"], err
    # Rank 0's account of the whole job (its script left early, exit 0): said as it is
    left_file = tmp_path / "left.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(left_file))
    left = ("the script failed: rank 0 (host h) exited 0 before the job ended, while the others "
            "still ran; then rank 1 (host h): RuntimeError: Connection closed by peer")
    cli._tell_torchrun(ScriptFailed(left, ""))
    assert local.failed(ChildFailedError("ddplab", {0: ProcessFailure(0, 2, 1, str(left_file))})) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"ddplab: error: {left}"], err
    killed = ChildFailedError("ddplab", {0: ProcessFailure(0, 1, -9, str(tmp_path / "none"))})
    assert local.failed(killed) == 128 + 9
    assert capsys.readouterr().err.strip() == (
        "ddplab: error: rank 0 was killed by SIGKILL (ddplab's hang watch stops a hung job's ranks "
        "so: a verdict line above names the rank waited for; else the OOM killer or a kill -9)")


@pytest.mark.parametrize("env, ours", [({}, True), ({"PET_LOG_DIR": "{tmp}/mine"}, False),
                                       ({"PET_TEE": "3"}, False)], ids=["none", "named", "tee"])
def test_torchruns_log_dir_is_ddplabs_unless_the_user_names_one_or_logs_to_it(
        tmp_path, monkeypatch, env, ours):
    """Plain torchrun leaves a /tmp/torchelastic_* a job (287 over a CI run); `ddplab run` gives
    it a folder of its own to remove, but not one the user named or asked logs to be kept in."""
    from torch.distributed.run import parse_args

    for k, v in env.items():
        monkeypatch.setenv(k, v.format(tmp=tmp_path))
    import socket
    import tempfile

    # A `ddplab run` killed outright (SIGKILL) left its folder: the next one removes it, not a
    # live job's, nor another host's (a /tmp shared with a container)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    host = socket.gethostname()
    left = [tmp_path / f"ddplab-torchrun-{host}-{gone}-x1", tmp_path / f"ddplab-torchrun-{host}-"
            f"{os.getpid()}-x2", tmp_path / f"ddplab-torchrun-elsewhere-{gone}-x3",
            tmp_path / f"ddplab-torchrun-{host}-{gone}-{os.getpid()}-x4"]  # host "{host}-{gone}"'s
    for folder in left:
        (folder / "attempt_0" / "0").mkdir(parents=True)
    config = parse_args(["--standalone", "--nproc-per-node", "2", "t.py"])
    made = local._log_dir(config)
    assert bool(made) == ours and (config.log_dir == made if ours else made == "")
    assert not ours or Path(made).is_dir() and Path(made).name.startswith("ddplab-torchrun-")
    assert [f.exists() for f in left] == [not ours, True, True, True]
    if ours:
        Path(made).rmdir()
    # The file `ddplab run` keeps its rank 0's last line in goes the same way (three were left in
    # /tmp by `ddplab run`s killed outright).
    lines = [tmp_path / f"ddplab-run-line-{host}-{gone}-y1", tmp_path / f"ddplab-run-line-{host}-"
             f"{os.getpid()}-y2"]
    # and a script rank's report and stacks, which its supervisor killed outright left
    reports = [tmp_path / f"ddplab-script-{host}-{gone}-z1.rank1.json",
               tmp_path / f"ddplab-script-{host}-{gone}-z1.rank1.stack.txt",
               tmp_path / f"ddplab-script-{host}-{os.getpid()}-z2.rank0.json"]
    for f in lines + reports:
        f.write_text("")
    made_line = subprocs.own_temp("run-line")
    assert [f.exists() for f in lines + reports] == [False, True, True, True, True]
    made_report = subprocs.own_temp("script", suffix=".rank0.json")
    assert [f.exists() for f in reports] == [False, False, True]
    assert made_line.parent == made_report.parent == tmp_path
    assert made_report.name.endswith(".rank0.json")


def test_ddplabs_loop_says_its_failed_run_last_too(tmp_path, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "DDPLAB_SET",
                 "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    sets = ["data.train_samples=64", "data.eval_samples=32", "data.image_size=8",
            "optim.lr=1e12", "tracking.system_metrics=false"]
    code = cli.main(["train", str(REPO / "experiments" / "quickstart.yaml"),
                     *[x for s in sets for x in ("--set", s)]])
    (run,) = runs(store)
    assert code == 1 and run.info.status == "FAILED"
    err = capsys.readouterr().err.strip().splitlines()
    assert "ddplab: error: train/loss is nan" in err[-2], err[-3:]
    assert err[-1].startswith(f"[ddplab] MLflow run {run.info.run_id} FAILED in {store}"), err[-3:]


@pytest.mark.e2e
@pytest.mark.parametrize("end, code", [("sys.exit(3)", 3), ("os.kill(os.getpid(), 9)", 128 + 9)],
                         ids=["sys.exit(3)", "sigkill"])
def test_a_failed_script_ends_ddplab_with_its_own_exit_code(tmp_path, store, end, code):
    """Plain python ends `sys.exit(3)` with 3 (and a shell says 128 + N for signal N): ddplab
    ended every failed script with 1, so a caller could not tell them apart."""
    script = tmp_path / "ends.py"
    script.write_text(f"import os, sys\nprint('working')\n{end}\n")
    out = ddplab(["train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path,
                 job_env(store))
    assert out.returncode == code, out.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FAILED"
    # ddplab's own checkout, as its loop's runs say it (a results page's stamp, reproduce)
    assert run.data.tags["ddplab.git_dirty"] in ("true", "false"), run.data.tags


@pytest.mark.e2e
def test_a_script_whose_process_trains_nothing_says_so_at_its_end(tmp_path, store):
    """An mp.spawn script's ranks are not observed: its run had no figure and no word why. (A
    script that only prints, ``--help``, gets no such note; one that made a process group and
    trained nothing is not told of ranks it never started: a hostile pass.)"""
    def said(name, code, *args):
        (tmp_path / name).write_text(code)
        out = ddplab(["train", str(tmp_path / name), "--set", f"checkpoint.dir={tmp_path / 'ck'}",
                      *args], tmp_path, job_env(store))
        assert out.returncode == 0, out.stderr[-3000:]
        assert "no training seen in the script's process" in out.stdout + out.stderr
        return out.stdout + out.stderr

    spawns = said("spawns.py", "import torch.multiprocessing as mp\n\n\ndef rank(i):\n"
                  "    print('rank', i, 'would train here')\n\n\n"
                  "if __name__ == '__main__':\n    mp.spawn(rank, nprocs=1)\n")
    assert "(torch.multiprocessing.spawn or Process, or torchrun's own main) are not observed" in spawns
    # pytorch/examples' mnist_hogwild: a shared model trained by mp.Process workers it starts
    # (spawn, as it sets), its own process only waiting: told of those, not of its own updates
    hogwild = said("hogwild.py", "import torch, torch.multiprocessing as mp\n\n\n"
                   "def train(model):\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                   "    for _ in range(3):\n        opt.zero_grad()\n"
                   "        model(torch.randn(4, 2)).sum().backward()\n        opt.step()\n"
                   "    print('worker trained')\n\n\n"
                   "if __name__ == '__main__':\n    mp.set_start_method('spawn', force=True)\n"
                   "    model = torch.nn.Linear(2, 1)\n    model.share_memory()\n"
                   "    p = mp.Process(target=train, args=(model,))\n    p.start()\n    p.join()\n")
    assert "worker trained" in hogwild and "torch.multiprocessing.spawn or Process" in hogwild
    # A launcher script calling torchrun's main itself: an empty FINISHED run, unsaid
    (tmp_path / "child.py").write_text("print('a rank would train here')\n")
    launches = said("launch.py", "import sys\nfrom torch.distributed import run\n"
                    "run.main(['--standalone', '--nproc-per-node', '1', sys.argv[1]])\n",
                    "--", str(tmp_path / "child.py"))
    assert "a rank would train here" in launches
    # A process group and no optimizer (no ranks of its own): not told of spawned ranks
    hello = said("hello.py", "import torch, torch.distributed as dist\n"
                 "dist.init_process_group('gloo')\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                 "print('sum', t.item())\ndist.destroy_process_group()\n")
    assert "spawn" not in hello and "records its own with ddplab.track.log" in hello, hello
    # One process, its own updates of tensors that are no nn.Module's ("What is torch.nn
    # really?"'s first part): its backwards say it trained, and it is told (it was not)
    # (fed by a DataLoader's worker process: the loader's, not a process the script trains in)
    scratch = said("scratch.py", "import torch\nw = torch.zeros(3, requires_grad=True)\n"
                   "data = torch.utils.data.DataLoader(torch.ones(3, 3), num_workers=1)\n"
                   "for x in data:\n    ((w - x) ** 2).sum().backward()\n"
                   "    with torch.no_grad():\n        w -= 0.1 * w.grad\n        w.grad.zero_()\n")
    assert "records its own with ddplab.track.log" in scratch and "Process" not in scratch, scratch


LEAVES = '''
import os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(20):
    if sys.argv[1] == "os-exit" and rank == 0 and step == 2:
        os._exit(int(sys.argv[2]))  # leaves mid-training; its peer waits in the next all-reduce
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    time.sleep(0.2)
'''


@pytest.mark.e2e
@pytest.mark.parametrize("code", [0, 3])
def test_a_rank_that_leaves_by_os_exit_is_the_cause_not_the_peer_it_left(tmp_path, store, code):
    """Rank 0 ``os._exit(0)`` mid-training: the run blamed rank 1's "Connection reset by peer"
    (a consequence), and the forensics line said rank 0 "died outright (SIGKILL, or the OOM
    killer)" though nothing killed it; so did ``os._exit(3)``'s."""
    script = tmp_path / "leaves.py"
    script.write_text(LEAVES)
    out = ddplab(["train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--",
                  "os-exit", str(code)], tmp_path, job_env(store), nproc=2)
    assert out.returncode != 0
    said = out.stdout + out.stderr
    if not code:
        assert "rank 0 (host" in said and "exited 0 before the job ended" in said, said[-3000:]
    assert f"exited {code} before the script's end (os._exit" in said, said[-3000:]
    assert "died outright" not in said, said[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FAILED" and "rank 0" in run.data.tags["ddplab.error"]


@pytest.mark.e2e
def test_a_refusal_on_every_rank_names_every_rank(tmp_path, store):
    """argparse refuses an argument on both ranks; torchrun stops rank 0's supervisor once
    rank 1 exited, after rank 0's script had exited 2 by itself: it read "stopped", and the
    verdict named rank 1 alone."""
    script = tmp_path / "args.py"
    # Both ranks refuse at once (each waits for the other to be ready, as a slow start-up on
    # a busy machine would otherwise have torchrun stop rank 0 before it parsed anything).
    script.write_text("import argparse, os, pathlib, time\n"
                      "here = pathlib.Path(__file__).parent\n"
                      "(here / f\"ready{os.environ['RANK']}\").touch()\n"
                      "deadline = time.time() + 60\n"
                      "while len(list(here.glob('ready*'))) < 2 and time.time() < deadline:\n"
                      "    time.sleep(0.01)\n"
                      "p = argparse.ArgumentParser()\n"
                      "p.add_argument('--epochs', type=int)\np.parse_args()\n")
    out = ddplab(["train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--",
                  "--epochs", "x"], tmp_path, job_env(store), nproc=2)
    assert out.returncode != 0
    assert "the script failed on ranks 0,1 (host" in out.stderr, out.stderr[-3000:]
    # argparse's own words, not a bare "SystemExit: 2" (a hostile pass)
    (run,) = runs(store)
    assert run.data.tags["ddplab.error"].startswith(
        "the script failed on ranks 0,1 (host ") and run.data.tags["ddplab.error"].endswith(
        "): args.py: error: argument --epochs: invalid int value: 'x' (SystemExit: 2)"), \
        run.data.tags["ddplab.error"]


@pytest.mark.e2e
def test_a_process_the_script_leaves_running_does_not_hold_the_job(tmp_path, store):
    """A helper the script started and left running holds the script's stdout: the job waited
    10 s a pipe for it (plain python does not wait at all). It ends with the job."""
    script = tmp_path / "leaves_a_helper.py"
    script.write_text("import subprocess\np = subprocess.Popen(['sleep', '60'])\n"
                      "print('helper', p.pid, flush=True)\n")
    out = ddplab(["train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path,
                 job_env(store))
    pid = int(re.search(r"helper (\d+)", out.stdout).group(1))  # type: ignore[union-attr]
    try:
        assert out.returncode == 0, out.stderr[-3000:]
        assert not _running(pid)  # (test_what_a_script_started_and_left_running_ends_...)
        (run,) = runs(store)
        # (it was 10 s more than the script's: the wait for the pipe; a loaded machine's start-up
        # is seconds, never 10)
        assert run.data.metrics["perf/wall_s"] < 10
    finally:
        subprocess.run(["kill", str(pid)], check=False)


@pytest.mark.e2e
def test_a_stray_module_in_the_current_directory_and_a_symlinked_script(tmp_path, store):
    """``random.py`` in the current directory was imported by ddplab's own processes (``-m``
    puts the current directory first), ending the job; plain python never sees it. And the
    script's ``__file__`` was the symlink's target: files beside the link were not found."""
    work, real = tmp_path / "work", tmp_path / "real"
    work.mkdir()
    real.mkdir()
    (work / "random.py").write_text("raise SystemExit('the stray random.py was imported')\n")
    (work / "data.txt").write_text("beside the link\n")
    (real / "train.py").write_text(
        "import os, random\nhere = os.path.dirname(__file__)\n"
        "print('FILE', __file__, open(os.path.join(here, 'data.txt')).read().strip())\n")
    (work / "train.py").symlink_to(real / "train.py")
    out = ddplab(["train", "train.py", "--set", f"checkpoint.dir={tmp_path / 'ck'}"], work,
                 job_env(store), nproc=1)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"FILE {work / 'train.py'} beside the link" in out.stdout, out.stdout[-2000:]


def _terminal(cols: int, mark: bytes = b"") -> tuple[int, bytearray, Any, Any]:
    """A pseudo-terminal ``cols`` wide for a job's output: (its end to give the job, what it
    has shown, the thread reading it, an event set once ``mark`` has been shown)."""
    import os
    import pty
    import threading

    read, write = pty.openpty()
    subprocess.run(["stty", "cols", str(cols)], stdin=write, check=True)
    seen, shown = bytearray(), threading.Event()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(read, 65536)
            except OSError:  # every writer gone
                return
            if not chunk:
                return
            seen.extend(chunk)
            if mark and mark in seen:
                shown.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    return write, seen, reader, shown


@pytest.mark.e2e
def test_a_script_run_in_a_terminal_writes_to_a_terminal(tmp_path, store):
    """Its stdout and stderr were pipes: tqdm, rich and coloured logging saw no terminal where
    plain python gives them one. Its output comes through byte for byte (a newline is not made
    CR-LF twice) at the terminal's size."""
    import os

    script = tmp_path / "in_a_terminal.py"
    script.write_text("import os, sys\nprint('TTY', sys.stdout.isatty(), sys.stderr.isatty(), "
                      "os.get_terminal_size(1).columns)\nprint('a\\nb', flush=True)\n")
    write, seen, reader, _ = _terminal(123)
    cmd = [str(BIN / "ddplab"), "train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}"]
    code = subprocess.run(cmd, cwd=tmp_path, env=job_env(store), stdin=subprocess.DEVNULL,
                          stdout=write, stderr=write, timeout=300).returncode
    os.close(write)
    reader.join(timeout=30)
    text = bytes(seen).decode(errors="replace")
    assert code == 0, text[-3000:]
    assert "TTY True True 123" in text and "a\r\nb\r\n" in text, text[-3000:]


@pytest.mark.e2e
def test_a_terminal_resized_while_the_script_runs_resizes_the_scripts_terminal(tmp_path, store):
    """The script's pseudo-terminal kept the size it had at the start: a progress bar drawn for
    the old width wrapped on every refresh once the user resized the window."""
    import os

    script = tmp_path / "resized.py"
    script.write_text(
        "import os, sys, time\n"
        "print('COLS', os.get_terminal_size(1).columns, flush=True)\n"
        "deadline = time.monotonic() + 30\n"
        "while os.get_terminal_size(1).columns == 123 and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print('NOW', os.get_terminal_size(1).columns, flush=True)\n")
    write, seen, reader, started = _terminal(123, b"COLS")
    cmd = [str(BIN / "ddplab"), "train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(store), stdin=subprocess.DEVNULL,
                            stdout=write, stderr=write)
    assert started.wait(120), bytes(seen).decode(errors="replace")[-3000:]
    subprocess.run(["stty", "cols", "77"], stdin=write, check=True)  # the user's resize
    code = proc.wait(timeout=120)
    os.close(write)
    reader.join(timeout=30)
    text = bytes(seen).decode(errors="replace")
    assert code == 0, text[-3000:]
    assert "COLS 123" in text and "NOW 77" in text, text[-3000:]


def _stopped_by_the_watch(tmp_path, store, source: str, hang_after_s: float = 3
                          ) -> tuple[subprocess.CompletedProcess, Any]:
    """A 2-rank job of ``source``, which hangs: its output and its one run."""
    script = tmp_path / "hangs.py"
    script.write_text(source)
    out = ddplab(["train", str(script), "--set", f"dist.hang_after_s={hang_after_s}", "--set",
                  f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path, job_env(store), nproc=2)
    assert out.returncode != 0
    (run,) = runs(store)
    # Recorded, so that reproduce's rerun is stopped as soon (it waited the default 300 s).
    assert run.data.params["ddplab.dist.hang_after_s"] == str(float(hang_after_s))
    return out, run


LATE = '''
import time, torch, torch.distributed as dist, os
if os.environ["RANK"] == "1":
    time.sleep(120)  # a slow set-up of its own: rank 0 waits for it in init_process_group
dist.init_process_group("gloo")
'''


@pytest.mark.e2e
def test_a_rank_late_to_its_process_group_is_the_one_named_not_the_one_waiting(tmp_path, store):
    """Rank 1 is slow before ``init_process_group``; rank 0 waits in it: both in set-up, and
    the verdict named rank 0 (2 runs of 2), its own stack inside init_process_group."""
    _, run = _stopped_by_the_watch(tmp_path, store, LATE, hang_after_s=2)
    verdict = run.data.tags["ddplab.verdict"]
    assert verdict.startswith("rank 1 (host ") and " in setup " in verdict, verdict
    assert "rank 0 waits in init_process_group (for the other ranks)" in verdict, verdict


NAN = '''
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    loss = model(torch.randn(8, 4)).sum() * float("nan")
    opt.zero_grad(); loss.backward(); opt.step()
'''


@pytest.mark.e2e
def test_a_nan_loss_finishes_as_under_plain_python_and_its_summary_stays_json(tmp_path, store):
    """summary.json held a bare NaN (``"final_loss": NaN``), which JSON readers refuse."""
    from mlflow import MlflowClient

    script = tmp_path / "nan.py"
    script.write_text(NAN)
    out = ddplab(["train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path,
                 job_env(store))
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    text = artifact_text(MlflowClient(store), run.info.run_id, "summary.json")

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    summary = json.loads(text, parse_constant=refuse)
    assert summary["steps"] == 6 and summary["final_loss"] is None, summary


REQUEUES = '''
import signal, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
signal.signal(signal.SIGUSR2, lambda *_: print("my own requeue handler ran", flush=True))
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    if step == 3 and dist.get_rank() == 1:
        time.sleep(120)
    model(torch.randn(8, 4)).sum().backward(); opt.step()
'''


@pytest.mark.e2e
def test_a_scripts_own_sigusr2_handler_is_not_what_the_hang_watch_asks_for_stacks(tmp_path, store):
    """The watch asked for stacks with SIGUSR2, which Slurm's --signal, Lightning and submitit
    scripts handle themselves: the script's requeue handler ran, and no stack came."""
    from mlflow import MlflowClient

    out, run = _stopped_by_the_watch(tmp_path, store, REQUEUES)
    assert "my own requeue handler ran" not in out.stdout + out.stderr, out.stdout[-3000:]
    assert run.data.tags["ddplab.verdict"].startswith("rank 1 (host "), run.data.tags
    stack = artifact_text(MlflowClient(store), run.info.run_id, "forensics/rank1.stack.txt")
    assert "hangs.py" in stack, stack


LEAVES_PROCESSES = '''
import subprocess, sys, torch
from torch.utils.data import DataLoader
kept = subprocess.Popen(["sleep", "300"])  # started and forgotten
daemon = subprocess.Popen(["sleep", "301"], start_new_session=True)  # detached on purpose
grouped = subprocess.Popen(["sleep", "302"], preexec_fn=lambda: __import__("os").setpgid(0, 0))
print("pids", kept.pid, daemon.pid, grouped.pid, flush=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x in DataLoader(torch.randn(32, 4), batch_size=8):
    model(x).sum().backward(); opt.step()
if sys.argv[1] == "fail":
    raise RuntimeError("failed with its process still running")
'''


@pytest.mark.e2e
@pytest.mark.parametrize("ending", ["ok", "fail"])
def test_what_a_script_started_and_left_running_ends_with_its_job(tmp_path, store, ending):
    """``Popen(["sleep", "300"])`` outlived the job, after a failure and a success alike (a
    DataLoader worker stuck in a hang did too), and so did one in a process group of its own
    (a hostile pass); one started in a session of its own is a daemon on purpose, and stays."""
    import os
    import signal

    script = tmp_path / "leaves.py"
    script.write_text(LEAVES_PROCESSES)
    out = ddplab(["train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--",
                  ending], tmp_path, job_env(store))
    assert out.returncode == (0 if ending == "ok" else 1), out.stderr[-3000:]
    kept, daemon, grouped = (int(p) for p in re.search(r"pids (\d+) (\d+) (\d+)",
                                                        out.stdout).groups())
    try:
        assert not _running(kept), "the forgotten process outlived the job"
        assert not _running(grouped), "the process in a group of its own outlived the job"
        assert _running(daemon), "the daemon started in a session of its own was stopped"
    finally:
        for pid in (kept, daemon, grouped):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


STUCK_AT_25 = '''
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(40):
    if step == 24 and dist.get_rank() == 1:
        time.sleep(120)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step(); opt.zero_grad()
'''


@pytest.mark.e2e
def test_rank_0s_last_log_point_is_kept_when_its_script_is_stopped(tmp_path, store):
    """The observation puts a log point into the spool one log point late (a script logging
    the same name itself has done so by then): rank 0 stopped by the hang watch at step 25
    never wrote step 20's, and train/loss ended at step 10."""
    from mlflow import MlflowClient

    _, run = _stopped_by_the_watch(tmp_path, store, STUCK_AT_25)
    assert "at step 25" in run.data.tags["ddplab.verdict"], run.data.tags["ddplab.verdict"]
    steps = [m.step for m in MlflowClient(store).get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == [10, 20], steps


AFTER_ITS_STEP = '''
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step, x in enumerate(DataLoader(torch.randn(400, 4), batch_size=8)):
    model(x).sum().backward()
    opt.step()
    if step == 4 and dist.get_rank() == 1:
        time.sleep(120)  # its own code after the step (a checkpoint, a metric's all-reduce)
'''


@pytest.mark.e2e
def test_a_hang_after_the_step_outside_the_data_loader_is_not_called_data_loading(tmp_path,
                                                                                  store):
    """Everything from a step's end to the next forward read "data loading"; with a DataLoader
    feeding the steps, that is only the time inside its next()."""
    _, run = _stopped_by_the_watch(tmp_path, store, AFTER_ITS_STEP)
    verdict = run.data.tags["ddplab.verdict"]
    assert verdict.startswith("rank 1 (host ") and \
        "at step 6 in its code between steps, outside its data loader" in verdict, verdict


A_BAD_RECORD = '''
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
dist.init_process_group("gloo")
class Records(Dataset):
    def __len__(self):
        return 400
    def __getitem__(self, i):
        if i == BAD:  # 241: rank 1's 6th batch of 8; 200: its first
            raise ValueError(f"corrupt record {i}")
        return torch.randn(4)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
first = dist.get_rank() * 200
for x in DataLoader(Records(), batch_size=8, sampler=range(first, first + 200)):
    model(x).sum().backward()
    opt.step()
'''


@pytest.mark.e2e
@pytest.mark.parametrize("bad, step", [(241, 6), (200, 1)])
def test_an_error_inside_the_data_loader_is_in_data_loading_and_its_traceback_is_the_users(
        tmp_path, store, bad, step):
    """A hostile pass: a Dataset raising in __getitem__ read "in its code between steps, outside
    its data loader" (the loader's hook said so on the error's way out), pointing away from the
    data, and "in setup" in the first batch; the consoles' tracebacks, through
    torch.distributed's "[rankN]:" excepthook, showed ddplab's boot.py and hooks between the
    user's frames."""
    script = tmp_path / "bad_record.py"
    script.write_text(A_BAD_RECORD.replace("BAD", str(bad)))
    out = ddplab(["train", str(script)], tmp_path, job_env(store), nproc=2)
    assert out.returncode != 0
    (run,) = runs(store)
    verdict = run.data.tags["ddplab.verdict"]
    assert verdict.startswith("rank 1 (host ") and f"ValueError: corrupt record {bad}" in verdict \
        and f"at step {step} in data loading" in verdict, verdict
    said = out.stdout + out.stderr
    assert 'bad_record.py", line 11, in __getitem__' in said, said[-3000:]
    assert "scriptmode" not in said.split("Traceback", 1)[1], said[-3000:]


RANK_0_GOES_ON = '''
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(5):
    model(torch.randn(8, 4)).sum().backward(); opt.step()
if dist.get_rank() == 0:
    time.sleep(12)  # its own evaluation and save, its process group never destroyed
    print("rank 0 saved", flush=True)
'''


@pytest.mark.e2e
def test_rank_0s_own_work_after_its_peers_ended_well_is_not_a_hang(tmp_path, store):
    """Rank 1's script returned; rank 0 went on alone (no destroy_process_group first): the
    watch stopped it as hung "in data loading", though no peer was left to deadlock with."""
    script = tmp_path / "goes_on.py"
    script.write_text(RANK_0_GOES_ON)
    # (4 s, not less: the wait in init_process_group, while rank 0 opens the run on a loaded
    # machine, is watched too, at 3x that)
    out = ddplab(["train", str(script), "--set", "dist.hang_after_s=4", "--set",
                  f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path, job_env(store), nproc=2)
    assert out.returncode == 0 and "rank 0 saved" in out.stdout, out.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and "ddplab.verdict" not in run.data.tags, run.data.tags


EXITS_3 = '''
import sys, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
for step in range(20):
    if step == 2 and dist.get_rank() == 1:
        sys.exit(3)
    model(torch.randn(8, 4)).sum().backward()
    time.sleep(0.1)
'''


@pytest.mark.e2e
def test_each_rank_exits_with_its_own_scripts_code(tmp_path, store):
    """Rank 1's script exits 3; rank 0's fails of it: rank 0's ddplab exited 3 too (the
    cause's code), where plain torchrun shows its own. (Two torchrun nodes of one rank each:
    one torchrun stops rank 0 once rank 1 failed, before its own failure, on a busy machine.)"""
    script = tmp_path / "exits3.py"
    script.write_text(EXITS_3)
    _, outs = _two_nodes(tmp_path, store, script)
    codes = dict(re.findall(r"rank\s+: (\d) \(local_rank: \d\)\s+exitcode\s+: (-?\d+)",
                            "\n".join(outs)))
    assert codes.get("1") == "3" and codes.get("0") not in (None, "3"), (codes, outs[0][-2000:])


TRAINS_ON = '''
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(600):
    model(torch.randn(8, 4)).sum().backward(); opt.step(); time.sleep(0.1)
    if step == 3 and dist.get_rank() == 0:
        print("training", flush=True)
'''


@pytest.mark.e2e
def test_torchrun_killed_outright_leaves_one_line_of_error_not_ddplabs_traceback(tmp_path, store):
    """kill -9 of torchrun: the run's error held ddplab's own frames (runs.py, supervisor.py,
    meeting.py) under the line that says it all."""
    import os
    import signal
    import time

    from mlflow import MlflowClient

    script = tmp_path / "trains_on.py"
    script.write_text(TRAINS_ON)
    job = subprocess.Popen([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m",
                            "ddplab", "train", str(script), "--set",
                            f"checkpoint.dir={tmp_path / 'ck'}"], cwd=tmp_path,
                           env=job_env(store), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    assert job.stdout is not None
    for line in job.stdout:
        if "training" in line:
            break
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    client, deadline = MlflowClient(store), time.monotonic() + 90
    while (run := runs(store)[0]).info.status == "RUNNING":
        assert time.monotonic() < deadline, "the run stayed RUNNING"
        time.sleep(1)
    error = client.get_run(run.info.run_id).data.tags["ddplab.error"]
    # (each rank stops with its launcher, launchers/tether.py: KILLED, as in ddplab's loop; the
    # rank says so either way it saw it first, the store gone or the kernel's SIGHUP)
    assert run.info.status == "KILLED", error
    assert ("the launcher is gone" in error or "its launcher, pid" in error) and \
        "Traceback" not in error and "\n" not in error.strip(), error



UNEVEN = '''
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(12 if dist.get_rank() == 0 else 6):  # rank 1 has half the batches
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step(); opt.zero_grad()
dist.barrier()
'''


@pytest.mark.e2e
def test_uneven_batches_per_rank_are_named_as_the_hangs_cause(tmp_path, store):
    """DDP's classic hang: rank 1 ran out of batches and waited in its barrier, rank 0 in its
    next step's all-reduce. The verdict said "rank 1 stopped at step 7 in its code between
    steps" of a rank that had no step 7."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN)
    out = ddplab(["train", str(script), "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set",
                  "dist.hang_after_s=4"], tmp_path, job_env(store), nproc=2)
    assert out.returncode != 0
    assert "rank 1 waits in a torch.distributed call of its own" in out.stderr, out.stderr[-3000:]
    assert "uneven data? rank 1 left its training steps while rank 0 still waits in one" in \
        out.stderr, out.stderr[-3000:]


DEAF = '''
import signal, time, torch, torch.distributed as dist
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank deaf to the stop
dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
if rank == 1:
    raise RuntimeError("rank 1 boom")
while True:
    time.sleep(1)
'''


@pytest.mark.e2e
def test_a_rank_deaf_to_the_stop_is_stopped_not_failed_by_itself(tmp_path, store):
    """Rank 1 raised; rank 0 ignored the SIGTERM its supervisor sent and ended by the SIGKILL
    after it: the verdict named it "killed by SIGKILL also failed by itself", a second cause
    (a hostile pass). It was stopped after rank 1."""
    (tmp_path / "deaf.py").write_text(DEAF)
    out = subprocess.run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m",
                          "ddplab", "train", str(tmp_path / "deaf.py"), "--set",
                          f"checkpoint.dir={tmp_path / 'ck'}"], cwd=tmp_path, env=job_env(store),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    (run,) = runs(store)
    error = run.data.tags["ddplab.error"].split("\n")[0]
    assert error.startswith("the script failed on rank 1 (host ") and "rank 1 boom" in error, error
    assert "also failed by itself" not in error and "then rank(s) 0 failed or were stopped" in error
