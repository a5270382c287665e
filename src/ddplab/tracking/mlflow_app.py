"""The MLflow server app that `make ui` and the ddplab/mlflow image serve: MLflow's own app,
opening its UI on the runs.

MLflow 3's UI has two views, GenAI (traces, prompts) and Model training (runs, metrics), and
the choice is UI-wide: the page reads it from the URL's ``workflowType`` parameter, else from
the browser's local storage (``mlflow.workflowType_v1``), else GenAI. A link with
``?workflowType=machine_learning`` shows the runs, but the experiment links inside the UI drop
the parameter, so the next click lands in GenAI's "Traces 0". Only the stored choice survives
navigation, and the UI stores it only when the user flips the toggle. So this app adds one line
to the UI's page: on a browser's first visit, store "Model training" as the choice. A user who
flips the toggle to GenAI keeps that choice; nothing else of MLflow changes (the assistant's
panel, which would open by itself and cover a quarter of the runs table, starts closed).

Registered as the ``mlflow.app`` entry point ``ddplab`` (pyproject.toml), the plugin hook
MLflow documents for server apps (its own ``basic-auth`` is one):
``mlflow server --app-name ddplab ...``. ``ddplab-auth`` is the same with MLflow's basic-auth
app on top (a team server: compose/tracking.yml, k8s/10-mlflow.yaml). Imports MLflow only, no
torch: the server image has none.
"""

from __future__ import annotations

from typing import Any

# MLflow 3.17's useLocalStorage keys are f"{key}_v{version}", values JSON.
FIRST_VISIT_CHOICES = {
    "mlflow.workflowType_v1": '"machine_learning"',
    # "The assistant has opened itself once already": else its panel opens on the first visit
    # and covers a quarter of the runs table, the columns ddplab's views add included.
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": "true",
    "mlflow.assistant.panelOpen_v1": "false",
}
_SETS = "".join(f"if(localStorage.getItem('{k}')===null)localStorage.setItem('{k}','{v}');"
                for k, v in FIRST_VISIT_CHOICES.items())
FIRST_VISIT = f"<script>try{{{_SETS}}}catch(e){{}}</script>"


def with_runs_view(page: bytes) -> bytes:
    """The UI's index.html with the first-visit choice, before MLflow's own script reads it."""
    if FIRST_VISIT.encode() in page or b"<head>" not in page:
        return page
    return page.replace(b"<head>", b"<head>" + FIRST_VISIT.encode(), 1)


def _on_index(response: Any) -> Any:
    from flask import request

    if request.endpoint != "serve" or response.status_code != 200 or response.mimetype != "text/html":
        return response
    response.direct_passthrough = False  # send_from_directory streams the file; we rewrite it
    response.set_data(with_runs_view(response.get_data()))
    return response


def create_app() -> Any:
    """MLflow's server app with the first-visit script; an ASGI app under uvicorn (MLflow's
    default server), the Flask app under gunicorn or waitress, as MLflow's basic-auth does."""
    from mlflow.environment_variables import _MLFLOW_SGI_NAME
    from mlflow.server import app

    app.after_request(_on_index)
    if _MLFLOW_SGI_NAME.get() == "uvicorn":
        from mlflow.server.fastapi_app import create_fastapi_app

        return create_fastapi_app(app)
    return app


def create_app_with_login() -> Any:
    """The same app behind MLflow's basic-auth (``--app-name ddplab-auth``): every request but
    /health asks for a login (the browser shows its login dialog), users and per-experiment
    permissions as MLflow documents them. Its settings are basic-auth's own: the ini file at
    MLFLOW_AUTH_CONFIG_PATH, MLFLOW_AUTH_ADMIN_PASSWORD, MLFLOW_FLASK_SERVER_SECRET_KEY."""
    from mlflow.server import app
    from mlflow.server.auth import create_app as with_basic_auth

    app.after_request(_on_index)
    return with_basic_auth(app)
