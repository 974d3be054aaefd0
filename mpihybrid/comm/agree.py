"""Agreeing on the first error: every rank passes its own (or None) to one collective and every
rank gets the same answer, so all raise (or exit) together and none is left waiting.

    first = first_error(world, error)          # the lowest rank's error, or None
    found, answers = agree(world, error, x)    # [(rank, error), ...], every rank's x
"""

from __future__ import annotations

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
