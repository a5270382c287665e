"""Issue 53, item 6: ``ddplab diagnose`` and the commands that open the store, on hostile input.
A forensics tag cut mid-JSON or with a field missing, extra or mistyped; a store one MLflow
schema behind (or ahead); a file at the store's path that is no SQLite database. Each is one
line, never a traceback. In-process (cli.main) on tmp stores: no job runs."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddplab import cli
from ddplab.agent import postmortem
from ddplab.forensics.watch import CUT, TAG_LIMIT, Ending, from_json, to_json
from ddplab.tracking import spool

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")
TRACEBACK = "ValueError: bad sample 17\n\nTraceback (most recent call last):\n" + "".join(
    f'  File "/home/u/project/train_{i}.py", line {i}, in step_{i}\n    loss = model(x)\n'
    for i in range(400))


def lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.strip()]


def one_line(err: str, says: str) -> None:
    assert "Traceback" not in err, err
    assert len(lines(err)) == 1 and says in err, err


def two_rank_failure(detail: str = TRACEBACK) -> list[Ending]:
    return [Ending(1, 7, "forward", 100.0, "failed", detail, "h1"),
            Ending(0, 7, "backward", 101.0, "failed", "DistBackendError: Connection closed by peer\n"
                   + detail, "h0")]


def watch_of(endings: list[Ending]) -> type:
    """A node's watch after the job (the delivery process's view): these endings, no files."""

    class Watch:
        hang_after_s = 300.0

        def endings(self) -> list[Ending]:
            return endings

        def files(self) -> list[Path]:
            return []

        def still_running(self) -> list[Ending]:
            return []

    return Watch


@pytest.fixture
def run_in(store: str, monkeypatch: pytest.MonkeyPatch):
    """A FAILED run in a fresh store the environment names; its client and id."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("x")).info.run_id
    client.set_terminated(run_id, "FAILED")
    client.set_tag(run_id, "ddplab.error", "ValueError: bad sample 17")
    return client, run_id


# ---- the forensics tag: written whole, read robustly ----

def test_a_long_errors_tag_is_whole_json_within_the_limit_its_first_lines_kept():
    endings = two_rank_failure()
    assert len(json.dumps([e.__dict__ for e in endings])) > 2 * TAG_LIMIT
    text = to_json(endings)
    assert len(text) <= TAG_LIMIT
    back = from_json(text)  # valid JSON, every field
    assert [(e.rank, e.step, e.phase, e.what, e.host) for e in back] == \
        [(e.rank, e.step, e.phase, e.what, e.host) for e in endings]
    for was, now in zip(endings, back, strict=True):
        assert now.detail.endswith(CUT) and was.detail.startswith(now.detail.removesuffix(CUT))
        assert now.detail.splitlines()[0] == was.detail.splitlines()[0]
        assert len(now.detail) > 2000  # cut only as much as needed
    short = [Ending(0, 1, "forward", 1.0, "failed", "short")]
    assert to_json(short) == json.dumps([short[0].__dict__])  # what fits is as it was
    many = [Ending(r, 3, "forward", 1.0, "done" if r % 3 else "failed", "x" * 500, "host")
            for r in range(200)]
    text = to_json(many)
    assert len(text) <= TAG_LIMIT and all(e.what == "failed" for e in from_json(text)[:60])


def test_the_delivery_records_the_tag_whole():
    class Client:
        tags: dict[str, str] = {}

        def set_tag(self, run_id: str, key: str, value: str) -> None:
            self.tags[key] = value

    Watch = watch_of(two_rank_failure())
    client = Client()
    postmortem.record(client, "r", Watch(), "node1", 2, holds_rank0=False)  # type: ignore[arg-type]
    text = client.tags["ddplab.forensics.node1"]
    assert len(text) <= TAG_LIMIT and len(from_json(text)) == 2
    # A restarted attempt took the run over (torchrun --max-restarts): this attempt's endings
    # stay off the run it goes on with.
    taken = Client()
    taken.tags = {}
    assert postmortem.record(taken, "r", Watch(), "node0", 2, holds_rank0=True,  # type: ignore[arg-type]
                             superseded=lambda: True) == ""
    assert taken.tags == {}


