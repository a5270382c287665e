"""`ddplab import` trusts nothing in what it imports (issue 53): a crafted archive reads nothing
outside itself, a folder's links are not followed, a tar bomb is refused before a byte is
unpacked, a run comes whole or not at all, nothing is imported twice (nor a store into itself),
no run comes in RUNNING (the shipped proof archive included), and a damaged archive is one line.
Real MLflow stores (copies of the session's migrated one), real archives, the real command."""

from __future__ import annotations

import bz2
import gzip
import io
import shutil
import sqlite3
import tarfile
import zipfile
from pathlib import Path

import pytest
from mlflow import MlflowClient

from ddplab import cli
from ddplab.tracking import import_source, importer
from tests.conftest import REPO

SHIPPED = REPO / "docs" / "results" / "gpu-proof-runs" / "proof-store.tar.gz"
SECRET = "ssh-rsa AAAA the importing user's own key"


@pytest.fixture(autouse=True)
def _here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a store's default artifact root is ./mlruns: never the repo's
    for name in ("DDPLAB_IMPORT_MAX_GB", "DDPLAB_IMPORT_MAX_FILES"):
        monkeypatch.delenv(name, raising=False)


def make_store(where: Path, migrated: Path, runs: int = 2, points: int = 10,
               status: str = "FINISHED") -> tuple[Path, list[str]]:
    """Another machine's store: where/store/mlflow.db and where/mlruns/, ``runs`` runs with a
    param, ``points`` points of a metric and an artifact each."""
    from mlflow.entities import Metric

    (where / "store").mkdir(parents=True)
    db = where / "store" / "mlflow.db"
    shutil.copyfile(migrated, db)
    client = MlflowClient(f"sqlite:///{db}")
    exp = client.create_experiment("quickstart", artifact_location=f"{(where / 'mlruns').as_uri()}/1")
    ids = []
    for i in range(runs):
        run = client.create_run(exp, run_name=f"run {i}").info.run_id
        client.log_param(run, "lr", "0.1")
        for at in range(0, points, 1000):
            client.log_batch(run, metrics=[Metric("train/loss", 1.0 / (s + 1), 1000 + s, s)
                                           for s in range(at, min(points, at + 1000))])
        (where / "a").mkdir(exist_ok=True)
        (where / "a" / "summary.json").write_text(f'{{"run": {i}}}')
        client.log_artifact(run, str(where / "a" / "summary.json"))
        if status != "RUNNING":
            client.set_terminated(run, status)
        ids.append(run)
    shutil.rmtree(where / "a")
    return db, ids


def pack(where: Path, out: Path) -> Path:
    with tarfile.open(out, "w:gz") as t:
        for name in ("store", "mlruns"):
            if (where / name).exists():
                t.add(where / name, arcname=name)
    return out


def ddplab_import(source: Path | str, store: str, capsys) -> tuple[int, list[str], str]:
    code = cli.main(["import", str(source), "--tracking-uri", store])
    out, err = capsys.readouterr()
    return code, [ln for ln in err.splitlines() if ln.strip()], out


def copies(store: str) -> list:
    client = MlflowClient(store)
    exps = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exps) if exps else []


def artifact_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_a_crafted_artifact_location_imports_nothing_from_outside(tmp_path, store, migrated_store, capsys):
    secret = tmp_path / "home" / "u" / ".ssh"
    secret.mkdir(parents=True)
    (secret / "id_rsa").write_text(SECRET)
    db, ids = make_store(tmp_path / "other", migrated_store, runs=3)
    with sqlite3.connect(db) as con:  # one run names the user's .ssh, one climbs out with ..
        con.execute("UPDATE runs SET artifact_uri=? WHERE run_uuid=?", (f"file:///x/mlruns/{secret}", ids[0]))
        con.execute("UPDATE runs SET artifact_uri=? WHERE run_uuid=?",
                    ("file:///x/mlruns/1/../../../home/u/.ssh", ids[1]))
    code, err, _ = ddplab_import(pack(tmp_path / "other", tmp_path / "store.tar.gz"), store, capsys)

    assert code == 0, err
    assert len(err) == 2 and all("leads out of the archive's mlruns/" in e for e in err), err
    assert {ids[0][:8], ids[1][:8]} == {e.split("run ")[1][:8] for e in err}
    assert len(copies(store)) == 3
    dest = tmp_path / "mlruns"  # the store's own artifact root (cwd/mlruns)
    assert all(SECRET not in p.read_text() for p in artifact_files(dest))
    assert [p.name for p in artifact_files(dest)] == ["summary.json"]  # the honest run's only


