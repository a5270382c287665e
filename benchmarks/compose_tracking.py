"""The compose files' tracking server (compose/tracking.yml) asks for a login: the admin
password it generated on its first `up`, read the way docs/tracking.md tells a user to."""

from __future__ import annotations

import base64
import json
import subprocess
import urllib.request
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def admin_password(compose: list[str], env: Mapping[str, str]) -> str:
    """The generated password ('' until the server's container runs)."""
    out = subprocess.run([*compose, "exec", "-T", "mlflow", "cat",
                          "/run/ddplab-tracking/admin-password"], env=dict(env), cwd=REPO,
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def client_env(compose: list[str], env: Mapping[str, str]) -> dict[str, str]:
    """What MLflow's client reads for basic auth."""
    return {"MLFLOW_TRACKING_USERNAME": "admin",
            "MLFLOW_TRACKING_PASSWORD": admin_password(compose, env)}


def rest(base: str, path: str, body: dict, password: str) -> dict:
    """One call of MLflow's REST API as admin."""
    login = base64.b64encode(f"admin:{password}".encode()).decode()
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": "Basic " + login})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())
