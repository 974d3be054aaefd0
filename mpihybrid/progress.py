"""Work that runs long without an action ending (an evaluation, a checkpoint file, a trace flush,
a schedule search) tells the running watchdog it is progressing, from any layer:

    from mpihybrid.progress import progress
    progress("searching a schedule")       # two stores; a no-op when no watchdog runs

The watchdog (train.watchdog) registers its flight record here with `watch()`; this module sits
at the bottom of the package so that config, pipeline and trace can tick it without importing
upward.
"""

from __future__ import annotations

from typing import Protocol

# how often the watchdog looks: a comm.timeout_s below it cannot be told from a stall
TICK_S = 1.0


class _Ticks(Protocol):
    def tick(self, what: str = "") -> None: ...


_watched: _Ticks | None = None  # the running watchdog's record, what progress() ticks


def progress(what: str = "") -> None:
    """Work is going on in this process: the running watchdog counts it as progress, not a stall."""
    flight = _watched
    if flight is not None:
        flight.tick(what)


def watch(flight: _Ticks | None) -> None:
    """Make `flight` the record progress() ticks (None: nothing is watched)."""
    global _watched
    _watched = flight


def watched() -> _Ticks | None:
    return _watched
