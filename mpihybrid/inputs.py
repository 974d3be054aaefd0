"""Reading a file a user names (text, CSV schedules, tokenizers, token files, job and cluster
files): only regular files, each bounded before it is read.

    text = read_regular(path, what="job file", limit=MAX_JOB_BYTES).decode()
    with open_regular(path, what="token file") as (fh, size):   # for np.memmap(fh, ...)
        ...

A FIFO, a device, a socket or a directory is refused with one line (InputFileError, which each
caller re-raises as its own error) before any open that could block: the path is stat'ed first,
then opened with O_NONBLOCK (a FIFO swapped in after the stat opens at once instead of waiting
for a writer; a regular file ignores the flag) and the open file checked again. A regular file
over its reader's bound is refused naming the bound. Writing is mpihybrid.files's.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

MiB = 1 << 20
MAX_TOML_BYTES = 1 * MiB  # a job file or a cluster file: a few KiB of settings


class InputFileError(ValueError):
    """A path a user named that is not read; the message is one line naming the path."""


class NotRegularFileError(InputFileError):
    """A directory, FIFO, device or socket where a file was asked for, or no file at all."""


class InputTooLargeError(InputFileError):
    """A regular file larger than the bound its reader names."""


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def human_limit(limit: int) -> str:
    """1048576 -> '1 MiB': a bound as an error names it."""
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if limit >= size and limit % size == 0:
            return f"{limit // size} {unit}"
    return f"{limit:,} bytes"


def _refuse_irregular(path: Path, what: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "of an unknown kind")
        raise NotRegularFileError(f"{what} {path} is {kind}, not a regular file")


def _bound(path: Path, what: str, size: int, limit: int | None) -> None:
    if limit is not None and size > limit:
        raise InputTooLargeError(
            f"{what} {path} is {size:,} bytes, over the {human_limit(limit)} a {what} may hold"
        )


def check_regular(path: str | os.PathLike, *, what: str, limit: int | None = None) -> int:
    """The size of a regular file (stat only, nothing opened), or InputFileError."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise NotRegularFileError(f"{what} {path}: no such file") from None
    except OSError as exc:
        raise InputFileError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    _refuse_irregular(path, what, st.st_mode)
    _bound(path, what, st.st_size, limit)
    return st.st_size


@contextmanager
def open_regular(
    path: str | os.PathLike, *, what: str, limit: int | None = None
) -> Iterator[tuple[BinaryIO, int]]:
    """(binary file, size) of a regular file of at most `limit` bytes (None: any), checked as
    the module's docstring says; InputFileError otherwise."""
    path = Path(path)
    check_regular(path, what=what, limit=limit)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise InputFileError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        _refuse_irregular(path, what, st.st_mode)
        _bound(path, what, st.st_size, limit)
        yield fh, st.st_size


def read_regular(path: str | os.PathLike, *, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; one that grows past `limit` while
    it is read (or a /proc file whose size says 0) is refused too."""
    chunks, total = [], 0
    with open_regular(path, what=what, limit=limit) as (fh, size):
        want = size + 1  # the size it says (a buffer of `limit` would be allocated whole)
        while chunk := _read(fh, min(want, limit + 1 - total), path, what):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise InputTooLargeError(
                    f"{what} {path} holds more than the {human_limit(limit)} a {what} may hold"
                )
            want = MiB
    return b"".join(chunks)  # one chunk: itself, not a copy


def _read(fh: BinaryIO, count: int, path, what: str) -> bytes:
    try:
        return fh.read(count)
    except OSError as exc:
        raise InputFileError(f"{what} {path}: cannot read it ({exc.strerror})") from None


def read_text(path: str | os.PathLike, *, what: str, limit: int) -> str:
    """read_regular's bytes as UTF-8 text; InputFileError when they are not."""
    data = read_regular(path, what=what, limit=limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(
            f"{what} {path} is not UTF-8 text (byte {exc.start} cannot be decoded)"
        ) from None
