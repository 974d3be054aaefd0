"""Activation liveness, the one rule: a micro-batch's activations on a stage are alive from its F
until its last backward action there -- W when the backward is split (the schedule has a W for
that stage and micro-batch), else B.

    live = Liveness(split=split_backwards(actions))  # actions.py: (stage, mb) with a W
    for a in actions: live.action(a, nbytes)
    live.peak_count[s], live.peak_bytes[s], live.peak_total_bytes

Used by the simulator (peaks from action lists), the runtime (peaks as it runs) and the analysis
of a trace (peaks from F/B/W rows; replay_rows).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from mpihybrid.trace.recorder import COMPUTE, KIND


class Liveness:
    """Micro-batches and bytes alive per stage, and their peaks, as actions run in order."""

    def __init__(self, split: set[tuple[int, int]]) -> None:
        self.split = split  # (stage, microbatch) whose backward is split into B and W
        self.count: dict[int, int] = defaultdict(int)
        self.peak_count: dict[int, int] = defaultdict(int)
        self.bytes: dict[int, int] = defaultdict(int)
        self.peak_bytes: dict[int, int] = defaultdict(int)
        self.total_bytes = self.peak_total_bytes = 0  # over every stage of the actions given
        self._held: dict[tuple[int, int], int] = {}

    def step(self, kind: str, stage: int, microbatch: int, nbytes: int = 0) -> None:
        """Account one action ("F", "B" or "W"; others change nothing)."""
        key = (stage, microbatch)
        if kind == "F":
            self._held[key] = nbytes
            self.count[stage] += 1
            self.bytes[stage] += nbytes
            self.total_bytes += nbytes
            self.peak_count[stage] = max(self.peak_count[stage], self.count[stage])
            self.peak_bytes[stage] = max(self.peak_bytes[stage], self.bytes[stage])
            self.peak_total_bytes = max(self.peak_total_bytes, self.total_bytes)
        elif kind == "W" or (kind == "B" and key not in self.split):
            held = self._held.pop(key, 0)
            self.count[stage] -= 1
            self.bytes[stage] -= held
            self.total_bytes -= held

    def action(self, a, nbytes: int = 0) -> None:
        """Account Action `a`: a merged W is a W of each micro-batch it covers, all at once."""
        for mb in a.microbatches:
            self.step(a.kind, a.stage, mb, nbytes)


def replay_rows(rows: np.ndarray) -> Liveness:
    """Liveness of trace rows of one rank and step, replayed in start order: an F holds the
    bytes its row recorded."""
    rows = rows[np.isin(rows["kind"], list(COMPUTE))]
    weights = rows[rows["kind"] == KIND["weight"]]
    live = Liveness(
        set(zip(weights["stage"].tolist(), weights["microbatch"].tolist(), strict=True))
    )
    ordered = rows[np.argsort(rows["start"], kind="stable")]
    columns = (ordered[n].tolist() for n in ("kind", "stage", "microbatch", "bytes"))
    for kind, stage, microbatch, nbytes in zip(*columns, strict=True):  # lists: no row objects
        live.step(COMPUTE[kind], stage, microbatch, nbytes)
    return live
