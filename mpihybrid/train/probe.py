"""Each rank's core speed as the run goes: a fixed product timed at every step boundary of a
CPU run that writes a trace or scores stragglers live.

    probe = CoreProbe(slow)  # slow: train.slowdown on this rank when it is a device's (D)
    probe.tick()            # at the boundary every rank reaches (train.loop): times the
                            # product where EVERY_S have passed since its last timing
    probe.median()          # seconds of one product, the median of the timings; NaN before one

A trace measures a stage's work on its rank's core, so a slower core and a costlier stage look
alike; where one layer type runs on both ranks of a V the same layer cost 20 % more on one core
than on the other within one run (docs/analysis.md). `whatif` carries a stage's cost to another
rank in another placement by these speeds (analysis.restage), and a rank slower than its
replicas by its core's speed alone is a slower device, not a straggler in its work
(analysis.stragglers, train.live_stragglers). The product, 192 x 192 in fp32, takes 0.11-0.17 ms
on a core of the machine the docs measure on, run twice (the first brings it back into the
cache) at most every EVERY_S: under 0.5 % of any run's time. It is timed in the thread's CPU
time: a core's speed while the rank has it, not the time the rank waited for one (more ranks
than cores), which the actions' own CPU times tell apart. The median, not the mean: one timing
that an interrupt or a cold page lands in can read several times the rest, and a mean carried
it into a whole run's speed (a 2.4x core from one such run, docs/analysis.md). The last KEEP
timings are kept (about 55 minutes at the most frequent).
"""

from __future__ import annotations

import math
import time

import numpy as np

from mpihybrid.pipeline.slowdown import Slowdown

SIZE = 192  # the product's side; benchmarks/core_speeds.py times the same
EVERY_S = 0.05  # the least time between two timings
KEEP = 65536  # timings kept (float32: 256 KiB)


class CoreProbe:
    def __init__(self, slow: Slowdown | None = None) -> None:
        a = np.random.default_rng(0).standard_normal((SIZE, SIZE)).astype(np.float32)
        self._a, self._out = a, np.empty_like(a)
        self._times = np.empty(KEEP, np.float32)  # a ring: timing i at i % KEEP
        self._count, self._last = 0, -math.inf
        self._slow = slow if slow is not None and slow.device else None

    def tick(self) -> None:
        if time.perf_counter() - self._last < EVERY_S:
            return
        np.matmul(self._a, self._a, out=self._out)
        t0 = time.thread_time()
        np.matmul(self._a, self._a, out=self._out)
        if self._slow is not None:  # a slower device on purpose: the product takes longer
            self._slow.after("F", time.thread_time() - t0, time.thread_time)
        self._times[self._count % KEEP] = time.thread_time() - t0
        self._count += 1
        self._last = time.perf_counter()

    def median(self) -> float:
        """The median seconds of the timings kept (NaN before the first)."""
        kept = self._times[: min(self._count, KEEP)]
        return float(np.median(kept)) if len(kept) else math.nan
