"""Agreeing on the first error: every rank passes its own (or None) to one collective and every
rank gets the same answer, so all raise (or exit) together and none is left waiting.

    first = first_error(world, error)          # the lowest rank's error, or None
    found, answers = agree(world, error, x)    # [(rank, error), ...], every rank's x
    value, error = rank0_decides(world, fn)    # fn() on rank 0: its value, or its error's line
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def agree(comm, error: Any, answer: Any = None) -> tuple[list[tuple[int, Any]], list[Any]]:
    """Collective: (rank, error) of every rank that has one, lowest rank first, and every rank's
    `answer` (a second thing the ranks settle in the same call), the same on every rank."""
    verdicts = comm.allgather((error, answer))
    found = [(rank, err) for rank, (err, _) in enumerate(verdicts) if err is not None]
    return found, [a for _, a in verdicts]


def first_error(comm, error: Any) -> Any:
    """Collective: the lowest rank's error, or None when no rank has one."""
    found, _ = agree(comm, error)
    return found[0][1] if found else None


def one_line(exc: BaseException) -> str:
    """An error as the one line a user reads: its message's first line (its type's name if it
    has none)."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def rank0_decides(
    comm,
    decide: Callable[[], Any],
    *,
    expected: tuple[type[BaseException], ...] = (Exception,),
    describe: Callable[[BaseException], str] = one_line,
) -> tuple[Any, str | None]:
    """Collective: `decide()` run on rank 0 alone (a file system look, a measurement, a search),
    and every rank gets the same (its value, None), or (None, describe(error)) where it raised
    one of `expected`, so all raise or go on together. Anything else rank 0 raises is raised
    there while the others wait in the broadcast: the caller ends the job (cli's abort_job).
    comm None: this process alone."""
    value, error = None, None
    if comm is None or comm.rank == 0:
        try:
            value = decide()
        except expected as exc:
            error = describe(exc)
    if comm is not None:
        value, error = comm.bcast((value, error), root=0)
    return (None, error) if error is not None else (value, None)
