"""The fault matrix of a hostile pass: nothing lost, nothing left RUNNING, one line instead of a
traceback. Real parts: a real `mlflow server`, a 127.0.0.1 proxy in front of it that answers
chosen status codes for a while, a tmpfs that fills up, real torchrun jobs and studies, the
spool as a crashed job leaves it."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from ddplab.tracking import spool
from tests.conftest import QUICK, REPO, job_env, runs
from tests.helpers import Server, printed_losses, wait_all

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent
QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")


def ddplab(args: list[str], cwd: Path, store: str, timeout: int = 300,
           **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ddplab"), *args], cwd=cwd, env=job_env(store, **env),
                          capture_output=True, text=True, timeout=timeout)


def one_line(out: subprocess.CompletedProcess, code: int, says: str) -> None:
    lines = [x for x in out.stderr.splitlines() if x.strip() and "Warning" not in x
             and not x.startswith("  ")]
    assert out.returncode == code, out.stdout[-1500:] + out.stderr[-1500:]
    assert "Traceback" not in out.stderr and any(says in x for x in lines), out.stderr[-2000:]


# ---- class 5: every command takes the tracking URI the same way ----

STUDY = REPO / "experiments" / "studies" / "ch09-bf16.yaml"


COMMANDS = [["study", "run", str(STUDY)], ["report", "abc"], ["reproduce", "abc"],
            ["bench", "collectives"], ["train", QUICKSTART]]
BAD_URIS = [
    ("garbage://x", "use a tracking server"),
    ("runs/mlflow.db", "use a tracking server (http://host:5000) or a store URI with one of the "
     "schemes http, https, sqlite, postgresql, mysql, mssql, file, databricks, databricks-uc, uc; "
     "for this SQLite file: sqlite:///runs/mlflow.db"),
    ("sqlite://", "an in-memory SQLite store vanishes"),
    # (two slashes short, or one: SQLAlchemy's parse error and 70-100 lines of traceback)
    ("sqlite:/tmp/runs.db", "a SQLite store is sqlite:/// then its path: sqlite:///relative/"
     "mlflow.db, sqlite:////absolute/mlflow.db; for the file /tmp/runs.db: sqlite:////tmp/runs.db"),
    ("sqlite://runs.db", "a SQLite store is sqlite:/// then its path: sqlite:///relative/"
     "mlflow.db, sqlite:////absolute/mlflow.db; for runs.db here: sqlite:///runs.db, for "
     "/runs.db: sqlite:////runs.db"),
    ("file:///tmp/nowhere-mlruns", "MLflow 3 refuses the file store"),
    ("http://[::1", "not a URL (Invalid IPv6 URL): http://host:5000"),  # (it passed, a hostile
    ("http://mlflow:port", "not a URL (Port could not be cast"),  # pass: unreachable, in the ranks)
    ("postgresql://u:p@127.0.0.1/db", "postgresql needs its driver"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_bad_tracking_uri_is_one_line_for_every_command(tmp_path, command):
    """The real program, once per command, with the URI that holds a password: exit 2, one
    line, the password masked. The other bad URIs: the test below, in-process."""
    from ddplab.logins import mask

    uri, says = BAD_URIS[-1]
    out = ddplab(command, tmp_path, uri, timeout=120)
    # A password in the URI is shown masked (postgresql://u:***@...), never as given.
    one_line(out, 2, f"MLFLOW_TRACKING_URI: got {mask(uri)!r}; {says}")
    assert ":p@" not in out.stdout + out.stderr


@pytest.mark.parametrize("uri, says", BAD_URIS[:-1], ids=[u for u, _ in BAD_URIS[:-1]])
def test_every_command_names_each_bad_tracking_uri_in_one_line(tmp_path, monkeypatch, capsys,
                                                               uri, says):
    """Every command x every other bad URI through the CLI's main, in-process (a real process
    each cost ~2-6 s of CPU; the test above runs the real program once per command)."""
    from ddplab import cli

    for name in list(os.environ):
        if name.startswith(("MLFLOW_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "OMPI_", "PMI_",
                            "SLURM_", "PET_", "TORCHELASTIC", "DDPLAB_SET")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for command in COMMANDS:
        code = cli.main(list(command))
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.strip() and "Warning" not in x
                 and not x.startswith(("  ", "[ddplab] checks: still "))]
        assert code == 2 and "Traceback" not in err, (command, err[-2000:])
        assert len(lines) == 1 and f"MLFLOW_TRACKING_URI: got {uri!r}; {says}" in lines[0], (
            command, err[-2000:])
    assert not list(tmp_path.iterdir())  # no store, no checkpoints, no results


def test_sync_checks_its_tracking_uri_too(tmp_path):
    out = ddplab(["sync", str(tmp_path), "--tracking-uri", "garbage://x"], tmp_path, "")
    one_line(out, 2, "--tracking-uri: got 'garbage://x'")


def test_bench_refuses_an_endless_timeout(tmp_path, store):
    one_line(ddplab(["bench", "collectives", "--timeout", "inf"], tmp_path, store), 2,
             "--timeout: got inf")


def test_a_run_id_that_names_no_run_is_one_line_and_no_run(tmp_path, store):
    out = ddplab(["train", QUICKSTART, *QUICK], tmp_path, store, MLFLOW_RUN_ID="0123abcd")
    one_line(out, 2, "MLFLOW_RUN_ID: got '0123abcd'; no such run")
    assert runs(store) == []


def test_two_jobs_started_together_on_a_fresh_store_both_finish(tmp_path, store):
    """...and `ddplab report` of one of them, no study's parent, is bad input."""
    args = [str(BIN / "ddplab"), "train", QUICKSTART, *QUICK, "--set", "train.max_steps=2"]
    procs = [subprocess.Popen([*args, "--set", f"checkpoint.dir={tmp_path / f'ck{i}'}"],
                              cwd=tmp_path, env=job_env(store), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for i in range(2)]
    outs = wait_all(procs, timeout=300)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-1500:] for o in outs)
    finished = runs(store)
    assert sorted(r.info.status for r in finished) == ["FINISHED", "FINISHED"]
    # `ddplab report` of a run that is no study's parent: bad input, one line.
    one_line(ddplab(["report", finished[0].info.run_id], tmp_path, store), 2,
             "is not a study's parent run")


