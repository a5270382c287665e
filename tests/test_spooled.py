"""Unit: a run no job writes (a study's parent, a benchmark's, a reproduction's verdict) keeps
its records in a spool until the server has them: an outage loses none (tracking/spooled.py),
on a real SQLite store and a real dead port."""

from __future__ import annotations

import subprocess

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag

from ddplab.tracking import life, spooled
from tests.helpers import BIN, free_port


def _write_everything(c: spooled.SpooledClient, run_id: str, files) -> None:
    c.set_tag(run_id, "ddplab.verdict", "fine")
    c.log_param(run_id, "study.repeats", 3)
    c.log_metric(run_id, "speedup", 1.5)
    c.log_batch(run_id, metrics=[Metric("busbw", 2.0, 1000, 4096)], params=[Param("p", "v")],
                tags=[RunTag("t", "u")])
    c.log_text(run_id, "a,b\n", "reproduce/differences.csv")
    c.log_artifacts(run_id, str(files))
    life.end(c, run_id, life.FINISHED)


def _files(tmp_path):
    files = tmp_path / "report"
    (files / "plots").mkdir(parents=True)
    (files / "report.md").write_text("# r\n")
    (files / "plots" / "speedup.png").write_bytes(b"\x89PNG")
    return files


def _assert_everything(client: MlflowClient, run_id: str) -> None:
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["ddplab.verdict"] == "fine" and run.data.tags["t"] == "u"
    assert run.data.params == {"study.repeats": "3", "p": "v"}
    assert run.data.metrics == {"speedup": 1.5, "busbw": 2.0}
    assert client.get_metric_history(run_id, "busbw")[0].step == 4096
    paths = {a.path for a in client.list_artifacts(run_id)} | {
        a.path for a in client.list_artifacts(run_id, "plots")} | {
        a.path for a in client.list_artifacts(run_id, "reproduce")}
    assert {"report.md", "plots/speedup.png", "reproduce/differences.csv"} <= paths, paths


def test_the_runs_records_wait_in_the_spool_and_other_runs_go_straight(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    mine, other = (life.create(client, exp, n).info.run_id for n in ("mine", "other"))
    home = tmp_path / "checkpoints" / "bench" / mine
    c = spooled.SpooledClient(client, uri, mine, exp, home)
    c.set_tag(other, "direct", "yes")  # another run's: at once
    assert client.get_run(other).data.tags["direct"] == "yes"
    _write_everything(c, mine, _files(tmp_path))
    before = client.get_run(mine)
    assert before.info.status == "RUNNING" and "ddplab.verdict" not in before.data.tags
    assert c.close(10) == ""
    _assert_everything(client, mine)
    assert not home.exists() and not (tmp_path / "checkpoints").exists()  # nothing to keep


def test_a_server_gone_at_the_end_keeps_every_record_for_ddplab_sync(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("e")
    mine = life.create(client, exp, "mine").info.run_id
    dead = MlflowClient(f"http://127.0.0.1:{free_port()}")  # the server, gone
    home = tmp_path / "checkpoints" / "reproduce" / mine
    c = spooled.SpooledClient(dead, uri, mine, exp, home)
    _write_everything(c, mine, _files(tmp_path))
    said = c.close(1)
    assert "records not sent" in said and f"ddplab sync {c.folder}" in said, said
    assert client.get_run(mine).info.status == "RUNNING"
    out = subprocess.run([str(BIN / "ddplab"), "sync", str(tmp_path / "checkpoints")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    _assert_everything(client, mine)
