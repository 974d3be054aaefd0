"""What actually ran: a trace's F/B/W rows of one step back as schedule actions, and their grid.

print(grid_as_run(events, placement, step=9))   # the step x rank grid of step 9, replica 0
"""

from __future__ import annotations

import numpy as np

from mpihybrid.pipeline.placement import Placement
from mpihybrid.pipeline.schedules import Action
from mpihybrid.pipeline.simulate import render_grid
from mpihybrid.trace.recorder import COMPUTE


def compute_rows(events: np.ndarray, step: int, replica: int = 0) -> np.ndarray:
    """The F/B/W rows of `step` on replica `replica`, in the order they started."""
    rows = events[
        (events["step"] == step)
        & (events["replica"] == replica)
        & np.isin(events["kind"], list(COMPUTE))
    ]
    return rows[np.argsort(rows["start"], kind="stable")]


def actions_as_run(
    events: np.ndarray, placement: Placement, step: int, replica: int = 0
) -> dict[int, list[Action]]:
    """Each pp rank's F/B/W of `step` (one replica) as schedule actions, in the order they
    started: what actually ran, ready for simulate.render_grid."""
    per_rank: dict[int, list[Action]] = {r: [] for r in range(placement.pp)}
    for e in compute_rows(events, step, replica):
        stage = int(e["stage"])
        per_rank[placement.rank_of(stage)].append(
            Action(stage, COMPUTE[int(e["kind"])], int(e["microbatch"]))
        )
    return per_rank


def grid_as_run(events: np.ndarray, placement: Placement, step: int, replica: int = 0) -> str:
    """The step x rank grid of what replica `replica` ran in `step`, ordered by start time; with
    several chunks per rank each cell names its stage (which chunk ran)."""
    return render_grid(actions_as_run(events, placement, step, replica), placement)
