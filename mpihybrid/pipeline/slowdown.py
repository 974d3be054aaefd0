"""Stragglers: the rule that names one (THRESHOLD, CHRONIC: analysis/stragglers.py after the
run, train/live_stragglers.py during it), and one made on purpose (train.slowdown, off by
default): one rank's F, B or W actions
take `factor` times as long, by doing real extra work after each (matrix products on the same
core, as a slower device would), so tests and demonstrations can make a straggler that the
analysis must find (docs/analysis.md). Kind D is a slower device: every compute action and the
core probe (train.probe) take `factor` times as long, which the analysis must not blame on the
rank's work.

    slow = Slowdown.parse("1:F:1.3")      # rank 1's forwards 1.3x; "0:FBW:2": all its compute
    slow.after("F", seconds_it_took)      # on that rank: work (factor - 1) x as long again
    Slowdown.parse("1:D:1.3")             # rank 1 on a 1.3x slower device
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

_BLOCK = 64  # a product this size takes microseconds: the clock is read between them
# slow: an action kind's median (or mean, live) at least this times its stage's fastest
# replica's; chronic: slow in at least this share of the steps (or step lines) seen
THRESHOLD = 1.15
CHRONIC = 0.5
# beyond a slower core (its probe over its fastest replica's, train.probe), THRESHOLD x that
# ratio to the power 1 + PROBE_FIT: the probe's product tells an action's speed on another core
# to within its ratio to this power (on a 3x device an action's CPU time measured 0.91-1.17x
# the probe's ratio: memory traffic and calls do not scale as a product does)
PROBE_FIT = 0.2


def core_ratios(speeds: np.ndarray) -> np.ndarray:
    """Each peer's core against its fastest peer's (train.probe seconds: a ratio of 1 is as fast
    as the fastest); all 1 where any peer's speed is not known (NaN, or not positive)."""
    speeds = np.asarray(speeds, dtype=float)
    if not np.isfinite(speeds).all() or not (speeds > 0).all():
        return np.ones_like(speeds)
    return speeds / speeds.min()


def beyond_core(core):
    """The factor a rank's CPU time must pass, against its fastest replica's, to be slow in its
    work on a core `core` x as slow as that replica's (1: as fast)."""
    return THRESHOLD * core ** (1.0 + PROBE_FIT)


@dataclass(frozen=True)
class Slowdown:
    rank: int
    kinds: str  # some of "FBW"
    factor: float

    @classmethod
    def parse(cls, text: str) -> Slowdown | None:
        """ "RANK:KINDS:FACTOR" ("" = off); ValueError naming what is wrong."""
        if not text:
            return None
        parts = text.split(":")
        if len(parts) != 3:
            raise ValueError(f"{text!r} is not RANK:KINDS:FACTOR (e.g. 1:F:1.3)")
        rank, kinds, factor = parts
        if not rank.isdigit():
            raise ValueError(f"{text!r}: the rank must be a whole number >= 0")
        if kinds != "D" and (not kinds or any(k not in "FBW" for k in kinds)):
            raise ValueError(f"{text!r}: the kinds are some of F, B, W, or D (a slower device)")
        try:
            value = float(factor)
        except ValueError:
            value = float("nan")
        if not 1.0 <= value <= 100.0:
            raise ValueError(f"{text!r}: the factor must be a number from 1 to 100")
        return cls(int(rank), kinds, value)

    @property
    def device(self) -> bool:
        """The whole device is slower: every compute kind and the core probe."""
        return self.kinds == "D"

    def after(self, kind: str, seconds: float, clock=time.perf_counter) -> None:
        """Work (factor - 1) x `seconds` more on `clock` when `kind` is slowed: the thread's CPU
        time where the action was timed in it (another process on the core then lengthens the
        wall, not the work), else the wall's."""
        if (kind in self.kinds or self.device) and seconds > 0:
            burn((self.factor - 1.0) * seconds, clock)


def burn(seconds: float, clock=time.perf_counter) -> None:
    """Real arithmetic until `seconds` have passed on `clock` (not a sleep: it holds the core)."""
    a = np.full((_BLOCK, _BLOCK), 1.0 / _BLOCK, dtype=np.float32)
    end = clock() + seconds
    while clock() < end:
        a = a @ a