def test_a_checkpoint_dir_that_cannot_be_written_is_one_line(tmp_path, store):
    out = ddplab(["train", QUICKSTART, "--set", "checkpoint.dir=/proc/ddplab-ck"], tmp_path, store)
    one_line(out, 2, "checkpoint.dir: got '/proc/ddplab-ck'; cannot write there")
    assert runs(store) == []


# ---- classes 1, 4, 6: sync with what crashed jobs and wrong stores leave ----

def make_spool(root: Path, store: str, lines: list[bytes], closed: bool = True) -> tuple[Path, str]:
    """A spool as a job leaves it: a run in ``store`` and these raw lines."""
    from mlflow import MlflowClient

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("x") or client.get_experiment(client.create_experiment("x"))
    run_id = client.create_run(exp.experiment_id).info.run_id
    d = spool.spool_dir(root, run_id, 0)
    spool.Meta(store, run_id, exp.experiment_id).write(d)
    (d / "records.jsonl").write_bytes(b"".join(lines))
    if closed:
        (d / spool.CLOSED).write_text("1")
    return d, run_id


def log(step: int) -> bytes:
    return json.dumps({"op": "log", "ts": 1000 + step, "step": step,
                       "metrics": {"loss": 1.0 / (step + 1)}}).encode() + b"\n"


def test_sync_sets_aside_what_is_no_record_counts_it_and_goes_on(tmp_path, store):
    from mlflow import MlflowClient

    end = b'{"op": "end", "ts": 5, "status": "FINISHED"}\n'
    bad, bad_id = make_spool(tmp_path / "a", store,
                             [log(0), b'{"op": "nonsense"}\n', b"[1, 2]\n", log(1), end])
    good, good_id = make_spool(tmp_path / "b", store, [log(0), log(1)])
    out = ddplab(["sync", str(tmp_path)], tmp_path, store)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "2 records set aside" in out.stderr and "Traceback" not in out.stderr
    c = MlflowClient(store)
    assert [m.step for m in c.get_metric_history(bad_id, "loss")] == [0, 1]
    assert [m.step for m in c.get_metric_history(good_id, "loss")] == [0, 1]  # the next spool too
    assert c.get_run(bad_id).info.status == "FINISHED"
    assert len((bad / spool.REJECTED).read_text().splitlines()) == 2


