"""The zero-bubble paper's exact formulation, solved by OR-Tools CP-SAT (the `search` extra).

    result = solve(placement, m, costs, limit=[4] * pp, split=True, time_limit=60, hint=lists)
    result.lists, result.status ("optimal" | "feasible"), result.makespan, result.bound

Variables: the start of every F, B and W (stage, micro-batch) on its rank's timeline. Constraints:
a rank runs one action at a time, the next `gap` after the last one's end at the earliest
(NoOverlap of intervals of cost plus gap; the end that others wait for and the makespan counts
is the cost's: pipeline/simulate.py's timing, one model, the optimizer's tail aside); F of stage
s waits for F of s-1, B of s for F of s and B of s+1, W for its B, each `send` later where the
tensor crosses ranks; a micro-batch's activations on a stage are alive from its F's start to its
W's end (its B's end where backwards are whole) and a rank holds at most limit[r] chunk
micro-batches at once (a Cumulative). Objective: the last end (the
step's makespan). Costs are scaled to integer ticks (SCALE ticks for the longest action), so the
proven bound is of the rounded costs; the lists found are simulated again with the real ones.

model.vocab_parallel (costs.vocab): every rank's E, S, T and G of every micro-batch are intervals
on its timeline too, with their inputs (vocab_passes.vocab_inputs: an S after the last stage's F,
a T after every share's S, the last stage's B after every T, the first stage's F after every E,
a G after the first stage's B), so the order of F, B and W is solved around them; the lists
returned hold F, B and W alone (the search places the passes on them, as on every candidate).

fifo: micro-batches start in order on every stage for each kind (every built-in schedule does).
It shrinks the search a great deal; an optimum "proved" is then the optimum of FIFO orders.
Without fifo only stage 0's forwards are ordered, which loses nothing (micro-batches are
interchangeable). The solver is seeded with `hint` (the greedy's order, its simulated times).
deterministic: one worker and a deterministic time limit, so the same costs give the same lists.
gap_limit: the solve stops once its best is proved within this fraction of the optimum (CP-SAT's
relative_gap_limit; 0: only at the optimum or the time limit); the status is then "feasible"
with that gap unless the bound met the best.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from mpihybrid.pipeline.actions import Action
from mpihybrid.pipeline.placement import Placement
from mpihybrid.pipeline.simulate import Costs, simulate
from mpihybrid.pipeline.vocab_passes import (
    VOCAB_KINDS,
    add_vocab_passes,
    key_rank,
    vocab_inputs,
)

SCALE = 1000  # ticks of the longest action


class SolverMissing(ImportError):
    """OR-Tools is not installed (pip install 'mpihybrid[search]')."""


@dataclass
class ExactResult:
    lists: dict[int, list[Action]] | None  # None: nothing found in the time
    status: str  # optimal | feasible | infeasible | unknown
    makespan: float  # of the rounded costs, in seconds (inf: nothing found)
    bound: float  # proven lower bound on it, in seconds
    seconds: float  # wall time of the solve
    work: float = 0.0  # CP-SAT's deterministic time of it (what a deterministic limit counts)

    @property
    def gap(self) -> float:
        """(found - bound) / found: 0 when optimal."""
        if not self.lists or self.makespan <= 0:
            return float("inf")
        return max(0.0, (self.makespan - self.bound) / self.makespan)


def _cp_model():
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise SolverMissing(
            "the exact search needs OR-Tools: pip install 'mpihybrid[search]' (ortools>=9.10)"
        ) from None
    return cp_model


def solver_missing() -> str | None:
    """SolverMissing's line where OR-Tools cannot be imported (the greedy's schedule is what the
    search gives then), else None."""
    try:
        _cp_model()
    except SolverMissing as exc:
        return str(exc)
    return None


def _value(x, s: int) -> float:
    return x if isinstance(x, (int, float)) else x[s]


def solve(
    placement: Placement,
    m: int,
    costs: Costs,
    *,
    limit: list[int],
    split: bool = True,
    time_limit: float = 60.0,
    hint: dict[int, list[Action]] | None = None,
    fifo: bool = True,
    deterministic: bool = False,
    workers: int = 2,
    gap_limit: float = 0.0,
) -> ExactResult:
    """The order minimising the makespan of these costs under the memory limit (module text)."""
    cp_model = _cp_model()
    model = cp_model.CpModel()
    n, last = placement.num_stages, placement.num_stages - 1
    kinds = ("F", "B", "W") if split else ("F", "B")

    def cost(kind: str, s: int) -> float:
        if kind == "F":
            return _value(costs.forward, s)
        if kind == "W" or split:
            return _value(costs.weight if kind == "W" else costs.backward, s)
        return _value(costs.backward, s) + _value(costs.weight, s)

    longest = max(cost(k, s) for k in kinds for s in range(n))
    tick = longest / SCALE
    dur = {(k, s): max(1, round(cost(k, s) / tick)) for k in kinds for s in range(n)}
    hop, gap = round(costs.send / tick), round(costs.gap / tick)
    shares = _share_ticks(costs, tick, placement.pp)
    horizon = sum(dur[(k, s)] + gap for k in kinds for s in range(n)) * m + 2 * n * (hop + 1)
    horizon += sum(d + gap + hop for d in shares.values()) * m
    start, end, per_rank = _actions(model, placement, m, dur, gap=gap, horizon=horizon)

    def after(key, before, cross: bool) -> None:
        model.Add(start[key] >= end[before] + (hop if cross else 0))

    if shares:
        _add_shares(model, shares, m, placement, (start, end, per_rank), after=after,
                    horizon=horizon, gap=gap, fifo=fifo)  # fmt: skip
    for s in range(n):
        for mb in range(m):
            if s > 0:
                after(("F", s, mb), ("F", s - 1, mb), placement.crosses(s - 1, s))
            after(("B", s, mb), ("F", s, mb), False)
            if s < last:
                after(("B", s, mb), ("B", s + 1, mb), placement.crosses(s + 1, s))
            if split:
                after(("W", s, mb), ("B", s, mb), False)
            for k in kinds if fifo else (("F",) if s == 0 else ()):
                if mb + 1 < m:
                    model.Add(start[(k, s, mb)] <= start[(k, s, mb + 1)])
    _add_ranks(model, placement, m, (start, end, per_rank), split=split, horizon=horizon,
               limit=limit)  # fmt: skip
    makespan = model.NewIntVar(0, horizon, "makespan")
    model.AddMaxEquality(makespan, [end[key] for key in start])
    fill = _fill_ticks(placement, m, dur, hop, kinds, passes=_pass_work(shares, m))
    model.Add(makespan >= fill)  # implied: helps the proof
    model.Minimize(makespan)
    if hint is not None:
        _add_hint(model, start, makespan, hint, placement, m=m, dur=dur, hop=hop, gap=gap,
                  shares=shares)  # fmt: skip
    limits = {"time_limit": time_limit, "deterministic": deterministic, "gap_limit": gap_limit}
    solver, status, seconds = _run(cp_model, model, workers=workers, **limits)
    bound = solver.BestObjectiveBound() * tick if status != "infeasible" else float("inf")
    if status not in ("optimal", "feasible"):
        return ExactResult(None, status, float("inf"), bound, seconds, solver.deterministic_time)
    ticks = {key: solver.Value(v) for key, v in start.items() if key[0] not in VOCAB_KINDS}
    lists = _lists(placement, ticks)
    found = solver.ObjectiveValue() * tick
    return ExactResult(lists, status, found, bound, seconds, solver.deterministic_time)


def _actions(model, placement, m: int, dur: dict, *, gap: int, horizon: int):
    """(start, end, per_rank): every F, B and W an interval on its rank's timeline."""
    timeline = {}, {}, {r: [] for r in range(placement.pp)}
    for (k, s), ticks in dur.items():
        rank = placement.rank_of(s)
        for mb in range(m):
            _interval(model, timeline, (k, s, mb), ticks, rank, gap=gap, horizon=horizon)
    return timeline


