"""Zero-bubble schedules beyond ZB-H1: ZB-H2, ZB-V and DualPipeV, as action lists.

    mpihybrid schedule show --schedule zb-v --pp 4 --microbatches 8

V placement (Placement.v): rank r holds stage r (its chunk going down, "down") and stage 2p-1-r
(its chunk coming back up, "up"), so rank 0 holds both the first and the last stage and the turn
(stage p-1 -> p) stays on rank p-1. ZB-V and DualPipeV follow the lists torch.distributed.pipelining
generates (ScheduleZBVZeroBubble, ScheduleDualPipeV), so a schedule torch writes as CSV and the one
built here are the same lists. ZB-H2 comes from a unit-time list scheduler (_greedy): the
zero-bubble paper's heuristic of a backward first, then a forward while memory allows, then a
deferred weight gradient.

DualPipeV overlaps one micro-batch's forward with another's backward on a GPU (two CUDA streams);
a CPU rank here has one core's worth of compute, so an overlapped pair runs as F then B.

p = pp, m = num_microbatches, s = global stage, mb = micro-batch.
"""

from __future__ import annotations

from mpihybrid.pipeline.actions import Action
from mpihybrid.pipeline.placement import Placement


class _Lists:
    """One rank's list under construction, with the next micro-batch of each (stage, kind)."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next: dict[tuple[int, str], int] = {}
        self.deferred: list[tuple[int, int]] = []  # (stage, mb) of split backwards awaiting W

    def forward(self, s: int) -> None:
        mb = self.next.get((s, "F"), 0)
        self.actions.append(Action(s, "F", mb))
        self.next[(s, "F")] = mb + 1

    def backward(self, s: int, split: bool) -> int:
        """B of the stage's next micro-batch; split: its W comes later (deferred)."""
        mb = self.next.get((s, "B"), 0)
        self.actions.append(Action(s, "B", mb))
        self.next[(s, "B")] = mb + 1
        if split:
            self.deferred.append((s, mb))
        return mb

    def weight(self) -> None:
        """W of the oldest deferred backward, if any."""
        if self.deferred:
            s, mb = self.deferred.pop(0)
            self.actions.append(Action(s, "W", mb))

    def count(self, s: int, kind: str) -> int:
        return self.next.get((s, kind), 0)


# ---------------------------------------------------------------- ZB-V (torch's ZBVZeroBubble)


def _zb_v_rank(pp: int, m: int, rank: int) -> list[Action]:
    # torch builds the lists for at least 2p-1 micro-batches and drops the ones past m
    n = max(2 * pp - 1, m)
    down, up = rank, 2 * pp - 1 - rank
    lists = _Lists()
    # warmup: chunk 0 forwards only, 2(p-r)-1 of them
    for _ in range(2 * (pp - rank) - 1):
        lists.forward(down)
    # warmup: the chunks' forwards alternate
    for _ in range(rank):
        lists.forward(up)
        lists.forward(down)
    # ramp: chunk 1 starts backward, each B with its W at once
    for _ in range(pp - rank):
        lists.forward(up)
        lists.backward(up, split=True)
        lists.weight()
    # steady state: F B W on chunk 0, then on chunk 1
    while lists.count(up, "F") < lists.count(down, "F") or lists.count(down, "F") < n:
        if lists.count(down, "F") < n:
            lists.forward(down)
        lists.backward(down, split=True)
        lists.weight()
        lists.forward(up)
        lists.backward(up, split=True)
        lists.weight()
    # cooldown: input gradients first, on both chunks, their Ws kept back
    w_down, w_up = lists.count(down, "B"), lists.count(up, "B")
    for _ in range(rank):
        lists.backward(down, split=False)
        lists.backward(up, split=False)
    # chunk 0's last backwards, each with the oldest chunk-0 W
    for _ in range(pp - rank):
        lists.backward(down, split=False)
        lists.actions.append(Action(down, "W", w_down))
        w_down += 1
    # drain: chunk 1's Ws, then chunk 0's
    lists.actions += [Action(up, "W", mb) for mb in range(w_up, lists.count(up, "B"))]
    lists.actions += [Action(down, "W", mb) for mb in range(w_down, lists.count(down, "B"))]
    return [a for a in lists.actions if a.microbatch < m]


def zb_v(pp: int, m: int, v: int = 2) -> dict[int, list[Action]]:
    """ZB-V: every rank 1F1B1W in a V, zero bubble at 1F1B's activation memory (m >= 2p-1)."""
    return {r: _zb_v_rank(pp, m, r) for r in range(pp)}


# ---------------------------------------------------------------- DualPipeV (torch's DualPipeV)


