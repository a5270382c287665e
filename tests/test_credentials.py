"""Unit: the tracking login from files (ddplab.credentials) and the team server's generated
secrets (docker/mlflow/make_secrets.py): what compose/tracking.yml and k8s/ rely on."""

from __future__ import annotations

import base64
import json
import stat
import sys

import pytest
import yaml

from ddplab.config import ConfigError
from ddplab.credentials import CREDENTIALS, from_files
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "docker" / "mlflow"))
import make_secrets  # noqa: E402


def test_files_fill_the_credentials_the_caller_did_not_set(tmp_path):
    (tmp_path / "u").write_text("alice\n")
    (tmp_path / "p").write_text("s3cret \n")
    env = {"MLFLOW_TRACKING_USERNAME_FILE": str(tmp_path / "u"),
           "MLFLOW_TRACKING_PASSWORD_FILE": str(tmp_path / "p"), "MLFLOW_TRACKING_USERNAME": ""}
    assert from_files(env) == ["MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"]
    assert (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]) == ("alice", "s3cret")


@pytest.mark.parametrize("given", CREDENTIALS)
def test_credentials_in_the_environment_win_as_a_set(tmp_path, given):
    """A token given by hand is never paired with a password from a file (MLflow would send
    basic auth and drop the token), nor a hand-given user with another file's password."""
    (tmp_path / "p").write_text("from-file\n")
    env = {given: "by-hand", "MLFLOW_TRACKING_PASSWORD_FILE": str(tmp_path / "p")}
    assert from_files(env) == []
    assert env.get("MLFLOW_TRACKING_PASSWORD", "") in ("", "by-hand")


@pytest.mark.parametrize("content, why", [(None, "cannot read it"), ("\n", "the file is empty")])
def test_a_bad_credential_file_is_one_line_naming_it(tmp_path, content, why):
    f = tmp_path / "pw"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ConfigError) as e:
        from_files({"MLFLOW_TRACKING_PASSWORD_FILE": str(f)})
    assert str(e.value).startswith(f"environment: MLFLOW_TRACKING_PASSWORD_FILE={f}: {why}")
    assert "\n" not in str(e.value)


def test_generated_secrets_are_private_and_kept_across_starts(tmp_path, capsys):
    make_secrets.write_missing(tmp_path)
    first = {f.name: f.read_text() for f in tmp_path.iterdir()}
    assert set(first) == {"admin-username", "admin-password", "flask-secret-key", "postgres-password"}
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o400 for f in tmp_path.iterdir())
    assert len(first["admin-password"].strip()) >= 24
    assert first["admin-password"] != first["postgres-password"]
    (tmp_path / "flask-secret-key").unlink()
    make_secrets.write_missing(tmp_path)  # a second `up`: the admin in the database keeps its password
    again = {f.name: f.read_text() for f in tmp_path.iterdir()}
    assert again["admin-password"] == first["admin-password"] and again["flask-secret-key"]
    assert "made flask-secret-key" in capsys.readouterr().out


def referenced_secrets() -> set[tuple[str, str]]:
    """Every (Secret, key) a manifest in k8s/ reads, through env or a volume."""
    found = set()

    def walk(node):
        if isinstance(node, dict):
            ref = node.get("secretKeyRef")
            if ref:
                found.add((ref["name"], ref["key"]))
            vol = node.get("secret")
            if isinstance(vol, dict) and vol.get("secretName", "").startswith("mlflow-"):
                for item in vol.get("items") or [{"key": "*"}]:
                    found.add((vol["secretName"], item["key"]))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for f in (REPO / "k8s").rglob("*.yaml"):
        for doc in yaml.safe_load_all(f.read_text()):
            walk(doc)
    return found


def test_make_k8s_secrets_makes_every_secret_and_key_the_manifests_read():
    made = {s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in s["data"].items()}
            for s in json.loads(make_secrets.k8s_manifests("ddplab"))["items"]}
    wanted = referenced_secrets()
    assert ("mlflow-server", "postgres-password") in wanted  # the walk finds the StatefulSet's
    for name, key in wanted:
        assert name in made and (key == "*" or key in made[name]), (name, key)
    # The jobs' login is the admin's, so a fresh cluster's jobs can log in at once.
    assert made["mlflow-credentials"]["password"] == made["mlflow-server"]["admin-password"]


def test_a_login_leaves_the_uri_for_mlflows_variables_unless_credentials_are_set():
    from ddplab.logins import from_uri, take_login

    env = {"MLFLOW_TRACKING_URI": "https://alice:p%40ss@mlflow.example:5000/base"}
    from_uri(env)
    assert env == {"MLFLOW_TRACKING_URI": "https://mlflow.example:5000/base",
                   "MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "p@ss"}
    given = {"MLFLOW_TRACKING_TOKEN": "tok"}  # the caller's own credentials win, as a set
    assert take_login("http://bob:x@h:1", given) == "http://h:1" and given == {
        "MLFLOW_TRACKING_TOKEN": "tok"}
    assert take_login("sqlite:///mlflow.db", {}) == "sqlite:///mlflow.db"


def test_mask_hides_every_urls_password_and_nothing_else():
    from ddplab.logins import mask

    text = ("postgresql+psycopg2://ddplab:s3cret@db:5432/mlflow and http://u:pw@h/x, "
            "plain http://h:5000/#/experiments and user@example.org")
    assert mask(text) == ("postgresql+psycopg2://ddplab:***@db:5432/mlflow and http://u:***@h/x, "
                          "plain http://h:5000/#/experiments and user@example.org")