def test_a_torn_last_line_does_not_leave_the_run_running(tmp_path, store):
    from mlflow import MlflowClient

    d, run_id = make_spool(tmp_path, store, [log(0), log(1), b'{"op": "end", "ts": 9, "sta'])
    out = ddplab(["sync", str(tmp_path)], tmp_path, store)
    assert out.returncode == 1 and "ended it FAILED" in out.stdout, out.stdout + out.stderr
    run = MlflowClient(store).get_run(run_id)
    assert run.info.status == "FAILED" and "without recording its end" in run.data.tags["ddplab.error"]
    again = ddplab(["sync", str(tmp_path)], tmp_path, store)
    assert "up to date" in again.stdout and MlflowClient(store).get_run(run_id).info.status == "FAILED"


def test_sync_to_a_store_without_the_run_delivers_nothing_and_says_so(tmp_path, store):
    d, _ = make_spool(tmp_path, store, [log(0)])
    other = f"sqlite:///{tmp_path / 'other.db'}"
    out = ddplab(["sync", str(tmp_path), "--tracking-uri", other], tmp_path, store)
    assert out.returncode == 1 and "has no run" in out.stderr, out.stdout + out.stderr
    assert "delivered" not in out.stdout and spool.left_in(d) == 1


# ---- class 1: a proxy that refuses for a while ----

