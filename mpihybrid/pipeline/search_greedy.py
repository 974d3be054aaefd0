"""The zero-bubble paper's greedy, driven by measured costs: a list scheduler in continuous time.

    lists = list_schedule(placement, m, costs, limit=[4] * pp)
    lists, result = best_greedy(placement, m, costs, max_inflight=2.0, split=True)

Each rank, as soon as it is free, runs one of the actions whose inputs have arrived by then: a B
first (the oldest micro-batch of its latest stage: the critical path), else an F while it holds
fewer than `limit` chunk micro-batches (the latest stage first pushes work down the pipe, the
earliest first fills the pipe), else a deferred W (its weight gradient). Inputs from another rank
arrive `send` seconds after their producer ends. When nothing is ready it either fills the wait
with a W or, policy "fit", runs a W only when it ends before the next known input arrives.
Ranks are stepped in order of the time they decide at, so a decision sees every action that ends
before it. With unit costs, free messages and policy "idle" this is the unit-time list scheduler
zb-h2 and v-half are built by (v_schedules._greedy), its special case.

best_greedy tries the policies and memory budgets up to the limit and keeps the order whose
simulation (simulate.simulate: the same costs, gaps and tails) ends first.
"""

from __future__ import annotations

import itertools
import math

from mpihybrid.pipeline.actions import Action, ScheduleError
from mpihybrid.pipeline.placement import Placement
from mpihybrid.pipeline.simulate import Costs, SimResult, simulate

INF = math.inf


def _value(x, s: int) -> float:
    return x if isinstance(x, (int, float)) else x[s]


def list_schedule(
    placement: Placement,
    m: int,
    costs: Costs,
    *,
    limit: list[int],
    split: bool = True,
    reserve: int = 0,
    fill: str = "idle",
    deep_first: bool = True,
) -> dict[int, list[Action]]:
    """Each rank's compute list, scheduled greedily against `costs` (see the module text).
    limit[r]: chunk micro-batches rank r may hold (F to W, or to B when not split); reserve: on
    a rank of several chunks, first-chunk forwards stop that many short of it (a V otherwise
    fills up with them and stalls); fill: "idle" or "fit" (when a W fills a wait)."""
    pp, last = placement.pp, placement.num_stages - 1
    stages = {r: placement.stages_of(r) for r in range(pp)}
    ends: dict[tuple[str, int, int], float] = {}
    next_f = dict.fromkeys(range(last + 1), 0)
    next_b = dict.fromkeys(range(last + 1), 0)
    alive = dict.fromkeys(range(pp), 0)
    deferred: dict[int, list[tuple[int, int]]] = {r: [] for r in range(pp)}
    clock = dict.fromkeys(range(pp), 0.0)
    out: dict[int, list[Action]] = {r: [] for r in range(pp)}
    remaining = (3 if split else 2) * m * (last + 1)

    def arrival(kind: str, s: int, mb: int, r: int) -> float:
        """When tensor (kind, s, mb) is usable on rank r; INF while not yet scheduled."""
        end = ends.get((kind, s, mb))
        if end is None:
            return INF
        return end + (costs.send if placement.rank_of(s) != r else 0.0)

    def ready_b(r: int, s: int) -> float:
        mb = next_b[s]
        if mb >= m or mb >= next_f[s]:
            return INF
        t = arrival("F", s, mb, r)
        return max(t, arrival("B", s + 1, mb, r)) if s < last else t

    def ready_f(r: int, s: int) -> float:
        mb = next_f[s]
        room = limit[r] - (reserve if len(stages[r]) > 1 and s == stages[r][0] else 0)
        if mb >= m or alive[r] >= room:
            return INF
        return arrival("F", s - 1, mb, r) if s > 0 else 0.0

    def decide(r: int) -> tuple[float, Action | None]:
        """(when rank r acts next, what), given what is scheduled so far."""
        free = clock[r] + (costs.gap if out[r] else 0.0)
        bs = [(max(ready_b(r, s), free), next_b[s], -s, s) for s in stages[r]]
        fs = [(max(ready_f(r, s), free), (-s if deep_first else s), s) for s in stages[r]]
        now_b = [b for b in bs if b[0] <= free]
        now_f = [f for f in fs if f[0] <= free]
        if now_b:
            s = min(now_b)[3]
            return free, Action(s, "B", next_b[s])
        if now_f:
            s = min(now_f)[2]
            return free, Action(s, "F", next_f[s])
        soonest = min([b[0] for b in bs] + [f[0] for f in fs])
        if deferred[r]:
            s, mb = deferred[r][0]
            if fill == "idle" or free + _value(costs.weight, s) <= soonest:
                return free, Action(s, "W", mb)
        if soonest == INF:
            return INF, None
        # wait for the next input, then decide again at that time
        at_b = [b for b in bs if b[0] == soonest]
        if at_b:
            s = min(at_b)[3]
            return soonest, Action(s, "B", next_b[s])
        s = min(f for f in fs if f[0] == soonest)[2]
        return soonest, Action(s, "F", next_f[s])

    cache = {r: decide(r) for r in range(pp)}  # a rank's decision changes when it or a
    while remaining:  # neighbour (a rank holding an adjacent stage) commits an action
        when, r, a = _earliest(cache)
        if a is None:
            raise ScheduleError(f"no order fits the memory limit {limit} (m={m})")
        s, mb = a.stage, a.microbatch
        if a.kind == "F":
            next_f[s] += 1
            alive[r] += 1
            duration = _value(costs.forward, s)
        elif a.kind == "B":
            next_b[s] += 1
            if split:
                deferred[r].append((s, mb))
                duration = _value(costs.backward, s)
            else:
                alive[r] -= 1
                duration = _value(costs.backward, s) + _value(costs.weight, s)
        else:
            deferred[r].pop(0)
            alive[r] -= 1
            duration = _value(costs.weight, s)
        ends[(a.kind, s, mb)] = clock[r] = when + duration
        out[r].append(a)
        remaining -= 1
        for q in {r} | {placement.rank_of(t) for t in (s - 1, s + 1) if 0 <= t <= last}:
            cache[q] = decide(q)
    return out


