"""Unit: the one precedence rule, applied by ``config.load`` alone (defaults < file <
``$DDPLAB_SET`` < ``--set``), and launchers that pass on only the user's own ``--set``: their
ranks read ``DDPLAB_SET`` from the environment they inherit (issue 51)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ddplab import cli
from ddplab.config import ConfigError, load

FILE = "name: p\ntrain:\n  epochs: 2\n  seed: 3\n  log_every: 4\ndata:\n  batch_size: 16\n"
USER_SETS = ["--set", "train.epochs=7", "--set", "data.batch_size=8"]


def experiment(tmp_path: Path) -> Path:
    p = tmp_path / "exp.yaml"
    p.write_text(FILE)
    return p


def test_defaults_then_file_then_ddplab_set_then_command_line(tmp_path):
    env = {"DDPLAB_SET": "train.epochs=5 train.seed=6 optim.lr=0.2 data.batch_size=12"}
    cfg = load(experiment(tmp_path), ["train.epochs=7", "optim.lr=0.3", "optim.lr=0.4"],
               environ=env)
    assert cfg.train.epochs == 7  # one key in all three: --set beats DDPLAB_SET beats the file
    assert cfg.train.seed == 6  # DDPLAB_SET beats the file
    assert cfg.train.log_every == 4  # the file beats the default
    assert cfg.optim.lr == 0.4  # --set beats DDPLAB_SET; the later --set wins
    assert cfg.data.batch_size == 12
    assert cfg.optim.momentum == 0.9  # a default nobody set
    assert load(experiment(tmp_path), environ={}).train.epochs == 2  # no DDPLAB_SET: the file


def test_a_mapping_set_on_a_section_sets_its_keys_and_keeps_the_others(tmp_path):
    """A hostile pass: ``--set 'train={epochs: 1}'`` (and a study's nested ``set: {train:
    {epochs: 1}}``) replaced the whole section: the file's seed and log_every silently went
    back to their defaults. A mapping on a section (nested ones too) is its keys; on a
    free-form key (``model.args``: another model's arguments) it replaces what was there."""
    p = tmp_path / "gpt.yaml"
    p.write_text(FILE + "model:\n  name: gpt\n  args: {n_layer: 2, n_head: 4}\n")
    env = {"DDPLAB_SET": "'train={epochs: 1}'"}
    cfg = load(p, ["train={early_stopping: {metric: eval/loss}}",
                   "train={early_stopping: {patience: 7}}", "model.args={n_layer: 3}"],
               environ=env)
    assert (cfg.train.epochs, cfg.train.seed, cfg.train.log_every) == (1, 3, 4)
    assert (cfg.train.early_stopping.metric, cfg.train.early_stopping.patience) == ("eval/loss", 7)
    assert cfg.model.args == {"n_layer": 3}  # (n_head not kept: the arguments as given)
    # Another callable named: the old one's arguments are not its own (a review: the GPT's
    # went to the CNN, "model 'cnn' takes no args")
    assert load(p, ["model={name: cnn}"], environ={}).model.args == {}
    # A study's nested set beside its variant's of the same section: both (study/spec.py)
    from ddplab.study.spec import Variant

    sets = Variant("v", set={"train": {"seed": 9}}).overrides({"train": {"epochs": 5}}, [])
    assert (load(p, sets, environ={}).train.epochs, load(p, sets, environ={}).train.seed) == (5, 9)


def test_load_reads_this_processs_ddplab_set_unless_given_an_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPLAB_SET", "train.epochs=5")
    assert load(experiment(tmp_path)).train.epochs == 5
    assert load(experiment(tmp_path), ["train.epochs=9"]).train.epochs == 9
    assert load(experiment(tmp_path), environ={"DDPLAB_SET": "train.epochs=6"}).train.epochs == 6


@pytest.mark.parametrize("env, sets, says", [
    ("train.epochs=x", [], "DDPLAB_SET 'train.epochs=x': train.epochs: got 'x'; expected int"),
    ("train.epochs=2", ["train.epochs=0"], "--set 'train.epochs=0': train.epochs: got 0; must be >= 1"),
    ("train.epochs=0", ["optim.lr=0.1"], "DDPLAB_SET 'train.epochs=0': train.epochs: got 0; must be >= 1"),
    ("trian.epochs=2", [], "DDPLAB_SET 'trian.epochs=2': trian: unknown key; allowed keys: name,"),
    ("epochs", [], "DDPLAB_SET 'epochs': expected key.sub=value"),
    ("description='open", [], "DDPLAB_SET: got \"description='open\"; No closing quotation"),
])
def test_a_bad_value_is_one_line_naming_its_source_key_value_and_what_is_allowed(
        tmp_path, env, sets, says):
    with pytest.raises(ConfigError) as e:
        load(experiment(tmp_path), sets, environ={"DDPLAB_SET": env})
    assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)