def test_b_a_link_in_an_import_folder_is_not_followed(tmp_path, store, migrated_store, capsys):
    secret = tmp_path / "home" / ".ssh"
    secret.mkdir(parents=True)
    (secret / "id_rsa").write_text(SECRET)
    db, ids = make_store(tmp_path / "other", migrated_store, runs=1)
    arts = next((tmp_path / "other" / "mlruns").rglob("artifacts"))
    (arts / "id_rsa").symlink_to(secret / "id_rsa")  # a link to a file, and one to a folder
    (arts / "keys").symlink_to(secret)
    code, err, _ = ddplab_import(tmp_path / "other", store, capsys)

    assert code == 0 and len(err) == 1 and "2 link(s)" in err[0], err
    [run] = copies(store)
    assert [a.path for a in MlflowClient(store).list_artifacts(run.info.run_id)] == ["summary.json"]
    assert all(SECRET not in p.read_text() for p in artifact_files(tmp_path / "mlruns"))
    # the store itself, a link out of the folder: not read either
    (tmp_path / "linked" / "store").mkdir(parents=True)
    (tmp_path / "linked" / "store" / "mlflow.db").symlink_to(db)
    code, err, _ = ddplab_import(tmp_path / "linked", store, capsys)
    assert code == 2 and len(err) == 1 and "holds no mlflow.db" in err[0] and "link" in err[0], err


def tar_bomb(out: Path, gib: int) -> Path:
    """A real .tar.gz of one ``gib`` GiB file of zeros, a few MB on disk: gzip members (each
    64 MiB of zeros, compressed once) one after another are one gzip stream."""
    info = tarfile.TarInfo("store/zeros.bin")
    info.size = gib * 1024**3
    zeros = gzip.compress(b"\0" * 64 * 1024**2, compresslevel=9)
    with open(out, "wb") as f:
        f.write(gzip.compress(info.tobuf(tarfile.USTAR_FORMAT)))
        for _ in range(gib * 16):
            f.write(zeros)
        f.write(gzip.compress(b"\0" * 1024))
    return out


def test_c_a_tar_bomb_is_refused_before_anything_is_unpacked(tmp_path, store, monkeypatch, capsys):
    bomb = tar_bomb(tmp_path / "store.tar.gz", 5)
    assert bomb.stat().st_size < 8 * 1024**2
    unpacked = []
    monkeypatch.setattr(tarfile.TarFile, "extractall", lambda *a, **k: unpacked.append(a))
    code, err, _ = ddplab_import(bomb, store, capsys)
    assert code == 2 and unpacked == [], err
    assert err == [f"ddplab: error: {bomb}: unpacks to at least 5.0 GB, over the 4.0 GB limit (nothing "
                   "was unpacked); raise it with DDPLAB_IMPORT_MAX_GB=N if it is what you expect"]

    many = tmp_path / "many.tar.gz"  # a bomb of files instead of bytes
    with tarfile.open(many, "w:gz") as t:
        for i in range(30):
            t.addfile(tarfile.TarInfo(f"store/f{i}"), io.BytesIO(b""))
    monkeypatch.setenv("DDPLAB_IMPORT_MAX_FILES", "20")
    code, err, _ = ddplab_import(many, store, capsys)
    assert code == 2 and len(err) == 1 and "over the 20-file limit" in err[0] and not unpacked, err

    monkeypatch.delenv("DDPLAB_IMPORT_MAX_FILES")  # the free space, with a disk of 100 MB
    monkeypatch.setattr(import_source.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1, 1, 10**8))
    code, err, _ = ddplab_import(SHIPPED, store, capsys)
    assert code == 2 and len(err) == 1 and "point TMPDIR at a disk with room" in err[0] and not unpacked, err
    assert copies(store) == []


