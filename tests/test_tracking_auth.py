"""End to end: ddplab against a real MLflow server with MLflow's own authentication, started
the way the ddplab/mlflow image starts it (docker/mlflow/serve.py: `--app-name ddplab-auth`,
its secrets read from files, its users in SQLite here): no credentials, wrong ones and a shared
experiment owned by someone else are each one line before or at the run's creation; the right
ones train, given in the environment or as files.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import QUICK, REPO, ddplab, job_env
from tests.helpers import ADMIN_PASSWORD, call

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent
QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")


@pytest.fixture
def server(login_server: str) -> str:
    """conftest's server with MLflow's authentication."""
    return login_server


def train(tmp_path: Path, uri: str, *extra: str, **creds: str) -> subprocess.CompletedProcess:
    env = job_env(uri, **creds)
    return ddplab(["train", QUICKSTART, *QUICK, "--set", "train.max_steps=4",
                   "--set", f"checkpoint.dir={tmp_path / 'ck'}", *extra], tmp_path, env)


def runs(uri: str, experiment: str) -> list[dict]:
    _, exp = call(uri, f"/api/2.0/mlflow/experiments/get-by-name?experiment_name={experiment}",
                  user=("admin", ADMIN_PASSWORD))
    if not exp:
        return []
    _, found = call(uri, "/api/2.0/mlflow/runs/search",
                    {"experiment_ids": [exp["experiment"]["experiment_id"]]},
                    user=("admin", ADMIN_PASSWORD))
    return found.get("runs", [])


def test_an_anonymous_client_gets_401_and_health_stays_open(server):
    assert call(server, "/api/2.0/mlflow/experiments/search", {"max_results": 1})[0] == 401
    assert call(server, "/health")[0] == 200
    assert call(server, "/")[0] == 401  # the browser's login dialog


def test_the_team_server_runs_without_mlflows_job_runner(server):
    """serve.py starts MLflow without its job runner: seven processes, each importing MLflow,
    took 31 s of CPU at every start (7.5 s without) for GenAI jobs ddplab runs none of."""
    import psutil

    port = server.rsplit(":", 1)[1]
    (main,) = [p for p in psutil.process_iter(["cmdline"])
               if "server" in (p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])]
    children = [" ".join(c.cmdline()) for c in main.children(recursive=True)]
    assert any("uvicorn" in c for c in children), children  # the server's own worker
    assert not [c for c in children if "_job_runner" in c or "huey" in c], children


def test_the_ui_behind_the_login_still_opens_on_the_runs(server):
    from ddplab.tracking.mlflow_app import FIRST_VISIT

    req = urllib.request.Request(server + "/", headers={"Authorization": "Basic " + base64.b64encode(
        f"admin:{ADMIN_PASSWORD}".encode()).decode()})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert FIRST_VISIT in r.read().decode()


def test_credentials_from_files_train_and_an_unreadable_file_is_one_line(tmp_path, server):
    (tmp_path / "user").write_text("admin\n")
    (tmp_path / "password").write_text(ADMIN_PASSWORD + "\n")
    ok = train(tmp_path, server, "--set", "tracking.experiment=from-files",
               MLFLOW_TRACKING_USERNAME_FILE=str(tmp_path / "user"),
               MLFLOW_TRACKING_PASSWORD_FILE=str(tmp_path / "password"))
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert [r["info"]["status"] for r in runs(server, "from-files")] == ["FINISHED"]
    missing = train(tmp_path, server, MLFLOW_TRACKING_USERNAME_FILE=str(tmp_path / "user"),
                    MLFLOW_TRACKING_PASSWORD_FILE=str(tmp_path / "nope"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    (line,) = [x for x in missing.stderr.splitlines() if "error" in x]
    assert f"MLFLOW_TRACKING_PASSWORD_FILE={tmp_path / 'nope'}: cannot read it" in line


def test_no_or_wrong_credentials_stop_the_job_before_any_run_with_one_line(tmp_path, server):
    none = train(tmp_path, server)
    assert none.returncode == 2, none.stderr[-2000:]
    (line,) = [x for x in none.stderr.splitlines() if "ddplab: error" in x]
    assert "MLFLOW_TRACKING_USERNAME: not set" in line and "HTTP 401" in line
    assert "Traceback" not in none.stderr
    wrong = train(tmp_path, server, MLFLOW_TRACKING_USERNAME="admin",
                  MLFLOW_TRACKING_PASSWORD="not-it")
    assert wrong.returncode == 2
    assert "refused the credentials of user 'admin'" in wrong.stderr
    assert runs(server, "quickstart") == []


def test_the_right_credentials_train_and_another_users_experiment_is_one_clear_line(tmp_path, server):
    ok = train(tmp_path, server, MLFLOW_TRACKING_USERNAME="admin",
               MLFLOW_TRACKING_PASSWORD=ADMIN_PASSWORD)
    assert ok.returncode == 0, ok.stderr[-3000:]
    (run,) = runs(server, "quickstart")
    assert run["info"]["status"] == "FINISHED"
    bob = {"MLFLOW_TRACKING_USERNAME": "bob", "MLFLOW_TRACKING_PASSWORD": "bob-" + ADMIN_PASSWORD}
    refused = train(tmp_path, server, **bob)  # "quickstart" is admin's; bob may only read it
    assert refused.returncode != 0
    assert "user bob may not create runs in the experiment 'quickstart'" in refused.stderr
    assert "tracking.experiment" in refused.stderr and "Traceback" not in refused.stderr
    own = train(tmp_path, server, "--set", "tracking.experiment=bob-quickstart", **bob)
    assert own.returncode == 0, own.stderr[-3000:]
    assert [r["info"]["status"] for r in runs(server, "bob-quickstart")] == ["FINISHED"]
    # The README's way for an admin to let bob in: MLflow's AuthServiceClient.
    from mlflow.server.auth.client import AuthServiceClient

    os.environ.update(MLFLOW_TRACKING_USERNAME="admin", MLFLOW_TRACKING_PASSWORD=ADMIN_PASSWORD)
    try:
        AuthServiceClient(server).grant_user_permission(
            "bob", "experiment", run["info"]["experiment_id"], "EDIT")
    finally:
        for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(k)
    granted = train(tmp_path, server, **bob)
    assert granted.returncode == 0, granted.stderr[-3000:]
    assert len(runs(server, "quickstart")) == 2


def _everything_recorded(uri: str, experiment: str, tmp_path: Path) -> str:
    """Every tag, param, metric name and artifact of the experiment's runs, as one text."""
    from mlflow import MlflowClient

    os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = \
        "admin", ADMIN_PASSWORD
    try:
        client = MlflowClient(uri)
        text = []
        for run in runs(uri, experiment):
            run_id = run["info"]["run_id"]
            text.append(json.dumps(run))
            out = Path(client.download_artifacts(run_id, "", str(tmp_path / "got" / run_id)))
            text += [p.read_text(errors="replace") for p in out.rglob("*") if p.is_file()]
        return "\n".join(text)
    finally:
        for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            os.environ.pop(k, None)


