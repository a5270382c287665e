"""The tracking server's credentials, from the environment or from files.

MLflow's client reads ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD`` (basic auth) or
``MLFLOW_TRACKING_TOKEN`` (bearer) from the environment. Secrets managers hand them over as
files instead (Docker and Compose secrets, Kubernetes Secret volumes), so ddplab also reads
``<NAME>_FILE``, the convention of the official database images: compose/tracking.yml's
generated login reaches the jobs that way, never through an image or a command line.

One precedence rule: credentials the caller set in the environment win, as a set: if any of
the three is set (non-empty), no file is read, so a token given by hand is never paired with a
password from a file.

A login written into the URI is taken out of it and sent the same way (logins.py).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from .logins import CREDENTIALS  # what MLflow's client sends; launchers forward them to every rank


def from_files(env: MutableMapping[str, str] | None = None) -> list[str]:
    """Set each credential from its ``<NAME>_FILE`` when the caller set none in ``env``
    (default: this process's environment, so the launchers forward the values). Returns the
    names set; a named file that cannot be read is a ConfigError (one line)."""
    from .config import ConfigError

    env = os.environ if env is None else env
    if any(env.get(name) for name in CREDENTIALS):
        return []
    loaded = []
    for name in CREDENTIALS:
        path = env.get(f"{name}_FILE", "")
        if not path:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read().strip()
        except UnicodeDecodeError:
            raise ConfigError(f"environment: {name}_FILE={path}: not a text file (UTF-8); "
                              f"allowed: a file holding the value as text, or set {name} "
                              "itself") from None
        except OSError as e:
            raise ConfigError(f"environment: {name}_FILE={path}: cannot read it ({e.strerror}); "
                              f"allowed: a readable file holding the value, or set {name} "
                              "itself") from None
        if not value:
            raise ConfigError(f"environment: {name}_FILE={path}: the file is empty; allowed: "
                              f"a file holding the value, or set {name} itself")
        env[name] = value
        loaded.append(name)
    return loaded

