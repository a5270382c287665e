"""Unit: experiment loading, the precedence rule, and errors that name file, key and value."""

import subprocess
import sys
from pathlib import Path

import pytest

from ddplab.config import MODEL_NAMES, ConfigError, ExperimentConfig, load

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(text)
    return p


def test_defaults_then_file_then_overrides(tmp_path):
    p = write(tmp_path, "train:\n  epochs: 4\n  seed: 9\ndata:\n  batch_size: 16\n")
    cfg = load(p, ["train.epochs=7", "optim.lr=0.5"])
    assert cfg.train.epochs == 7          # override beats file
    assert cfg.train.seed == 9            # file beats default
    assert cfg.optim.lr == 0.5            # override of a default
    assert cfg.data.batch_size == 16
    assert cfg.data.num_workers == ExperimentConfig().data.num_workers  # default kept


@pytest.mark.parametrize("text, overrides, expected", [
    ("train:\n  epoch: 3\n", [], r"exp.yaml: train.epoch: unknown key; allowed keys: epochs"),
    ("train:\n  epochs: three\n", [], r"exp.yaml: train.epochs: got 'three'; expected int"),
    ("train:\n  epochs: 0\n", [], r"train.epochs: got 0; must be >= 1"),
    ("model:\n  name: resnet9\n", [], r"model.name: got 'resnet9'; choose one of: cnn, resnet18"),
    ("dist:\n  backend: nvlink\n", [], r"dist.backend: got 'nvlink'; expected one of 'auto'"),
    ("train:\n  deterministic: 1\n", [], r"train.deterministic: got 1; expected true or false"),
    ("data:\n  batch_size: true\n", [], r"data.batch_size: got True; expected int"),
    ("", ["train.epochs=x"], r"--set 'train.epochs=x': train.epochs: got 'x'; expected int"),
    ("", ["trian.epochs=2"], r"--set 'trian.epochs=2': trian: unknown key"),
    ("", ["train.epochs"], r"--set 'train.epochs': expected key.sub=value"),
    ("- a\n- b\n", [], r"exp.yaml: the top level must be a mapping"),
    ("train: [1, 2]\n", [], r"exp.yaml: train: got \[1, 2\]; expected a mapping"),
    ("data:\n  num_workers: 0\n  persistent_workers: true\n", [],
     r"data.persistent_workers: got True; needs data.num_workers > 0"),
])
def test_errors_name_source_key_value_and_allowed(tmp_path, text, overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load(write(tmp_path, text), overrides)


def test_missing_file_is_named():
    with pytest.raises(ConfigError, match="nope.yaml: experiment file not found"):
        load("nope.yaml")


def test_threads_per_rank_takes_int_or_auto(tmp_path):
    assert load(None, ["dist.threads_per_rank=3"]).dist.threads_per_rank == 3
    assert load(None, ["dist.threads_per_rank=auto"]).dist.threads_per_rank == "auto"
    with pytest.raises(ConfigError, match="dist.threads_per_rank: got 'many'"):
        load(None, ["dist.threads_per_rank=many"])


def test_int_is_accepted_where_float_is_expected():
    assert load(None, ["optim.lr=1"]).optim.lr == 1.0


@pytest.mark.parametrize("world, accum, batch, expected", [(2, 1, 32, 64), (4, 2, 16, 128),
                                                           (1, 1, 8, 8)])
def test_batch_arithmetic(world, accum, batch, expected):
    cfg = load(None, [f"train.grad_accum_steps={accum}", f"data.batch_size={batch}"])
    assert cfg.global_batch(world) == expected


def test_declared_global_batch_must_match_layout():
    cfg = load(None, ["data.batch_size=32", "train.global_batch_size=64"])
    assert cfg.global_batch(2) == 64
    with pytest.raises(ConfigError, match=r"32 x world 3 x train.grad_accum_steps 1 = 96"):
        cfg.global_batch(3)


def test_flat_and_yaml_round_trip(tmp_path):
    cfg = load(None, ["train.epochs=5"])
    assert cfg.flat()["train.epochs"] == 5
    again = load(write(tmp_path, cfg.to_yaml()))
    assert again == cfg


@pytest.mark.parametrize("path", sorted((REPO / "experiments").glob("*.yaml")))
def test_shipped_experiments_load_and_open_with_their_command(path):
    cfg = load(path)
    head = path.read_text().splitlines()[:6]
    assert any("ddplab train" in line or "make " in line for line in head), head
    assert any("global batch" in line.lower() for line in path.read_text().splitlines()[:12])
    assert cfg.model.name in MODEL_NAMES


def test_env_overrides_sit_between_file_and_command_line(tmp_path):
    from ddplab.config import env_overrides

    env = {"DDPLAB_SET": "train.epochs=5  optim.lr=0.2"}
    p = write(tmp_path, "train:\n  epochs: 2\n")
    cfg = load(p, ["optim.lr=0.3"], environ=env)  # load reads DDPLAB_SET itself
    assert (cfg.train.epochs, cfg.optim.lr) == (5, 0.3)
    assert env_overrides(env) == [("DDPLAB_SET", "train.epochs=5"), ("DDPLAB_SET", "optim.lr=0.2")]
    assert env_overrides({}) == []


def test_the_configuration_reference_page_is_the_schemas_own():
    """docs/config-reference.md is generated from config.py (make docs); a key added, removed
    or re-documented without regenerating it fails here."""
    out = subprocess.run([sys.executable, str(REPO / "tools" / "config_doc.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    page = (REPO / "docs" / "config-reference.md").read_text()
    assert "| `dist.fsdp.mixed_precision` |" in page and "| `train.epochs` |" in page


def test_a_study_passes_values_with_spaces_lists_and_maps_to_compose_intact(tmp_path):
    """The compose variants' DDPLAB_SET reads back as the values the study set (it was split
    at every space), and BACKEND is left empty unless the study sets a backend."""
    from ddplab.config import env_overrides, parse_override
    from ddplab.study.runner import compose_env
    from ddplab.study.spec import load_study

    (tmp_path / "compose").mkdir()  # a checkout: its compose files above the study
    (tmp_path / "compose" / "multinode.yml").write_text("services: {}\n")
    (tmp_path / "exp.yaml").write_text("name: e\ndist: {backend: gloo}\n")
    (tmp_path / "s.yaml").write_text(
        "name: s\nexperiment: exp.yaml\nvariants:\n"
        "  - {name: a, launcher: compose, set: {description: 'two words', "
        "script.env: {A: 'x y'}, script.args: [--n, '1 2'], tracking.run_name: \"it's\"}}\n"
        "  - {name: b, launcher: compose, set: {dist.backend: ccl}}\n")
    study = load_study(tmp_path / "s.yaml")
    env = compose_env(study, study.variant("a"), 0, "http://127.0.0.1:5000")
    read = map(parse_override, env_overrides({"DDPLAB_SET": env["DDPLAB_SET"]}))
    got = {".".join(keys): value for keys, value in read}
    assert got["description"] == "two words" and got["tracking.run_name"] == "it's"
    assert got["script.env"] == {"A": "x y"} and got["script.args"] == ["--n", "1 2"]
    assert env["BACKEND"] == ""  # the experiment's gloo stands
    assert compose_env(study, study.variant("b"), 0, "http://x:1")["BACKEND"] == "ccl"


def test_ddplab_set_with_an_unbalanced_quote_is_one_config_error():
    from ddplab.config import ConfigError, env_overrides

    with pytest.raises(ConfigError, match="DDPLAB_SET: got .*quote"):
        env_overrides({"DDPLAB_SET": "description='open"})
