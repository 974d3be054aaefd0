"""Each rank's core speed as the run goes, for the trace: a fixed product timed at every step
boundary of a traced run on the CPU.

    probe = CoreProbe()
    probe.tick()            # at the boundary every rank reaches (train.loop): times the
                            # product where EVERY_S have passed since its last timing
    probe.mean()            # seconds of one product, over the run; NaN before the first

A trace measures a stage's work on its rank's core, so a slower core and a costlier stage look
alike; where one layer type runs on both ranks of a V the same layer cost 20 % more on one core
than on the other within one run (docs/analysis.md). `whatif` carries a stage's cost to another
rank in another placement by these speeds (analysis.restage). The product, 192 x 192 in fp32,
takes 0.11-0.17 ms on a core of the machine the docs measure on, run twice (the first brings
it back into the cache) at most every EVERY_S: under 0.5 % of any run's time.
"""

from __future__ import annotations

import math
import time

import numpy as np

SIZE = 192  # the product's side; benchmarks/core_speeds.py times the same
EVERY_S = 0.05  # the least time between two timings


class CoreProbe:
    def __init__(self) -> None:
        a = np.random.default_rng(0).standard_normal((SIZE, SIZE)).astype(np.float32)
        self._a, self._out = a, np.empty_like(a)
        self._total, self._count, self._last = 0.0, 0, -math.inf

    def tick(self) -> None:
        if time.perf_counter() - self._last < EVERY_S:
            return
        np.matmul(self._a, self._a, out=self._out)
        t0 = time.perf_counter()
        np.matmul(self._a, self._a, out=self._out)
        self._last = time.perf_counter()
        self._total += self._last - t0
        self._count += 1

    def mean(self) -> float:
        return self._total / self._count if self._count else math.nan
