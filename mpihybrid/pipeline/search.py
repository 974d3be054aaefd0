"""Search a schedule for these costs under a memory limit: the split of blocks into chunks times
the order of every rank's F, B and W, and how far each built-in schedule is from what it found.

    result = search(costs, pp=2, m=4, max_inflight=2, placements=("loop", "v"))
    result.lists, result.placement, result.ranges, result.sim, result.status, result.bound
    print(format_result(result))  # search_report.py

For each placement (loop: one chunk per rank; v: rank r holds stages r and 2p-1-r) the splits of
the blocks that load the busiest rank least (nn.model's rule, the few best) are each ordered by
the greedy (search_greedy); the built-in schedules of that placement are candidates too. The
best (placement, split) of each placement is then solved exactly (search_exact, CP-SAT) when it
is small enough (EXACT_ACTIONS) and the solver is installed, seeded with the best order so far.
Every candidate is judged by simulate.simulate on the same costs (model.vocab_parallel: with its
passes placed on the candidate's lists, vocab_passes.py): the order whose step ends first wins
(then the lower peak). Memory: at most `max_inflight` micro-batches of a rank's share alive
on any rank (simulate.peak_per_rank, the liveness rule). Where the costs say what a merged W
pass costs (SearchCosts.weight_more), each placement and split's best order is tried with its W
passes merged in groups of 2, 4, ... up to M (actions.merge_weights): one GEMM per weight over
the group's rows, the earlier W caches kept until it runs (within the limit).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from mpihybrid.pipeline.actions import Action, ScheduleError, merge_weights
from mpihybrid.pipeline.placement import Placement
from mpihybrid.pipeline.search_bounds import any_placement_bound, busiest_work, fill_bound
from mpihybrid.pipeline.search_costs import CostsError, SearchCosts
from mpihybrid.pipeline.search_greedy import CAPS, best_greedy
from mpihybrid.pipeline.simulate import Costs, SimResult, simulate
from mpihybrid.pipeline.vocab_passes import add_vocab_passes

EXACT_ACTIONS = 800  # the exact search runs where a step has at most this many F/B/W
SPLITS = 3  # splits of the blocks tried per placement (the least-loaded first)
LARGE_CAPS = 2  # the greedy's memory budgets tried where the step is too large to solve exactly
MAX_ENUMERATED = 20_000  # splits enumerated before only the balanced one is tried
# a searched schedule must beat the fastest built-in within the limit by this fraction of its
# simulated step, or that built-in (its placement, its split, its order) is the answer: a tie on
# costs that are not the run's is no reason to run an untried grid
TIE_MARGIN = 0.02


def judge(lists: dict, placement: Placement, costs: Costs, m: int) -> SimResult:
    """How a candidate's lists run: simulated, with model.vocab_parallel's passes placed on
    them first where the costs have their seconds (costs.vocab)."""
    if costs.vocab:
        lists = add_vocab_passes(lists, placement, m, costs, simulate)
    return simulate(lists, placement, costs)


@dataclass
class Candidate:
    placement: Placement
    ranges: list[range]
    lists: dict[int, list[Action]]
    sim: SimResult
    how: str  # greedy | exact | a built-in's name
    sim_costs: Costs = field(default_factory=Costs, repr=False)  # the costs of this split
    merged: int = 1  # its W passes merged in groups of up to this many (actions.merge_weights)

    @property
    def found_by(self) -> str:
        """What found it, and its merged W: "zb-v", "greedy, W merged in 4s"."""
        return self.how + (f", W merged in {self.merged}s" if self.merged > 1 else "")

    @property
    def key(self) -> tuple[float, float]:
        return (round(self.sim.makespan, 12), max(self.sim.peak_per_rank))


@dataclass
class SearchResult:
    best: Candidate
    pp: int
    m: int
    max_inflight: float
    costs: SearchCosts
    status: str  # optimal | feasible (exact, with a proven bound) | heuristic
    bound: float  # proven lower bound of the best placement and split (0: none)
    # per solve: (placement and split, status, seconds, deterministic seconds, found, bound)
    solver_seconds: list[tuple[str, str, float, float, float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    table: list[dict] = field(default_factory=list)  # the built-ins on the same costs
    searched: Candidate | None = None  # the best order searched (best: a built-in on a tie)

    @property
    def step_bound(self) -> float:
        """The busiest rank's own work at the searched split (F + B + W of its stages, m times)."""
        return busiest_work(self.costs, self.best.placement, self.best.ranges, self.m)

    @property
    def fill_bound(self) -> float:
        """step_bound plus the wait for each rank's first input: no order at this split and
        placement beats it (search_bounds)."""
        return fill_bound(self.costs, self.best.placement, self.best.ranges, self.m)

    @property
    def any_bound(self) -> float | None:
        """The fill bound over every map of the blocks to the ranks: no schedule of these whole
        blocks on pp ranks beats it (None: too many maps, or a trace's fixed stages)."""
        return any_placement_bound(self.costs, self.pp, self.m)

    @property
    def gap(self) -> float:
        if not self.bound:
            return float("nan")
        return max(0.0, 1.0 - self.bound / self.best.sim.makespan)