class RefusingProxy:
    """127.0.0.1 proxy to a real server; from the job's first log-batch on, it answers the
    log-batches with ``statuses`` in turn, ``each`` times per status (a proxy or an auth layer
    having a bad spell), then forwards them again; everything else is forwarded throughout. The
    spell is counted in refusals, not seconds: the delivery's back-off (up to 10 s between sends
    while the job runs) and a loaded machine's slow job would let a clock's window end before
    its second status was ever served."""

    def __init__(self, upstream_port: int, statuses: tuple[int, ...] = (403,), each: int = 2) -> None:
        self.statuses, self.each = statuses, each
        self.refused: dict[int, int] = dict.fromkeys(statuses, 0)
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                # One status after the other (not alternating: a record refused with one is
                # retried alone and would meet the other, hiding how each is treated).
                status = next((s for s in outer.statuses if outer.refused[s] < outer.each), None)
                if "log-batch" in self.path and status is not None:
                    outer.refused[status] += 1
                    self.send_response(status)
                    # As each says it: an auth layer's JSON 403 (MLflow reads its error code), a
                    # proxy's HTML 404 (MLflow falls back on the HTTP status: a JSON body would
                    # be read as the 403 its error code names, testing nothing of 404).
                    payload = (b'{"error_code": "PERMISSION_DENIED", "message": "refused"}'
                               if status == 403 else b"<html><body>404 Not Found</body></html>")
                    self.send_header("Content-Type", "application/json" if status == 403
                                     else "text/html")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                _relay(self, upstream_port, body)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _any  # noqa: N815

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def _relay(handler: http.server.BaseHTTPRequestHandler, upstream_port: int, body: bytes,
           answer: bool = True) -> None:
    """The request to the real server, and (``answer``) its answer back to the client; without
    one, the connection closes unanswered: the server did the work, the client never hears."""
    conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
    headers = {k: v for k, v in handler.headers.items() if k.lower() != "host"}
    headers["Host"] = f"127.0.0.1:{upstream_port}"
    conn.request(handler.command, handler.path, body=body or None, headers=headers)
    r = conn.getresponse()
    data = r.read()
    if not answer:
        handler.close_connection = True
        return
    handler.send_response(r.status)
    for k, v in r.getheaders():
        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
            handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def test_a_lost_answer_to_a_runs_creation_leaves_one_run_not_a_running_twin(tmp_path):
    """The server made the run, its answer never came, and MLflow's client sent the create
    again (it retries every request): two runs of one job, the unanswered one RUNNING for ever,
    with nothing in it. A real server behind a proxy that swallows the first create's answer."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    from ddplab.tracking import life

    server = Server(tmp_path)
    server.start()
    creates: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _any(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            first = "runs/create" in self.path and not creates
            if "runs/create" in self.path:
                creates.append(self.path)
            _relay(self, server.port, body, answer=not first)

        do_GET = do_POST = _any  # noqa: N815

        def log_message(self, *a):
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        client = MlflowClient(f"http://127.0.0.1:{proxy.server_port}")
        exp = client.create_experiment("lost-answer")
        run = life.create(client, exp, "the job")
    finally:
        proxy.shutdown()
    assert len(creates) >= 2, f"the client did not send the create again: {creates}"
    direct = server.client()
    alive = direct.search_runs([exp])
    assert [r.info.run_id for r in alive] == [run.info.run_id], alive
    assert alive[0].info.status == "RUNNING"  # the job's own, still to end
    everything = direct.search_runs([exp], run_view_type=ViewType.ALL)  # the deleted twin too
    twins = [r for r in everything if r.info.run_id != run.info.run_id]
    assert twins and all(r.info.status == "FAILED" for r in twins), everything
    server.kill()


def test_a_refusal_window_mid_job_loses_no_metric_param_or_tag(tmp_path):
    """403, then 404, in one job: both are refusals the job must outlast (one job, not a job per
    status: each cost ~45 s of CI)."""
    server = Server(tmp_path)
    server.start()
    proxy = RefusingProxy(server.port, (403, 404))
    try:
        args = [QUICKSTART, *QUICK, "--set", "train.epochs=4", "--set", "train.log_every=2",
                "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set", "tracking.delivery_timeout_s=60"]
        job = subprocess.Popen([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m",
                                "ddplab", "train", *args], cwd=tmp_path, env=job_env(proxy.uri),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = job.communicate(timeout=300)
    finally:
        proxy.close()
    assert job.returncode == 0, out[-3000:]
    assert all(proxy.refused.values()), f"the window refused {proxy.refused}: the test did not test"
    client = server.client()
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    losses = sorted((m.step, round(m.value, 4)) for m in history)
    assert losses == sorted((s, round(v, 4)) for s, v in printed_losses(out).items())
    from ddplab.config import load

    cfg = load(QUICKSTART, [a for a in args if "=" in a and not a.startswith("/")])
    assert set(cfg.flat()) <= set(run.data.params)
    assert run.data.tags["ddplab.world_size"] == "2" and run.info.status == "FINISHED"
    assert not list((tmp_path / "ck").rglob(spool.REJECTED))
    server.kill()


# ---- class 3: a full disk ----

@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_full_disk_ends_the_run_failed_with_its_reason_and_leaves_no_partial_file(tmp_path, store):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(small)], check=True)
    try:
        out = subprocess.run(
            [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "-m", "ddplab", "train",
             QUICKSTART, *QUICK, "--set", f"checkpoint.dir={small / 'ck'}",
             "--set", "tracking.delivery_timeout_s=5"],
            cwd=tmp_path, env=job_env(store), capture_output=True, text=True, timeout=300)
        leftovers = list(small.rglob("*.tmp"))
    finally:
        subprocess.run(["umount", str(small)], check=False)
    assert out.returncode != 0
    assert "No space left on device" in out.stderr and "[rank0]: Traceback" not in out.stderr
    (run,) = runs(store)
    assert run.info.status == "FAILED" and "No space left on device" in run.data.tags["ddplab.error"]
    assert leftovers == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_checkpoint_folder_full_at_the_start_is_one_line_and_the_runs_error(tmp_path, store):
    """Out of inodes before the first step (the spool's meta could not be written): a
    traceback on the console, and the run's error only "see the job's console" (a hostile
    pass). One line, exit 1, and the run FAILED with the reason."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=6", "tmpfs", str(small)],
                   check=True)
    try:
        out = subprocess.run([str(BIN / "ddplab"), "train", QUICKSTART, *QUICK, "--set",
                              f"checkpoint.dir={small / 'ck'}"], cwd=tmp_path, env=job_env(store),
                             capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["umount", str(small)], check=False)
    said = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in said, said[-4000:]
    assert f"ddplab: error: checkpoint.dir {small / 'ck'}: No space left on device (" in said, said
    (run,) = runs(store)
    assert run.info.status == "FAILED", run.info
    assert run.data.tags["ddplab.error"].startswith(f"checkpoint.dir {small / 'ck'}: No space left")


