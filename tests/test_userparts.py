"""Your own experiment: a model, datasets and a loss given by import path; ImageFolder trees;
the built-in GPT on byte tokens. Unit tests first, then real jobs (torchrun, mpirun, the CPU
image) with modules and data that live outside the repository."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from ddplab import config
from ddplab.workload import data, losses, textdata, userparts
from ddplab.workload.gpt import GPT
from tests.conftest import REPO, job_env, runs

BIN = Path(sys.executable).parent
SPIRALS = REPO / "experiments" / "examples" / "spirals.yaml"

MYNET = '''
import torch
from torch import nn


class Net(nn.Module):
    """A small CNN; ddplab passes channels, image_size and num_classes from the data."""

    def __init__(self, channels, image_size, num_classes, width=16):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(width, num_classes))
        self.image_size = image_size

    def forward(self, x):
        return self.body(x)


def build(channels, image_size, num_classes, width=16):
    return Net(channels, image_size, num_classes, width)
'''

COLOURS = {"red": (200, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 200)}


def imagefolder_tree(root: Path, per_class: dict[str, int], size: int = 12) -> Path:
    """A real ImageFolder tree of PNGs: one colour per class, with noise."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for split, n in per_class.items():
        for name, rgb in COLOURS.items():
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                noise = torch.randint(-60, 61, (size, size, 3), generator=g)
                pixels = (torch.tensor(rgb) + noise).clamp(0, 255).to(torch.uint8).numpy()
                Image.fromarray(pixels, "RGB").save(root / split / name / f"{i}.png")
    return root


@pytest.fixture
def own_experiment(tmp_path: Path) -> Path:
    """An experiment, its model module and its images, all outside the repository."""
    exp = tmp_path / "myexp"
    exp.mkdir()
    (exp / "mynet.py").write_text(MYNET)
    imagefolder_tree(tmp_path / "imgs", {"train": 48, "val": 16})
    (exp / "own.yaml").write_text(yaml.safe_dump({
        "name": "own", "data": {"dataset": "imagefolder", "root": str(tmp_path / "imgs"),
                                "image_size": 12, "batch_size": 8},
        "model": {"name": "mynet:build", "args": {"width": 16}},
        "optim": {"name": "adam", "lr": 0.01}, "train": {"epochs": 4, "log_every": 4},
        "checkpoint": {"dir": str(tmp_path / "ck")}}))
    return exp / "own.yaml"


# ---- unit ----

