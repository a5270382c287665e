"""Print uv's options for the package sources pip is configured with, for `make setup`.

uv reads none of pip's settings. On a machine whose pip.conf or PIP_* variables name a mirror or
a folder of wheels (a company's index, a machine that keeps PyTorch's CUDA wheels on disk), uv
would download from PyPI what pip takes from there: ~3 GB for torch's CUDA build. With these
options both install the lock from the same places.

Usage: python tools/uv_sources.py   (prints one line of options; nothing when pip names none)
"""

from __future__ import annotations

import ast
import shlex
import subprocess
import sys

# pip's keys that name where packages come from, and uv's `uv pip install` options for each.
UV_OPTION = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
}
# pip's precedence, lowest first: the variables (":env:") override every file.
SCOPES = ("global", "user", "site", ":env:")


def _unquote(value: str) -> str:
    # pip prints each value as Python's repr: a multi-line pip.conf value comes as '\n/a\n/b'.
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value
    return parsed if isinstance(parsed, str) else value


def pip_sources(config_list: str) -> dict[str, list[str]]:
    """`pip config list` lines (scope.key='value') -> each source key's values, as pip resolves them."""
    by_scope: dict[str, dict[str, str]] = {}
    for line in config_list.splitlines():
        name, sep, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        if sep and key in UV_OPTION:
            by_scope.setdefault(key, {})[scope] = _unquote(value.strip())
    resolved = {}
    for key, scopes in by_scope.items():
        winner = max(scopes, key=lambda s: SCOPES.index(s) if s in SCOPES else -1)
        resolved[key] = scopes[winner].split()  # pip's lists are separated by spaces or newlines
    return resolved


def uv_options(sources: dict[str, list[str]]) -> list[str]:
    options = [part for key, flag in UV_OPTION.items() for value in sources.get(key, [])
               for part in (flag, value)]
    if options:
        # pip takes the best match from every index; uv stops at the first index that lists a
        # package, so a mirror holding other releases would hide the locked pin. The lock's
        # hashes are what guard against a look-alike package, as with pip.
        options += ["--index-strategy", "unsafe-best-match"]
    return options


def main() -> int:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    print(shlex.join(uv_options(pip_sources(listing))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
