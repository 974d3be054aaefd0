"""A registered schedule: everything the rest of mpihybrid asks of it (schedules.SPECS)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpihybrid.pipeline.actions import Action
from mpihybrid.pipeline.placement import Placement


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """Built with keywords: each field says what it is (SPECS, csv_schedule.csv_spec)."""

    name: str
    build: Callable[[int, int, int], dict[int, list[Action]]]  # (pp, m, v) -> compute lists
    placement: str  # loop: stage s on rank s % p; v: rank r holds r and 2p-1-r; rows: a CSV's
    chunks: int  # model chunks per rank; 0: train.virtual_stages (>= 2) chooses
    min_microbatches: Callable[[int, int], int]  # (pp, v) -> the fewest m it accepts
    bubble_text: str  # closed-form idle fraction, F = B = W
    bubble: Callable[[int, int, int], float] | None  # (p, m, v) -> it; None: simulate (CSV)
    splits_backward: bool  # B (input gradient) and W (weight gradient) are separate actions
    memory_text: str  # the paper's activation memory per rank, in one stage's micro-batches
    note: str = ""
    m_multiple_of_pp: bool = False  # interleaved: m % p == 0
    placement_of: Callable[[int, int], Placement] | None = None  # rows: the file's placement
    check: Callable[[int, int, int], None] | None = None  # (pp, m, v): raise ScheduleError

    def make_placement(self, pp: int, v: int) -> Placement:
        if self.placement_of is not None:
            return self.placement_of(pp, v)
        return Placement.v(pp, v) if self.placement == "v" else Placement.loop(pp, v)
