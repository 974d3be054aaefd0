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
simulation (simulate.simulate: the same costs, gaps and tails) ends first; where the costs carry
model.vocab_parallel's passes, the VOCAB_JUDGED fastest distinct orders are simulated again with
the passes placed on them (vocab_passes.add_vocab_passes) and the fastest of those is kept.
"""

from __future__ import annotations

import itertools
import math

from mpihybrid.pipeline.actions import Action, ScheduleError
from mpihybrid.pipeline.placement import Placement
from mpihybrid.pipeline.simulate import Costs, SimResult, simulate
from mpihybrid.pipeline.vocab_passes import add_vocab_passes
from mpihybrid.progress import progress

INF = math.inf
CAPS = 6  # memory budgets best_greedy tries: the limit's and the ones just below it
# model.vocab_parallel: the greedy's fastest distinct orders placed with the passes and simulated
# again (placing them simulates the lists about 10 m times: a few orders, not every try)
VOCAB_JUDGED = 3


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
    g = _ListScheduler(
        placement,
        m,
        costs,
        limit=limit,
        split=split,
        reserve=reserve,
        fill=fill,
        deep_first=deep_first,
    )
    pp, last = placement.pp, placement.num_stages - 1
    cache = {r: g.decide(r) for r in range(pp)}  # a rank's decision changes when it or a
    while g.remaining:  # neighbour (a rank holding an adjacent stage) commits an action
        when, r, a = _earliest(cache)
        if a is None:
            raise ScheduleError(f"no order fits the memory limit {limit} (m={m})")
        g.commit(r, when, a)
        s = a.stage
        for q in {r} | {placement.rank_of(t) for t in (s - 1, s + 1) if 0 <= t <= last}:
            cache[q] = g.decide(q)
    return g.out


class _ListScheduler:
    """list_schedule's state: what each stage has run, what each rank holds and when it is free."""

    def __init__(self, placement, m, costs, *, limit, split, reserve, fill, deep_first):
        self.placement, self.m, self.costs, self.limit = placement, m, costs, limit
        self.split, self.reserve, self.fill, self.deep_first = split, reserve, fill, deep_first
        pp, self.last = placement.pp, placement.num_stages - 1
        self.stages = {r: placement.stages_of(r) for r in range(pp)}
        self.ends: dict[tuple[str, int, int], float] = {}
        self.next_f = dict.fromkeys(range(self.last + 1), 0)
        self.next_b = dict.fromkeys(range(self.last + 1), 0)
        self.alive = dict.fromkeys(range(pp), 0)
        self.deferred: dict[int, list[tuple[int, int]]] = {r: [] for r in range(pp)}
        self.clock = dict.fromkeys(range(pp), 0.0)
        self.out: dict[int, list[Action]] = {r: [] for r in range(pp)}
        self.remaining = (3 if split else 2) * m * (self.last + 1)

    def arrival(self, kind: str, s: int, mb: int, r: int) -> float:
        """When tensor (kind, s, mb) is usable on rank r; INF while not yet scheduled."""
        end = self.ends.get((kind, s, mb))
        if end is None:
            return INF
        return end + (self.costs.send if self.placement.rank_of(s) != r else 0.0)

    def ready_b(self, r: int, s: int) -> float:
        mb = self.next_b[s]
        if mb >= self.m or mb >= self.next_f[s]:
            return INF
        t = self.arrival("F", s, mb, r)
        return max(t, self.arrival("B", s + 1, mb, r)) if s < self.last else t

    def ready_f(self, r: int, s: int) -> float:
        mb = self.next_f[s]
        first = len(self.stages[r]) > 1 and s == self.stages[r][0]
        room = self.limit[r] - (self.reserve if first else 0)
        if mb >= self.m or self.alive[r] >= room:
            return INF
        return self.arrival("F", s - 1, mb, r) if s > 0 else 0.0

    def decide(self, r: int) -> tuple[float, Action | None]:
        """(when rank r acts next, what), given what is scheduled so far."""
        free = self.clock[r] + (self.costs.gap if self.out[r] else 0.0)
        next_b, next_f = self.next_b, self.next_f
        bs = [(max(self.ready_b(r, s), free), next_b[s], -s, s) for s in self.stages[r]]
        order = -1 if self.deep_first else 1
        fs = [(max(self.ready_f(r, s), free), order * s, s) for s in self.stages[r]]
        now_b = [b for b in bs if b[0] <= free]
        now_f = [f for f in fs if f[0] <= free]
        if now_b:
            s = min(now_b)[3]
            return free, Action(s, "B", next_b[s])
        if now_f:
            s = min(now_f)[2]
            return free, Action(s, "F", next_f[s])
        soonest = min([b[0] for b in bs] + [f[0] for f in fs])
        if self.deferred[r]:
            s, mb = self.deferred[r][0]
            if self.fill == "idle" or free + _value(self.costs.weight, s) <= soonest:
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

    def commit(self, r: int, when: float, a: Action) -> None:
        """Rank r runs `a` from `when`: its stage moves on, its memory and clock with it."""
        s, mb, costs = a.stage, a.microbatch, self.costs
        if a.kind == "F":
            self.next_f[s] += 1
            self.alive[r] += 1
            duration = _value(costs.forward, s)
        elif a.kind == "B":
            self.next_b[s] += 1
            if self.split:
                self.deferred[r].append((s, mb))
                duration = _value(costs.backward, s)
            else:
                self.alive[r] -= 1
                duration = _value(costs.backward, s) + _value(costs.weight, s)
        else:
            self.deferred[r].pop(0)
            self.alive[r] -= 1
            duration = _value(costs.weight, s)
        self.ends[(a.kind, s, mb)] = self.clock[r] = when + duration
        self.out[r].append(a)
        self.remaining -= 1


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
    placement: Placement,
    m: int,
    costs: Costs,
    *,
    max_inflight: float,
    split: bool = True,
    caps: int = CAPS,
) -> tuple[dict[int, list[Action]], SimResult]:
    """The greedy's best order over its policies (fill, deep or shallow first, reserve) and the
    `caps` largest memory budgets up to the limit: the one whose simulation ends first (then the
    lower peak). ScheduleError when none fits the limit."""
    from mpihybrid.pipeline.schedules import validate

    top = min(budgets(placement, max_inflight)[0], m * placement.chunks)  # more is never held
    found: dict[tuple, tuple] = {}  # each distinct order: (key, lists, result)
    reserves = (0, 1) if placement.chunks > 1 else (0,)
    for cap, fill, deep, reserve in itertools.product(
        range(top, max(0, top - caps), -1), ("idle", "fit"), (True, False), reserves
    ):
        progress("searching a schedule (greedy)")
        try:
            lists = list_schedule(
                placement,
                m,
                costs,
                limit=[cap] * placement.pp,
                split=split,
                reserve=reserve,
                fill=fill,
                deep_first=deep,
            )
            validate(lists, placement, m)
        except ScheduleError:
            continue
        result = simulate(lists, placement, costs)
        if max(result.peak_per_rank) > max_inflight + 1e-9:
            continue
        key = (round(result.makespan, 12), max(result.peak_per_rank))
        order = tuple(tuple(acts) for _, acts in sorted(lists.items()))
        found.setdefault(order, (key, lists, result))
    if not found:
        raise ScheduleError(
            f"no greedy order holds at most {max_inflight:g} micro-batches of a rank's share"
        )
    ranked = sorted(found.values(), key=lambda f: f[0])
    if costs.vocab:  # the passes' cost decides between the fastest few
        ranked = sorted((_with_passes(placement, m, costs, f) for f in ranked[:VOCAB_JUDGED]),
                        key=lambda f: f[0])  # fmt: skip
    return ranked[0][1], ranked[0][2]


def _with_passes(placement: Placement, m: int, costs: Costs, found: tuple) -> tuple:
    """(key, lists, result) of a greedy order judged with model.vocab_parallel's passes placed:
    the key and the result with them, the lists without (the search places them again on the
    order it keeps)."""
    _, lists, _ = found
    result = simulate(add_vocab_passes(lists, placement, m, costs, simulate), placement, costs)
    return (round(result.makespan, 12), max(result.peak_per_rank)), lists, result
