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

import atexit
import errno
import fcntl
import json
import os
import re
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
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


# ---------------------------------------------------------------------------------------------
# one run per checkpoint directory and per trace path


class LockedError(OSError):
    """Another live run holds the lock; the message names it and the lock file."""


_HELD: dict[str, RunLock] = {}  # lock file -> its lock, what this process holds


@dataclass
class RunLock:
    """An exclusive lock on a run's file or directory, held by one process until release() or
    its exit: a lock file (`DIR/.lock`, `.NAME.lock` beside a file) locked with flock(2) and
    naming its holder (host, pid, the process's start time, SLURM job).

    The kernel drops a flock lock when its process dies (kill -9, MPI_Abort, a lost node on NFS
    once its lease ends), so the lock file a killed run leaves behind does not lock anything: the
    next run takes it over. Where the file system refuses flock (ENOLCK, EOPNOTSUPP, ENOSYS:
    Lustre mounted without `flock`, NFSv3 without lockd), the file alone is the lock (created
    with O_EXCL): a holder on this host whose pid is gone or belongs to a later process, or a
    holder that was this same SLURM job before a requeue, is stale and replaced."""

    path: Path
    what: str
    fd: int | None = None

    def release(self) -> None:
        """Remove the lock file (ours alone) and drop the lock; safe to call twice."""
        if _HELD.get(str(self.path)) is self:
            del _HELD[str(self.path)]
        if self.fd is None:
            return
        try:
            if _is_me(_holder_of(self.path)):
                self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def lock_path_for(target: str | os.PathLike, is_dir: bool) -> Path:
    """The lock file of a directory (inside it) or of a file (hidden, beside it)."""
    target = Path(target)
    return target / ".lock" if is_dir else target.parent / f".{target.name}.lock"