def test_when_the_verdict_appears_the_runs_error_names_the_cause_already(run_in):
    """Rank 0 ended the run FAILED with what it saw; the verdict names rank 1. Whoever reads the
    run as soon as ddplab.verdict is there (a user, a test, a study) finds ddplab.error naming
    rank 1 already, rank 0's own error beside it: the verdict is written last."""
    client, run_id = run_in
    client.set_tag(run_id, "ddplab.error", "DistBackendError: Connection closed by peer")
    seen: dict[str, str] = {}
    set_tag = client.set_tag

    def spy(run: str, key: str, value: str) -> None:
        if key == "ddplab.verdict":
            seen.update(client.get_run(run).data.tags)  # the run as a reader finds it then
        set_tag(run, key, value)

    Watch = watch_of(two_rank_failure("ValueError: bad sample 17"))
    client.set_tag = spy
    line = postmortem.record(client, run_id, Watch(), "node0", 2,  # type: ignore[arg-type]
                             holds_rank0=True)
    assert line.startswith("rank 1 (host h1) failed (ValueError: bad sample 17) at step 7"), line
    assert seen["ddplab.error"] == line, seen
    assert seen["ddplab.error.rank0"] == "DistBackendError: Connection closed by peer", seen
    assert client.get_run(run_id).data.tags["ddplab.verdict"] == line


def test_a_postmortem_the_server_did_not_take_is_kept_and_delivered_once_later(run_in, tmp_path,
                                                                            monkeypatch):
    """The server down at the job's end: the node's endings, files and the verdict stay in its
    spool (postmortem.json) and deliver_kept (what `ddplab sync` runs) puts them in the run;
    one an attempt started after (its meta.json newer) took the run over from is dropped."""
    from mlflow import MlflowClient

    client, run_id = run_in
    monkeypatch.setattr(postmortem, "WAIT_FOR_NODES_S", 0.0)
    stack = tmp_path / "rank-1.stack.txt"
    stack.write_text("File faulty.py, line 42")
    (tmp_path / "meta.json").write_text("{}")

    class OnFile(watch_of(two_rank_failure("ValueError: bad sample 17"))):  # type: ignore[misc]
        def files(self) -> list[Path]:
            return [stack]

    down = MlflowClient("http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    line = postmortem.record(down, run_id, OnFile(), "node0", 2, holds_rank0=True, keep=tmp_path)
    assert line.startswith("rank 1 (host h1) failed (ValueError: bad sample 17)"), line
    kept = tmp_path / postmortem.KEPT
    assert kept.is_file() and postmortem.deliver_kept(down, run_id, tmp_path) != ""
    assert kept.is_file() and "ddplab.verdict" not in client.get_run(run_id).data.tags
    assert postmortem.deliver_kept(client, run_id, tmp_path) == "" and not kept.exists()
    tags = client.get_run(run_id).data.tags
    assert tags["ddplab.verdict"] == line == tags["ddplab.error"], tags
    assert tags["ddplab.error.rank0"] == "ValueError: bad sample 17"  # rank 0's own, beside it
    assert len(from_json(tags["ddplab.forensics.node0"])) == 2
    assert [a.path for a in client.list_artifacts(run_id, "forensics/node0")] == \
        ["forensics/node0/rank-1.stack.txt"]
    # kept, then a restarted attempt attached to the run: its end is its own
    postmortem.record(down, run_id, OnFile(), "node0", 2, holds_rank0=True, keep=tmp_path)
    client.set_tag(run_id, "ddplab.verdict", "the restarted attempt's")
    os.utime(tmp_path / "meta.json", (time.time() + 5, time.time() + 5))
    assert postmortem.deliver_kept(client, run_id, tmp_path) == "" and not kept.exists()
    assert client.get_run(run_id).data.tags["ddplab.verdict"] == "the restarted attempt's"


def test_a_rank_still_blocked_beside_a_failed_rank_0_is_not_a_lost_node(run_in, tmp_path):
    """A hostile pass: rank 0's checkpoint hit a full disk; rank 1, on the same node, alive and
    blocked in its all-reduce until the launcher stopped it, read "rank 1 reported nothing
    (their node lost?)" in the verdict (taken as rank 0 ended, before rank 1's error came). A
    real heartbeat of each, rank 1's in a process of its own."""
    from ddplab.forensics import heartbeat
    from ddplab.forensics.watch import Watch

    client, run_id = run_in
    blocked = beating_rank(tmp_path, 1, 2, "backward", 51)
    try:
        rank0 = heartbeat.Heartbeat(tmp_path, 0, 2)
        rank0.beat("checkpoint", 50)
        rank0.failed("CheckpointError: could not write step-50.pt: No space left on device")
        t0 = time.monotonic()
        line = postmortem.record(client, run_id, Watch(tmp_path, 300.0, "h"), "node0", 2,
                                 holds_rank0=True)
        assert time.monotonic() - t0 < postmortem.WAIT_FOR_NODES_S  # no wait for a lost node
    finally:
        blocked.kill()
        blocked.wait()
    assert line == ("rank 0 (host h) failed (CheckpointError: could not write step-50.pt: No space "
                    "left on device) at step 50 in checkpoint; rank 1 stopped after it"), line


def test_a_live_rank_is_one_that_maps_its_heartbeat_not_a_pid_reused_since(tmp_path):
    """What refuses a resume of a running job's run (agent/protocol.refuse_a_running_job): a
    rank alive on this host with its heartbeat mapped. A live process that only has the
    heartbeat's pid (reused since its rank ended) is no such rank."""
    from ddplab.forensics.heartbeat import RECORD, hb_path
    from ddplab.forensics.watch import live_in

    rank = beating_rank(tmp_path, 1, 2, "forward", 3)
    other = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); "
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "up\n"
        found = live_in(tmp_path)
        assert found is not None and (found.rank, found.pid) == (1, rank.pid)
        reused = bytearray(hb_path(tmp_path, 1).read_bytes())
        step, t, phase, _, r, world = RECORD.unpack_from(reused)
        RECORD.pack_into(reused, 0, step, t, phase, other.pid, r, world)
        hb_path(tmp_path, 1).unlink()  # a new file: the rank's mapping is of the old one
        hb_path(tmp_path, 1).write_bytes(bytes(reused))
        assert live_in(tmp_path) is None
    finally:
        for p in (rank, other):
            p.kill()
            p.wait()