def _interval(model, timeline, key, ticks: int, rank: int, *, gap: int, horizon: int) -> None:
    """Action `key` (kind, stage or share, mb) of `ticks` on `rank`'s timeline, followed by the
    rank's gap: occupied (nothing else starts) but waited on by none."""
    start, end, per_rank = timeline
    name = "{}{}_{}".format(*key)
    start[key] = model.NewIntVar(0, horizon, f"s{name}")
    end[key] = start[key] + ticks
    per_rank[rank].append(model.NewFixedSizeIntervalVar(start[key], ticks + gap, f"i{name}"))


def _share_ticks(costs: Costs, tick: float, pp: int) -> dict[tuple[str, int], int]:
    """model.vocab_parallel: (kind, share) -> ticks of the share's pass; {} without."""
    if not costs.vocab:
        return {}
    return {(k, r): max(0, round(_value(costs.vocab.get(k, 0.0), r) / tick))
            for k in VOCAB_KINDS for r in range(pp)}  # fmt: skip


def _add_ranks(model, placement, m: int, timeline, *, split: bool, horizon, limit) -> None:
    """One action at a time on a rank; at most limit[r] chunk micro-batches alive on it."""
    start, end, per_rank = timeline
    for r, intervals in per_rank.items():
        model.AddNoOverlap(intervals)
        alive = []
        for s in placement.stages_of(r):
            for mb in range(m):
                freed = end[("W" if split else "B", s, mb)]
                size = model.NewIntVar(0, horizon, f"a{s}_{mb}")
                alive.append(model.NewIntervalVar(start[("F", s, mb)], size, freed, f"l{s}_{mb}"))
        model.AddCumulative(alive, [1] * len(alive), limit[r])


