"""Unit: one error base. A DdplabError is its one line and its exit code; anything else is a
bug, shown as a one-line summary and then its traceback (the CLI, in-process)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import ddplab
from ddplab import cli
from ddplab.errors import BadInput, DdplabError


def _package_exceptions() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(ddplab.__path__, "ddplab."):
        if ".stand_in." in info.name or info.name.endswith(("__main__", "mlflow_app")):
            continue
        module = importlib.import_module(info.name)
        found += [c for _, c in inspect.getmembers(module, inspect.isclass)
                  if issubclass(c, BaseException) and c.__module__ == info.name]
    return found


def test_every_error_class_of_the_package_is_a_ddplab_error():
    found = _package_exceptions()
    assert len(found) >= 12
    assert [c.__qualname__ for c in found if not issubclass(c, DdplabError)] == []
    assert {c.__name__ for c in found if issubclass(c, BadInput)} >= {"ConfigError", "LaunchError"}


def _failing(error: BaseException) -> argparse.Namespace:
    """A parsed command whose handler raises ``error`` (cli.run maps it)."""
    def handler(args):
        raise error

    return argparse.Namespace(command="config", func=handler)


def test_a_ddplab_error_is_one_line_and_its_exit_code(capsys):
    from ddplab.training.checkpoint import CheckpointError

    assert cli.run(_failing(CheckpointError("checkpoint.dir: /x is full"))) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["ddplab config: error: checkpoint.dir: /x is full"]
    assert cli.run(_failing(BadInput("data.path: got 'x'; no such folder"))) == 2
    assert capsys.readouterr().err.strip() == "ddplab: error: data.path: got 'x'; no such folder"


def test_anything_else_is_a_bug_with_one_line_first_and_its_traceback(capsys):
    import json

    bug = argparse.Namespace(command="config", func=lambda a: json.loads("{"))  # raised in a library
    with pytest.raises(ValueError, match="Expecting property name"):
        cli.run(bug)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ddplab: error: unexpected JSONDecodeError: Expecting property name enclosed in "
                   "double quotes: line 1 column 2 (char 1) (traceback below)"]


def test_an_error_raised_in_the_users_own_code_says_so_and_where(capsys):
    """A user's dataset, model or loss raising is theirs to read, not a ddplab bug."""
    with pytest.raises(ValueError, match="a real bug"):
        cli.run(_failing(ValueError("a real bug\nsecond line")))
    (err,) = capsys.readouterr().err.strip().splitlines()
    line = _failing.__code__.co_firstlineno + 3  # handler's raise
    assert err == (f"ddplab: error: your code ({Path(__file__)}:{line}) raised ValueError: a real "
                   "bug (traceback below)")


def test_first_line_is_what_happened_not_a_librarys_note_and_is_cut_visibly():
    from ddplab.errors import first_line

    sqlalchemy = ("(raised as a result of Query-invoked autoflush; consider using a "
                  "session.no_autoflush block if this flush is occurring prematurely)\n"
                  "(sqlite3.OperationalError) database or disk is full\n[SQL: INSERT ...]")
    assert first_line(sqlalchemy) == "(sqlite3.OperationalError) database or disk is full"
    assert first_line("\n  one\ntwo") == "one" and first_line("") == ""
    long = first_line("x" * 700 + " Start it, or set tracking.enabled=false")
    assert len(long) == 600 and long.endswith("...")


def test_a_long_traceback_keeps_its_header_the_scripts_frames_and_where_it_was_raised():
    """A hostile pass: a Lightning script's failure in its 40-frame stack was kept as its last
    6000 characters, cut mid-line (", in run"), its Traceback header and the script's own
    frame (`t.fit(...)` in pl_train.py) gone, and nothing said that text was left out."""
    from ddplab.errors import keep_ends

    frames = "".join(f'  File "/site-packages/lightning/f{i}.py", line {i}, in f{i}\n    call()\n'
                     for i in range(300))
    tb = ("Traceback (most recent call last):\n  File \"pl_train.py\", line 46, in <module>\n"
          "    t.fit(M(), dl)\n" + frames + "ValueError: bad batch at step 10\n")
    kept = keep_ends(tb, 6000)
    assert len(kept) <= 6000 and kept.startswith("Traceback (most recent call last):\n")
    assert '"pl_train.py", line 46' in kept and kept.endswith("ValueError: bad batch at step 10\n")
    assert "lines left out ...]" in kept and all(line.startswith(("  ", "Traceback", "Value"))
                                                for line in kept.splitlines())
    assert keep_ends("short\n", 6000) == "short\n"
    # A review: an exception line longer than the tail's room (load_state_dict's "Missing
    # key(s)" with 600 keys) was left out whole; its start is kept.
    huge = tb.replace("ValueError: bad batch at step 10", "RuntimeError: Missing key(s): " +
                      ", ".join(f'"layer{i}.weight"' for i in range(600)))
    kept = keep_ends(huge, 6000)
    assert "RuntimeError: Missing key(s): \"layer0.weight\"" in kept and len(kept) <= 6100, kept[-300:]
