"""Unit: one environment everywhere. The hashed locks agree with pyproject.toml and
constraints.txt, and every image's torch is the lock's."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "docker"))
sys.path.insert(0, str(REPO / "tools"))
from lock import DIGEST_PREFIX, inputs_digest  # noqa: E402
from lock_subset import entries  # noqa: E402

LOCKS = ("requirements.lock", "requirements-dev.lock")


def pins(name: str) -> dict[str, str]:
    return {_norm(n): v for n, v, _ in entries((REPO / name).read_text())}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("lock", LOCKS)
def test_the_lock_was_made_from_todays_pyproject_and_constraints(lock):
    first = (REPO / lock).read_text().splitlines()[0]
    assert first == DIGEST_PREFIX + inputs_digest(lock), \
        f"{lock} is older than pyproject.toml or constraints.txt: run make lock"


@pytest.mark.parametrize("lock, extras", [("requirements.lock", ("gpu",)),
                                          ("requirements-dev.lock", ("gpu", "dev"))])
def test_every_declared_dependency_is_pinned_within_its_range(lock, extras):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]
    pinned = pins(lock)
    for text in wanted:
        req = Requirement(text)
        assert _norm(req.name) in pinned, f"{req.name} is not in {lock}: run make lock"
        version = pinned[_norm(req.name)]
        assert req.specifier.contains(version, prereleases=True), (text, version)
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            assert pinned[_norm(name)] == version.strip(), line


def test_both_locks_agree_and_every_pin_has_a_hash():
    runtime, dev = pins("requirements.lock"), pins("requirements-dev.lock")
    assert {n: (v, dev.get(n)) for n, v in runtime.items() if dev.get(n) != v} == {}
    for lock in LOCKS:
        for name, _, lines in entries((REPO / lock).read_text()):
            assert "--hash=sha256:" in lines, f"{name} in {lock} has no hash"


@pytest.mark.parametrize("dockerfile", ["cpu-oneccl", "cuda-nccl"])
def test_each_image_builds_the_locks_torch(dockerfile):
    text = (REPO / "docker" / dockerfile / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S*)", text, re.M))
    lock = pins("requirements.lock")
    assert args["TORCH_VERSION"] == lock["torch"] and args["TORCHVISION_VERSION"] == lock["torchvision"]
    assert args["MLFLOW_VERSION"] == lock["mlflow"]
    assert "--require-hashes" in text and "requirements.lock" in text


def test_the_subset_leaves_torchs_own_parts_to_torch():
    import subprocess

    out = subprocess.run([sys.executable, str(REPO / "docker" / "lock_subset.py"),
                          str(REPO / "requirements.lock"), "--pins", "--skip",
                          "torch|torchvision|triton|cuda-.*|nvidia-(?!ml-py).*"],
                         capture_output=True, text=True, check=True).stdout
    names = {_norm(line.split("==")[0]) for line in out.splitlines()}
    assert "mlflow" in names and "nvidia-ml-py" in names and "sympy" in names
    assert not names & {"torch", "torchvision", "triton", "nvidia-nccl-cu13"}


def test_a_study_report_warns_when_variants_ran_different_environments():
    from types import SimpleNamespace

    from ddplab.study.table import environment_warnings

    def child(variant, build, lock="abc", sha="s", status="FINISHED", start=0):
        return SimpleNamespace(info=SimpleNamespace(status=status, start_time=start),
                               data=SimpleNamespace(tags={
            "ddplab.variant": variant, "ddplab.torch_build": build, "ddplab.lock": lock,
            "ddplab.image": "none", "ddplab.git_sha": sha}))
    same = [child("a", "2.14.1+cpu"), child("b", "2.14.1+cpu")]
    assert environment_warnings(same) == []
    # b failed, then ran again after a commit, as a and c did: the code they count is one
    rerun = [child("b", "2.14.1+cpu", sha="old", status="FAILED", start=1),
             child("a", "2.14.1+cpu", sha="new", start=2), child("b", "2.14.1+cpu", sha="new", start=3)]
    assert environment_warnings(rerun) == []
    mixed = [child("native", "2.14.1+cu130"), child("image", "2.7.1+cpu", lock="def")]
    warned = environment_warnings(mixed)
    assert len(warned) == 2 and "different torch (ddplab.torch_build): 2.14.1+cu130: native; " \
        "2.7.1+cpu: image" in warned[0]
    # A hostile pass: a job that failed before recording what it ran on gave four warnings
    # ("different torch ...: ?: r1"): an unknown environment is no difference.
    untold = SimpleNamespace(info=SimpleNamespace(status="FAILED", start_time=0),
                             data=SimpleNamespace(tags={"ddplab.variant": "c"}))
    assert environment_warnings([*same, untold]) == []



def test_runs_record_this_checkouts_lock_digest():
    """``ddplab.lock`` of a native run is the digest the repository's lock opens with, never
    'unknown' (the lookup once pointed at src/requirements.lock: issue 50)."""
    from ddplab.tracking import capsule

    first = (REPO / "requirements.lock").read_text().splitlines()[0]
    assert capsule.lock_digest() == first.removeprefix(DIGEST_PREFIX)[:16] != "unknown"
    assert capsule.LOCK_FILES[0] == REPO / "requirements.lock"


def _wheel(folder: Path, name: str, module: str) -> Path:
    """A pure-Python wheel of one module, built by hand: PyPI has no package of this name."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-1.0.dist-info"
    files = {f"{name}.py": module,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    files[f"{info}/RECORD"] = "".join(f"{n},sha256={digest(t)},{len(t)}\n" for n, t in files.items())
    files[f"{info}/RECORD"] += f"{info}/RECORD,,\n"
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for n, t in files.items():
            zf.writestr(n, t)
    return wheel


def test_make_setups_uv_installs_from_the_indexes_and_wheel_folders_pip_is_configured_with(tmp_path):
    """uv reads no pip.conf: a machine whose pip takes torch's CUDA wheels from its disk had uv
    download them again. tools/uv_sources.py hands pip's sources to uv (make setup); here a
    package that only a wheel folder named by PIP_FIND_LINKS holds installs with uv offline,
    and without those options uv cannot find it."""
    import hashlib
    import subprocess

    (tmp_path / "wheels").mkdir()
    wheel = _wheel(tmp_path / "wheels", "ddplab_probe", "ANSWER = 42\n")
    conf = tmp_path / "pip.conf"
    index = f"file://{tmp_path}/nowhere/simple"
    other = f"file://{tmp_path}/other/simple"  # a pip.conf list on lines of its own, as pip allows
    conf.write_text(f"[global]\nextra-index-url =\n    {index}\n    {other}\n"
                    f"find-links = {tmp_path}/elsewhere\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    env.update(PIP_CONFIG_FILE=str(conf), PIP_FIND_LINKS=str(tmp_path / "wheels"))  # over the file's
    said = subprocess.run([sys.executable, str(REPO / "tools" / "uv_sources.py")], env=env,
                          capture_output=True, text=True, check=True).stdout.split()
    assert said == ["--extra-index-url", index, "--extra-index-url", other,
                    "--find-links", str(tmp_path / "wheels"), "--index-strategy", "unsafe-best-match"]
    (tmp_path / "nowhere" / "simple").mkdir(parents=True)
    (tmp_path / "other" / "simple").mkdir(parents=True)
    (tmp_path / "req.txt").write_text(
        f"ddplab-probe==1.0 --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}\n")
    uv = [str(Path(sys.executable).parent / "uv"), "pip", "install", "--offline", "--no-deps",
          "--require-hashes", "--target", str(tmp_path / "site"), "-r", str(tmp_path / "req.txt")]
    env["UV_CACHE_DIR"] = str(tmp_path / "cache")
    without = subprocess.run(uv, env=env, capture_output=True, text=True)
    assert without.returncode != 0 and "ddplab-probe" in without.stderr
    installed = subprocess.run(uv + said, env=env, capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr
    assert (tmp_path / "site" / "ddplab_probe.py").read_text() == "ANSWER = 42\n"
