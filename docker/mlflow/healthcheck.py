"""Healthy only when a real API call succeeds with the Host header clients use.

/health is exempt from MLflow's host check, so it passes while every client gets 403; this
calls the experiments API as a client named MLFLOW_HEALTH_HOST (default mlflow:5000) would.
"""

import os
import sys
import urllib.request

port = os.environ.get("MLFLOW_PORT", "5000")
host = os.environ.get("MLFLOW_HEALTH_HOST", f"mlflow:{port}")
req = urllib.request.Request(f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/search?max_results=1",
                             headers={"Host": host})
try:
    with urllib.request.urlopen(req, timeout=4) as r:
        r.read()
except Exception as e:  # noqa: BLE001 - any failure is "unhealthy"
    sys.exit(f"unhealthy: client call as Host {host} failed: {e}")
