"""Writing files all or nothing: the one atomic writer of traces, exports, plots, CSVs and
checkpoints.

    write_atomic("runs/seed.json", text)                # bytes or str
    with atomic_path("runs/seed.h5") as tmp:            # for writers that want a path (h5py)
        h5py.File(tmp, "w") ...
    commit_dir(partial, final)                          # a directory of files, renamed whole

A file is written to a temporary name in its own directory, flushed to disk (fsync), renamed over
the target (os.replace: readers see the old file or the new one, never half of one), and the
directory is fsynced so the rename itself survives a crash.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def check_target(path: str | os.PathLike, overwrite: bool) -> Path:
    """`path` as a Path, or the error writing it would end in (nothing is touched)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists (--overwrite replaces it)")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
    return path


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        if not os.path.isdir(path):
            raise
        # some file systems refuse fsync on a directory; the rename still happened
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; on leaving, fsync it, rename it over
    `path` and fsync the directory. On an exception the temporary is removed and `path` is left
    as it was. FileExistsError when `path` exists and overwrite is False."""
    path = check_target(path, overwrite)
    tmp = _create_temporary(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename in (str(tmp), tmp):  # the user knows `path`, not our hidden temporary
            raise _naming(exc, path) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def _create_temporary(path: Path) -> Path:
    """An empty, new temporary file beside `path`; the error names `path` when that fails."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        # O_EXCL: never clobber another writer's temporary; mode 0o666 lets the umask decide
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as exc:
        raise _naming(exc, path) from None
    return tmp


def _naming(exc: OSError, path: Path) -> OSError:
    """The same kind of error, its message naming `path`: 'cannot write PATH: REASON'."""
    reason = exc.strerror or str(exc)
    kind = PermissionError if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else type(exc)
    return _error(kind, exc.errno, f"cannot write {path}: {reason}")


def _error(kind: type[OSError], code: int | None, message: str) -> OSError:
    """An OSError whose str() is `message` alone (no '[Errno N]'), errno kept."""
    exc = kind(message)
    exc.errno = code
    return exc


def probe_file(path: str | os.PathLike) -> None:
    """Create and remove the temporary a write of `path` would use: an error now (naming
    `path`) rather than after hours of training. os.access is no test: root passes it."""
    _create_temporary(Path(path)).unlink()


def probe_dir(path: str | os.PathLike) -> Path:
    """Create directory `path` (and its parents) if needed and write a file in it, or raise
    the OSError that writing there ends in, naming `path`."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise _error(
            NotADirectoryError, errno.ENOTDIR, f"{path} is a file, not a directory"
        ) from None
    except OSError as exc:
        message = f"cannot create directory {path}: {exc.strerror}"
        raise _error(type(exc), exc.errno, message) from None
    _create_temporary(path / "probe").unlink()
    return path


def write_atomic(path: str | os.PathLike, data: bytes | str, overwrite: bool = False) -> None:
    """Write `data` to `path` all or nothing (atomic_path).

    FileExistsError when `path` exists and overwrite is False (nothing is touched then).
    """
    payload = data.encode() if isinstance(data, str) else data
    with atomic_path(path, overwrite) as tmp, open(tmp, "wb") as fh:
        fh.write(payload)


def commit_dir(partial: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Rename a directory written in full under a temporary name to `final`: every file in it
    and the directory itself are fsynced first (other ranks may have written them), the
    parent after. FileExistsError when `final` exists."""
    partial, final = Path(partial), Path(final)
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    for child in partial.iterdir():
        if child.is_file():
            fsync_path(child)
    fsync_path(partial)
    os.rename(partial, final)
    fsync_path(final.parent)
    return final
