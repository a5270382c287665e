#!/usr/bin/env python3
"""Start ddplab's tracking server from the environment (the Dockerfile's ENV has the defaults).

    mlflow-serve              the server
    mlflow-serve db-upgrade   migrate the store's schema (`mlflow db upgrade`) after an upgrade

Alone (`docker run ddplab/mlflow`): SQLite on the /mlflow volume, no login. As a team server
(compose/tracking.yml, k8s/10-mlflow.yaml):
- MLFLOW_DB_HOST (with MLFLOW_DB_PORT, MLFLOW_DB_NAME, MLFLOW_DB_USER, MLFLOW_DB_PASSWORD_FILE):
  the store on PostgreSQL (psycopg2: SQLAlchemy's plain postgresql:// wants psycopg 3);
- MLFLOW_AUTH_ADMIN_PASSWORD_FILE and MLFLOW_FLASK_SERVER_SECRET_KEY_FILE: MLflow's basic-auth
  (`--app-name ddplab-auth`), its users and permissions in the same database.
Secrets are read from files at start, never from the image or the command line; a missing one
stops the server with one line naming it.
"""

import os
import socket
import sys
import tempfile
import time
import urllib.parse


def fail(msg: str) -> None:
    sys.exit(f"mlflow-serve: error: {msg}")


def secret(name: str) -> str:
    """NAME from the environment, else from the file NAME_FILE names ('' when neither is set)."""
    if os.environ.get(name):
        return os.environ[name]
    path = os.environ.get(f"{name}_FILE", "")
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except OSError as e:
        fail(f"{name}_FILE={path}: cannot read it ({e.strerror})")
    if not value:
        fail(f"{name}_FILE={path}: the file is empty")
    return value


def wait_for_database(host: str, port: int) -> None:
    """Kubernetes starts MLflow and PostgreSQL together (compose waits for its healthcheck):
    wait up to MLFLOW_DB_WAIT_S for the database to take connections, saying so once."""
    deadline = time.monotonic() + float(os.environ.get("MLFLOW_DB_WAIT_S", "180"))
    said = False
    while True:
        try:
            socket.create_connection((host, port), timeout=3).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                fail(f"MLFLOW_DB_HOST={host}:{port}: no database there ({e.strerror or e}) "
                     f"within MLFLOW_DB_WAIT_S={os.environ.get('MLFLOW_DB_WAIT_S', '180')} s")
            if not said:
                print(f"mlflow-serve: waiting for the database at {host}:{port}", flush=True)
                said = True
            time.sleep(1)


def store_uri() -> str:
    host = os.environ.get("MLFLOW_DB_HOST", "")
    if not host:
        return os.environ["MLFLOW_BACKEND_STORE_URI"]
    wait_for_database(host, int(os.environ.get("MLFLOW_DB_PORT", "5432")))
    password = secret("MLFLOW_DB_PASSWORD") or fail(
        "MLFLOW_DB_HOST is set but neither MLFLOW_DB_PASSWORD nor MLFLOW_DB_PASSWORD_FILE is")
    user = urllib.parse.quote(os.environ.get("MLFLOW_DB_USER", "mlflow"), safe="")
    return (f"postgresql+psycopg2://{user}:{urllib.parse.quote(password, safe='')}@{host}:"
            f"{os.environ.get('MLFLOW_DB_PORT', '5432')}/{os.environ.get('MLFLOW_DB_NAME', 'mlflow')}")


def with_login(uri: str) -> bool:
    """Basic-auth's settings in the environment and a private ini file; False without auth."""
    admin_password = secret("MLFLOW_AUTH_ADMIN_PASSWORD")
    if not admin_password:
        return False
    key = secret("MLFLOW_FLASK_SERVER_SECRET_KEY") or fail(
        "a login needs MLFLOW_FLASK_SERVER_SECRET_KEY or MLFLOW_FLASK_SERVER_SECRET_KEY_FILE "
        "(the same on every replica: it signs the UI's forms)")
    os.environ.update(MLFLOW_AUTH_ADMIN_PASSWORD=admin_password, MLFLOW_FLASK_SERVER_SECRET_KEY=key)
    # The users in the runs' database on PostgreSQL (their own tables); else a SQLite file.
    auth_db = uri if uri.startswith("postgresql") else os.environ.get(
        "MLFLOW_AUTH_DATABASE_URI", "sqlite:////mlflow/basic_auth.db")
    fd, ini = tempfile.mkstemp(prefix="basic_auth-", suffix=".ini")  # 0600, holds the DB password
    with os.fdopen(fd, "w") as f:
        f.write("[mlflow]\n"
                f"default_permission = {os.environ.get('MLFLOW_AUTH_DEFAULT_PERMISSION', 'READ')}\n"
                f"database_uri = {auth_db.replace('%', '%%')}\n"
                f"admin_username = {os.environ.get('MLFLOW_AUTH_ADMIN_USERNAME', 'admin')}\n"
                "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                # Each request's password check is a scrypt hash (n=32768: 0.39 s of a core
                # measured on a busy 2-core machine), and a job sends thousands of requests.
                # Cached per worker for a minute (MLflow's basic_auth.ini explains the
                # staleness: a changed password reaches the other workers within that).
                f"auth_cache_ttl_seconds = {os.environ.get('MLFLOW_AUTH_CACHE_TTL_S', '60')}\n")
    os.environ["MLFLOW_AUTH_CONFIG_PATH"] = ini
    # The admin made once here, before the workers start: each worker would otherwise try at
    # once, and all but one get a unique-key error in the database's log.
    from mlflow.server.auth import bootstrap_admin_user

    try:
        bootstrap_admin_user()
    except Exception as e:  # noqa: BLE001 - MLflow's own message says what to fix
        fail(f"the login's admin user could not be made: {str(e).splitlines()[0]}")
    return True


def main() -> None:
    uri = store_uri()
    if sys.argv[1:] == ["db-upgrade"]:
        os.execvp("mlflow", ["mlflow", "db", "upgrade", uri])
    login = with_login(uri)
    # MLflow's job runner starts seven more processes, each importing MLflow (~30 s of CPU at
    # start, measured) and leaves their queues in /dev/shm, for MLflow's GenAI jobs: ddplab runs
    # none. A caller may still set it.
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    os.execvp("mlflow", [
        "mlflow", "server", "--app-name", "ddplab-auth" if login else "ddplab",
        "--backend-store-uri", uri,
        "--artifacts-destination", os.environ["MLFLOW_ARTIFACTS_DESTINATION"], "--serve-artifacts",
        "--host", os.environ.get("MLFLOW_HOST", "0.0.0.0"), "--port", os.environ["MLFLOW_PORT"],
        "--workers", os.environ["MLFLOW_WORKERS"],
        "--allowed-hosts", os.environ["MLFLOW_ALLOWED_HOSTS"]])


if __name__ == "__main__":
    main()