def _through_cli(argv: list[str], monkeypatch, module, name: str) -> argparse.Namespace:
    """``argv`` through the real CLI (cli.run: credentials, then the command) with
    DDPLAB_SET set, stopping where the launcher would start its ranks; the args it got."""
    monkeypatch.setenv("DDPLAB_SET", "train.epochs=1 data.batch_size=4")
    got: list[argparse.Namespace] = []
    monkeypatch.setattr(module, name, lambda a: got.append(a) or 0)
    assert cli.run(cli.parse(argv)) == 0
    return got[0]


def test_ddplab_run_gives_torchrun_only_the_users_own_sets(tmp_path, monkeypatch):
    from ddplab.launchers import local

    a = _through_cli(["run", "--nproc-per-node", "2", str(experiment(tmp_path)), *USER_SETS],
                     monkeypatch, local, "run")
    argv = local.torchrun_args(a)
    assert argv[-5:] == [str(experiment(tmp_path)), *USER_SETS], argv
    assert all(isinstance(x, str) for x in argv) and "DDPLAB_SET" not in " ".join(argv)
    # what the preflight and every rank then read: DDPLAB_SET from the environment, once
    cfg = load(a.experiment, a.overrides, a.script_args)
    assert (cfg.train.epochs, cfg.data.batch_size) == (7, 8)


def test_ddplab_launch_and_mpi_leave_ddplab_set_to_the_environment(tmp_path, monkeypatch):
    from ddplab.launchers import mpi, rendezvous

    exp = str(experiment(tmp_path))
    a = _through_cli(["launch", "--nnodes", "1", "--", exp, *USER_SETS], monkeypatch,
                     rendezvous, "launch")
    a.train_args = rendezvous.train_args(a.train_args)
    argv = rendezvous.torchrun_argv(a, rendezvous.Plan("10.0.0.2", "10.0.0.2", "eth0"))
    assert argv[-8:] == ["-m", "ddplab", "train", exp, *USER_SETS], argv

    m = _through_cli(["mpi", "launch", "--nnodes", "1", "--", exp, *USER_SETS], monkeypatch,
                     mpi, "main")
    m.train_args = rendezvous.train_args(m.train_args)
    argv = mpi.mpirun_argv(m, ["w0"], [], "10.1.0.0/16", {"DDPLAB_SET": "train.epochs=1"})
    assert argv[-5:] == [exp, *USER_SETS], argv
    assert " -x DDPLAB_SET " in " ".join(argv)  # by name: the ranks read it themselves
    assert "train.epochs=1" not in argv


@pytest.mark.parametrize("how, says", [
    ("file", "job.yaml: train.epochs: got 3; a script job runs your script's own loop"),
    ("set", "--set 'optim.lr=0.1': optim.lr: got 0.1; a script job"),
    ("env", "DDPLAB_SET 'data.batch_size=4': data.batch_size: got 4; a script job"),
    ("module", "--set 'train.epochs=2': train.epochs: got 2; a script job"),
])
def test_a_script_job_refuses_the_loops_own_keys_in_one_line(tmp_path, monkeypatch, how, says):
    """A script reads its own epochs and lr: ignoring ddplab's would run something other than
    what was asked. Allowed beside a script: script, dist, tracking, checkpoint, name."""
    from ddplab.launchers.local import load_job

    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text("script: {path: train.py}\ndist: {threads_per_rank: 1}\n"
                   + ("train: {epochs: 3}\n" if how == "file" else ""))
    env = {"DDPLAB_SET": "data.batch_size=4"} if how == "env" else {}
    sets = {"set": ["optim.lr=0.1"], "module": ["train.epochs=2"]}.get(how, [])
    monkeypatch.setattr("os.environ", {**env})
    with pytest.raises(ConfigError) as e:
        if how == "module":
            load_job(None, "pkg.train", sets, None)
        else:
            load(job, sets, environ=env)
    said = str(e.value)
    assert says in said and "script.flags." in said and "\n" not in said, said
    # The same job without them loads: a script's keys, its layout, its tracking.
    ok = load(job if how != "file" else script, ["dist.threads_per_rank=2", "checkpoint.keep=1"],
              environ={})
    assert ok.script.path.endswith("train.py") and ok.dist.threads_per_rank == 2


def test_a_script_jobs_printed_config_loads_again(tmp_path):
    """`ddplab config my_train.py > exp.yaml; ddplab train exp.yaml`: the printed config leaves
    out the loop's sections, which a script job refuses."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    printed = tmp_path / "exp.yaml"
    printed.write_text(load(script, ["script.flags.lr=0.1"], environ={}).to_yaml())
    again = load(printed, environ={})
    assert again.script.path == str(script.resolve()) and again.script.flags == {"lr": 0.1}
    assert "train:" in load(experiment(tmp_path), environ={}).to_yaml()  # a loop job's keeps them
