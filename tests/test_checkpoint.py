"""Unit: atomic writes, newest-valid resume, corrupt and partial files."""

import os
import time

import pytest
import torch

from ddplab.config import ConfigError
from ddplab.training import checkpoint


def payload(step: int, final: bool = False, run_id: str = "run1") -> dict:
    return {"model": {"w": torch.full((2,), float(step))}, "optimizer": {}, "scheduler": {},
            "scaler": {}, "step": step, "epoch": 0, "samples_in_epoch": step * 4,
            "world_size": 2, "rng": {"torch": torch.get_rng_state(), "python": (3, (1, 2), None)},
            "config": {"name": "x"}, "run_id": run_id, "final": final}


def save(root, step, **kw):
    ck = checkpoint.Checkpointer(root, keep=3, active=True)
    ck.save(payload(step, **kw))
    time.sleep(0.01)  # distinct mtimes
    return ck.last


def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    good = save(tmp_path, 10)

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(checkpoint.CheckpointError, match=r"step-00000020.pt \(disk full\)"):
        save(tmp_path, 20)
    monkeypatch.undo()
    assert not (good.parent / "step-00000020.pt").exists()  # never renamed into place
    assert not (good.parent / "step-00000020.pt.tmp").exists()  # nor left half-written
    path, p = checkpoint.find_resume("auto", tmp_path)
    assert path == good and p["step"] == 10


def test_newest_corrupt_or_partial_is_skipped_with_a_warning(tmp_path):
    save(tmp_path, 10)
    second = save(tmp_path, 20)
    (second.parent / "step-00000030.pt").write_bytes(b"garbage")
    partial = payload(40)
    del partial["optimizer"]
    torch.save(partial, second.parent / "step-00000040.pt")
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        path, p = checkpoint.find_resume("auto", tmp_path)
    assert path == second and p["step"] == 20


def test_finished_job_starts_fresh_and_never_means_never(tmp_path):
    save(tmp_path, 10)
    save(tmp_path, 20, final=True)
    assert checkpoint.find_resume("auto", tmp_path) is None
    assert checkpoint.find_resume("never", tmp_path) is None
    assert checkpoint.find_resume("auto", tmp_path / "empty") is None


def test_newest_across_runs_wins(tmp_path):
    save(tmp_path, 50, run_id="old")
    newest = save(tmp_path, 5, run_id="new")
    path, p = checkpoint.find_resume("auto", tmp_path)
    assert path == newest and p["run_id"] == "new"


def test_explicit_path(tmp_path):
    target = save(tmp_path, 10)
    assert checkpoint.find_resume(str(target), tmp_path)[1]["step"] == 10
    with pytest.raises(ConfigError, match="checkpoint.resume: got '.*missing.pt'; no such checkpoint"):
        checkpoint.find_resume(str(tmp_path / "missing.pt"), tmp_path)


def test_a_runs_folder_resumes_its_newest_and_an_empty_folder_says_so(tmp_path):
    save(tmp_path, 10)
    newest = save(tmp_path, 20)
    path, p = checkpoint.find_resume(str(newest.parent), tmp_path)
    assert path == newest and p["step"] == 20
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="a folder with no step-"):
        checkpoint.find_resume(str(tmp_path / "empty"), tmp_path)


def test_keeps_only_the_newest(tmp_path):
    for s in (1, 2, 3, 4, 5):
        last = save(tmp_path, s)
    assert sorted(p.name for p in last.parent.iterdir()) == [
        "step-00000003.pt", "step-00000004.pt", "step-00000005.pt"]


def test_inactive_rank_writes_nothing(tmp_path):
    checkpoint.Checkpointer(tmp_path, 3, active=False).save(payload(1))
    assert not os.listdir(tmp_path)


def _cfg(*sets: str):
    from ddplab import config

    return config.load(None, list(sets))