def test_d_an_interrupted_import_leaves_no_running_run_and_a_rerun_completes_it(
        tmp_path, store, migrated_store, monkeypatch, capsys):
    make_store(tmp_path / "other", migrated_store, runs=2, points=2500)
    archive = pack(tmp_path / "other", tmp_path / "store.tar.gz")
    real = MlflowClient.log_batch
    calls, stop_at = [], [5]  # Ctrl-C at the 5th batch of metrics: the 2nd run's 2nd of 3

    def ctrl_c_midway(self, run_id, metrics=(), **kw):
        calls.extend([1] if metrics else [])
        if len(calls) == stop_at[0]:
            raise KeyboardInterrupt
        return real(self, run_id, metrics=metrics, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", ctrl_c_midway)
    code, err, _ = ddplab_import(archive, store, capsys)
    assert code == 130 and "the same command again imports the rest" in err[0], err
    left = [(r.info.status, r.data.tags.get(importer.INCOMPLETE)) for r in copies(store)]
    assert left == [("FINISHED", None)]  # the first run whole, nothing of the second

    # killed outright (the part copy is not deleted): the rerun replaces it
    calls.clear()
    stop_at[0] = 2
    monkeypatch.setattr(MlflowClient, "delete_run", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    assert ddplab_import(archive, store, capsys)[0] == 130
    assert len(copies(store)) == 2  # one whole, one part copy tagged incomplete
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    code, err, out = ddplab_import(archive, store, capsys)
    assert code == 0 and "1 run(s) into" in out and "1 already there" in out, (out, err)
    assert len(err) == 1 and "left incomplete" in err[0], err
    runs = copies(store)
    assert len(runs) == 2 and all(r.info.status == "FINISHED" and importer.INCOMPLETE not in r.data.tags
                                  for r in runs)
    client = MlflowClient(store)
    assert [len(client.get_metric_history(r.info.run_id, "train/loss")) for r in runs] == [2500, 2500]

    # a param the store refuses (a name over MLflow's 250 characters): that run is not
    # imported, the other is, whole; one warning names it, one error line counts
    db, ids = make_store(tmp_path / "third", migrated_store, runs=2)
    with sqlite3.connect(db) as con:
        con.execute("UPDATE params SET key=? WHERE run_uuid=?", ("k" * 300, ids[0]))
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    shutil.copyfile(migrated_store, tmp_path / "fresh.db")
    code, err, _ = ddplab_import(pack(tmp_path / "third", tmp_path / "third.tar.gz"), fresh, capsys)
    assert code == 1 and len(err) == 2 and ids[0][:8] in err[0] and "1 run(s) not imported" in err[1], err
    assert [r.data.tags[importer.MARK] for r in copies(fresh)] == [ids[1]]
    assert copies(fresh)[0].info.status == "FINISHED"


def test_e_reimporting_or_importing_a_store_into_itself_adds_nothing(tmp_path, migrated_store, capsys):
    db, ids = make_store(tmp_path / "home", migrated_store, runs=2)
    home = f"sqlite:///{db}"
    # an archive of this very store: its runs' ids are here already
    code, err, out = ddplab_import(pack(tmp_path / "home", tmp_path / "self.tar.gz"), home, capsys)
    assert code == 0 and "0 run(s) into" in out and "2 already there" in out, (out, err)
    code, err, out = ddplab_import(tmp_path / "home", home, capsys)  # `ddplab import .`
    assert code == 0 and len(err) == 1 and "holds this store itself" in err[0], err
    assert sorted(r.info.run_id for r in copies(home)) == sorted(ids)

    # imported twice; and A into B, B into C, then A into C: each run once
    stores = {}
    for name in "BC":
        shutil.copyfile(migrated_store, tmp_path / f"{name}.db")
        stores[name] = f"sqlite:///{tmp_path / f'{name}.db'}"
    a = pack(tmp_path / "home", tmp_path / "a.tar.gz")
    assert ddplab_import(a, stores["B"], capsys)[0] == 0
    assert "0 run(s) into" in ddplab_import(a, stores["B"], capsys)[2]
    (tmp_path / "b" / "store").mkdir(parents=True)
    shutil.copyfile(tmp_path / "B.db", tmp_path / "b" / "store" / "mlflow.db")
    assert "2 run(s) into" in ddplab_import(tmp_path / "b", stores["C"], capsys)[2]
    assert "2 already there" in ddplab_import(a, stores["C"], capsys)[2]
    assert [len(copies(stores[n])) for n in "BC"] == [2, 2]
    # A copy is not the importer's run: made without a user (a plain client's), it names none
    # (it was credited to whoever imported it, the UI's "Created by").
    assert all("mlflow.user" not in r.data.tags for r in copies(stores["C"]))


def test_f_no_run_comes_in_running_and_the_shipped_archive_holds_none(tmp_path, store, migrated_store,
                                                                      capsys):
    make_store(tmp_path / "other", migrated_store, runs=2, status="RUNNING")
    code, err, _ = ddplab_import(pack(tmp_path / "other", tmp_path / "store.tar.gz"), store, capsys)
    assert code == 0 and len(err) == 1 and "2 run(s) were still RUNNING" in err[0], err
    assert {(r.info.status, r.data.tags[importer.WAS]) for r in copies(store)} == {("KILLED", "RUNNING")}
    assert all(r.info.end_time and r.data.tags["ddplab.error"] for r in copies(store))

    shipped = f"sqlite:///{tmp_path / 'shipped.db'}"  # as docs/results/gpu-proof.md says
    shutil.copyfile(migrated_store, tmp_path / "shipped.db")
    code, err, out = ddplab_import(SHIPPED, shipped, capsys)
    assert code == 0 and err == [] and "11 run(s) into" in out, (out, err)
    status = {r.info.run_name: r.info.status for r in copies(shipped)}
    assert "RUNNING" not in status.values()
    assert status["study ch09-16-cores"] == status["2r-8t r0"] == "KILLED"  # the budget's kill


def corrupt(kind: str, tmp_path: Path, migrated_store: Path, store: str) -> Path:
    out = tmp_path / "store.tar.gz"
    if kind in ("truncated", "forged alembic version", "garbage db", "deleted experiment",
                "a member climbing out", "bytes flipped"):
        db, _ = make_store(tmp_path / "other", migrated_store, runs=1)
        if kind == "forged alembic version":
            with sqlite3.connect(db) as con:
                con.execute("UPDATE alembic_version SET version_num='ffffffffffff'")
        if kind == "garbage db":
            db.write_bytes(b"SQLite format 3\0" + b"\x5a" * 8192)
        if kind == "deleted experiment":
            client = MlflowClient(store)
            client.delete_experiment(client.create_experiment("quickstart"))
        pack(tmp_path / "other", out)
        if kind == "truncated":
            out.write_bytes(out.read_bytes()[: out.stat().st_size // 2])
        if kind == "bytes flipped":
            data = bytearray(out.read_bytes())
            data[len(data) // 2: len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2:][:64])
            out.write_bytes(bytes(data))
        if kind == "a member climbing out":
            with tarfile.open(out, "w:gz") as t:
                t.addfile(tarfile.TarInfo("../../evil"), io.BytesIO(b""))
        return out
    if kind == "zip":
        with zipfile.ZipFile(out, "w") as z:
            z.writestr("store/mlflow.db", "x")
    else:
        out.write_bytes({"empty": b"", "text": b"not an archive\n" * 10,
                         "gzip of text": gzip.compress(b"hello " * 1000),
                         "bz2 of garbage": bz2.compress(b"\x01\x02" * 999),
                         "random bytes": bytes(range(256)) * 40}[kind])
    return out


@pytest.mark.parametrize("kind, says", [
    ("truncated", "truncated or damaged"),
    ("forged alembic version", "MLflow schema version ['ffffffffffff'] is not one MLflow"),
    ("garbage db", "its mlflow.db is damaged or not an SQLite database"),
    ("deleted experiment", "experiment 'quickstart' was deleted in"),
    ("a member climbing out", "would land outside the folder"),
    ("empty", "not a tar archive"), ("text", "not a tar archive"), ("zip", "not a tar archive"),
    ("gzip of text", "not a tar archive"), ("bz2 of garbage", "not a tar archive"),
    ("random bytes", "not a tar archive"), ("bytes flipped", "truncated or damaged")])
def test_g_a_damaged_archive_is_one_line(kind, says, tmp_path, migrated_store, store, capsys):
    archive = corrupt(kind, tmp_path, migrated_store, store)
    code, err, out = ddplab_import(archive, store, capsys)
    assert code in (1, 2) and len(err) == 1 and says in err[0] and out == "", (out, err)
    assert "Traceback" not in err[0] and copies(store) == []


def test_h_a_server_that_does_not_answer_is_one_line_at_once(tmp_path, migrated_store, capsys):
    """A hostile pass: `ddplab import --tracking-uri http://127.0.0.1:<nothing>` was silent for
    4 minutes 10 seconds (MLflow's retries) before its line. It is now the job's probe's line."""
    import socket
    import time

    make_store(tmp_path / "home", migrated_store, runs=1)
    with socket.socket() as s:  # a port nothing listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        t0 = time.monotonic()
        code, err, out = ddplab_import(tmp_path / "home", f"http://127.0.0.1:{s.getsockname()[1]}",
                                       capsys)
        took = time.monotonic() - t0
    assert code == 1 and len(err) == 1 and "is unreachable" in err[0], err
    assert "nothing was imported" in err[0] and took < 60, (took, err)