def _add_shares(model, shares: dict, m: int, placement, timeline, *, after, horizon, gap, fifo):
    """model.vocab_parallel's passes (module text): an interval per (kind, share, mb) on the
    share's rank, its inputs, the first stage's F after every E, the last stage's B after every
    T; timeline: (start, end, per_rank) of the model, which this fills in."""
    start, last = timeline[0], placement.num_stages - 1
    for (k, r), ticks in shares.items():
        for mb in range(m):
            _interval(model, timeline, (k, r, mb), ticks, r, gap=gap, horizon=horizon)
    for (k, r), _ in shares.items():  # each rank's passes of a kind in micro-batch order
        for mb in range(m):
            for need in vocab_inputs(Action(r, k, mb), last, placement.pp):
                after((k, r, mb), need, key_rank(need, placement) != r)
            if fifo and mb + 1 < m:
                model.Add(start[(k, r, mb)] <= start[(k, r, mb + 1)])
    for mb in range(m):
        for r in range(placement.pp):
            after(("F", 0, mb), ("E", r, mb), placement.rank_of(0) != r)
            after(("B", last, mb), ("T", r, mb), placement.rank_of(last) != r)


def _pass_work(shares: dict, m: int) -> dict[int, tuple[int, int]]:
    """Per rank: the ticks of its passes that may run before any input (its E's) and of those
    that wait for the last stage's F (its S, T and G), {} without the passes."""
    work: dict[int, tuple[int, int]] = {}
    for (k, r), ticks in shares.items():
        early, late = work.get(r, (0, 0))
        work[r] = (early + m * ticks, late) if k == "E" else (early, late + m * ticks)
    return work


