"""Issue 53, item 5: bounds before work. A study's jobs (the grid as the product of its axes)
and every YAML document ddplab reads from a user (experiment files, study files, ``--set`` and
``DDPLAB_SET`` values) are bounded before anything is planned: over the bound, one line naming
the limit and how to raise it, exit 2, at once. In-process through the CLI's main."""

from __future__ import annotations

import os
import time

import pytest
import yaml

from tests.conftest import REPO

QUICKSTART = str(REPO / "experiments" / "quickstart.yaml")
FAST_S = 2.0


def bomb(levels: int = 9, width: int = 9) -> str:
    """A "billion laughs" as flow YAML, under 500 bytes: 9 aliases of 9 aliases... = 9^9 leaves."""
    items = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    items += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "{" + ", ".join(items) + "}"


@pytest.fixture
def at(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith(("DDPLAB_SET", "DDPLAB_MAX", "MLFLOW_TRACKING_URI")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return tmp_path


def refused(capsys, argv: list[str]) -> str:
    """``ddplab ARGV``: exit 2, one line, no traceback, within FAST_S; the line."""
    from ddplab import cli

    t0 = time.monotonic()
    code = cli.main(argv)
    took = time.monotonic() - t0
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in out.err, out.err[-2000:]
    assert took < FAST_S, f"{took:.1f}s: {lines[0]}"
    assert lines[0].startswith("ddplab: error: ") and not out.out.strip(), out
    return lines[0]


def study(path, **fields) -> str:
    body = {"name": "big", "experiment": QUICKSTART, **fields}
    path.write_text(yaml.safe_dump(body, default_flow_style=None))
    return str(path)


def test_a_million_variant_grid_is_refused_before_it_is_expanded(at, capsys):
    axis = list(range(1, 101))
    path = study(at / "grid.yaml", grid={"data.batch_size": axis, "train.epochs": axis,
                                         "train.log_every": axis})
    line = refused(capsys, ["study", "run", path, "--dry-run"])
    assert (f"{path}: grid: got '100 x 100 x 100 = 1000000 variants'; 1000000 variants x 1 "
            "repeats = 1000000 jobs, and a study plans at most max_jobs: 1000 (set max_jobs: N "
            "in the study file") in line


def test_max_jobs_bounds_listed_variants_repeats_and_the_command_lines_repeats(at, capsys):
    from ddplab import cli

    four = {"grid": {"train.log_every": [1, 2], "train.epochs": [1, 2]}, "max_jobs": 4}
    assert cli.main(["study", "run", study(at / "ok.yaml", **four), "--dry-run"]) == 0
    assert "4 jobs (4 variants x 1 repeats)" in capsys.readouterr().out
    line = refused(capsys, ["study", "run", str(at / "ok.yaml"), "--dry-run", "--repeats", "2"])
    assert "ok.yaml: repeats: got 2; 4 variants x 2 repeats = 8 jobs, and a study plans at most " \
           "max_jobs: 4" in line
    listed = [{"name": f"v{i}"} for i in range(3)]
    line = refused(capsys, ["study", "run", study(at / "l.yaml", variants=listed, repeats=2,
                                                  max_jobs=5), "--dry-run"])
    assert "l.yaml: variants: got '3 variants'; 3 variants x 2 repeats = 6 jobs" in line
    line = refused(capsys, ["study", "run", study(at / "m.yaml", variants=listed, max_jobs=0)])
    assert "max_jobs: got 0; must be an integer in [1, 1000000]" in line
    # --repeats 0 is the default (the file's): the range that refuses -1 says so, not [1, ...]
    line = refused(capsys, ["study", "run", str(at / "ok.yaml"), "--dry-run", "--repeats", "-1"])
    assert "--repeats: got -1; must be an integer in [0, 1000] (0, the default: the file's repeats)" in line


def test_an_alias_bomb_in_a_study_file_is_refused_in_one_line(at, capsys):
    path = at / "bomb.yaml"
    path.write_text(f"name: big\nexperiment: {QUICKSTART}\nvariants: [{{name: a}}]\n"
                    f"set: {{model.args: {bomb()}}}\n")
    assert path.stat().st_size < 1024
    line = refused(capsys, ["study", "run", str(path), "--dry-run"])
    assert (f"{path}: the YAML expands to over 100000 nodes at line 4" in line
            and "allowed: at most 100000 nodes a document; DDPLAB_MAX_YAML_NODES=N allows more"
            in line), line


@pytest.mark.parametrize("where", ["--set", "DDPLAB_SET", "experiment"])
def test_an_alias_bomb_in_a_set_or_an_experiment_is_refused_in_one_line(at, capsys, monkeypatch,
                                                                        where):
    value = f"model.args={bomb()}"
    path = study(at / "s.yaml", variants=[{"name": "a"}])
    experiment = QUICKSTART
    if where == "experiment":
        experiment = str(at / "exp.yaml")
        (at / "exp.yaml").write_text(f"name: x\ndescription: y\nlaughs: {bomb()}\n")
        path = study(at / "s.yaml", variants=[{"name": "a"}], experiment=experiment)
    extra = ["--set", value] if where == "--set" else []
    if where == "DDPLAB_SET":
        monkeypatch.setenv("DDPLAB_SET", f"'{value}'")
    for argv in (["study", "run", path, "--dry-run", *extra], ["config", experiment, *extra]):
        line = refused(capsys, argv)
        assert "the YAML expands to over 100000 nodes" in line and "DDPLAB_MAX_YAML_NODES" in line
        if where != "experiment":  # the value named by its start, not all of its bytes
            assert f"{where} 'model.args={{a0: &a0" in line and "characters)'" in line, line


def test_a_recursive_alias_and_a_deep_nesting_are_one_line_each(at, capsys):
    (at / "rec.yaml").write_text("name: x\ndescription: &d [1, *d]\n")
    assert "the alias *d at line 2, column 21 is inside the node it names" in refused(
        capsys, ["config", "rec.yaml"])
    (at / "deep.yaml").write_text("name: x\nmodel: {args: " + "[" * 3000 + "]" * 3000 + "}\n")
    assert ("deep.yaml: the YAML nests lists or mappings deeper than 100 levels at line 2, "
            "column 113; allowed: at most 100 levels") in refused(capsys, ["config", "deep.yaml"])


def test_the_yaml_bound_is_raised_by_its_variable_and_a_bad_value_is_one_line(at, capsys,
                                                                             monkeypatch):
    from ddplab import cli

    big = study(at / "big.yaml", variants=[{"name": f"v{i}", "set": {"train.log_every": i + 1}}
                                           for i in range(200)])
    monkeypatch.setenv("DDPLAB_MAX_YAML_NODES", "500")
    assert "over 500 nodes" in refused(capsys, ["study", "run", big, "--dry-run"])
    monkeypatch.setenv("DDPLAB_MAX_YAML_NODES", "5000")
    assert cli.main(["study", "run", big, "--dry-run"]) == 0
    capsys.readouterr()
    monkeypatch.setenv("DDPLAB_MAX_YAML_NODES", "lots")
    assert "environment: DDPLAB_MAX_YAML_NODES: got 'lots'; a whole number >= 1" in refused(
        capsys, ["config", QUICKSTART])


def test_every_shipped_experiment_and_study_is_far_under_the_yaml_bound():
    from ddplab.config import MAX_YAML_NODES, _Loader

    for path in [*(REPO / "experiments").glob("*.yaml"), *(REPO / "experiments" / "studies").glob("*.yaml")]:
        loader = _Loader(path.read_text())
        loader.get_single_node()
        assert loader.nodes < MAX_YAML_NODES // 20, (path, loader.nodes)


# ---- item 6 (part): the GPU proof kit's OUT ----

def test_the_proof_refuses_an_out_that_is_a_file_in_one_line(tmp_path, capsys):
    """benchmarks/gpu_proof.py's own argument handling, in-process (no step runs)."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_proof

    (tmp_path / "a-file").write_text("x")
    for out, says in ((tmp_path / "a-file", "an existing file; allowed: a folder"),
                      (tmp_path / "a-file" / "sub", "cannot make it (Not a directory)")):
        assert gpu_proof.main([str(out)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"gpu_proof: OUT: got {str(out)!r}: {says}"), line


def test_the_proof_script_takes_out_and_kit_where_the_user_stands(tmp_path):
    """benchmarks/gpu_proof.sh as typed, with a stand-in Python that records what it is asked
    (no kit is installed, no step runs): a relative OUT and --kit are the caller's working
    directory's, never the checkout's; an OUT that is a file is one line before any install."""
    import subprocess

    script = REPO / "benchmarks" / "gpu_proof.sh"
    (tmp_path / "a-file").write_text("x")
    bad = subprocess.run(["bash", str(script), "a-file"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        f"gpu_proof: OUT: got '{tmp_path / 'a-file'}': an existing file; allowed: a folder (new "
        "or existing) for the proof's logs, store and pages"], bad.stderr
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "stand-in.whl").write_text("")
    log = tmp_path / "asked.txt"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    python.chmod(0o755)
    ran = subprocess.run(["bash", str(script), "rel/out", "--kit", "kit", "--quick"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": os.environ["PATH"], "PYTHON": str(python)})
    assert ran.returncode == 0, ran.stderr
    asked = log.read_text().splitlines()
    assert f"benchmarks/gpu_proof.py {tmp_path / 'rel' / 'out'} --quick" in asked, asked
    assert any(f"{tmp_path / 'kit'}/stand-in.whl" in a for a in asked), asked
    assert (tmp_path / "rel" / "out").is_dir() and not (REPO / "rel").exists()
