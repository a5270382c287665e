"""What ``ddplab import`` reads, read as untrusted: an archive or a folder someone else made.

Nothing in it is followed out of it. An archive is checked before a byte is unpacked (its
unpacked size, its number of files, the free space, names that would land outside the folder)
and only its plain files and folders are unpacked (links and device files are left out); a
folder's store is read from a snapshot, and its artifacts are copied only where they are plain
files inside its mlruns/ (no link followed, nothing outside read). The store itself (its MLflow
schema, its SQLite file) is checked before MLflow opens it. Every refusal is one line.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import tarfile
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..errors import BadInput

MAX_UNPACKED_GB = 4.0
"""The most an archive may unpack to (the GPU proof's is 3 MB); $DDPLAB_IMPORT_MAX_GB raises it."""
MAX_FILES = 100_000
"""The most files and folders an archive may hold; $DDPLAB_IMPORT_MAX_FILES raises it."""
SPARE_BYTES = 256 * 1024**2
"""Free space left over in the temporary folder once an archive is unpacked."""
FIND_DEPTH = 3
"""How deep in an archive or folder mlflow.db and mlruns/ are looked for."""


class ArchiveError(BadInput):
    """An archive or store that cannot be read, or is refused: one line, nothing imported."""


@dataclass
class Source:
    db: Path  # a private copy of the store (an unpacked archive's, or a snapshot of a folder's)
    artifacts: Path | None  # its mlruns/, inside the archive or the folder
    links: int = 0  # links and device files left out when unpacking


def limits() -> tuple[int, int]:
    """(bytes, files) an archive may unpack to: the constants, or the environment's."""
    try:
        gb = float(os.environ.get("DDPLAB_IMPORT_MAX_GB") or MAX_UNPACKED_GB)
        files = int(os.environ.get("DDPLAB_IMPORT_MAX_FILES") or MAX_FILES)
    except ValueError as e:
        raise BadInput(f"DDPLAB_IMPORT_MAX_GB / DDPLAB_IMPORT_MAX_FILES: not a number ({e})") from None
    return int(gb * 1024**3), files


def size(n: float) -> str:
    for unit in ("bytes", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def shown(text: object, most: int = 120) -> str:
    """An untrusted name as it may be printed: no control characters, bounded."""
    s = "".join(c if c.isprintable() else "?" for c in str(text))
    return s if len(s) <= most else s[:most] + "..."


def first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return shown(lines[0] if lines else type(e).__name__, 300)


def open_source(path: Path, tmp: Path) -> Source:
    """The store in ``path`` (a .tar.gz or a folder), as a private copy under ``tmp``."""
    if path.is_dir():
        return _from_folder(path, tmp)
    if not path.is_file():
        raise ArchiveError(f"{shown(path)}: neither a file nor a folder")
    links = _unpack(path, tmp / "archive")
    db = find(tmp / "archive", "mlflow.db", folder=False)
    if db is None:
        raise ArchiveError(f"{shown(path)}: holds no mlflow.db (an embedded store)")
    check_store(db, path)
    return Source(db, find(tmp / "archive", "mlruns", folder=True), links)


def _open_tar(archive: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(archive, "r:*")
    except PermissionError as e:
        raise ArchiveError(f"{shown(archive)}: cannot be read ({first_line(e)})") from None
    except Exception:  # noqa: BLE001 - tarfile's list of every method it tried, in one line
        empty = " (it is empty)" if archive.stat().st_size == 0 else ""
        raise ArchiveError(f"{shown(archive)}: not a tar archive (.tar.gz, .tar.bz2, .tar.xz or "
                           f".tar){empty}") from None


def _unpack(archive: Path, into: Path) -> int:
    """Unpack the archive's plain files and folders into ``into``, once its size, its number of
    files, its names and the free space are checked; the links and device files left out."""
    most, most_files = limits()
    t = _open_tar(archive)
    try:
        with t:
            kept, total, links = [], 0, 0
            for n, m in enumerate(t, 1):  # headers only: each member's data is skipped, not kept
                if n > most_files:
                    raise ArchiveError(f"{shown(archive)}: holds over {most_files:,} files, over the "
                                       f"{most_files:,}-file limit; raise it with "
                                       "DDPLAB_IMPORT_MAX_FILES=N if it is what you expect")
                parts = Path(m.name).parts
                if m.name.startswith(("/", "\\")) or ".." in parts:
                    raise ArchiveError(f"{shown(archive)}: holds {shown(m.name)!r}, which would land "
                                       "outside the folder it unpacks into: refused")
                if not (m.isfile() or m.isdir()):
                    links += 1  # symbolic and hard links, devices, FIFOs: never unpacked
                    continue
                total += m.size if m.isfile() else 0
                if total > most:
                    raise ArchiveError(f"{shown(archive)}: unpacks to at least {size(total)}, over "
                                       f"the {size(most)} limit (nothing was unpacked); raise it "
                                       "with DDPLAB_IMPORT_MAX_GB=N if it is what you expect")
                kept.append(m)
            _to_the_end(t, most - total, archive)
            into.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(into).free
            if total + SPARE_BYTES > free:
                raise ArchiveError(f"{shown(archive)}: unpacks to {size(total)} and {into.parent} has "
                                   f"{size(free)} free ({size(SPARE_BYTES)} must be left over); "
                                   "point TMPDIR at a disk with room")
            t.extractall(into, members=kept, filter="data")
    except ArchiveError:
        raise
    except Exception as e:  # noqa: BLE001 - anything a damaged archive raises (EOFError, zlib.error, ...)
        raise ArchiveError(f"{shown(archive)}: truncated or damaged ({first_line(e)})") from None
    return links


def _to_the_end(t: tarfile.TarFile, most: int, archive: Path) -> None:
    """Read what follows the archive's last member: the compression's own check (gzip's CRC)
    comes only at the end of its stream, and a damaged one must be refused before unpacking."""
    stream = t.fileobj
    while stream is not None and (chunk := stream.read(1024**2)):
        most -= len(chunk)
        if most < 0:
            raise ArchiveError(f"{shown(archive)}: unpacks to more than the {size(limits()[0])} limit "
                               "(after its last file); raise it with DDPLAB_IMPORT_MAX_GB=N if it is "
                               "what you expect")


def _from_folder(folder: Path, tmp: Path) -> Source:
    db = find(folder, "mlflow.db", folder=False)
    if db is None:
        raise ArchiveError(f"{shown(folder)}: holds no mlflow.db (an embedded store), or only "
                           "through a link, which ddplab import does not follow")
    copy = tmp / "mlflow.db"
    need = db.stat().st_size + SPARE_BYTES
    if need > shutil.disk_usage(tmp).free:
        raise ArchiveError(f"{shown(db)}: {size(db.stat().st_size)}, more than {tmp.parent} has free; "
                           "point TMPDIR at a disk with room")
    try:  # a snapshot: nothing is ever written to the folder's store
        with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as src, \
                closing(sqlite3.connect(copy)) as dst:
            src.backup(dst)
    except sqlite3.Error as e:
        raise ArchiveError(f"{shown(db)}: not a readable SQLite store ({first_line(e)})") from None
    check_store(copy, db)
    return Source(copy, find(folder, "mlruns", folder=True))


def find(root: Path, name: str, folder: bool) -> Path | None:
    """The shallowest ``name`` under ``root`` (a plain file, or a folder), links not followed."""
    level = [root]
    for _ in range(FIND_DEPTH):
        below: list[Path] = []
        for where in sorted(level):
            try:
                entries = sorted(os.scandir(where), key=lambda e: e.name)
            except OSError:
                continue
            for e in entries:
                if e.is_symlink():
                    continue
                if e.name == name and (e.is_dir() if folder else e.is_file()):
                    return Path(e.path)
                if e.is_dir() and not e.name.startswith("."):
                    below.append(Path(e.path))
        level = below
    return None


def check_store(db: Path, shown_as: Path) -> None:
    """The private copy ``db`` is an MLflow store this MLflow reads: an SQLite file, undamaged,
    with MLflow's tables and a schema version MLflow knows (an older one is upgraded, in the
    copy only)."""
    where = shown(shown_as)
    try:
        with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as con:
            checked = con.execute("PRAGMA quick_check").fetchone()
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            missing = {"alembic_version", "experiments", "runs", "params", "tags", "metrics"} - tables
            versions = [] if missing else [r[0] for r in con.execute(
                "SELECT version_num FROM alembic_version")]
    except sqlite3.Error as e:
        raise ArchiveError(f"{where}: its mlflow.db is damaged or not an SQLite database "
                           f"({first_line(e)})") from None
    if not checked or checked[0] != "ok":
        raise ArchiveError(f"{where}: its mlflow.db is damaged ({shown(checked and checked[0])})")
    if missing:
        raise ArchiveError(f"{where}: its mlflow.db is not an MLflow store (no {', '.join(sorted(missing))} "
                           "table)")
    import mlflow
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config, _upgrade_db, create_sqlalchemy_engine_with_retry

    script = ScriptDirectory.from_config(_get_alembic_config(db_url=""))
    head = script.get_current_head()
    if versions == [head]:
        return
    try:
        known = len(versions) == 1 and script.get_revision(str(versions[0])) is not None
    except Exception:  # noqa: BLE001 - alembic's own errors for an unknown or malformed id
        known = False
    if not known:
        raise ArchiveError(f"{where}: its MLflow schema version {shown(versions, 60)} is not one "
                           f"MLflow {mlflow.__version__} knows (a newer MLflow's, or not MLflow's): "
                           "import it with an MLflow as new as the one that wrote it")
    try:
        _upgrade_db(create_sqlalchemy_engine_with_retry(f"sqlite:///{db}"))
    except Exception as e:  # noqa: BLE001 - any failure of the migration, one line
        raise ArchiveError(f"{where}: its MLflow schema ({shown(versions[0])}) could not be upgraded to "
                           f"MLflow {mlflow.__version__}'s ({first_line(e)})") from None


OUTSIDE = Path("/nonexistent/outside")
"""What :func:`artifact_folder` answers for a location that leads out of the source's mlruns/."""


def artifact_folder(uri: str, root: Path | None) -> Path | None:
    """The folder a run's recorded artifact location names, rewritten into the source's own
    mlruns/ (it named another machine's: ``file:///tmp/proof/work/mlruns/1/<run>/artifacts``);
    None if it names none there, OUTSIDE if it leads out of it (``.../mlruns//home/u/.ssh``,
    ``..``, a link)."""
    parsed = urlparse(uri or "")
    if root is None or parsed.scheme not in ("", "file"):
        return None  # artifacts kept elsewhere (a server, a bucket): not in the archive
    parts = unquote(parsed.path).split("/")
    if "mlruns" not in parts:
        return None
    rest = parts[parts.index("mlruns") + 1:]
    while rest and rest[-1] == "":
        rest.pop()
    if not rest or any(p in ("", ".", "..") or "\\" in p for p in rest):
        return OUTSIDE
    folder = root.joinpath(*rest)
    if not folder.exists() and not folder.is_symlink():
        return None
    if not inside(folder, root):
        return OUTSIDE
    return folder if folder.is_dir() else None


def inside(path: str | Path, root: Path) -> bool:
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


def stage(folder: Path, root: Path, into: Path) -> tuple[int, int]:
    """Copy ``folder``'s plain files, inside ``root``, to ``into``: (copied, left out). A link,
    to a file or a folder, is never followed; each file is opened without following one, and
    read only if it is still a plain file inside ``root`` once open."""
    copied = left = 0
    for here, dirs, files in os.walk(folder, followlinks=False):
        for d in [d for d in dirs if os.path.islink(os.path.join(here, d))]:
            dirs.remove(d)
            left += 1
        for f in files:
            path = os.path.join(here, f)
            before = os.lstat(path)
            if not stat.S_ISREG(before.st_mode):
                left += 1
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                left += 1
                continue
            with open(fd, "rb") as src:
                now = os.fstat(fd)
                real = f"/proc/self/fd/{fd}"
                where = os.readlink(real) if os.path.exists(real) else path
                if (now.st_ino, now.st_dev) != (before.st_ino, before.st_dev) or \
                        not stat.S_ISREG(now.st_mode) or not inside(where, root):
                    left += 1
                    continue
                out = into / os.path.relpath(path, folder)
                out.parent.mkdir(parents=True, exist_ok=True)
                with open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                copied += 1
    return copied, left
