"""Progress lines for commands that run for minutes (sweep, bench train, bench allreduce).

    progress = progress_echo(world.rank, quiet)
    progress("[2/12] 1f1b M=4 repeat 1: 38.1 ms/step")

Rank 0 prints them on stderr when the user's stderr is a terminal and --quiet was not given;
elsewhere (other ranks, a pipe, a batch log) they are dropped, so the output stays the results.
Under mpiexec a rank's stderr is a pipe to the launcher even at a terminal, so the launcher's
own stderr decides (Linux /proc; where that cannot be read, the rank's own stderr).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import click

LAUNCHERS = ("mpiexec", "mpirun", "srun")


def progress_echo(rank: int, quiet: bool) -> Callable[[str], None]:
    if rank == 0 and not quiet and on_terminal():
        return lambda text: click.echo(text, err=True)
    return lambda _text: None


def on_terminal() -> bool:
    """Whether the user sees stderr on a terminal: the MPI launcher's stderr when this process
    runs under one (it forwards ours through a pipe), else our own."""
    if sys.stderr.isatty():
        return True
    pid = os.getpid()
    for _ in range(4):  # rank -> proxy -> launcher
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read()
            pid = int(stat[stat.rindex(")") + 2 :].split()[1])  # the parent's pid
            with open(f"/proc/{pid}/comm") as fh:
                name = fh.read().strip()
            if name.startswith(LAUNCHERS):
                return os.readlink(f"/proc/{pid}/fd/2").startswith(("/dev/pts/", "/dev/tty"))
        except (OSError, ValueError, IndexError):
            return False
    return False