def test_the_preflight_checks_the_run_a_named_folder_resumes_one_level_down(tmp_path):
    """`ddplab run --set checkpoint.resume=checkpoints/<experiment>` resumes the newest run in
    it; the preflight (checkpoint.not_running) checked the folder itself, found no spool there,
    and let a second job start on a live run, refused only later on rank 0."""
    from ddplab.agent.protocol import forensics_dir
    from ddplab.config import ConfigError
    from ddplab.training import checkpoint

    experiment = tmp_path / "quickstart"
    run = experiment / "run1"
    run.mkdir(parents=True)
    import torch

    # (the preflight reads what a checkpoint is, not its tensors: a file that is not one is
    # refused there too, test_checkpoint.py)
    torch.save({k: None for k in checkpoint.REQUIRED}, run / "step-00000004.pt")
    rank = beating_rank(forensics_dir(run / "spool" / "node0"), 0, 1, "forward", 3)
    try:
        for named in (experiment, run, run / "step-00000004.pt"):
            with pytest.raises(ConfigError, match=f"still running on this host .*pid {rank.pid}"):
                checkpoint.not_running(str(named), tmp_path)
    finally:
        rank.kill()
        rank.wait()
    checkpoint.not_running(str(experiment), tmp_path)  # its job ended: resumable


