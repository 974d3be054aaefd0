"""One action of a pipeline schedule, printed like torch.distributed.pipelining: `1F0`, `0B3`;
which backwards a list splits, and the split that sends a gradient before its W.

s = global stage (model chunk) 0 .. num_stages-1, mb = micro-batch; where a stage lives is the
schedule's Placement (placement.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpihybrid.pipeline.placement import Placement

COMPUTE_KINDS = ("F", "B", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


class ScheduleError(ValueError):
    """An illegal schedule configuration, an invalid action list or a deadlock."""


@dataclass(frozen=True)
class Action:
    stage: int  # global stage = model chunk index, 0 .. num_stages-1
    kind: str  # compute: F, B, W; communication: SEND_F, RECV_F, SEND_B, RECV_B
    microbatch: int
    peer: int = -1  # pp rank on the other side (communication actions only)

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def message_key(action: Action) -> tuple[str, int, int]:
    """("F" or "B", sending stage, microbatch): identical for a SEND and its matching RECV."""
    direction = action.kind[-1]
    if action.kind.startswith("SEND"):
        return direction, action.stage, action.microbatch
    return direction, action.stage + (-1 if direction == "F" else 1), action.microbatch


def split_backwards(
    actions: Iterable[Action] | Mapping[int, Iterable[Action]],
) -> set[tuple[int, int]]:
    """(stage, mb) of every backward split into a B and a W: those with a W action. `actions`:
    one rank's list, or every rank's (rank -> list)."""
    lists = actions.values() if isinstance(actions, Mapping) else [actions]
    return {(a.stage, a.microbatch) for acts in lists for a in acts if a.kind == "W"}


def last_weight_actions(actions: Iterable[Action]) -> dict[int, tuple[str, int]]:
    """stage -> (kind, mb) of the action that writes the stage's weight gradients last in a step:
    its last W, or its last whole B (a B without a W). The gradient buckets of the stage start
    during it (runtime: grads_final), so it also carries their work. `actions`: every action of
    the stage, in its rank's order (one rank's list, or all of them)."""
    actions = list(actions)
    split = split_backwards(actions)
    return {
        a.stage: (a.kind, a.microbatch)
        for a in actions
        if a.kind == "W" or (a.kind == "B" and (a.stage, a.microbatch) not in split)
    }


def send_grads_early(
    compute: dict[int, list[Action]], placement: Placement
) -> dict[int, list[Action]]:
    """Every whole backward whose input gradient goes to another rank becomes B then W.

    Lowered, that is B (input gradient), SEND_B, W: the gradient leaves before the weight
    gradient is computed, so the previous stage's backward starts a W earlier. Order and memory
    are the schedule's own (W follows its B at once). Backwards already split (zero-bubble) and
    those whose gradient stays on the rank or goes nowhere (stage 0) are left whole.
    """
    out: dict[int, list[Action]] = {}
    for rank, actions in compute.items():
        split = split_backwards(actions)
        out[rank] = []
        for a in actions:
            out[rank].append(a)
            crosses = placement.crosses(a.stage, a.stage - 1)
            if a.kind == "B" and crosses and (a.stage, a.microbatch) not in split:
                out[rank].append(Action(a.stage, "W", a.microbatch))
    return out
