"""Unit: a run's life has one owner (tracking/life.py): no other module creates or ends a run,
and what it does holds on a real MLflow store."""

from __future__ import annotations

import ast
from pathlib import Path

from ddplab.tracking import life, schema

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ddplab"
# The script's own MLflow calls, joined to the job's run: MLflow's API patched, not called by us.
PATCHES_MLFLOW = {"training/scriptmode/mlflow_join.py"}


def test_only_life_creates_or_ends_a_run():
    found = []
    for path in PACKAGE.rglob("*.py"):
        name = str(path.relative_to(PACKAGE))
        if name == "tracking/life.py" or name in PATCHES_MLFLOW:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("create_run", "set_terminated"):
                found.append(f"{name}:{node.lineno}: .{node.attr}")
    assert not found, "runs created or ended outside tracking/life.py:\n" + "\n".join(found)


def test_end_says_why_within_mlflows_limit_and_end_if_running_leaves_an_ended_run(tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("e")
    one = life.create(client, exp, "one", {"a": "b"}).info.run_id
    assert client.get_run(one).info.status == life.RUNNING
    life.end(client, one, life.FAILED, "x" * (schema.TAG_LIMIT + 100))
    run = client.get_run(one)
    assert run.info.status == "FAILED" and run.data.tags[schema.ERROR] == "x" * schema.TAG_LIMIT
    assert run.info.run_name == "one" and run.data.tags["a"] == "b"
    # Already ended: a late owner (a study whose job ended its own run) changes nothing.
    assert life.end_if_running(client, one, life.KILLED, "late") == "FAILED"
    assert client.get_run(one).data.tags[schema.ERROR] == "x" * schema.TAG_LIMIT
    two = life.create(client, exp, "two").info.run_id
    assert life.end_if_running(client, two, life.KILLED, "stopped") == "KILLED"
    run = client.get_run(two)
    assert run.info.status == "KILLED" and run.data.tags[schema.ERROR] == "stopped"
