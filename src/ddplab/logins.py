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
from collections.abc import Mapping, MutableMapping
from typing import Any
from urllib.parse import unquote

CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
# A URL's login, the one rule mask and split_login share: after "scheme://", the user runs to the
# first ':' (no '/', no whitespace), and the password from there to the LAST '@' before the host,
# so a password may hold '@', ':', '/', '#', '?', '%', quotes... (``http://u:s3cr@t:pa/ss@host``).
# Within text, a URL ends at whitespace: the password ends at the last '@' of its word. A later
# '@' in the same word (``http://host:5000/x@y``) is taken for the login's end too: masked more
# than needed, never less.
_PASSWORD_IN_URL = re.compile(r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*://[^:/\s]*):\S+@")


def mask(text: str) -> str:
    """``text`` with every URL's password shown as ``***`` (``postgresql://u:***@db/x``): THE
    credential filter of everything ddplab prints or records (the logger, the environment
    capture, the spool's records, the recorded config, a study's commands and files)."""
    return _PASSWORD_IN_URL.sub(r"\1:***@", text) if "@" in text and "://" in text else text


def masked(value: Any) -> Any:
    """``value`` with :func:`mask` applied to every string in it (keys too), through mappings,
    lists and tuples: a record masked field by field, so its structure (JSON, YAML) stays."""
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, Mapping):
        return {masked(k): masked(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [masked(v) for v in value]
    return value


def split_login(uri: str) -> tuple[str, str, str]:
    """(the URI without its login, user, password) for an http(s) URI with one; else (uri, "", "").
    The login ends at the LAST '@' (the password may hold '@', '/', ':'...; percent-encoded
    characters are decoded), as for :func:`mask`."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme.lower() not in ("http", "https") or "@" not in rest:
        return uri, "", ""
    login, _, host = rest.rpartition("@")
    user, _, password = login.partition(":")
    return f"{scheme}://{host}", unquote(user), unquote(password)


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