FILLED = """
import subprocess, sys
from ddplab.tracking.store import open_client
client = open_client(sys.argv[1])
run = client.create_run(client.create_experiment("e")).info.run_id
subprocess.run(["dd", "if=/dev/zero", f"of={sys.argv[2]}", "bs=4k"], capture_output=True)
try:
    for i in range(2000):
        client.log_metric(run, "m" * 200 + str(i), float(i), step=i)
except Exception as e:
    print("raised:", str(e))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_store_on_a_full_disk_is_one_line_not_pages_of_tracebacks(tmp_path, store):
    """A hostile pass: the store's disk full when the run is opened gave 357 lines, 9
    tracebacks (MLflow's log of each SQLAlchemy error, the delivery's answer, rank 0's "unexpected
    RuntimeError", rank 1 quoting them), and a last line that named SQLAlchemy's autoflush note
    instead of the full disk; filled later, MLflow logged a traceback at each of the delivery's
    tries. Now one line a rank, what to do in it; MLflow's raise is ddplab's to say."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(small)], check=True)
    try:
        out = subprocess.run(
            [str(BIN / "ddplab"), "run", "--nproc-per-node", "2", QUICKSTART, *QUICK],
            cwd=tmp_path, env=job_env(f"sqlite:///{small / 'mlflow.db'}"), capture_output=True,
            text=True, timeout=300)
        subprocess.run(["umount", str(small)], check=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)], check=True)
        later = subprocess.run([sys.executable, "-c", FILLED, f"sqlite:///{small / 'mlflow.db'}",
                                str(small / "filler")], capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["umount", str(small)], check=False)
    said = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in said, said[-4000:]
    full = f"cannot be written: database or disk is full (SQLite); free space on {small}"
    # rank 1's line of rank 0's failure, the job's last line (rank 0's whichever rank ended
    # first), and rank 0's own line, unless torchrun stopped rank 0 first: rank 1, passing
    # rank 0's failure on, may end first while rank 0 ends its run (CI saw both)
    assert said.count(full) in (2, 3) and "[rank 1] ddplab: error: rank 0 failed" in said, \
        said[-4000:]
    last = said.strip().splitlines()[-1]
    assert last.startswith("ddplab: error: rank 0 failed") and full in last, said[-4000:]
    assert "raised:" in later.stdout and "database or disk is full" in later.stdout, later
    assert "SQLAlchemy database error" not in later.stderr, later.stderr[-3000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only mount needs root (CI runs as root)")
def test_a_store_on_a_read_only_mount_is_refused_before_the_ranks_start_in_one_line(tmp_path):
    """A hostile pass: a SQLite store on a read-only mount failed once the run was opened, on
    rank 0, after the ranks had started: exit 1 and four tracebacks ("attempt to write a
    readonly database"). Refused before any rank, as bad input: one line, exit 2."""
    folder = tmp_path / "ro"
    folder.mkdir()
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    subprocess.run([sys.executable, "-c", "import sys\nfrom ddplab.tracking.store import open_client"
                    "\nopen_client(sys.argv[1]).search_experiments()", uri], check=True,
                   capture_output=True, timeout=120)
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
        out = subprocess.run([str(BIN / "ddplab"), "run", "--nproc-per-node", "2", QUICKSTART, *QUICK],
                             cwd=tmp_path, env=job_env(uri), capture_output=True, text=True,
                             timeout=300)
    finally:
        subprocess.run(["umount", str(folder)], check=False)
    said = (out.stdout + out.stderr).strip()
    assert out.returncode == 2 and "Traceback" not in said, said[-4000:]
    assert said.splitlines()[-1].startswith("ddplab: error: the MLflow store "), said[-4000:]
    assert f"cannot be written: {folder / 'mlflow.db'} is read-only here" in said, said[-4000:]
    assert "[rank" not in said, said[-4000:]  # no rank started


# ---- classes 2, 4, 6: studies ----

TINY = {"data.train_samples": 256, "data.eval_samples": 128, "train.epochs": 1,
        "tracking.system_metrics": False}


def tiny_study(tmp_path: Path, **fields) -> Path:
    study = {"name": "hostile", "experiment": QUICKSTART, "set": TINY, "repeats": 1,
             "variants": [{"name": "one", "nproc": 1}, {"name": "two", "nproc": 2}], **fields}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


def study_runs(store: str) -> list:
    return [r for r in runs(store) if r.data.tags.get("ddplab.study_role") == "job"]


def test_a_study_rerun_with_other_settings_refuses_and_fresh_starts_anew(tmp_path, store):
    """One study for both: its strings stay strings (a YAML-looking "speed: fast" is not read
    back as a mapping), a rerun with other settings is refused, a bad DDPLAB_SET names itself,
    and --fresh starts anew."""
    path = tiny_study(tmp_path, variants=[{"name": "one", "nproc": 1}],
                      set={**TINY, "description": "speed: fast", "train.max_steps": 2})
    first = ddplab(["study", "run", str(path)], tmp_path, store)
    assert first.returncode == 0, first.stderr[-2000:]
    (child,) = study_runs(store)
    assert child.data.params["description"] == "speed: fast"  # not read back as a mapping
    changed = ddplab(["study", "run", str(path), "--set", "optim.lr=0.5"], tmp_path, store)
    one_line(changed, 2, "the study's set changed since its parent run")
    bad = ddplab(["study", "run", str(path), "--fresh"], tmp_path, store, DDPLAB_SET="train.epochs=x")
    one_line(bad, 2, "DDPLAB_SET 'train.epochs=x': train.epochs: got 'x'")
    fresh = ddplab(["study", "run", str(path), "--set", "optim.lr=0.5", "--fresh"], tmp_path, store)
    assert fresh.returncode == 0 and "already FINISHED" not in fresh.stdout, fresh.stderr[-2000:]
    assert sorted(r.data.params["optim.lr"] for r in study_runs(store)) == ["0.01", "0.5"]


def test_a_study_rerun_after_its_script_was_edited_refuses_to_mix_the_two(tmp_path, store):
    """A hostile pass: a study whose experiment file names a script (``script.path``) skipped
    its FINISHED job after the script was edited and compared it with new jobs of the edited
    script, unsaid. Only the experiment file itself was in the settings' digest."""
    (tmp_path / "grid.py").write_text("print('lr', 0.1)\n")
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump({"name": "grid", "script": {"path": "grid.py"}}))
    path = tiny_study(tmp_path, experiment="exp.yaml", set={}, variants=[{"name": "one", "nproc": 1}])
    first = ddplab(["study", "run", str(path)], tmp_path, store)
    assert first.returncode == 0, first.stderr[-2000:]
    again = ddplab(["study", "run", str(path)], tmp_path, store)
    assert again.returncode == 0 and "already FINISHED" in again.stdout, again.stderr[-2000:]
    (tmp_path / "grid.py").write_text("print('lr', 0.5)\n")
    one_line(ddplab(["study", "run", str(path)], tmp_path, store), 2,
             "the study's scripts changed since its parent run")
    assert len(study_runs(store)) == 1


