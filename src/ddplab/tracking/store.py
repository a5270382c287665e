"""Where runs are kept: the tracking URI (its default, its check), the client, whether the
server answers and lets this client in, and where a browser shows a run."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import TrackingConfig
from ..errors import DdplabError


class TrackingError(DdplabError, RuntimeError):
    """The tracking store cannot be used."""


class StoreUnusable(TrackingError):
    """A store this MLflow cannot open as it is: its schema older (or newer) than this MLflow's,
    or a file at its path that is no SQLite database. Bad input, found before anything ran."""

    exit_code = 2


class StoreUnwritable(TrackingError):
    """A SQLite store whose file cannot be written: its disk full, or read-only."""


def embedded_store() -> str:
    """The default store of every command: SQLite in the working directory (make: the repo)."""
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def resolve_uri(cfg: TrackingConfig, env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """tracking.uri, else $MLFLOW_TRACKING_URI, else the embedded store."""
    return cfg.uri or env.get("MLFLOW_TRACKING_URI") or embedded_store()


def ui_address(uri: str, experiment_id: str, run_id: str = "", view: str = "") -> str:
    """Where a browser shows the run (or, without one, the experiment's runs table in the saved
    view ``view``, see ui_views.py): ": <url>", or " in <store>; browse it with ..."."""
    # workflowType: MLflow 3's UI opens in its GenAI view unless told (or the user toggled it).
    query = "workflowType=machine_learning" + (f"&viewStateShareKey={view}" if view else "")
    route = f"#/experiments/{experiment_id}/runs{'/' + run_id if run_id else ''}?{query}"
    # Inside compose or a cluster the tracking URI is an in-network name (http://mlflow:5000)
    # that the user's browser cannot open: DDPLAB_UI_URL says where the browser finds the UI.
    from ..logins import mask

    ui, uri = mask(os.environ.get("DDPLAB_UI_URL", "")), mask(uri)
    if ui or uri.startswith(("http://", "https://")):
        return f": {(ui or uri).rstrip('/')}/{route}"
    return f" in {uri}; browse it with {_ui_command(uri)}, then http://127.0.0.1:5000/{route}"


def _ui_command(uri: str) -> str:
    """`make ui` where it serves this store (the checkout's own mlflow.db, or the store its
    MLFLOW_TRACKING_URI names, from the checkout); anywhere else MLflow's server with ddplab's
    app over this store, which make ui runs. ``uri`` is masked: a store with a login is named
    by the variable that holds it, so the command runs as printed."""
    import shlex

    from ..logins import mask

    try:
        here: Path | None = Path.cwd()
    except OSError:  # (the job's folder was deleted under it: its run still ends, saying where)
        here = None
    env = os.environ.get("MLFLOW_TRACKING_URI", "")
    named = bool(env) and uri == mask(env)
    if here and (here / "Makefile").is_file() and (here / "src" / "ddplab").is_dir():
        if uri == embedded_store() or named:
            return "`make ui`"
    store = '"$MLFLOW_TRACKING_URI"' if named and env != uri else shlex.quote(uri)
    return f"`mlflow server --app-name ddplab --backend-store-uri {store}`"


# What MLflow's client can open (mlflow.tracking._tracking_service.utils, store registry).
TRACKING_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "file",
                    "databricks", "databricks-uc", "uc")
# SQLAlchemy's default driver per database (SQLAlchemy 2.1: psycopg 3 for postgresql).
DB_DRIVERS = {"postgresql": ("psycopg", "psycopg[binary]"), "mysql": ("MySQLdb", "mysqlclient"),
              "mssql": ("pyodbc", "pyodbc")}
DRIVER_MODULES = {"psycopg2": "psycopg2-binary", "psycopg": "psycopg[binary]",
                  "pymysql": "pymysql", "mysqldb": "mysqlclient", "pyodbc": "pyodbc",
                  "pg8000": "pg8000", "asyncpg": "asyncpg", "pymssql": "pymssql"}


def uri_problem(value: str) -> str | None:
    """Why MLflow's client could not use this tracking URI, or None (no network involved)."""
    import importlib.util

    scheme, sep, rest = value.partition(":")
    scheme = scheme.lower() if sep else ""
    base, _, driver = scheme.partition("+")
    if base not in TRACKING_SCHEMES:
        # A bare path to a SQLite file (what MLflow's own docs open as sqlite:///mlflow.db):
        # the URI it meant, to copy.
        meant = f"; for this SQLite file: sqlite:///{value}" \
            if not sep and value.endswith((".db", ".sqlite", ".sqlite3")) else ""
        return (f"use a tracking server (http://host:5000) or a store URI with one of the "
                f"schemes {', '.join(TRACKING_SCHEMES)}{meant}")
    if base == "sqlite" and rest.strip("/") in ("", ":memory:"):
        return ("an in-memory SQLite store vanishes with the process that opened it, before the "
                "run could be read: give a file, sqlite:///path/mlflow.db")
    if base == "sqlite" and not rest.startswith("///"):  # (SQLAlchemy's error, with a traceback)
        path = rest.lstrip("/")
        meant = (f"; for {path} here: sqlite:///{path}, for /{path}: sqlite:////{path}"
                 if rest.startswith("//") else  # (two slashes: either was meant)
                 f"; for the file /{path}: sqlite:////{path}" if rest.startswith("/") else "")
        return ("a SQLite store is sqlite:/// then its path: sqlite:///relative/mlflow.db, "
                f"sqlite:////absolute/mlflow.db{meant}")
    if base == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
        return ("MLflow 3 refuses the file store unless MLFLOW_ALLOW_FILE_STORE=true; use "
                "sqlite:///path/mlflow.db (the default) or a server")
    if base in ("http", "https"):
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError as e:  # ("http://[::1": it failed inside the ranks, "unreachable")
            return f"not a URL ({e}): http://host:5000"
        if not parts.hostname:
            return "no host in it: http://host:5000"
    if base in DB_DRIVERS:
        module, package = (driver, DRIVER_MODULES.get(driver, driver)) if driver else DB_DRIVERS[base]
        if importlib.util.find_spec(module.lower() if module != "MySQLdb" else module) is None:
            return f"{base} needs its driver: pip install {package} (or name one: {base}+driver://)"
    return None


