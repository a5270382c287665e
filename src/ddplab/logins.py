"""Logins in URLs: out of the tracking URI, masked everywhere else.

A login written into the URI (``http://alice:PASSWORD@host:5000``, in MLFLOW_TRACKING_URI or
``tracking.uri``) is taken out of it at once and sent the way MLflow's client sends any login
(``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``), so the URI that every message,
tag, artifact and spool file shows holds no password; ``mask`` hides the password of any other
URL (a database URI, a ``--set`` echoed back) wherever text is printed or recorded: the logger,
the environment capture, the recorded config, a study's command. No ddplab import here: the
config and the logger use it.
"""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from urllib.parse import unquote, urlsplit, urlunsplit

CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
_PASSWORD_IN_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):[^@\s/]+@")


def mask(text: str) -> str:
    """``text`` with every URL's password shown as ``***`` (``postgresql://u:***@db/x``)."""
    return _PASSWORD_IN_URL.sub(r"\1:***@", text) if "@" in text else text


def split_login(uri: str) -> tuple[str, str, str]:
    """(the URI without its login, user, password) for an http(s) URI with one; else (uri, "", "")."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return uri, "", ""
    host = parts.netloc.rsplit("@", 1)[1]
    return (urlunsplit(parts._replace(netloc=host)), unquote(parts.username or ""),
            unquote(parts.password or ""))


def take_login(uri: str, env: MutableMapping[str, str] | None = None) -> str:
    """``uri`` without its login; the login goes to MLFLOW_TRACKING_USERNAME/PASSWORD unless
    the caller set credentials in the environment (they win, as for files)."""
    env = os.environ if env is None else env
    clean, user, password = split_login(uri)
    if clean != uri and not any(env.get(name) for name in CREDENTIALS):
        if user:
            env["MLFLOW_TRACKING_USERNAME"] = user
        if password:
            env["MLFLOW_TRACKING_PASSWORD"] = password
    return clean


def from_uri(env: MutableMapping[str, str] | None = None) -> None:
    """MLFLOW_TRACKING_URI's login, if any, moved into the credential variables (before any
    launcher copies the environment to the ranks and the delivery processes)."""
    env = os.environ if env is None else env
    uri = env.get("MLFLOW_TRACKING_URI", "")
    if uri:
        env["MLFLOW_TRACKING_URI"] = take_login(uri, env)