def test_a_studys_settings_hold_its_own_modules_by_content_not_an_installed_librarys(tmp_path):
    """The loop's counterpart of the script above: a model module beside the experiment file
    (``mymodel:build``), edited, is another study; torchvision's is the environment's."""
    from ddplab.study import runner, spec

    (tmp_path / "mymodel.py").write_text("def build(**kw):\n    raise NotImplementedError\n")
    exp = yaml.safe_load(Path(QUICKSTART).read_text())
    exp["model"] = {"name": "mymodel:build"}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(exp))
    path = tiny_study(tmp_path, experiment="exp.yaml", variants=[
        {"name": "mine", "nproc": 1},
        {"name": "theirs", "nproc": 1, "set": {"model.name": "torchvision.models:resnet18"}}])
    before = runner.settings_digest(spec.load_study(path))
    (tmp_path / "mymodel.py").write_text("def build(**kw):\n    raise ValueError\n")
    after = runner.settings_digest(spec.load_study(path))
    assert [k for k in before if before[k] != after[k]] == ["modules"], (before, after)
    theirs = runner.settings_digest(spec.load_study(tiny_study(tmp_path, experiment="exp.yaml", variants=[
        {"name": "theirs", "nproc": 1, "set": {"model.name": "torchvision.models:resnet18"}}])))
    none = runner.settings_digest(spec.load_study(tiny_study(tmp_path)))["modules"]  # quickstart's
    assert theirs["modules"] == none != after["modules"]