def absolute_store(uri: str, cwd: str | None = None) -> str:
    """A local store's URI with its path made absolute (``sqlite:///mlflow.db`` is relative,
    ``sqlite:////x`` absolute; ``file:`` and a bare path alike), so that it names the same
    store from any directory; any other URI as given."""
    from urllib.parse import urlparse

    here = Path(cwd or os.getcwd())
    u = str(uri).rstrip("/")
    if u.startswith("file:"):
        return f"file://{(here / (urlparse(u).path or u[len('file:'):])).resolve()}"
    if u.startswith("sqlite:///"):
        path, sep, query = u[len("sqlite:///"):].partition("?")
        return f"sqlite:///{(here / path).resolve()}{sep}{query}"
    if not re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", u):  # a bare path
        return str((here / u).resolve())
    return str(uri)


def validated_uri(explicit: str = "", source: str = "--tracking-uri") -> str:
    """The tracking URI a command uses (``explicit``, else $MLFLOW_TRACKING_URI, else the
    embedded store here), or one ConfigError line naming where the bad one came from."""
    from ..logins import take_login

    value, where = (explicit, source) if explicit else (
        os.environ.get("MLFLOW_TRACKING_URI", ""), "MLFLOW_TRACKING_URI")
    if not value:
        return embedded_store()
    check_uri(value, where)
    return take_login(value)


def check_uri(value: str, where: str) -> None:
    """One ConfigError line for a tracking URI MLflow's client could not use (uri_problem),
    naming where it came from, a URL's password masked."""
    from ..config import ConfigError
    from ..logins import mask

    problem = uri_problem(value)
    if problem:
        raise ConfigError(f"{where}: got {mask(value)!r}; {problem}")


def reachable_client(uri: str) -> Any:
    """An MlflowClient for ``uri``, or one TrackingError line at once when the server does not
    answer (MLflow's own client would retry for minutes)."""
    problem = check_reachable(uri)
    if problem:
        raise TrackingError(f"{problem}: start it, or set MLFLOW_TRACKING_URI")
    return open_client(uri)


def reading_client(uri: str, run_id: str) -> Any:
    """A client for a command that reads a recorded run: a SQLite store that is not there is
    bad input (a ConfigError), not made empty on the way to "not found"."""
    from ..config import ConfigError

    db = sqlite_path(uri)
    if db is not None and not db.exists():
        raise ConfigError(f"run {run_id}: no tracking store at {uri} ({db} does not exist); set "
                          "MLFLOW_TRACKING_URI to the store the run is in")
    return reachable_client(uri)