def _progress() -> None:
    from mpihybrid.progress import progress

    progress("searching a schedule")


def make_placement(style: str, pp: int) -> Placement:
    return Placement.v(pp) if style == "v" else Placement.loop(pp)


def splits(costs: SearchCosts, placement: Placement, count: int = SPLITS) -> list[list[range]]:
    """The `count` splits of the blocks into the placement's stages with the least-loaded busiest
    rank (then the smallest largest stage, then the sum of squares); a fixed split as it is."""
    n, k = costs.units, placement.num_stages
    if costs.fixed:
        if n != k:
            raise CostsError(
                f"costs from {costs.source} are of {n} stages; a {placement.style} placement at "
                f"pp={placement.pp} has {k} (a trace fixes its split: trace a run of {k} stages)"
            )
        return [[range(i, i + 1) for i in range(n)]]
    if n < k:
        raise CostsError(f"{n} blocks cannot make the {k} stages of a {placement.style} placement")
    totals = [costs.total(i) for i in range(n)]
    if math.comb(n - 1, k - 1) > MAX_ENUMERATED:
        from mpihybrid.nn.model import balanced_for_ranks

        return [balanced_for_ranks(totals, list(placement.stage_ranks))]
    prefix = list(itertools.accumulate(totals, initial=0.0))
    scored = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        sizes = [prefix[bounds[i + 1]] - prefix[bounds[i]] for i in range(k)]
        load = [0.0] * placement.pp
        for s, size in enumerate(sizes):
            load[placement.rank_of(s)] += size
        scored.append(((max(load), max(sizes), sum(x * x for x in sizes)), bounds))
    scored.sort()
    return [[range(b[i], b[i + 1]) for i in range(k)] for _, b in scored[:count]]


def _builtin_seeds(placement: Placement, m: int, split: bool) -> list[tuple[str, dict]]:
    """The built-in schedules' lists on this placement (as training runs them)."""
    from mpihybrid.pipeline.schedules import SCHEDULES, build_schedule, chunks_for, get_spec

    seeds = []
    for name in SCHEDULES:
        spec, v = get_spec(name), chunks_for(name, placement.chunks)
        if spec.make_placement(placement.pp, v) != placement or spec.splits_backward != split:
            continue
        try:
            seeds.append((name, build_schedule(name, placement.pp, m, v, early_grad_send=True)))
        except ScheduleError:
            continue
    return seeds