def test_a_study_variant_that_cannot_run_here_stops_it_before_any_run(tmp_path, store):
    path = tiny_study(tmp_path, variants=[{"name": "one", "nproc": 1},
                                          {"name": "half", "nproc": 1, "set": {"train.amp": "fp16"}}])
    one_line(ddplab(["study", "run", str(path)], tmp_path, store), 2,
             "variant half: train.amp: got 'fp16'; fp16 needs a CUDA device")
    assert runs(store) == []


def test_a_page_of_a_study_still_running_is_refused(tmp_path, store):
    """`report --page` of a RUNNING study wrote a stamped page of "0/1" without a word."""
    from mlflow import MlflowClient

    client = MlflowClient(store)
    exp = client.create_experiment("running-study")
    parent = client.create_run(exp, tags={"ddplab.study_role": "parent"}).info.run_id
    out = ddplab(["report", parent, "--page", "running-study"], tmp_path, store)
    one_line(out, 2, f"--page: study run {parent} is still RUNNING")
    assert not list(tmp_path.rglob("running-study.md"))


def test_a_study_whose_server_dies_stops_with_one_line_and_a_rerun_leaves_nothing_running(tmp_path):
    server = Server(tmp_path)
    server.start()
    # The server dies as the first job's training starts (its spool appears); the job keeps
    # its records in the spool and gives up on delivering after 5 s instead of 60, and so does
    # the study's parent (the study's set reaches it too).
    # One variant: the rerun's point is the killed job's run (a second variant only added a job);
    # of one rank: nothing here is about several ranks (a second rank only added a process).
    path = tiny_study(tmp_path, set={**TINY, "train.epochs": 6, "tracking.delivery_timeout_s": 5},
                      variants=[{"name": "one", "nproc": 1}])
    proc = subprocess.Popen([str(BIN / "ddplab"), "study", "run", str(path)], cwd=tmp_path,
                            env=job_env(server.uri), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "checkpoints").rglob("records.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    server.kill()
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=600)
    assert time.monotonic() - t0 < 300, "the study hung on the dead server"
    assert proc.returncode == 1 and "stopped answering" in err and "Traceback" not in err, err[-3000:]
    # The parent's own records (its end among them) wait in its spool, and the study says so.
    (kept,) = (tmp_path / "checkpoints" / "studies").rglob("parent-*/spool/run/records.jsonl")
    assert '"op":"end"' in kept.read_text() and "ddplab sync" in out + err, out[-2000:]
    server.start()
    again = subprocess.run([str(BIN / "ddplab"), "study", "run", str(path)], cwd=tmp_path,
                           env=job_env(server.uri), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    client = server.client()
    every = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r for r in every if r.info.status == "RUNNING"] == []
    finished = {r.data.tags.get("ddplab.variant") for r in every if r.info.status == "FINISHED"
                and r.data.tags.get("ddplab.study_role") == "job"}
    assert finished == {"one"}
    # The rerun sent what the first left, then ended the parent itself: nothing is kept.
    assert not list((tmp_path / "checkpoints" / "studies").rglob("parent-*"))
    (parent,) = [r for r in every if r.data.tags.get("ddplab.study_role") == "parent"]
    assert parent.info.status == "FINISHED" and parent.data.tags.get("ddplab.study.verdict")
    server.kill()


def test_a_study_killed_while_a_job_starts_leaves_nothing_running_after_the_rerun(tmp_path, store):
    import signal

    path = tiny_study(tmp_path, variants=[{"name": "one", "nproc": 1}])
    runs(store)  # the store's tables first
    proc = subprocess.Popen([str(BIN / "ddplab"), "study", "run", str(path)], cwd=tmp_path,
                            env=job_env(store), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not study_runs(store):  # the child run exists; its job is only starting
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(5)
    again = ddplab(["study", "run", str(path)], tmp_path, store, timeout=600)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    every = runs(store)
    assert [r.info.status for r in every if r.info.status == "RUNNING"] == []
    assert "FINISHED" in [r.info.status for r in study_runs(store)]