def test_two_jobs_resuming_one_run_at_once_the_second_is_refused_while_the_first_lives(tmp_path):
    """Two identical reruns started together both passed the live-rank check (neither's rank
    had a heartbeat yet), and the second attached to the run the first was taking (a hostile
    pass, 3 of 3). The rank 0 that takes a run locks its folder for its process's life; a job's
    end lets it go (release_runs), and so does its process's death."""
    from ddplab.agent import protocol
    from ddplab.config import ConfigError

    run = tmp_path / "run1"
    run.mkdir()
    code = ("import sys, time\nfrom pathlib import Path\nfrom ddplab.agent import protocol\n"
            "protocol.refuse_a_running_job(Path(sys.argv[1]), 'x', hold=True)\n"
            "print('held', flush=True)\ntime.sleep(60)\n")
    first = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert first.stdout is not None and first.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match="a job starting or running on this host .*resume.lock"):
            protocol.refuse_a_running_job(run, "checkpoint.resume: auto found run1,", hold=True)
    finally:
        first.kill()
        first.wait()
    protocol.refuse_a_running_job(run, "checkpoint.resume: auto found run1,", hold=True)
    protocol.refuse_a_running_job(run, "again, in the same process", hold=True)
    protocol.release_runs()
    second = subprocess.run([sys.executable, "-c", code.replace("time.sleep(60)", ""), str(run)],
                            capture_output=True, text=True, timeout=60)
    assert second.stdout == "held\n", second.stderr[-2000:]
    # A rank 0 gone while its forked children (DataLoader workers) live: its lock went with it
    # (a copy of the lock's file in a child held it, and refused the job's own restart)
    forks = code.replace("time.sleep(60)", "import os\nif os.fork() == 0:\n    os.close(1)\n"
                         "    os.close(2)\n    time.sleep(60)\n")
    orphaned = subprocess.run([sys.executable, "-c", forks, str(run)], capture_output=True,
                              text=True, timeout=60)
    assert orphaned.stdout.startswith("held\n"), orphaned.stderr[-2000:]
    protocol.refuse_a_running_job(run, "checkpoint.resume: auto found run1,", hold=True)
    protocol.release_runs()
    # A finished run's checkpoint, named: the job starts a new run from it, so two fine-tunes
    # of it may start together (each was refused as "the same steps twice in one run")
    import torch

    from ddplab.training import checkpoint

    torch.save({**{k: None for k in checkpoint.REQUIRED}, "final": True}, run / "step-00000004.pt")
    first = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert first.stdout is not None and first.stdout.readline() == "held\n"
        path, payload = checkpoint.find_resume(str(run / "step-00000004.pt"), tmp_path)
        assert payload["final"] and path == run / "step-00000004.pt"
    finally:
        first.kill()
        first.wait()