def test_a_resume_may_change_where_it_tracks_and_saves_but_not_what_it_computes():
    from ddplab.config import ConfigError

    saved = _cfg().to_dict()
    now = _cfg("tracking.experiment=elsewhere", "checkpoint.keep=5", "train.epochs=9")
    changed = {k for k, _, _ in checkpoint.check_resume(saved, now, "ck.pt")}
    assert changed == {"tracking.experiment", "checkpoint.keep", "train.epochs"}
    with pytest.raises(ConfigError) as refused:
        checkpoint.check_resume(saved, _cfg("optim.lr=0.5", "tracking.experiment=x"), "ck.pt")
    assert "optim.lr: 0.01 -> 0.5" in str(refused.value) and "tracking" not in str(refused.value)
    allowed = _cfg("optim.lr=0.5", "checkpoint.resume_changes=allow")
    assert ("optim.lr", 0.01, 0.5) in checkpoint.check_resume(saved, allowed, "ck.pt")
    # How steps are timed and checked may change; a checkpoint written before a key existed
    # had its default (so an older checkpoint resumes), a value other than the default is a change
    debug = _cfg("train.sync_debug=warn", "train.exact_step_times=true")
    assert {k for k, _, _ in checkpoint.check_resume(saved, debug, "ck.pt")} == {
        "train.sync_debug", "train.exact_step_times"}
    older = {**saved, "train": {k: v for k, v in saved["train"].items() if k != "sync_debug"},
             "model": {k: v for k, v in saved["model"].items() if k != "compile_mode"}}
    assert checkpoint.check_resume(older, _cfg(), "ck.pt") == []
    with pytest.raises(ConfigError, match="model.compile_mode: 'default' -> 'max-autotune'"):
        checkpoint.check_resume(older, _cfg("model.compile=true", "model.compile_mode=max-autotune"),
                                "ck.pt")


def test_a_resume_on_another_world_size_keeps_the_global_batch_or_says_which_batch_does():
    from ddplab.config import ConfigError

    saved = _cfg("data.batch_size=32").to_dict()
    ck = {"config": saved, "world_size": 2, "global_batch": 64}
    # 4 ranks x 16 = 64: the same optimizer steps, only split otherwise.
    checkpoint.check_resume(saved, _cfg("data.batch_size=16"), "ck.pt", 4, ck)
    with pytest.raises(ConfigError) as refused:
        checkpoint.check_resume(saved, _cfg("data.batch_size=32"), "ck.pt", 4, ck)
    assert "global batch of 64" in str(refused.value) and "data.batch_size=16" in str(refused.value)


def test_export_refuses_to_overwrite_its_own_source(tmp_path, capsys):
    from ddplab import cli

    ckpt = tmp_path / "step-00000004.pt"
    ckpt.write_bytes(b"not replaced")
    assert cli.main(["checkpoint", "export", str(ckpt), str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "it is the checkpoint itself" in err and "Traceback" not in err
    assert ckpt.read_bytes() == b"not replaced"


def test_export_of_a_dangling_link_or_a_forged_file_is_one_line(tmp_path, capsys):
    """`ddplab checkpoint export` used to end in FileNotFoundError (a dangling link among a
    folder's checkpoints) or a traceback (a file that is no checkpoint)."""
    from ddplab import cli

    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "step-00000009.pt").symlink_to(tmp_path / "gone.pt")
    assert cli.main(["checkpoint", "export", str(folder), str(tmp_path / "out.pt")]) == 2
    assert "no step-*.pt checkpoint in it" in capsys.readouterr().err
    (folder / "step-00000001.pt").write_bytes(b"forged: not a torch file")
    assert cli.main(["checkpoint", "export", str(folder), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "step-00000001.pt: unreadable" in err and "Traceback" not in err
    assert not (tmp_path / "out.pt").exists()


def test_a_state_dict_named_to_resume_is_bad_input_before_the_ranks_and_on_rank_0(tmp_path):
    """A hostile pass: `checkpoint.resume=out.pt`, what `ddplab checkpoint export` wrote, started
    `ddplab run`'s ranks, then failed the job (exit 1): "missing fields [...]"."""
    from ddplab.training.checkpoint import find_resume, not_running

    exported = tmp_path / "out.pt"
    torch.save({"fc.weight": torch.zeros(2, 2)}, exported)
    for check in (not_running, find_resume):  # ddplab run's preflight; rank 0
        with pytest.raises(ConfigError, match=r"checkpoint.resume: got '.*out.pt'; not a "
                           r"checkpoint ddplab wrote \(a file without its model"):
            check(str(exported), tmp_path / "checkpoints")
