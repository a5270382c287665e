"""Issue 53, item 4: one credential filter (logins.mask) on every path that prints or records.

A password holding '@' and other URL-special characters (``s3cr@t:pa/ss``), planted in
``DDPLAB_SET``, ``--set``, a study's own set, a variant's set and a grid axis: no console line,
plan, environment.json, spool record, config.yaml or param may show any of it. In-process
through the CLI's main where no job is needed; one real short job for what only a job records.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.conftest import QUICK, REPO, ddplab, job_env, runs

PASSWORD = "s3cr@t:pa/ss"
# What must never show: the password, and each piece of it a wrong split of the login would
# leave behind (the part after its first '@', the part after its '/').
PIECES = (PASSWORD, "s3cr@t", "t:pa/ss", "pa/ss")
QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")


def leaks(text: str) -> list[str]:
    return [p for p in PIECES if p in text]


@pytest.fixture
def clean_env(monkeypatch):
    """No credentials, no DDPLAB_SET of the caller's: each test plants its own."""
    for name in list(os.environ):
        if name.startswith(("MLFLOW_", "DDPLAB_SET", "DDPLAB_MAX")):
            monkeypatch.delenv(name)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, "")  # a login taken out in-process is gone after the test
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("password", [PASSWORD, "p@ss@word", "a#b?c[d]e", "x%40y", "q'u\"o:t@e/s",
                                      "s/la/sh", "ends-with@"])
def test_the_login_ends_at_the_last_at_for_mask_and_split_login(password):
    from ddplab.logins import mask, split_login

    uri = f"http://alice:{password}@mlflow.example:5000/base"
    assert split_login(uri) == ("http://mlflow.example:5000/base", "alice",
                                password.replace("%40", "@"))
    for text in (uri, f"DDPLAB_SET='tracking.uri={uri} x=1'", f"got {uri!r}; allowed",
                 f"postgresql+psycopg2://db:{password}@db:5432/mlflow"):
        shown = mask(text)
        assert password not in shown and ":***@" in shown, shown
        assert "mlflow.example:5000/base" in shown or "@db:5432/mlflow" in shown, shown
    # A user that is an e-mail address keeps its '@'; nothing without a password changes.
    assert mask(f"https://a@b.org:{password}@h/x") == "https://a@b.org:***@h/x"
    for text in ("http://h:5000/#/experiments and user@example.org", "git+ssh://git@github.com:o/r",
                 "http://user@host:5000/path", "sqlite:///mlflow.db"):
        assert mask(text) == text


def test_masked_filters_every_string_and_keeps_the_structure():
    from ddplab.logins import masked

    record = {"op": "log", "ts": 1, "params": {"tracking.uri": f"http://u:{PASSWORD}@h:1",
                                               "n": 3, "x": None},
              "list": [f"s3://k:{PASSWORD}@b/x", ("t", f"https://u:{PASSWORD}@h")],
              f"http://k:{PASSWORD}@key": 1.5}
    out = json.dumps(masked(record))
    assert not leaks(out), out
    back = json.loads(out)
    assert back["params"] == {"tracking.uri": "http://u:***@h:1", "n": 3, "x": None}
    assert back["list"] == ["s3://k:***@b/x", ["t", "https://u:***@h"]]


def test_environment_capture_and_spool_records_show_no_password(tmp_path):
    from ddplab.tracking import spool
    from ddplab.tracking.capsule import launcher_env

    env = {"DDPLAB_SET": f"tracking.uri=http://u:{PASSWORD}@h:5000 data.root=x",
           "MLFLOW_TRACKING_URI": f"https://u:{PASSWORD}@h", "HOME": "/root"}
    captured = launcher_env(env)
    assert captured["DDPLAB_SET"] == "tracking.uri=http://u:***@h:5000 data.root=x"
    assert not leaks(json.dumps(captured))
    stream = spool.Stream(tmp_path, "records")
    stream.append({"op": "log", "ts": 1, "step": 0,
                   "params": {"data.root": f"https://d:{PASSWORD}@data/x"}, "tags": {}})
    stream.append({"op": "text", "ts": 2, "name": "environment.json",
                   "text": json.dumps({"env": env}, indent=2)})
    stream.close()
    text = (tmp_path / "records.jsonl").read_text()
    assert not leaks(text), text
    assert [r["op"] for _, r in stream.pending()] == ["log", "text"]  # still records


def test_config_with_ddplab_set_and_set_prints_no_password(tmp_path, clean_env, capsys):
    from ddplab import cli

    clean_env.chdir(tmp_path)
    clean_env.setenv("DDPLAB_SET", f"tracking.uri=http://u:{PASSWORD}@h:5000")
    assert cli.main(["config", QUICKSTART]) == 0
    assert cli.main(["config", QUICKSTART, "--set", f"tracking.uri=https://v:{PASSWORD}@h2"]) == 0
    out = capsys.readouterr()
    assert not leaks(out.out + out.err), out
    assert "uri: http://h:5000" in out.out and "uri: https://h2" in out.out
    # Any other URL in the config (a database named in the description) is masked in print.
    assert cli.main(["config", QUICKSTART, "--set", f"description=db postgresql://d:{PASSWORD}@db/x"]
                    ) == 0
    out = capsys.readouterr()
    assert not leaks(out.out) and "postgresql://d:***@db/x" in out.out, out.out
    # The bad value of a --set is echoed back in its one line: masked too.
    assert cli.main(["config", QUICKSTART, "--set", f"train.epochs=http://u:{PASSWORD}@h"]) == 2
    err = capsys.readouterr().err
    assert not leaks(err) and "train.epochs" in err and len(err.strip().splitlines()) == 1, err