def test_a_module_beside_the_experiment_imports_without_pythonpath(own_experiment, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "mynet", raising=False)
    cfg = config.load(own_experiment)
    parts = userparts.resolve(cfg, own_experiment)
    assert parts.search_path == str(own_experiment.parent) and parts.paths == {"model": "mynet:build"}
    info = data.DataInfo("image", 3, 12, 3)
    from ddplab.workload import models

    model = models.build(cfg.model, info, parts.model)
    assert model(torch.zeros(2, 3, 12, 12)).shape == (2, 3)  # num_classes came from the data
    tags = parts.tags()
    file = own_experiment.parent / "mynet.py"
    assert tags["ddplab.user.model.file"] == str(file)
    assert tags["ddplab.user.model.sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    assert tags["ddplab.user.model.git"] == "not in git"


def test_offered_passes_only_the_names_a_signature_declares():
    def build(num_classes, hidden=4):
        return num_classes, hidden
    got = userparts.offered(build, {"hidden": 8}, {"num_classes": 5, "channels": 3, "hidden": 1})
    assert got == {"num_classes": 5, "hidden": 8}  # the user's args win over ddplab's values


def git_repo_with_a_commit(root: Path) -> None:
    """A real git repository holding a.py (x = 1), committed."""
    git = shutil.which("git")
    assert git
    for args in (["init", "-q"], ["add", "a.py"],
                 ["-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "a"]):
        if args[0] == "add":
            (root / "a.py").write_text("x = 1\n")
        subprocess.run([git, "-C", str(root), *args], check=True, capture_output=True)


def test_git_state_tells_committed_modified_and_untracked(tmp_path):
    git_repo_with_a_commit(tmp_path)
    (tmp_path / "b.py").write_text("y = 1\n")
    assert userparts.git_state(tmp_path / "a.py") == "committed"
    assert userparts.git_state(tmp_path / "b.py") == "untracked"
    (tmp_path / "a.py").write_text("x = 2\n")
    assert userparts.git_state(tmp_path / "a.py") == "modified"


def test_byte_tokens_are_the_text_shifted_by_one(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 20)
    train, evals = textdata.datasets(str(text), 16, 0, 0, seed=0)
    x, y = train[3]
    assert x.dtype == torch.long and x.shape == (16,) and torch.equal(x[1:], y[:-1])
    assert x[0] == (3 * 16) % 256 and len(train) == (4608 - 1) // 16 and len(evals) == (512 - 1) // 16
    assert textdata.problem(str(text), 16) == ""
    assert "too short" in textdata.problem(str(text), 4096)


def test_generated_text_is_the_seeds_and_only_the_seeds():
    a, b, c = textdata.generated(5000, 1), textdata.generated(5000, 1), textdata.generated(5000, 2)
    assert a == b and a != c and len(a) == 5000
    assert set(a) <= set(b"abcdefghijklmnopqrstuvwxyz .\n")


def test_gpt_gives_logits_per_position_and_ties_its_weights():
    m = GPT(vocab_size=256, seq_len=32, n_layer=2, n_head=4, n_embd=64)
    out = m(torch.randint(256, (3, 20)))
    assert out.shape == (3, 20, 256) and m.lm_head.weight is m.wte.weight
    # causal: the first position's logits do not depend on later tokens
    x = torch.randint(256, (1, 20))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    assert torch.equal(m(x)[0, :10], m(y)[0, :10]) and not torch.equal(m(x)[0, 10:], m(y)[0, 10:])


def test_cross_entropy_flattens_token_logits():
    out, tgt = torch.randn(2, 5, 7), torch.randint(7, (2, 5))
    expected = torch.nn.functional.cross_entropy(out.reshape(10, 7), tgt.reshape(10))
    assert torch.equal(losses.cross_entropy(out, tgt), expected)
    assert losses.is_classification(out, tgt) and not losses.is_classification(out, tgt.float())


def test_imagefolder_tree_gives_classes_and_sizes_from_the_tree(tmp_path):
    root = imagefolder_tree(tmp_path / "imgs", {"train": 3, "val": 2}, size=10)
    cfg = config.load(None, ["data.dataset=imagefolder", f"data.root={root}", "data.image_size=8"])
    assert data.imagefolder_problem(str(root)) == ""
    train, evals = data.datasets(cfg.data, 0)
    assert len(train) == 9 and len(evals) == 6 and train[0][0].shape == (3, 8, 8)
    assert data.describe(cfg.data, train) == data.DataInfo("image", 3, 8, 3)
    gray = config.load(None, ["data.dataset=imagefolder", f"data.root={root}", "data.channels=1"])
    assert data.datasets(gray.data, 0)[0][0][0].shape == (1, 32, 32)


def test_imagefolder_refuses_a_symlink_loop_and_an_empty_class_up_front(tmp_path):
    """A link back up the tree (train/red/loop -> ..) made torchvision read 12 images as 492
    samples, the other classes' under red; an empty class folder trained silently."""
    root = imagefolder_tree(tmp_path / "imgs", {"train": 2, "val": 1}, size=8)
    (root / "train" / "red" / "loop").symlink_to("..")
    problem = data.imagefolder_problem(str(root))
    assert "links back to" in problem and "symlink loop" in problem, problem
    (root / "train" / "red" / "loop").unlink()
    assert data.imagefolder_problem(str(root)) == ""
    (root / "val" / "green").mkdir(exist_ok=True)
    for f in (root / "val" / "green").iterdir():
        f.unlink()
    problem = data.imagefolder_problem(str(root))
    assert problem.startswith(str((root / "val" / "green").resolve())) and "no images" in problem


def test_imagefolder_refuses_broken_links_and_empty_images_and_counts_per_class(tmp_path):
    """A dangling link, a zero-byte or a corrupt image failed mid-training on every rank; the
    run now also says how many images each class had."""
    root = imagefolder_tree(tmp_path / "imgs", {"train": 2, "val": 1}, size=8)
    (root / "train" / "red" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    assert "gone.png: a broken symbolic link" in data.imagefolder_problem(str(root))
    (root / "train" / "red" / "gone.png").unlink()
    (root / "val" / "blue" / "0.png").write_bytes(b"")
    assert "0.png: an empty file" in data.imagefolder_problem(str(root))
    (root / "val" / "blue" / "0.png").write_bytes(b"\x89PNG but not really an image")
    assert "0.png: not an image PIL can read" in data.imagefolder_problem(str(root))
    (root / "val" / "blue" / "0.png").unlink()
    (root / "val" / "blue" / "1.png").write_bytes((root / "val" / "red" / "0.png").read_bytes())
    assert data.imagefolder_problem(str(root)) == ""
    cfg = config.load(None, ["data.dataset=imagefolder", f"data.root={root}", "data.image_size=8"])
    train, _ = data.datasets(cfg.data, 0)
    assert data.per_class(train) == "blue 2, green 2, red 2"


def test_a_users_dataset_describes_itself_by_attributes_then_shapes():
    cfg = config.load(None, ["data.dataset=mine:sets"])
    ds = torch.utils.data.TensorDataset(torch.zeros(4, 1, 6, 6), torch.zeros(4, dtype=torch.long))
    ds.classes = ["a", "b", "c", "d", "e"]
    assert data.describe(cfg.data, ds) == data.DataInfo("image", 1, 6, 5)
    toks = torch.utils.data.TensorDataset(torch.zeros(4, 9, dtype=torch.long), torch.zeros(4, 9))
    assert data.describe(cfg.data, toks).model_kwargs() == {"vocab_size": 256, "seq_len": 9}


# ---- real jobs ----

def _torchrun(args: list[str], cwd: Path, store: str, nproc: int = 2, timeout: int = 600,
              **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", "-m",
                           "ddplab", *args], cwd=cwd, env=job_env(store, **env), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.e2e
def test_own_model_and_imagefolder_outside_the_repository_train_under_torchrun(
        own_experiment, tmp_path, store):
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    out = _torchrun(["train", str(own_experiment)], elsewhere, store)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    t, m = run.data.tags, run.data.metrics
    assert run.info.status == "FINISHED" and t["ddplab.world_size"] == "2"
    assert t["ddplab.data.per_class"] == "train: blue 48, green 48, red 48; eval: blue 16, green 16, red 16"
    assert m["eval/accuracy"] > 0.6, m  # chance is 1/3
    file = own_experiment.parent / "mynet.py"
    assert t["ddplab.user.model"] == "mynet:build" and t["ddplab.user.model.file"] == str(file)
    assert t["ddplab.user.model.sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    assert run.data.params["model.args.width"] == "16" and run.data.params["data.dataset"] == "imagefolder"


@pytest.mark.e2e
def test_lm_tiny_eval_loss_falls_by_a_third(tmp_path, store):
    """The shipped lm-tiny learns: its eval loss falls by a third within 200 of its 560 steps
    (measured: 4.41 at step 10, 2.77 at step 200, in 20 s untracked on 2 cores)."""
    out = _torchrun(["train", str(REPO / "experiments" / "lm-tiny.yaml"),
                     "--set", f"data.root={REPO / 'docs'}", "--set", "train.max_steps=200",
                     "--set", f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path, store)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    from mlflow import MlflowClient

    evals = [m.value for m in sorted(MlflowClient(store).get_metric_history(run.info.run_id, "eval/loss"),
                                     key=lambda m: m.step)]
    assert len(evals) > 10 and evals[-1] <= 0.7 * evals[0], evals
    assert run.data.metrics["eval/perplexity"] == pytest.approx(math.exp(evals[-1]))
    assert 0 < run.data.metrics["eval/accuracy"] < 1


# As an image states it: the code's sha and whether its tree was clean (a developer's checkout
# is dirty while they work, and --strict refuses that by design).
PINNED = {"DDPLAB_GIT_SHA": "0123456789ab", "DDPLAB_GIT_DIRTY": "false"}


def _reproduce(run_id: str, cwd: Path, store: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ddplab"), "reproduce", run_id, *extra], cwd=cwd,
                          env=job_env(store, **PINNED), capture_output=True, text=True, timeout=600)


@pytest.mark.e2e
def test_reproduce_finds_the_users_module_and_strict_refuses_it_changed(tmp_path, store):
    exp = tmp_path / "examples"
    shutil.copytree(SPIRALS.parent, exp)
    args = ["train", str(exp / "spirals.yaml"), "--set", "train.max_steps=10",
            "--set", "train.deterministic=true", "--set", f"checkpoint.dir={tmp_path / 'ck'}"]
    out = _torchrun(args, tmp_path, store, **PINNED)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    assert run.data.tags["ddplab.user.loss"] == "spirals:smoothed_cross_entropy"
    assert run.data.tags["ddplab.git_dirty"] == "false"
    same = _reproduce(run.info.run_id, tmp_path, store, "--strict")
    assert same.returncode == 0 and ": bitwise (" in same.stdout, same.stdout + same.stderr[-2000:]
    module = exp / "spirals.py"
    module.write_text(module.read_text().replace("label_smoothing=0.05", "label_smoothing=0.1"))
    changed = _reproduce(run.info.run_id, tmp_path, store, "--strict")
    assert changed.returncode == 2, changed.stdout + changed.stderr
    assert f"module {module}: changed since the run" in changed.stderr


@pytest.mark.e2e
def test_a_study_sweeps_model_and_data_args_of_a_users_experiment(tmp_path, store):
    shutil.copytree(SPIRALS.parent, tmp_path / "examples")
    study = tmp_path / "sweep.yaml"
    study.write_text(yaml.safe_dump({
        "name": "sweep", "experiment": "examples/spirals.yaml", "repeats": 1,
        "set": {"train.max_steps": 8, "tracking.system_metrics": False},
        "grid": {"nproc": [1], "model.args.hidden": [8, 16], "data.args.arms": [2]}}))
    out = subprocess.run([str(BIN / "ddplab"), "study", "run", str(study)], cwd=tmp_path,
                         env=job_env(store), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    children = [r for r in runs(store) if "ddplab.variant" in r.data.tags]
    assert sorted(r.data.params["model.args.hidden"] for r in children) == ["16", "8"]
    assert {r.data.params["data.args.arms"] for r in children} == {"2"}
    assert all(r.info.status == "FINISHED" for r in children)


@pytest.mark.mpi
def test_the_example_experiment_runs_under_mpirun(tmp_path, store):
    mpirun = shutil.which("mpirun")
    assert mpirun, "Open MPI is not installed: apt-get install openmpi-bin (CI does)"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = job_env(store, MASTER_PORT=str(port))
    if os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    out = subprocess.run(
        [mpirun, "--oversubscribe", "-np", "2", "-x", "MLFLOW_TRACKING_URI", "-x", "MASTER_PORT",
         "-x", "PATH", str(BIN / "ddplab"), "train", str(SPIRALS),  # its 20 epochs: ~15 s
         "--set", f"checkpoint.dir={tmp_path / 'ck'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    assert run.info.status == "FINISHED" and run.data.tags["ddplab.launcher"] == "openmpi"
    assert run.data.tags["ddplab.user.model"] == "spirals:mlp" and run.data.metrics["eval/accuracy"] > 0.6


def test_git_dirty_says_so_and_keeps_the_diff(tmp_path):
    from ddplab.tracking import capsule

    git_repo_with_a_commit(tmp_path)
    assert capsule.git_dirty(tmp_path) == ("false", "")
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("")
    dirty, diff = capsule.git_dirty(tmp_path)
    assert dirty == "true" and "+x = 2" in diff and "#   new.py" in diff


@pytest.mark.e2e
def test_a_run_from_a_dirty_tree_says_so_and_strict_reproduce_refuses_it(tmp_path, store):
    dirty = {**PINNED, "DDPLAB_GIT_DIRTY": "true"}
    out = _torchrun(["train", str(SPIRALS), "--set", "train.max_steps=4",
                     "--set", f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path, store, nproc=1, **dirty)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)
    assert run.data.tags["ddplab.git_dirty"] == "true"
    refused = _reproduce(run.info.run_id, tmp_path, store, "--strict")
    assert refused.returncode == 2 and "uncommitted changes" in refused.stderr, refused.stderr
    assert len(runs(store)) == 1  # refused before any new run


LOGGING_LOSS = '''
import os
import mlflow
import torch.nn.functional as F
from ddplab import track
from spirals import *  # noqa: F401,F403 - the example's model and data

calls = {"n": 0}


def loss(outputs, targets):
    value = F.cross_entropy(outputs, targets)
    calls["n"] += 1
    if int(os.environ.get("RANK", "0")) == 0 and calls["n"] % 4 == 0:
        mlflow.log_metric("user/plain_mlflow", value.item(), step=calls["n"])
        track.log({"user/tracked": value.item()}, step=calls["n"])
    return value
'''


@pytest.mark.e2e
def test_a_user_loss_logging_to_mlflow_and_track_lands_in_the_one_run(tmp_path, store):
    """A user's loss calling mlflow.log_metric made a SECOND run (experiment Default, left
    RUNNING); now the job's run is active for user code, and ddplab.track goes through it."""
    exp = tmp_path / "examples"
    shutil.copytree(SPIRALS.parent, exp)
    (exp / "logging_loss.py").write_text(LOGGING_LOSS)
    out = _torchrun(["train", str(exp / "spirals.yaml"), "--set", "train.max_steps=12",
                     "--set", "train.loss=logging_loss:loss",
                     "--set", f"checkpoint.dir={tmp_path / 'ck'}"], tmp_path, store)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = runs(store)  # no second run anywhere in the store
    assert run.info.status == "FINISHED"
    assert "user/plain_mlflow" in run.data.metrics and "user/tracked" in run.data.metrics


@pytest.mark.parametrize("shadow", ["mlflow.py", "sqlite3.py", "secrets.py", "torch/__init__.py"])
def test_a_module_beside_the_experiment_that_shadows_a_library_is_one_line(tmp_path, capsys,
                                                                            shadow):
    from ddplab import cli

    exp = tmp_path / "examples"
    shutil.copytree(SPIRALS.parent, exp)
    (exp / shadow).parent.mkdir(parents=True, exist_ok=True)
    (exp / shadow).write_text("raise ImportError('the user module, not the library')\n")
    code = cli.main(["train", str(exp / "spirals.yaml"), "--set", "train.max_steps=2",
                     "--set", "tracking.enabled=false", "--set", f"checkpoint.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert f"{exp / shadow.split('/')[0]}" in line and "shadows the module" in line


EXITING = '''
import sys
import torch.nn.functional as F
from spirals import *  # noqa: F401,F403

if "{when}" == "import":
    sys.exit({code})
calls = {{"n": 0}}


def loss(outputs, targets):
    calls["n"] += 1
    if calls["n"] == 3:
        sys.exit({code})
    return F.cross_entropy(outputs, targets)
'''


@pytest.mark.parametrize("when, code, exit_code, said", [
    ("import", 0, 2, "importing exiting_import_0 called sys.exit(0)"),
    ("training", 0, 1, "user code called sys.exit(0) during the job"),
    ("training", 3, 1, "user code called sys.exit(3) during the job"),
])
def test_sys_exit_in_user_code_is_a_failure_in_one_line(tmp_path, capsys, monkeypatch, store,
                                                         when, code, exit_code, said):
    """sys.exit(0) at a user module's import exited 0 with no run and no word; in a loss it
    ended the process 0 or 3 with no line. Exit 0 from user code is no success."""
    from ddplab import cli

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.chdir(tmp_path)  # the run's artifacts, in ./mlruns of its store: not the checkout's
    exp = tmp_path / "examples"
    shutil.copytree(SPIRALS.parent, exp)
    name = f"exiting_{when}_{code}"  # one module per case: this process imports each once
    (exp / f"{name}.py").write_text(EXITING.format(when=when, code=code))
    got = cli.main(["train", str(exp / "spirals.yaml"), "--set", "train.max_steps=6",
                    "--set", f"train.loss={name}:loss", "--set", f"checkpoint.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert got == exit_code and said in err and "Traceback" not in err, err
    found = runs(store) if Path(store.removeprefix("sqlite:///")).exists() else []
    assert [r.info.status for r in found] == ([] if when == "import" else ["FAILED"])


def test_a_slow_user_part_says_what_the_checks_wait_for(capfd):
    """A module or callable that blocks used to hang the checks step without a line."""
    import time

    from ddplab.workload.userparts import still_working

    # Lines due at 0.1 s and 1.1 s, the next at 2.1 s: 0.4 s of room for a busy machine's late
    # wake-ups (the first line's "(0 s)" holds until 0.5 s).
    with still_working("calling mymod:slow (data.dataset)", first_s=0.1, every_s=1.0):
        time.sleep(1.8)
    time.sleep(1.0)  # nothing more once it returned
    lines = [x for x in capfd.readouterr().err.splitlines() if "checks: still" in x]
    assert len(lines) == 2 and "calling mymod:slow (data.dataset) (0 s)" in lines[0]


@pytest.mark.e2e
def test_a_dataset_built_differently_on_one_rank_is_refused_naming_the_rank(tmp_path, store):
    """A user's data callable whose content depends on the rank (here its seed; in the wild an
    unseeded generator or a per-rank path) would train each rank on other data without a word.
    The ranks compare a fingerprint of their datasets before training: one line names rank 1."""
    shutil.copy(REPO / "experiments" / "examples" / "spirals.py", tmp_path / "spirals.py")
    (tmp_path / "rankdata.py").write_text(
        "import os\n\nimport spirals\n\n\ndef make_data(seed: int = 0):\n"
        "    return spirals.make_data(512, 128, seed=seed + int(os.environ.get('RANK', '0')))\n")
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({"name": "rankdata", "data": {"dataset": "rankdata:make_data"},
                                   "model": {"name": "spirals:mlp"}, "train": {"epochs": 1},
                                   "tracking": {"system_metrics": False}}))
    out = _torchrun(["train", str(exp)], tmp_path, store)
    assert out.returncode != 0, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if "built other data" in line]
    # Rank 0's own line, or, when torchrun's SIGTERM (rank 1 failed first) ends rank 0 before it
    # prints, the node's verdict line: either names rank 1 and the data.
    assert said and all("data.dataset: rank 1 built other data than rank 0" in line
                        for line in said), said
    deadline = time.monotonic() + 60  # the node's delivery process ends the run after the ranks
    while [r.info.status for r in runs(store)] != ["FAILED"]:
        assert time.monotonic() < deadline, [r.info.status for r in runs(store)]
        time.sleep(1)