def _earliest(cache: dict) -> tuple[float, int, Action | None]:
    """The rank that acts first (the lowest rank on a tie) and its action."""
    best = (INF, 0, None)
    for r, (when, a) in cache.items():
        if a is not None and when < best[0]:
            best = (when, r, a)
    return best


def budgets(placement: Placement, max_inflight: float) -> list[int]:
    """Chunk micro-batches per rank that `max_inflight` micro-batches of a rank's share allow."""
    return [int(math.floor(max_inflight * placement.chunks + 1e-9))] * placement.pp


def best_greedy(
    placement: Placement, m: int, costs: Costs, *, max_inflight: float, split: bool = True
) -> tuple[dict[int, list[Action]], SimResult]:
    """The greedy's best order over its policies (fill, deep or shallow first, reserve) and every
    memory budget from 1 to the limit: the one whose simulation ends first (then the lower peak).
    ScheduleError when none fits the limit."""
    from mpihybrid.pipeline.schedules import validate

    top = min(budgets(placement, max_inflight)[0], m * placement.chunks)  # more is never held
    best: tuple | None = None
    reserves = (0, 1) if placement.chunks > 1 else (0,)
    for cap, fill, deep, reserve in itertools.product(
        range(top, 0, -1), ("idle", "fit"), (True, False), reserves
    ):
        try:
            lists = list_schedule(placement, m, costs, limit=[cap] * placement.pp, split=split,
                                  reserve=reserve, fill=fill, deep_first=deep)  # fmt: skip
            validate(lists, placement, m)
        except ScheduleError:
            continue
        result = simulate(lists, placement, costs)
        if max(result.peak_per_rank) > max_inflight + 1e-9:
            continue
        key = (round(result.makespan, 12), max(result.peak_per_rank))
        if best is None or key < best[0]:
            best = (key, lists, result)
    if best is None:
        raise ScheduleError(
            f"no greedy order holds at most {max_inflight:g} micro-batches of a rank's share"
        )
    return best[1], best[2]