def acquire_lock(target: str | os.PathLike, what: str, is_dir: bool = False) -> RunLock:
    """Lock `target` for this process (its directory must exist); LockedError naming the
    holder when another live run has it. Taking a lock this process holds returns it."""
    path = lock_path_for(target, is_dir)
    if str(path) in _HELD:
        return _HELD[str(path)]
    for _ in range(8):  # a holder releasing (unlinking) between our open and our lock: again
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise _naming(exc, Path(target)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _error(LockedError, errno.EBUSY, _in_use(path, what)) from None
            if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return _acquire_by_file(path, what)
            raise _naming(exc, Path(target)) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return _held(RunLock(path, what, fd))
        os.close(fd)
    raise _error(LockedError, errno.EBUSY, _in_use(path, what))


def _held(lock: RunLock) -> RunLock:
    """Record a lock just taken: its holder written into it, released at exit (sys.exit too;
    after os._exit or a kill the kernel drops the flock and the next run takes the file over)."""
    _write_holder(lock.fd)
    if not _HELD:
        atexit.register(release_all)
    _HELD[str(lock.path)] = lock
    return lock


def release_all() -> None:
    """Release every lock this process holds (at the end of a command; exit does it too)."""
    for lock in list(_HELD.values()):
        lock.release()


def _acquire_by_file(path: Path, what: str) -> RunLock:
    """No flock here: the lock file itself is the lock, stale holders replaced (see RunLock)."""
    for _ in range(8):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            if not _stale(_holder_of(path)):
                raise _error(LockedError, errno.EBUSY, _in_use(path, what)) from None
            path.unlink(missing_ok=True)
            continue
        except OSError as exc:
            raise _naming(exc, path) from None
        return _held(RunLock(path, what, fd))
    raise _error(LockedError, errno.EBUSY, _in_use(path, what))


def _process_start(pid: int) -> str:
    """The start time of process `pid` in clock ticks since boot (/proc), "" where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, after the command's parentheses


def _holder_text() -> str:
    pid = os.getpid()
    since = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return json.dumps(
        {
            "host": socket.gethostname(),
            "pid": pid,
            "start": _process_start(pid),
            "slurm_job": os.environ.get("SLURM_JOB_ID", ""),
            "since": since,
        }
    )


def _is_me(holder: dict | None) -> bool:
    return bool(holder) and (holder.get("host"), holder.get("pid")) == (
        socket.gethostname(),
        os.getpid(),
    )


def _write_holder(fd: int) -> None:
    text = _holder_text().encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, text, 0)


def _holder_of(path: Path) -> dict | None:
    """The holder a lock file names (None: unreadable, empty or not ours)."""
    try:
        with open(path, "rb") as fh:
            holder = json.loads(fh.read(4096) or b"null")
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _stale(holder: dict | None) -> bool:
    """Whether a lock file's holder is certainly gone (only then is its lock replaced)."""
    if holder is None:
        return False  # being written, or not ours: never taken over
    slurm_job = os.environ.get("SLURM_JOB_ID", "")
    if slurm_job and holder.get("slurm_job") == slurm_job:
        return True  # this job before its requeue (a job runs once at a time)
    if holder.get("host") != socket.gethostname():
        return False  # another host's process cannot be asked
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    start = _process_start(pid)
    return bool(start and holder.get("start") and start != holder["start"])


def _in_use(path: Path, what: str) -> str:
    holder = _holder_of(path) or {}
    who = ""
    if holder:
        who = f" (pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"
        who += f", SLURM job {holder['slurm_job']})" if holder.get("slurm_job") else ")"
    return (
        f"{what} is in use by another run{who}: wait for it to end or choose another path "
        f"(lock file {path})"
    )


def clean_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove the temporaries (`.NAME.PID.HEX.tmp`) earlier writes of `path` left behind when
    their process died: only names of this pattern, only of a pid that no longer runs here.
    Call it holding the lock of `path`, so no other run writes them."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.[0-9a-f]{{8}}\.tmp")
    removed = []
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    for name in names:
        match = pattern.fullmatch(name)
        if match and not pid_alive(int(match.group(1))):
            try:
                (path.parent / name).unlink()
            except OSError:
                continue
            removed.append(path.parent / name)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (another user's counts as running)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


# ---------------------------------------------------------------------------------------------
# reading HDF5 files someone else may have made

DEFLATE_MAX_RATIO = 1032  # zlib's largest expansion: a gzip chunk of n bytes inflates to < 1032 n


def h5_dataset_problem(ds, file_size: int) -> str:
    """Why an HDF5 dataset must not be read ("" when it may): data kept outside the file
    (external storage, a virtual dataset), a filter other than gzip/shuffle/fletcher32, or a
    declared size the file cannot hold (unallocated chunks read as fill values, a contiguous
    block past the end): what a reader checks before allocating memory for it."""
    import h5py

    if ds.is_virtual:
        return "is a virtual dataset (its data lives in other files)"
    if ds.external:
        return "keeps its data in external files"
    nbytes = int(ds.size) * ds.dtype.itemsize
    plist = ds.id.get_create_plist()
    layout = plist.get_layout()
    stored = ds.id.get_storage_size()
    if layout == h5py.h5d.CHUNKED:
        allowed = {h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_FLETCHER32}
        for i in range(plist.get_nfilters()):
            if plist.get_filter(i)[0] not in allowed:
                return f"uses HDF5 filter {plist.get_filter(i)[0]} (only gzip and shuffle)"
        chunks = ds.chunks or ()
        expected = 1
        for n, c in zip(ds.shape, chunks, strict=False):
            expected *= -(-n // c) if c else 0
        if ds.id.get_num_chunks() < expected or stored > file_size:
            return f"declares {ds.shape} but the file holds fewer of its rows"
        if nbytes > DEFLATE_MAX_RATIO * stored + (1 << 16):
            return f"declares {nbytes} bytes, more than its {stored} stored bytes can hold"
    elif layout == h5py.h5d.CONTIGUOUS:
        if nbytes > file_size or (nbytes and stored < nbytes):
            return f"declares {nbytes} bytes but the file holds {min(stored, file_size)}"
    return ""
