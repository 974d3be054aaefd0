"""Progress lines for commands that run for minutes (sweep, bench train, bench allreduce).

    progress = progress_echo(world.rank, quiet)
    progress("[2/12] 1f1b M=4 repeat 1: 38.1 ms/step")

Rank 0 prints them on stderr unless --quiet, one short line per run, repeat or size: the
results stay on stdout (a pipe or `> file` gets only them), and a batch log shows how far a long
sweep got. No terminal detection: under mpiexec a rank's stderr is a pipe even at a terminal,
and a progress bar redrawn through that pipe would only garble a log.
"""

from __future__ import annotations

from collections.abc import Callable

import click


def progress_echo(rank: int, quiet: bool) -> Callable[[str], None]:
    if rank == 0 and not quiet:
        return lambda text: click.echo(text, err=True)
    return lambda _text: None