def recorded_run(run_id: str) -> tuple[Any, Any, str]:
    """(client, run, uri) for a run of the store the environment names: no such run is bad
    input (a ConfigError, exit 2: `ddplab report`, `reproduce`, `diagnose` say it alike);
    anything else the server says, a TrackingError."""
    from mlflow.exceptions import MlflowException

    from ..config import ConfigError

    uri = validated_uri()
    client = reading_client(uri, run_id)
    try:
        return client, client.get_run(run_id), uri
    except MlflowException as e:
        # no such run, or no run id at all ('', 'my run'): the input, not the store
        bad = getattr(e, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
        raise (ConfigError if bad else TrackingError)(
            f"run {run_id!r} in {uri}: {str(e).splitlines()[0]}") from None


def sqlite_path(uri: str) -> Path | None:
    """The database file of a sqlite:/// URI (sqlite:////abs or sqlite:///rel), else None."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Jobs started together on a new SQLite store would both run MLflow's schema migrations
    ("duplicate column name"): the first to open it does, the others wait on a file lock."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    import fcntl

    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{db}.ddplab-lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield  # an unwritable folder: MLflow's own error will say so
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class _RaisedAnyway(logging.Filter):
    """MLflow logs each SQLAlchemy OperationalError of a store (a full disk, a locked database)
    with its whole traceback, then raises it: a delivery retrying every 2 s printed 20
    tracebacks in a 10 s job (a hostile pass). ddplab says what it raised, in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SQLAlchemy database error")


def quiet_store_errors() -> None:
    """MLflow's store errors said once, by ddplab, not also logged with tracebacks by MLflow."""
    db = logging.getLogger("mlflow.store.db.utils")
    if not any(isinstance(f, _RaisedAnyway) for f in db.filters):
        db.addFilter(_RaisedAnyway())


def open_client(uri: str) -> Any:
    """An MlflowClient whose store is ready (created and migrated once, under store_lock); a
    store it cannot open as it is (unusable) is one StoreUnusable line."""
    from mlflow import MlflowClient

    quiet_store_errors()
    # ddplab's own few files (a resumed run's forensics moved aside, a reproduction's config):
    # no progress bar of MLflow's between the job's lines
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

    try:
        with store_lock(uri):
            problem = _store_problem(uri)  # before MLflow retries it, logging each try
            if problem:
                raise StoreUnusable(problem)
            client = MlflowClient(uri)
            if not uri.startswith(("http://", "https://")):
                client.search_experiments(max_results=1)  # creates and migrates the store now
    except StoreUnusable:
        raise
    except Exception as e:
        known = unusable(e, uri)
        if known is None:
            raise
        raise known from None
    return client


# ---- a store this MLflow cannot use as it is: one line, the same on every command ----

SCHEMA_MISMATCH = re.compile(r"out-of-date database schema \(found version (\w*), but expected "
                             r"(\w+)\)")
"""MLflow's refusal (mlflow.store.db.utils._verify_schema), for a schema older than its own and,
worded alike, a newer one."""
NOT_A_DATABASE = ("file is not a database", "database disk image is malformed",
                  "unable to open database file")
"""SQLite's words for a store path that holds something else, or cannot be opened."""
UNWRITABLE = ("database or disk is full", "attempt to write a readonly database")
"""SQLite's words for a store it cannot write (StoreUnwritable)."""


def schema_advice(uri: str, found: str, needed: str) -> str:
    """The one line for a store whose MLflow schema is not this MLflow's."""
    import importlib.metadata

    from ..logins import mask

    shown = mask(uri)
    if found in ("", "None"):
        return (f"the MLflow store {shown} has tables but no MLflow schema version: not an MLflow "
                "store, or a broken one; point MLFLOW_TRACKING_URI at another store, or move "
                "this one aside (a new one is made in its place)")
    known, _ = _migrations()
    if known and found not in known:
        return (f"the MLflow store {shown} is at schema {found}, which this MLflow "
                f"({importlib.metadata.version('mlflow')}) does not know (it needs {needed}): a "
                "newer MLflow made it; upgrade MLflow (pip install -U mlflow), or use another "
                "store")
    return (f"the MLflow store {shown} is at schema {found}, this MLflow needs {needed}: upgrade "
            f"it with `mlflow db upgrade {shown}` (back it up first)")


def _not_a_database(uri: str, said: str) -> str:
    from ..logins import mask

    db = sqlite_path(uri)
    what = ""
    if db is not None and db.is_dir():
        what = f" ({db} is a directory)"
    elif db is not None and db.is_file():
        what = f" ({db}: {db.stat().st_size} bytes, not an SQLite database MLflow can read)"
    return (f"the MLflow store {mask(uri)} cannot be opened: {said}{what}; point "
            "MLFLOW_TRACKING_URI at another store, or move that path aside (a new store is made "
            "in its place)")


def _unwritable(uri: str, said: str) -> str:
    from ..logins import mask

    db = sqlite_path(uri)
    where = f" on {db.parent}" if db is not None else ""
    return (f"the MLflow store {mask(uri)} cannot be written: {said} (SQLite); free space{where} "
            "or make it writable, or point MLFLOW_TRACKING_URI at another store")


def unusable(e: BaseException, uri: str, schema_only: bool = False) -> TrackingError | None:
    """What MLflow or SQLite raised on opening ``uri``, as one line, when it says the store is
    unusable as it is (SCHEMA_MISMATCH; unless ``schema_only``, NOT_A_DATABASE, UNWRITABLE);
    else None."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        text = str(cause)
        # (the delivery process's answer, as rank 0 raised it)
        said_there = re.search(r"\b(StoreUnusable|StoreUnwritable): (.+)", text)
        if said_there:
            kind = StoreUnusable if said_there.group(1) == "StoreUnusable" else StoreUnwritable
            return kind(said_there.group(2))
        m = SCHEMA_MISMATCH.search(text)
        if m:
            return StoreUnusable(schema_advice(uri, m.group(1), m.group(2)))
        said = next((s for s in NOT_A_DATABASE if s in text), "")
        if said and not schema_only:
            return StoreUnusable(_not_a_database(uri, said))
        said = next((s for s in UNWRITABLE if s in text), "")
        if said and not schema_only:
            return StoreUnwritable(_unwritable(uri, said))
        cause = cause.__cause__ or cause.__context__
    return None


def store_problem(uri: str) -> str | None:
    """Before any job: the one line for a SQLite store this MLflow cannot use as it is (what
    opening it would raise, see unusable), else None. Reads the file itself, without MLflow (a
    job's rank 0 does not import it), under store_lock (a job beside it may be making the
    store's schema); any doubt is None: opening the store says what it is."""
    db = sqlite_path(uri)
    if db is None:
        return None
    # SQLite writes the file and, beside it, its journal: a read-only file or folder failed
    # only once the run was opened, on rank 0, with tracebacks (a hostile pass)
    for path in (db, db.parent) if db.exists() else (db.parent,):
        if path.exists() and not os.access(path, os.W_OK):
            return _unwritable(uri, f"{path} is read-only here")
    if not db.exists():
        return None
    with store_lock(uri):
        return _store_problem(uri)


def _store_problem(uri: str) -> str | None:
    import sqlite3
    from urllib.parse import quote

    db = sqlite_path(uri)
    if db is None:
        return None
    if db.is_dir():
        return _not_a_database(uri, "unable to open database file")
    if not db.is_file():
        return None  # made on first use
    try:
        with contextlib.closing(sqlite3.connect(f"file:{quote(str(db.resolve()))}?mode=ro",
                                                uri=True, timeout=5)) as con:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master")}
            if "alembic_version" not in tables:
                return None  # new (MLflow makes its tables), or not MLflow's: MLflow says
            row = con.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.OperationalError:
        return None  # locked, unreadable: opening it says why
    except sqlite3.DatabaseError as e:
        said = next((s for s in NOT_A_DATABASE if s in str(e)), str(e).split("\n")[0][:100])
        return _not_a_database(uri, said)
    _, head = _migrations()
    found = str(row[0]) if row and row[0] else ""
    return schema_advice(uri, found, head) if head and found != head else None


@functools.cache
def _migrations() -> tuple[frozenset[str], str]:
    """(every schema revision this MLflow knows, its newest), from its migration scripts (read,
    not imported: MLflow's import costs a job's rank 0 a second); (empty, "") when unclear."""
    import importlib.util

    spec = importlib.util.find_spec("mlflow")
    if spec is None or not spec.submodule_search_locations:
        return frozenset(), ""
    versions = Path(list(spec.submodule_search_locations)[0]) / "store" / "db_migrations" / "versions"
    revisions: set[str] = set()
    parents: set[str] = set()
    try:
        for f in versions.glob("*.py"):
            text = f.read_text(errors="replace")
            rev = re.search(r"^revision\s*(?::[^=\n]*)?=\s*[\"'](\w+)[\"']", text, re.M)
            down = re.search(r"^down_revision\s*(?::[^=\n]*)?=\s*(.+)$", text, re.M)
            if rev:
                revisions.add(rev.group(1))
            if down:
                parents.update(re.findall(r"[\"'](\w+)[\"']", down.group(1)))
    except OSError:
        return frozenset(), ""
    heads = revisions - parents
    return frozenset(revisions), (next(iter(heads)) if len(heads) == 1 else "")


def check_reachable(uri: str, timeout_s: float = 5.0) -> str | None:
    """None when the store answers a real API call, else a one-line reason.

    Through MLflow's own client, so every way it authenticates works here too (basic auth,
    MLFLOW_TRACKING_TOKEN, a custom CA, auth plugins), but without its minutes of retries: a
    job should say at once that the server is down. /health would not do: it answers even
    when clients get 403 (allowed-hosts).
    """
    if not uri.startswith(("http://", "https://")):
        return None
    from mlflow import MlflowClient

    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(timeout_s))}
    saved = {k: os.environ.get(k) for k in quick}
    os.environ.update(quick)
    try:
        MlflowClient(uri).search_experiments(max_results=1)
        return None
    except Exception as e:  # noqa: BLE001 - any failure is the one line below
        from ..logins import mask

        return mask(_no_answer(uri, e))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v




