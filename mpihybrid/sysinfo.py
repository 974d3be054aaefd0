"""What the MPI library and the host say about themselves, made safe to write to a file.

    mpi_library()          # "Open MPI v4.1.4, package: Debian OpenMPI, ..." (first line, clean)
    hostname()             # this host's name, clean
    clean_text(any_str)    # printable, bounded: what any such string becomes before a file

An MPI library's strings are C buffers: Open MPI's `Get_library_version()` ends in NUL bytes,
which HDF5's variable-length strings refuse ("VLEN strings do not support embedded NULLs"), so
a traced run failed on rank 0. Nothing that comes from MPI or the host reaches a trace, a flight
record or a report without going through `clean_text`: NULs and other control characters
become spaces (runs of them one), bytes that are not text become U+FFFD, and the length is
bounded (what is cut says so with a trailing "...").
"""

from __future__ import annotations

import re
import socket

# C0 and C1 control characters (tab and newline included: these strings are one line each)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")
# lone surrogates (bytes that were not UTF-8, kept by surrogateescape) cannot be encoded
_SURROGATE = re.compile("[\ud800-\udfff]")
LIMIT = 256  # characters: an MPI library's version line is ~100, a hostname at most 253


def clean_text(text: str | bytes, limit: int = LIMIT) -> str:
    """`text` as one printable line of at most `limit` characters."""
    head = text[: 4 * limit + 4]  # a huge string is cut before it is scanned
    if isinstance(head, bytes):
        head = head.decode("utf-8", "replace")
    line = _CONTROL.sub(" ", _SURROGATE.sub("\ufffd", head)).strip()
    if len(line) > limit or len(text) > len(head):
        line = line[: max(limit - 3, 0)].rstrip() + "..."
    return line


def mpi_library() -> str:
    """The MPI library's version string, first line, clean (Open MPI's carries NULs)."""
    from mpi4py import MPI

    lines = MPI.Get_library_version().replace("\x00", "\n").strip().splitlines()
    return clean_text(lines[0] if lines else "")


def hostname() -> str:
    """This host's name, clean."""
    return clean_text(socket.gethostname())


def processor_name() -> str:
    """MPI's name for this rank's processor (usually the hostname), clean."""
    from mpi4py import MPI

    return clean_text(MPI.Get_processor_name())
