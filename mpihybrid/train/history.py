"""A per-step metric (the loss, the accuracy) in a fixed ring: a run's memory does not grow with
its steps.

    losses = History()                      # or History(window, first): a checkpoint's
    losses.append(2.31); losses[-1]; len(losses)   # len: every step so far
    losses.kept(); losses.first             # the last KEEP values, the step (0-based) of the first

A million-step run held its losses and accuracies as Python lists: 64 bytes a step on every
rank. The whole curve is the trace's (/steps); a checkpoint keeps the last KEEP steps.
"""

from __future__ import annotations

import numpy as np

KEEP = 1 << 16  # steps kept: 512 KiB of float64 a metric


class History:
    """The last KEEP values of a per-step metric; earlier steps read as NaN."""

    def __init__(self, values=(), first: int = 0):
        self._ring = np.full(KEEP, np.nan)
        self._n = int(first)
        for value in values:
            self.append(value)

    def append(self, value: float) -> None:
        self._ring[self._n % KEEP] = value
        self._n += 1

    def __len__(self) -> int:
        return self._n

    @property
    def first(self) -> int:
        """The step (0-based) of the oldest value kept."""
        return max(self._n - KEEP, 0)

    def __getitem__(self, i: int) -> float:
        i = i + self._n if i < 0 else i
        if not 0 <= i < self._n:
            raise IndexError(i)
        return float(self._ring[i % KEEP]) if i >= self.first else float("nan")

    def kept(self) -> list[float]:
        """The kept values, oldest first (every step's while the run is under KEEP steps)."""
        return [float(self._ring[i % KEEP]) for i in range(self.first, self._n)]