def test_a_study_dry_run_shows_no_password_from_any_set(tmp_path, clean_env, capsys):
    """DDPLAB_SET, --set, the study's set, a variant's set, a compose variant's
    environment: the plan is printed, every password is not; the login went where MLflow's
    client reads it, for the jobs to inherit."""
    from ddplab import cli

    uri = f"http://u:{PASSWORD}@127.0.0.1:5000"
    study = {"name": "leak", "experiment": QUICKSTART, "set": {"tracking.uri": uri},
             "variants": [{"name": "a", "set": {"tracking.uri": uri,
                                                "description": f"postgresql://d:{PASSWORD}@db/x"}},
                          {"name": "b", "launcher": "compose",
                           "set": {"tracking": {"uri": uri}}}]}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    clean_env.chdir(tmp_path)
    clean_env.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    clean_env.setenv("DDPLAB_SET", f"tracking.uri={uri} 'description=x https://z:{PASSWORD}@h'")
    code = cli.main(["study", "run", str(path), "--dry-run", "--set", f"tracking.uri={uri}"])
    out = capsys.readouterr()
    assert code == 0, out.err
    plan = [x for x in out.out.splitlines() if x.startswith("  ")]
    assert len(plan) == 2 and all("tracking.uri=http://127.0.0.1:5000" in x for x in plan), plan
    assert "postgresql://d:***@db/x" in plan[0] and "DDPLAB_SET=" in plan[1], plan
    # Each tracking URI's login was taken OUT (not merely masked): every set, listed or typed,
    # names the bare server, so study.yaml and the parent run's params hold no login either.
    assert "u:***@127.0.0.1" not in out.out and '"uri": "http://127.0.0.1:5000"' in plan[1], plan
    assert not leaks(out.out + out.err), out.out
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == PASSWORD  # what every job inherits
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "u"


def test_the_study_file_recorded_in_the_parent_run_is_masked(tmp_path, clean_env, monkeypatch):
    """study.yaml, as the study logs it (a set no job takes the login out of: a database's)."""
    from ddplab.study import runner, spec

    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({"name": "leak", "experiment": QUICKSTART,
                                    "description": f"against postgresql://d:{PASSWORD}@db/x",
                                    "set": {"description": f"postgresql://d:{PASSWORD}@db/x"},
                                    "variants": [{"name": "a"}]}))
    study = spec.load_study(path)
    logged = {}
    monkeypatch.chdir(tmp_path)  # the parent's spool, under ./checkpoints: not the checkout's

    class Client:
        def search_runs(self, *a, **k):
            return []

        def create_run(self, *a, **k):
            logged["tags"] = k["tags"]
            return type("R", (), {"info": type("I", (), {"run_id": "r1"})})()

        def log_text(self, run_id, text, name):
            logged[name] = text

    tracker = runner.Tracker.__new__(runner.Tracker)
    tracker.client, tracker.uri, tracker.study, tracker.exp_id = Client(), "sqlite://", study, "1"
    monkeypatch.setattr(runner.sys, "argv", ["ddplab", "study", "run", str(path), "--set",
                                             f"data.root=s3://k:{PASSWORD}@b/x"])
    tracker.parent(fresh=True, resolved=yaml.safe_dump({"set": study.set}))
    assert "postgresql://d:***@db/x" in logged["study.yaml"]
    assert not leaks(logged["study.yaml"] + json.dumps(logged["tags"])), logged
    assert logged["tags"]["mlflow.note.content"] == "against postgresql://d:***@db/x"  # the UI's


@pytest.mark.e2e
def test_a_real_job_records_and_prints_no_password(tmp_path, store):
    """The one real job: DDPLAB_SET's tracking.uri holds the password (overridden by --set, so
    the job runs on the test's store, and DDPLAB_SET stays in every rank's environment, which
    environment.json records); a --set value holds it too. Console, artifacts (environment.json,
    config.yaml), params, tags, the spool folder: none shows it."""
    env = job_env(store, DDPLAB_SET=f"tracking.uri=http://u:{PASSWORD}@127.0.0.1:9 "
                                    f"'data.root=https://d:{PASSWORD}@data.example/x'")
    out = ddplab(["train", QUICKSTART, *QUICK, "--set", f"tracking.uri={store}",
                  "--set", f"data.root=https://e:{PASSWORD}@data.example/y",
                  "--set", f"description=db at postgresql://d:{PASSWORD}@db/x",
                  "--set", "train.max_steps=4", "--set", "checkpoint.every_steps=0",
                  "--set", "checkpoint.every_epochs=0"], tmp_path, env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not leaks(out.stdout + out.stderr)
    (run,) = runs(store)
    from mlflow import MlflowClient

    client = MlflowClient(store)
    for name in ("environment.json", "config.yaml"):
        text = Path(client.download_artifacts(run.info.run_id, name, str(tmp_path))).read_text()
        assert not leaks(text), (name, leaks(text))
        assert "***@" in text, name  # the URL is there, its password is not
    recorded = json.dumps([run.data.params, run.data.tags])
    assert not leaks(recorded), leaks(recorded)
    assert run.data.params["data.root"] == "https://e:***@data.example/y"
    # The description is the UI's (mlflow.note.content): it showed the password.
    assert run.data.tags["mlflow.note.content"].startswith("db at postgresql://d:***@db/x")
    spooled = [p for p in (tmp_path / "checkpoints").rglob("spool/**/*") if p.is_file()]
    assert spooled and not [p for p in spooled if leaks(p.read_text(errors="replace"))]