def search(
    costs: SearchCosts,
    pp: int,
    m: int,
    *,
    max_inflight: float | None = None,
    placements: tuple[str, ...] = ("loop", "v"),
    split: bool = True,
    time_limit: float = 60.0,
    exact: bool = True,
    deterministic: bool = False,
    ranges: list[range] | None = None,
    tick=None,
    gap_limit: float = 0.0,
) -> SearchResult:
    """The best schedule found (module text). max_inflight: micro-batches of a rank's share
    (default_limit: what the fastest built-in holds, at least p); ranges: a split of the blocks
    to keep (only placements of that many stages are tried); tick(): called between candidates
    (a watchdog's progress); gap_limit: an exact solve stops once proved within it."""
    tick = tick or _progress
    rows = builtin_rows(costs, pp, m)
    limit = _checked_limit(default_limit(rows, pp) if max_inflight is None else max_inflight, m)
    split = split and costs.can_split
    notes = [] if costs.can_split else [f"{costs.source}: backwards ran whole, so B/W not split"]
    found: list[Candidate] = []
    per_split: dict[tuple, Candidate] = {}  # (style, split): its best order so far
    for style in placements:
        placement = make_placement(style, pp)
        # a large step (no exact search): the balanced split alone, the greedy's top budgets
        large = (3 if split else 2) * m * placement.num_stages > EXACT_ACTIONS
        try:
            tried = splits(costs, placement, 1 if large else SPLITS) if ranges is None else [ranges]
        except CostsError as exc:
            notes.append(f"{style} placement not tried: {exc}")
            continue
        for split_ranges in tried:
            if len(split_ranges) != placement.num_stages:
                notes.append(
                    f"{style} placement not tried: the split kept has {len(split_ranges)} stages"
                )
                break
            sim_costs = costs.split(split_ranges)
            try:
                lists, sim = best_greedy(placement, m, sim_costs, max_inflight=limit, split=split,
                                         caps=LARGE_CAPS if large else CAPS)  # fmt: skip
                # (with model.vocab_parallel, `sim` has the passes placed: best_greedy judged it)
                found.append(Candidate(placement, split_ranges, lists, sim, "greedy", sim_costs))
            except ScheduleError:
                pass
            for name, lists in _builtin_seeds(placement, m, split):
                sim = judge(lists, placement, sim_costs, m)
                if max(sim.peak_per_rank) <= limit + 1e-9:
                    found.append(Candidate(placement, split_ranges, lists, sim, name, sim_costs))
            tick()
        for c in found:
            key = (style, tuple(c.ranges))
            if c.placement == placement and (key not in per_split or c.key < per_split[key].key):
                per_split[key] = c
    if not found:
        why = "; ".join(notes) or f"none holds at most {limit:g} micro-batches of a rank's share"
        raise ScheduleError(f"schedule search found no schedule: {why}")
    proved, solves = {}, []
    if exact:
        limits = {"time_limit": time_limit, "gap_limit": gap_limit, "deterministic": deterministic}
        proved = _exact(per_split, found, m, limit, split, limits=limits, notes=notes,
                        solves=solves)  # fmt: skip
        tick()
    if costs.weight_more and split:
        found += _merged(per_split, found, m, limit)
        tick()
    best = searched = min(found, key=lambda c: c.key)
    if ranges is None:
        best = _keep_builtin(searched, rows, costs, m, limit, placements=placements, notes=notes)
    status, bound = proved.get((best.placement.style, tuple(best.ranges)), ("heuristic", 0.0))
    result = SearchResult(
        best, pp, m, limit, costs, status, bound, solves, notes, searched=searched
    )
    result.table = builtin_table(rows, limit, result)
    return result