@pytest.mark.parametrize("where", ["MLFLOW_TRACKING_URI", "--set"])
def test_a_login_in_the_uri_trains_and_the_password_is_nowhere(tmp_path, server, where):
    """http://admin:PASSWORD@host: the job logs in, and the password is in no console line,
    tag, param, artifact (environment.json, config.yaml, logs) or spool file."""
    with_login = server.replace("http://", f"http://admin:{ADMIN_PASSWORD}@")
    experiment = f"login-{where.strip('-').lower().replace('_', '-')}"
    if where == "--set":
        env = job_env(server)
        out = ddplab(["train", QUICKSTART, *QUICK, "--set", "train.max_steps=4",
                      "--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set",
                      f"tracking.uri={with_login}", "--set", f"tracking.experiment={experiment}",
                      "--set", "dist.backend=gloo"], tmp_path, env, nproc=2)
    else:
        out = ddplab(["train", QUICKSTART, *QUICK, "--set", "train.max_steps=4",
                      "--set", f"checkpoint.dir={tmp_path / 'ck'}",
                      "--set", f"tracking.experiment={experiment}"], tmp_path,
                     job_env(with_login), nproc=2)
    assert out.returncode == 0, out.stderr[-3000:].replace(ADMIN_PASSWORD, "***")
    assert [r["info"]["status"] for r in runs(server, experiment)] == ["FINISHED"]
    recorded = _everything_recorded(server, experiment, tmp_path)
    assert "environment.json" in recorded or '"MLFLOW_TRACKING_URI"' in recorded
    spooled = "\n".join(p.read_text(errors="replace")
                        for p in (tmp_path / "ck").rglob("*") if p.is_file() and p.suffix != ".pt")
    for name, text in (("console", out.stdout + out.stderr), ("the run", recorded),
                       ("the spool", spooled)):
        assert ADMIN_PASSWORD not in text, f"the password is in {name}"
    said = out.stdout + out.stderr
    assert "admin:***@" not in said and f"{server}/#/experiments/" in said  # the plain address


def test_a_binary_password_file_is_one_line(tmp_path, server):
    (tmp_path / "password").write_bytes(b"\x89\xff\xfe\x00binary")
    out = train(tmp_path, server, MLFLOW_TRACKING_PASSWORD_FILE=str(tmp_path / "password"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "MLFLOW_TRACKING_PASSWORD_FILE" in out.stderr and "not a text file" in out.stderr