def _fill_ticks(placement: Placement, m: int, dur: dict, hop: int, kinds: tuple, *, passes) -> int:
    """search_bounds' fill bound in the model's own ticks: for every rank and stage it holds,
    the first micro-batch's forward through the stages before it, then the rank's work on that
    stage and its later ones, and its S, T and G passes (which wait for the last stage's F of
    their micro-batch, so come after that release too; passes: _pass_work). Implied by the
    constraints, so adding it cuts nothing feasible."""
    n, bound, release = placement.num_stages, 0, [0] * placement.num_stages
    for s in range(1, n):
        crossing = hop if placement.crosses(s - 1, s) else 0
        release[s] = release[s - 1] + dur[("F", s - 1)] + crossing
    for r in range(placement.pp):
        mine = placement.stages_of(r)
        early, late = passes.get(r, (0, 0))
        everything = sum(m * dur[(k, t)] for t in mine for k in kinds) + early + late
        bound = max(bound, everything)
        for s in mine:
            work = sum(m * dur[(k, t)] for t in mine if t >= s for k in kinds)
            bound = max(bound, release[s] + work + late)
    return bound


def _run(cp_model, model, *, time_limit: float, deterministic: bool, workers: int, gap_limit):
    """(the solver, "optimal" | "feasible" | "infeasible" | "unknown", seconds it took)."""
    solver = cp_model.CpSolver()
    solver.parameters.relative_gap_limit = gap_limit
    if deterministic:
        solver.parameters.num_workers = 1
        solver.parameters.max_deterministic_time = time_limit
    else:
        solver.parameters.num_workers = workers
        solver.parameters.max_time_in_seconds = time_limit
    t0 = time.perf_counter()
    code = _solve_ticking(solver, model)
    seconds = time.perf_counter() - t0
    names = {
        cp_model.OPTIMAL: "optimal",
        cp_model.FEASIBLE: "feasible",
        cp_model.INFEASIBLE: "infeasible",
    }
    status = names.get(code, "unknown")
    if status == "optimal" and solver.ObjectiveValue() > solver.BestObjectiveBound():
        status = "feasible"  # stopped by the gap limit, not proved
    return solver, status, seconds


def _solve_ticking(solver, model) -> int:
    """solver.Solve(model) in a thread of its own (CP-SAT lets go of the GIL while it solves),
    this one telling the watchdog every TICK_S that the search goes on (mpihybrid.progress):
    a minute's solve at the start of a run is work, not a stall."""
    from mpihybrid.progress import TICK_S, progress

    codes: list = []
    worker = threading.Thread(target=lambda: codes.append(solver.Solve(model)), daemon=True)
    worker.start()
    while worker.is_alive():
        progress("searching a schedule (exact)")
        worker.join(TICK_S / 2)
    if not codes:
        raise RuntimeError("the CP-SAT solve ended without a status")
    return codes[0]


def _add_hint(model, start, makespan, hint, placement, *, m, dur, hop, gap, shares) -> None:
    """The hint's start times as the model counts them (its own durations and gap in ticks, no
    tail), so a hint whose order the model allows is a solution to start from; with the
    vocabulary passes, placed on it as training places them (vocab_passes.add_vocab_passes), so
    every variable is hinted and the first solution is the hint as training would run it."""
    n = placement.num_stages
    ticks = Costs(
        forward=[dur[("F", s)] for s in range(n)],
        backward=[dur[("B", s)] for s in range(n)],
        weight=[dur.get(("W", s), 0) for s in range(n)],
        send=hop,
        gap=gap,
        vocab={k: [shares[(k, r)] for r in range(placement.pp)] for k in VOCAB_KINDS}
        if shares
        else None,
    )
    if shares:
        hint = add_vocab_passes(hint, placement, m, ticks, simulate)
    result = simulate(hint, placement, ticks)
    for a, t in result.start.items():
        key = (a.kind, a.stage, a.microbatch)
        if key in start:
            model.AddHint(start[key], round(t))
    model.AddHint(makespan, round(result.makespan))


def _lists(placement: Placement, starts: dict[tuple[str, int, int], int]) -> dict:
    """Each rank's actions in the order of their start ticks."""
    order = {"F": 0, "B": 1, "W": 2}
    lists: dict[int, list] = {r: [] for r in range(placement.pp)}
    for (kind, s, mb), _ in sorted(starts.items(), key=lambda kv: (kv[1], order[kv[0][0]])):
        lists[placement.rank_of(s)].append(Action(s, kind, mb))
    return lists
