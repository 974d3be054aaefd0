"""Directories a process makes in the temporary directory, and their removal on every exit path:
the process's own end (atexit), an abort it starts (remove_all() before MPI_Abort or os._exit),
and a kill it cannot see (the next process to make one removes those whose maker is gone).

    path = make_dir("mpihybrid-auto-")   # TMPDIR/mpihybrid-auto-<pid>@<host>.XXXXXXXX
    remove(path)                          # done with it
    remove_all()                          # before MPI_Abort / os._exit
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
from pathlib import Path

from mpihybrid.files import pid_alive

_MADE: list[Path] = []


def make_dir(prefix: str) -> Path:
    """A new directory TMPDIR/{prefix}{pid}@{host}.XXXXXXXX, removed when this process ends
    (leftovers of this prefix whose process is gone are removed first)."""
    sweep(prefix)
    if not _MADE:
        atexit.register(remove_all)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}@{socket.gethostname()}."))
    _MADE.append(path)
    return path


def remove(path: str | os.PathLike) -> None:
    path = Path(path)
    shutil.rmtree(path, ignore_errors=True)
    if path in _MADE:
        _MADE.remove(path)


def remove_all() -> None:
    """Every directory make_dir made in this process (an abort's last act; exit does it too)."""
    for path in list(_MADE):
        remove(path)


def sweep(prefix: str) -> list[Path]:
    """Remove this host's {prefix}* directories whose process no longer runs (a rank killed by
    an abort or by the OS leaves its own behind); another host's, or a live one's, stay."""
    gone = []
    host = socket.gethostname()
    for path in Path(tempfile.gettempdir()).glob(f"{prefix}*@*"):
        pid, _, rest = path.name[len(prefix) :].partition("@")
        if rest.rsplit(".", 1)[0] != host or not pid.isdigit() or pid_alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(path)
    return gone