def beating_rank(folder: Path, rank: int, world: int, phase: str,
                 step: int) -> subprocess.Popen[str]:
    """A real rank's heartbeat, in a process of its own that lives a minute (kill it)."""
    code = ("import time\nfrom pathlib import Path\nfrom ddplab.forensics import heartbeat\n"
            f"heartbeat.start(Path({str(folder)!r}), {rank}, {world})\n"
            f"heartbeat.beat({phase!r}, {step})\nprint('up', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    return proc


def test_the_error_tag_keeps_its_first_line():
    from ddplab.tracking.tracker import ERROR_LIMIT, error_tag

    tag = error_tag(TRACEBACK)
    assert len(tag) <= ERROR_LIMIT and tag.startswith("ValueError: bad sample 17\n")
    assert tag.endswith(TRACEBACK[-1000:])
    assert error_tag("short\nerror") == "short\nerror"


def diagnose(run_id: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["diagnose", run_id])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return code, out, err


def test_a_tag_cut_mid_json_is_one_line_the_other_node_still_shown(run_in, capsys):
    client, run_id = run_in
    cut = json.dumps([e.__dict__ for e in two_rank_failure()])[:8000]  # what ddplab wrote before
    client.set_tag(run_id, "ddplab.forensics.node0", cut)
    client.set_tag(run_id, "ddplab.forensics.node1", to_json(two_rank_failure("IndexError: x")))
    code, out, err = diagnose(run_id, capsys)
    assert code == 0 and not lines(err), err
    bad = [x for x in out.splitlines() if "ddplab.forensics.node0" in x]
    assert len(bad) == 1 and "unreadable (not JSON" in bad[0] and "8000 characters" in bad[0], out
    assert "rank 1 (h1, node1): failed at step 7 in forward: IndexError: x" in out
    assert "verdict: ValueError: bad sample 17" in out


@pytest.mark.parametrize(("row", "says"), [
    ({"rank": "one"}, "ending 0's rank is \"one\", not int"),
    ({"time": None}, "ending 0's time is null, not float"),
    ({"detail": ["a"]}, "ending 0's detail is [\"a\"], not str"),
    ({"step": True}, "ending 0's step is true, not int"),
    ({"what": ...}, "ending 0 has no what"),
])
def test_a_missing_or_mistyped_field_is_one_line_naming_it(run_in, capsys, row, says):
    client, run_id = run_in
    ending = {k: v for k, v in {**two_rank_failure("E")[0].__dict__, **row}.items()
              if v is not ...}  # ...: the field left out
    client.set_tag(run_id, "ddplab.forensics.node0", json.dumps([ending]))
    client.set_tag(run_id, "ddplab.forensics.node1", '{"not": "a list"}')
    code, out, err = diagnose(run_id, capsys)
    assert code == 0 and not lines(err), err
    assert f"ddplab.forensics.node0: unreadable ({says};" in out, out
    assert "ddplab.forensics.node1: unreadable (a JSON dict, not a list of endings;" in out, out


def test_an_extra_field_a_newer_ddplab_wrote_is_ignored(run_in, capsys):
    client, run_id = run_in
    ending = {**two_rank_failure("OSError: disk")[0].__dict__, "gpu": 3}
    client.set_tag(run_id, "ddplab.forensics.node0", json.dumps([ending]))
    code, out, _ = diagnose(run_id, capsys)
    assert code == 0 and "rank 1 (h1, node0): failed at step 7 in forward: OSError: disk" in out


def test_the_verdict_reads_the_other_nodes_past_an_unreadable_one():
    class Client:
        def get_run(self, run_id: str):
            class Data:
                tags = {"ddplab.forensics.node1": '[{"rank": 2',  # read first
                        "ddplab.forensics.node2": to_json(two_rank_failure("IndexError: x")[:1])}

            class Run:
                data = Data

            return Run

    mine = [Ending(0, 7, "backward", 101.0, "failed", "DistBackendError: closed", "h0")]
    everyone = postmortem._everyone(Client(), "r", "node0", mine, 2, wait_s=0.0)
    assert sorted(e.rank for e in everyone) == [0, 1]


# ---- a store this MLflow cannot use as it is: one line, exit 2, on every command ----

def _alembic() -> tuple[str, str]:
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    script = ScriptDirectory.from_config(_get_alembic_config(""))
    head = script.get_current_head()
    assert head is not None
    down = script.get_revision(head).down_revision
    assert isinstance(down, str)
    return head, down


def test_the_schema_read_without_mlflow_is_mlflows_own():
    from ddplab.tracking.store import _migrations

    known, head = _migrations()
    assert (head, True) == (_alembic()[0], _alembic()[1] in known)


def at_schema(store: str, version: str) -> str:
    db = store.removeprefix("sqlite:///")
    with sqlite3.connect(db) as con:
        con.execute("UPDATE alembic_version SET version_num = ?", (version,))
    return store


def sync_spool(tmp_path: Path, store: str) -> list[str]:
    d = spool.spool_dir(tmp_path / "left", "0" * 32, 0)
    spool.Meta(store, "0" * 32, "0").write(d)
    (d / "records.jsonl").write_text('{"op": "end", "status": "FINISHED", "ts": 1}\n')
    return ["sync", str(tmp_path / "left"), "--timeout", "1"]


def command(name: str, tmp_path: Path, store: str) -> list[str]:
    if name == "sync":
        return sync_spool(tmp_path, store)
    return {"diagnose": ["diagnose", "0" * 32], "report": ["report", "0" * 32],
            "train": ["train", QUICKSTART, "--set", f"checkpoint.dir={tmp_path / 'ck'}"]}[name]


@pytest.mark.parametrize("name", ["diagnose", "report", "sync", "train"])
def test_a_store_one_schema_behind_is_the_upgrade_advice_alone(
        name, store, tmp_path, monkeypatch, capsys):
    head, down = _alembic()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", at_schema(store, down))
    monkeypatch.chdir(tmp_path)
    assert cli.main(command(name, tmp_path, store)) == 2
    out, err = capsys.readouterr()
    one_line(err, f"ddplab: error: the MLflow store {store} is at schema {down}, this MLflow "
                  f"needs {head}: upgrade it with `mlflow db upgrade {store}` (back it up first)")
    if name == "train":  # refused before the job: no run opened, nothing trained
        assert "epoch" not in out and not (tmp_path / "ck").exists()


def test_a_store_a_newer_mlflow_made_says_so(store, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", at_schema(store, "fedcba987654"))
    assert cli.main(["diagnose", "0" * 32]) == 2
    one_line(capsys.readouterr().err, "is at schema fedcba987654, which this MLflow")


@pytest.mark.parametrize("name", ["diagnose", "report", "sync", "train"])
def test_a_garbage_file_at_the_stores_path_is_one_line(name, tmp_path, monkeypatch, capsys):
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"this is no SQLite database\n" * 200)
    store = f"sqlite:///{db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.chdir(tmp_path)
    assert cli.main(command(name, tmp_path, store)) == 2
    one_line(capsys.readouterr().err, f"ddplab: error: the MLflow store {store} cannot be "
                                      "opened: file is not a database")


@pytest.mark.parametrize("name", ["diagnose", "sync"])
def test_a_directory_at_the_stores_path_is_one_line_at_once(name, tmp_path, monkeypatch, capsys):
    """At once: MLflow retries a store it cannot open for minutes, logging each try."""
    (tmp_path / "mlflow.db").mkdir()
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    t0 = time.monotonic()
    assert cli.main(command(name, tmp_path, store)) == 2
    one_line(capsys.readouterr().err, "is a directory")
    assert time.monotonic() - t0 < 10


def test_a_store_cut_short_is_one_line(store, monkeypatch, capsys):
    db = Path(store.removeprefix("sqlite:///"))
    data = db.read_bytes()
    db.write_bytes(data[:100] + b"\xff" * (len(data) - 100))  # its header, then garbage
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert cli.main(["report", "0" * 32]) == 2
    one_line(capsys.readouterr().err, f"ddplab: error: the MLflow store {store} cannot be opened")


def test_a_good_store_still_opens(store, monkeypatch, capsys):
    from ddplab.tracking.store import store_problem

    assert store_problem(store) is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert cli.main(["diagnose", "0" * 32]) == 2  # no such run: its own line
    one_line(capsys.readouterr().err, "ddplab: error: run '00000000000000000000000000000000' in")
    for bad in ("", "my run"):  # not a run id: the input (exit 2), not the store (exit 1)
        assert cli.main(["diagnose", bad]) == 2
        one_line(capsys.readouterr().err, f"ddplab: error: run {bad!r} in")


def test_a_command_that_reads_a_store_that_is_not_there_makes_none(tmp_path, monkeypatch,
                                                                    capsys):
    """A typo in a sqlite path made `ddplab diagnose` create the folder and an empty store;
    `ddplab reproduce` (the embedded store, in a folder without one) an empty mlflow.db there."""
    typo = tmp_path / "typo" / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{typo}")
    for command in ("diagnose", "report", "reproduce"):
        assert cli.main([command, "0" * 32]) == 2
        one_line(capsys.readouterr().err, "no tracking store at")
        assert not typo.parent.exists()


def test_diagnose_of_a_studys_parent_lists_its_jobs_that_did_not_finish(store, monkeypatch,
                                                                        capsys):
    """It said "verdict: no rank failed or hung" of a parent whose job had failed."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    c = MlflowClient(store)
    exp = c.create_experiment("s")
    parent = c.create_run(exp, tags={"ddplab.study": "s", "ddplab.study_role": "parent"}).info.run_id
    for variant, status in (("a", "FINISHED"), ("b", "FAILED")):
        job = c.create_run(exp, tags={"mlflow.parentRunId": parent, "ddplab.study_role": "job",
                                      "ddplab.variant": variant, "ddplab.repeat": "0"})
        c.set_terminated(job.info.run_id, status)
        failed = job.info.run_id
    assert cli.main(["diagnose", parent]) == 0
    said = capsys.readouterr().out
    assert "is study s's parent run: it ran no job itself; of its 2 jobs, 1 did not finish:" in said
    assert f"  b repeat 0: FAILED: ddplab diagnose {failed}" in said and "verdict" not in said


def test_diagnose_of_a_running_job_says_it_has_no_verdict_yet(store, monkeypatch, capsys):
    """A RUNNING script run read "verdict: no rank failed or hung", then "not recorded (rank 0
    ended before it could say ...)" of a rank 0 that had not ended."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    c = MlflowClient(store)
    run = c.create_run(c.create_experiment("s"), tags={"ddplab.mode": "script"}).info.run_id
    assert cli.main(["diagnose", run]) == 0
    said = capsys.readouterr().out
    assert said.splitlines() == [
        f"run {run}: RUNNING",
        "verdict: none yet: the job is still running, or it was killed before it could end its "
        "run (`ddplab sync` ends such a run from its spool)"]


