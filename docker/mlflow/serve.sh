#!/bin/sh
# Start the tracking server from the environment (see the Dockerfile's ENV for defaults).
set -e
# --app-name ddplab: MLflow's own app, opening its UI on the runs (src/ddplab/mlflow_app.py).
exec mlflow server --app-name ddplab \
  --backend-store-uri "${MLFLOW_BACKEND_STORE_URI}" \
  --artifacts-destination "${MLFLOW_ARTIFACTS_DESTINATION}" \
  --serve-artifacts \
  --host 0.0.0.0 --port "${MLFLOW_PORT}" \
  --workers "${MLFLOW_WORKERS}" \
  --allowed-hosts "${MLFLOW_ALLOWED_HOSTS}"
