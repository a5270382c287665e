#!/usr/bin/env python3
"""Healthy only when a real API call succeeds with the Host header clients use, and with the
admin's login when the server asks for one (mlflow-serve's MLFLOW_AUTH_ADMIN_PASSWORD_FILE).

/health is exempt from MLflow's host check and from its login, so it passes while every client
gets 403 or 401; this calls the experiments API as a client named MLFLOW_HEALTH_HOST (default
mlflow:5000) would.
"""

import base64
import os
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
from serve import secret  # noqa: E402 - the server's own reading of its secret files

port = os.environ.get("MLFLOW_PORT", "5000")
host = os.environ.get("MLFLOW_HEALTH_HOST", f"mlflow:{port}")
headers = {"Host": host}
password = secret("MLFLOW_AUTH_ADMIN_PASSWORD")
if password:
    login = f"{os.environ.get('MLFLOW_AUTH_ADMIN_USERNAME', 'admin')}:{password}"
    headers["Authorization"] = "Basic " + base64.b64encode(login.encode()).decode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1",
                             headers=headers)
try:
    with urllib.request.urlopen(req, timeout=4) as r:
        r.read()
except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"
    sys.exit(f"unhealthy: client call as Host {host} failed: {e}")
