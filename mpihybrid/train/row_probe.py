"""How this host's passes scale with a micro-batch's rows, for the trace: each of the rank's
model chunks timed at the run's rows and at half of them (twice them where a micro-batch holds
one sample), F, B and W apart, once the steps are done (a traced CPU run, replica 0's ranks).

    rows, timings = time_rows(job.workload, chunks=[0, 3])   # {chunk: [F, F2, B, B2, W, W2]}

A change of M changes the rows of every micro-batch, and what half the rows cost is the host's:
on one machine the GPT's passes at half their rows took 0.52-0.57 of them and the MLP's
0.46-0.54, where the cost model calibrated on another machine said 0.53-0.56 and 0.57-0.61
(docs/analysis.md). whatif's change of M scales each stage's measured F, B and W by the line
through these two points (predict/rows.py); a trace without them falls back to the cost model.
Each chunk is built afresh (its own weights) at both sizes; one micro-batch a pass, a warm-up and
rounds alternating the sizes (REPEATS of them, more where a round is short: until the rounds
hold ENOUGH seconds, at most MOST rounds), the median of each pass, timed in the thread's CPU
time (the shape of the cost, not the waits for a core): about 5 micro-batches' work per chunk
of a GPT; a small MLP's passes of tens of microseconds take up to MOST rounds, where 4 rounds'
medians let one interrupt turn the half-size passes dearer than the whole (1 test in 10 under
load).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import numpy as np

from mpihybrid.nn.cost import Workload
from mpihybrid.nn.data import task_dims
from mpihybrid.nn.model import build_stage
from mpihybrid.nn.profile import chunk_inputs, chunk_loss

REPEATS = 4
ENOUGH = 0.05  # seconds of CPU time in a chunk's rounds (both sizes) before they may stop
MOST = 64


def other_size(size: int) -> int:
    """The second point's samples a micro-batch: half, or twice one sample."""
    return size // 2 if size >= 2 else 2 * size


def time_rows(work: Workload, chunks: list[int]) -> tuple[list[int], dict[int, list[float]]]:
    """([rows, rows2], {chunk: [F, F2, B, B2, W, W2]}): seconds of one micro-batch's passes of
    each chunk at the run's rows and at the other point's."""
    works = [
        dataclasses.replace(work, microbatches=1, microbatch_size=size)
        for size in (work.microbatch_size, other_size(work.microbatch_size))
    ]
    out = {}
    for c in chunks:
        passes = [_Passes(w, c) for w in works]
        for p in passes:  # the first round warms up (and compiles)
            p.run()
        start = time.thread_time()
        for rounds in range(1, MOST + 1):
            for p in passes:
                p.run()
            if rounds >= REPEATS and time.thread_time() - start >= ENOUGH:
                break
        full, other = (p.medians() for p in passes)
        out[c] = [x for pair in zip(full, other, strict=True) for x in pair]
    return [w.rows for w in works], out


class _Passes:
    """One chunk at one micro-batch size: its F, B and W timed round after round (the loss with
    the last chunk, in F: its value and gradient, as the runtime runs them)."""

    def __init__(self, work: Workload, chunk: int):
        self.stage = build_stage(work.model, *task_dims(work.data), chunk, work.chunks,
                                 seed=work.seed)  # fmt: skip
        (self.x,), (self.target,) = chunk_inputs(work, chunk)
        self.loss = chunk_loss(work) if chunk == work.chunks - 1 else None
        self.first = chunk == 0
        self.times: list[tuple[float, float, float]] = []

    def run(self) -> None:
        clock = time.thread_time
        t0 = clock()
        out, cache = self.stage.forward(self.x)
        if self.loss is not None:  # in F, as the runtime runs it
            _, _, dy = self.loss.step(out, self.target, 1.0)
        else:
            dy = np.full_like(out, 1e-3)
        t1 = clock()
        _, wcache = self.stage.backward_input(dy, cache, need_dx=not self.first)
        t2 = clock()
        self.stage.backward_weight(wcache)
        self.times.append((t1 - t0, t2 - t1, clock() - t2))

    def medians(self) -> list[float]:
        return [statistics.median(t[k] for t in self.times[1:]) for k in range(3)]