def _keep_builtin(best: Candidate, rows, costs, m, limit, *, placements, notes) -> Candidate:
    """The fastest built-in within the limit (its placement, split and order, as builtin_rows
    simulated it) unless `best` beats its step by TIE_MARGIN (a note says what was kept);
    `best` where none qualifies. One placement asked (train.schedule_placement): only built-ins
    of that placement's pp or 2 pp stages qualify (not interleaved's 2 pp stages of a loop)."""
    from mpihybrid.pipeline.schedules import build_schedule, placement_of

    pp = best.placement.pp
    asked = make_placement(placements[0], pp) if len(placements) == 1 else None
    fits = [
        r
        for r in rows
        if "makespan" in r
        and r["peak"] <= limit + 1e-9
        and asked in (None, placement_of(r["schedule"], pp, r["v"]))
    ]
    if not fits:
        return best
    row = min(fits, key=lambda r: (round(r["makespan"], 12), r["peak"]))
    beats = best.sim.makespan < (1 - TIE_MARGIN) * row["makespan"]
    if (best.how, best.merged) == (row["schedule"], 1) or beats:
        return best
    placement = placement_of(row["schedule"], pp, row["v"])
    ranges = splits(costs, placement, 1)[0]
    lists = build_schedule(row["schedule"], placement.pp, m, row["v"], early_grad_send=True)
    sim_costs = costs.split(ranges)
    sim = judge(lists, placement, sim_costs, m)
    notes.append(
        f"the best searched ({best.placement.style} {[len(r) for r in best.ranges]}, "
        f"{best.found_by}) "
        f"simulates {_time(best.sim.makespan, costs.source == 'unit')}: not {TIE_MARGIN:.0%} "
        f"faster than {row['schedule']}, which is kept"
    )
    return Candidate(placement, ranges, lists, sim, row["schedule"], sim_costs)


def _merged(per_split: dict, found: list[Candidate], m: int, limit: float) -> list[Candidate]:
    """Each placement and split's best order so far with its W passes merged in groups of
    2, 4, ... up to m (actions.merge_weights), where it holds within the limit."""
    out = []
    for seed in per_split.values():
        same = [c for c in found if c.placement == seed.placement and c.ranges == seed.ranges]
        base = min(same, key=lambda c: c.key)
        for group in sorted({min(2**i, m) for i in range(1, m.bit_length() + 1)} - {1}):
            lists = merge_weights(base.lists, group)
            sim = judge(lists, base.placement, base.sim_costs, m)
            if max(sim.peak_per_rank) <= limit + 1e-9:
                out.append(Candidate(base.placement, base.ranges, lists, sim, base.how,
                                     base.sim_costs, merged=group))  # fmt: skip
    return out


def _checked_limit(limit: float, m: int) -> float:
    """The memory limit, refused below one micro-batch (no schedule holds less) or NaN; above m
    (inf, 1e30: no limit) it is m, since a rank never holds more than its share of all m."""
    if not limit >= 1:
        raise ScheduleError(
            f"a memory limit of {limit:g} micro-batches of a rank's share: no schedule holds "
            "less than one (the smallest limit any schedule meets is 1)"
        )
    return float(min(limit, m))


def _exact(per_split, found, m, limit, split, *, limits, notes, solves):
    """Solve every split tried exactly where small (limits: solve's; the time shared among
    them), seeded with its best order: {(style, split): (status, bound)}; the orders found join
    `found`, each solve's (style, status, seconds, deterministic seconds, found, bound) `solves`."""
    from mpihybrid.pipeline.search_exact import SolverMissing, solve
    from mpihybrid.pipeline.search_greedy import budgets

    small = {
        k: c
        for k, c in per_split.items()
        if (3 if split else 2) * m * c.placement.num_stages <= EXACT_ACTIONS
    }
    if len(small) < len(per_split):
        notes.append(f"exact search skipped where a step has more than {EXACT_ACTIONS} actions")
    proved = {}
    for key, seed in sorted(small.items(), key=lambda kv: kv[1].key):
        hint = _hint_for(seed, found, split)
        try:
            res = solve(
                seed.placement,
                m,
                seed.sim_costs,
                limit=budgets(seed.placement, limit),
                split=split,
                hint=hint.lists,
                **(limits | {"time_limit": limits["time_limit"] / len(small)}),
            )
        except SolverMissing as exc:
            notes.append(f"{exc}; the greedy's schedule instead")
            return {}
        sizes = [len(r) for r in seed.ranges]
        solves.append((f"{key[0]} {sizes}", res.status, res.seconds, res.work, res.makespan,
                       res.bound))  # fmt: skip
        if res.lists is not None:
            sim = judge(res.lists, seed.placement, seed.sim_costs, m)
            found.append(
                Candidate(seed.placement, seed.ranges, res.lists, sim, "exact", seed.sim_costs)
            )
            proved[key] = (res.status, res.bound)
    return proved


