"""One action of a pipeline schedule, printed like torch.distributed.pipelining: `1F0`, `0B3`;
which backwards a list splits, the split that sends a gradient before its W, and merged W
passes (`0W4+5+6+7`: one weight-gradient pass over four micro-batches, one GEMM per weight).

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
    # a merged W: the further micro-batches its one pass covers (microbatch is the first)
    merged: tuple[int, ...] = ()

    @property
    def microbatches(self) -> tuple[int, ...]:
        """Every micro-batch the action covers: its own, and a merged W's others."""
        return (self.microbatch, *self.merged)

    def __str__(self) -> str:
        more = "".join(f"+{mb}" for mb in self.merged)
        return f"{self.stage}{self.kind}{self.microbatch}{more}"


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
    return {(a.stage, mb) for acts in lists for a in acts if a.kind == "W" for mb in a.microbatches}


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


def merge_weights(compute: dict[int, list[Action]], group: int) -> dict[int, list[Action]]:
    """A stage's W passes merged in groups of up to `group` micro-batches (train.merge_w).

    Each group runs as one W where its last member ran (its earlier members wait for it: nothing
    but the step's end needs a weight gradient, so no other action moves); a stage's last group
    holds what is left. group = 1 leaves the lists as they are. The merged pass makes one GEMM
    per weight over the group's rows (nn Stage.backward_weight_merged) and keeps the earlier
    members' W caches alive until it runs (Liveness frees them then)."""
    if group <= 1:
        return {r: list(acts) for r, acts in compute.items()}
    out: dict[int, list[Action]] = {}
    for rank, actions in compute.items():
        total = {}  # stage -> its W passes on this rank
        for a in actions:
            if a.kind == "W":
                total[a.stage] = total.get(a.stage, 0) + len(a.microbatches)
        pending: dict[int, list[int]] = {}
        seen = dict.fromkeys(total, 0)
        out[rank] = []
        for a in actions:
            if a.kind != "W":
                out[rank].append(a)
                continue
            members = pending.setdefault(a.stage, [])
            members += a.microbatches
            seen[a.stage] += len(a.microbatches)
            if len(members) >= group or seen[a.stage] == total[a.stage]:
                out[rank].append(Action(a.stage, "W", members[0], merged=tuple(members[1:])))
                pending[a.stage] = []
    return out