def _no_answer(uri: str, e: Exception) -> str:
    """check_reachable's line for what MLflow's client raised, by the delivery's rule
    (``spool.describe``): answered, with its status, or unreachable, with urllib3's cause."""
    from .spool import describe

    return f"tracking server {uri} {describe(e, silent='is unreachable', refused='answered')}"


def auth_refusal(uri: str) -> str | None:
    """One line naming what to do when the store refuses this client, else None: the server's
    401 or 403 (what to set), or a SQLite store this MLflow cannot use as it is (store_problem:
    a job refuses before it starts, not once its run should open)."""
    stale = store_problem(uri)
    if stale:
        return stale
    problem = check_reachable(uri)
    if not problem or " answered HTTP 40" not in problem:
        return None
    user = os.environ.get("MLFLOW_TRACKING_USERNAME", "")
    if " answered HTTP 401" in problem:
        if not user and not os.environ.get("MLFLOW_TRACKING_TOKEN"):
            return (f"MLFLOW_TRACKING_USERNAME: not set; the tracking server {uri} asks for "
                    "credentials (HTTP 401): set MLFLOW_TRACKING_USERNAME and "
                    "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) for it")
        who = f"user {user!r}" if user else "MLFLOW_TRACKING_TOKEN"
        return (f"MLFLOW_TRACKING_PASSWORD: the tracking server {uri} refused the credentials of "
                f"{who} (HTTP 401): check MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                "(or MLFLOW_TRACKING_TOKEN)")
    if " answered HTTP 403" in problem:
        return (f"MLFLOW_TRACKING_URI: the tracking server {uri} answered HTTP 403: its "
                "--allowed-hosts does not list the host:port this job calls it by, or user "
                f"{user or '(none)'} may not read experiments there ({problem.split('(', 1)[-1][:160]}")
    return None


def _permission_denied(e: Exception) -> bool:
    return getattr(e, "get_http_status_code", lambda: 0)() == 403 or "PERMISSION_DENIED" in str(e)


def _experiment_refused(exp_name: str, e: Exception) -> TrackingError:
    user = os.environ.get("MLFLOW_TRACKING_USERNAME", "(no user)")
    return TrackingError(
        f"tracking: user {user} may not create runs in the experiment {exp_name!r} on this server "
        "(HTTP 403: its creator has MANAGE on it, others READ unless granted EDIT): choose another "
        "experiment name (the experiment file's `name:`, or --set tracking.experiment=NAME), or "
        "ask its owner or an admin to grant you EDIT (docs/tracking.md, \"A tracking server "
        "with authentication\")")