def _hint_for(seed: Candidate, found: list[Candidate], split: bool) -> Candidate:
    """The best order of seed's placement and split that the exact model can take whole: every
    backward split where the model splits them (dualpipev's whole ones leave it a partial
    hint); seed itself where none is."""
    from mpihybrid.pipeline.actions import split_backwards

    def whole(c: Candidate) -> bool:
        bs = sum(a.kind == "B" for acts in c.lists.values() for a in acts)
        return not split or len(split_backwards(c.lists)) == bs

    same = [c for c in found if c.placement == seed.placement and c.ranges == seed.ranges]
    return min((c for c in same if whole(c)), key=lambda c: c.key, default=seed)


def builtin_rows(costs: SearchCosts, pp: int, m: int) -> list[dict]:
    """Every built-in schedule simulated on the same costs, at the split nn.model balances for
    its placement (model.partition = "timed"'s rule): its step, bubble and rank peak."""
    from mpihybrid.pipeline.schedules import (
        SCHEDULES,
        build_schedule,
        check_config,
        chunks_for,
        placement_of,
    )

    rows = []
    for name in SCHEDULES:
        v = chunks_for(name, 2)
        row = {"schedule": name, "v": v}
        try:
            check_config(name, pp, m, v)
            placement = placement_of(name, pp, v)
            ranges = splits(costs, placement, 1)[0]
        except CostsError:
            rows.append(row | {"note": f"the costs are of {costs.units} stages, it runs {pp * v}"})
            continue
        except ScheduleError as exc:
            rows.append(row | {"note": str(exc).splitlines()[0]})
            continue
        lists = build_schedule(name, pp, m, v, early_grad_send=True)
        sim = judge(lists, placement, costs.split(ranges), m)
        rows.append(
            row
            | {
                "makespan": sim.makespan,
                "bubble": sim.bubble_fraction,
                "peak": max(sim.peak_per_rank),
                "note": "",
            }
        )
    return rows


def default_limit(rows: list[dict], pp: int) -> float:
    """The memory limit when none is given: the rank peak of the built-in schedule that is
    fastest on these costs (the lower peak on a tie), and at least p (1F1B's). So the search
    never holds more than the schedule it is to beat, and may hold what that one holds."""
    timed = [r for r in rows if "makespan" in r]
    if not timed:
        return float(pp)
    fastest = min(timed, key=lambda r: (round(r["makespan"], 12), r["peak"]))
    return max(float(pp), fastest["peak"])


def builtin_table(rows: list[dict], limit: float, result) -> list[dict]:
    """builtin_rows with each one's distance from the best found (and from the proven bound)
    and whether it holds more than the limit."""
    best, out = result.best.sim.makespan, []
    for row in rows:
        if "makespan" not in row:
            out.append(dict(row))
            continue
        out.append(
            row
            | {
                "vs_best": row["makespan"] / best - 1,
                "vs_bound": row["makespan"] / result.bound - 1 if result.bound else None,
                "note": "over the memory limit" if row["peak"] > limit + 1e-9 else "",
            }
        )
    return out


def _time(seconds: float, unit: bool) -> str:
    return f"{seconds:.4g}" if unit else f"{seconds * 1e3:.1f} ms"


def csv_of(result: SearchResult) -> str:
    """torch's compute-only CSV of the schedule found (csv_schedule.dump_csv)."""
    from mpihybrid.pipeline.csv_schedule import dump_csv
    from mpihybrid.pipeline.simulate import unit_costs

    lists, placement = result.best.lists, result.best.placement
    return dump_csv(lists, simulate(lists, placement, unit_costs(lists)).start)