def _dualpipev_rank(pp: int, m: int, rank: int) -> list[Action]:
    down, up = rank, 2 * pp - 1 - rank
    lists = _Lists()

    def overlapped(forward_stage: int, backward_stage: int) -> None:
        # torch: OVERLAP_F_B(F, full B) on two CUDA streams; here F, then B
        lists.forward(forward_stage)
        lists.backward(backward_stage, split=False)

    # warmup: chunk 0 forwards only
    for _ in range(2 * (pp - rank - 1)):
        lists.forward(down)
    # warmup: one forward on each chunk
    for _ in range(rank + 1):
        lists.forward(down)
        lists.forward(up)
    # ramp: chunk 1's first backwards (split, W at once), each followed by a forward
    for _ in range(pp - rank - 1):
        lists.backward(up, split=True)
        lists.weight()
        lists.forward(up)
    # steady state: overlapped pairs, forward of one chunk with backward of the other
    for i in range(m - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:
            lists.forward(down)
            lists.backward(up, split=False)
        else:
            overlapped(down, up)
        overlapped(up, down)
    # cooldown: chunk 1's last backwards, each with a pair
    for _ in range(pp - rank - 1):
        lists.backward(up, split=False)
        overlapped(up, down)
    # drain: backwards of both chunks; halfway the Ws start to be deferred (zero bubble)
    split = False
    half = (rank + 1) // 2
    for i in range(rank + 1):
        split = split or (i == half and rank % 2 == 1)
        lists.backward(up, split=split)
        split = split or (i == half and rank % 2 == 0)
        lists.backward(down, split=split)
    for _ in range(pp - rank - 1):
        lists.weight()
        lists.backward(down, split=split)
    # the Ws left
    while lists.deferred:
        lists.weight()
    return lists.actions


def dualpipev(pp: int, m: int, v: int = 2) -> dict[int, list[Action]]:
    """DualPipeV (DeepSeek, the V of DualPipe): bidirectional pairs on a V, m >= 2p."""
    return {r: _dualpipev_rank(pp, m, r) for r in range(pp)}


# ---------------------------------------------------------------- the list scheduler


def _greedy(
    placement: Placement, m: int, limit: list[int], reserve: int = 0
) -> dict[int, list[Action]]:
    """Unit time, F = B = W: at every step each rank runs one action: a B whose gradient has
    arrived (the oldest micro-batch first), else an F whose input has arrived while the rank
    holds fewer than limit[rank] chunk micro-batches (the latest stage first, pushing work down
    the pipe), else the oldest deferred W. Messages arrive the step after they are sent.
    reserve: on a rank of two chunks, forwards of its first chunk stop `reserve` short of the
    limit, so the second chunk's forward, which turns a micro-batch back towards its
    backward, always has room (without it a V fills every rank with first-chunk forwards and
    stalls)."""
    last = placement.num_stages - 1
    done: set[tuple[str, int, int]] = set()
    next_f = dict.fromkeys(range(last + 1), 0)
    next_b = dict.fromkeys(range(last + 1), 0)
    alive = dict.fromkeys(range(placement.pp), 0)
    deferred: dict[int, list[tuple[int, int]]] = {r: [] for r in range(placement.pp)}
    out: dict[int, list[Action]] = {r: [] for r in range(placement.pp)}
    total = 3 * m * (last + 1)
    idle_steps = 0
    while sum(len(a) for a in out.values()) < total:
        finished = []
        for r in range(placement.pp):
            stages = placement.stages_of(r)
            backwards = [
                (next_b[s], -s, s)
                for s in stages
                if next_b[s] < m
                and ("F", s, next_b[s]) in done
                and (s == last or ("B", s + 1, next_b[s]) in done)
            ]
            first = stages[0] if len(stages) > 1 else None
            forwards = [
                (-s, s)
                for s in stages
                if next_f[s] < m
                and (s == 0 or ("F", s - 1, next_f[s]) in done)
                and alive[r] < limit[r] - (reserve if s == first else 0)
            ]
            if backwards:
                _, _, s = min(backwards)
                a = Action(s, "B", next_b[s])
                next_b[s] += 1
                deferred[r].append((s, a.microbatch))
            elif forwards:
                _, s = min(forwards)
                a = Action(s, "F", next_f[s])
                next_f[s] += 1
                alive[r] += 1
            elif deferred[r]:
                s, mb = deferred[r].pop(0)
                a = Action(s, "W", mb)
                alive[r] -= 1
            else:
                continue
            out[r].append(a)
            finished.append(a)
        done |= {(a.kind, a.stage, a.microbatch) for a in finished}
        idle_steps = 0 if finished else idle_steps + 1
        if idle_steps > 1:
            raise AssertionError(f"list scheduler stuck: limits {limit} too small at m={m}")
    return out


def zb_h2(pp: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    """ZB-H2: up to 2p-1 micro-batches alive on rank 0 (max(p, 2(p-r)-1) on rank r), so the
    warm-up runs extra forwards before the first B and the Ws fill the tail: the paper's
    parallelogram. Its zero bubble needs one step's tail to overlap the next step's head (the
    paper drops the optimizer's synchronisation); a step here ends with a world Allreduce (the
    loss, the stop agreement), so one step idles like ZB-H1, (p-1)/(3m+p-1)."""
    return _greedy(Placement.loop(pp), m, [max(pp, 2 * (pp - r) - 1) for r in range(pp)])


def v_half(pp: int, m: int, v: int = 2) -> dict[int, list[Action]]:
    """V-Half (the controllable-memory paper's memory column, (p+2)//2 micro-batches of a
    rank's share, about half of 1F1B's p): the list scheduler on the V with each rank holding
    at most 2 * ((p+2)//2) chunk micro-batches, one of them kept for its second chunk. Not the
    paper's building-block construction: its bubble with equal costs is below 1F1B's from
    p = 3 on and equal at p = 2, above the paper's V-Half (about p/(2m))."""
    return _greedy(Placement.v(pp), m, [2 * ((pp + 2) // 2)] * pp, reserve=1)