def test_diagnose_of_a_run_that_finished_after_a_resume_labels_the_failed_attempts_files(
        store, monkeypatch, capsys):
    """A run that failed, resumed and FINISHED listed the failed attempt's error files under
    "stacks, crash dumps and errors (the run's artifacts)", beside "no rank failed or hung"."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    c = MlflowClient(store)
    run = c.create_run(c.create_experiment("r"), tags={
        "ddplab.resumed_from": "checkpoints/r/step20.pt"}).info.run_id
    c.log_text(run, "RuntimeError: injected failure at step 20", "forensics/node0/rank-1.error.txt")
    c.set_terminated(run, "FINISHED")
    assert cli.main(["diagnose", run]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[1] == "verdict: no rank failed or hung"
    assert said[2] == ("stacks, crash dumps and errors of an earlier attempt (this run resumed "
                       "after it; its ending is in resumes/):")
    assert said[3].endswith("forensics/node0/rank-1.error.txt")


def test_a_survivors_watcher_leaves_a_run_whose_rank_0_closed_its_spool(store, tmp_path):
    """A hostile pass: the server down as a job failed; rank 1's watcher ended the run "global
    rank 0 lost" once the server came back, over rank 0's own ending waiting in its spool (for
    its delivery, or ``ddplab sync``). A closed spool is rank 0's ending: the watcher leaves
    the run; without one, rank 0 is lost and the run ends FAILED, as before."""
    from mlflow import MlflowClient

    from ddplab.agent.orphan import end_orphan

    client = MlflowClient(store)
    exp = client.create_experiment("x")
    ended_by_rank0, lost = (client.create_run(exp).info.run_id for _ in range(2))
    spool_dir = tmp_path / "spool" / "node0"
    spool_dir.mkdir(parents=True)
    (spool_dir / spool.CLOSED).write_text("1")
    assert not end_orphan(store, ended_by_rank0, "RuntimeError: peer", 1.0, spool_dir)
    assert client.get_run(ended_by_rank0).info.status == "RUNNING"  # (its spool ends it)
    assert end_orphan(store, lost, "RuntimeError: peer", 1.0, tmp_path / "elsewhere")
    run = client.get_run(lost)
    assert run.info.status == "FAILED"
    assert run.data.tags["ddplab.error"] == "global rank 0 lost; this rank saw: RuntimeError: peer"


def test_a_survivors_watcher_whose_rank_0_closed_its_spool_never_loads_mlflow(tmp_path):
    """The watcher a surviving rank leaves: when rank 0's spool closes (rank 0 ended the run
    itself, the common case), it ends without importing MLflow, which cost ~2 s of CPU on every
    surviving rank of every failed job. The server is one nothing listens on: asking it would
    be the slow path."""
    spool_dir = tmp_path / "node0"
    spool_dir.mkdir()
    (spool_dir / spool.CLOSED).write_text("1")
    probe = ("import sys, time; from ddplab.agent.orphan import end_orphan; t0 = time.monotonic(); "
             "ended = end_orphan('http://127.0.0.1:9', 'a' * 32, 'x', 20.0, "
             f"__import__('pathlib').Path({str(spool_dir)!r})); "
             "print(ended, 'mlflow' in sys.modules, round(time.monotonic() - t0, 1))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    ended, loaded, took = out.stdout.split()
    assert (ended, loaded) == ("False", "False"), out.stdout + out.stderr[-2000:]
    assert float(took) < 5, took


def test_a_survivors_watcher_gives_up_at_once_on_a_silent_server(tmp_path):
    """A hostile pass: with the server down as rank 0 was SIGKILLed, a survivor's watcher, a
    real detached process, lived 2 to 4 minutes past the job (MLflow's default retries in each
    call), not its 20 s grace. Against a port nothing listens on it now ends within seconds."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        t0 = time.monotonic()
        watcher = subprocess.run([sys.executable, "-m", "ddplab.agent.orphan", uri, "0" * 32,
                                  "RuntimeError: peer", "--grace", "1"], env=env,
                                 capture_output=True, text=True, timeout=120)
    assert watcher.returncode == 0, watcher.stderr
    assert time.monotonic() - t0 < 30, (time.monotonic() - t0, watcher.stderr[-2000:])
    assert "could not check run" in watcher.stderr, watcher.stderr[-2000:]
