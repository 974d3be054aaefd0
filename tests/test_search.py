"""Schedule search (pipeline/search*.py): the exact search proves known optima and matches brute
force, the greedy's unit-time case is the list scheduler zb-h2 and v-half are built by, searched
schedules are valid and dry-run, bad costs and limits are one line."""

from __future__ import annotations

import itertools
import math

import pytest

from mpihybrid.pipeline import search_exact
from mpihybrid.pipeline.csv_schedule import parse_csv
from mpihybrid.pipeline.placement import Placement
from mpihybrid.pipeline.schedules import ScheduleError, dry_run, lower, validate
from mpihybrid.pipeline.search import csv_of, search
from mpihybrid.pipeline.search_costs import CostsError, SearchCosts, check_values, unit_costs
from mpihybrid.pipeline.search_greedy import list_schedule
from mpihybrid.pipeline.simulate import Costs, simulate
from mpihybrid.pipeline.v_schedules import v_half, zb_h2


def _best_builtin(result) -> float:
    return min(r["makespan"] for r in result.table if "makespan" in r and not r["note"])


def test_unit_pp2_m4_is_proved_optimal_and_equals_the_best_builtin():
    result = search(unit_costs(2), 2, 4, time_limit=30)
    assert result.status == "optimal"
    assert math.isclose(result.best.sim.makespan, result.bound)
    assert math.isclose(result.best.sim.makespan, _best_builtin(result))  # zb-v's 25 = 6m+p-1
    assert result.best.sim.makespan == 25


@pytest.mark.parametrize("pp, m", [(2, 4), (3, 6), (4, 8)])
def test_exact_loop_reaches_zb_h1_with_unit_costs(pp, m):
    # 3m+p-1 is zb-h1's makespan at rank memory p, and no order does better (the first F
    # reaches rank p-1 after p-1 steps, which then has 3m steps of its own work)
    placement = Placement.loop(pp)
    res = search_exact.solve(placement, m, Costs(1, 1, 1), limit=[pp] * pp, time_limit=30)
    assert res.status == "optimal" and res.makespan == 3 * m + pp - 1
    validate(res.lists, placement, m)


def _brute_force(placement: Placement, m: int, costs: Costs) -> float:
    """The least makespan over every per-rank order of whole F/B (no memory limit)."""
    per_rank = {
        r: [(k, s, mb) for s in placement.stages_of(r) for mb in range(m) for k in "FB"]
        for r in range(placement.pp)
    }
    from mpihybrid.pipeline.actions import Action

    best = math.inf
    orders = [itertools.permutations(acts) for acts in per_rank.values()]
    for combo in itertools.product(*orders):
        lists = {r: [Action(s, k, mb) for k, s, mb in order] for r, order in enumerate(combo)}
        try:
            validate(lists, placement, m)
        except ScheduleError:
            continue
        best = min(best, simulate(lists, placement, costs).makespan)
    return best


def test_exact_matches_brute_force_on_unequal_costs():
    placement = Placement.loop(2)
    costs = Costs(forward=[1.0, 3.0], backward=[2.0, 1.0], weight=[0.0, 0.0], send=0.5)
    res = search_exact.solve(placement, 2, costs, limit=[4, 4], split=False, fifo=False,
                             time_limit=30)  # fmt: skip
    assert res.status == "optimal"
    found = simulate(res.lists, placement, costs).makespan
    assert math.isclose(found, _brute_force(placement, 2, costs), rel_tol=1e-3)


@pytest.mark.parametrize("pp, m", [(2, 4), (3, 6), (4, 8)])
def test_greedy_with_unit_costs_is_the_unit_time_list_scheduler(pp, m):
    loop = list_schedule(Placement.loop(pp), m, Costs(1, 1, 1),
                         limit=[max(pp, 2 * (pp - r) - 1) for r in range(pp)])  # fmt: skip
    assert loop == zb_h2(pp, m)
    v = list_schedule(Placement.v(pp), m, Costs(1, 1, 1), limit=[2 * ((pp + 2) // 2)] * pp,
                      reserve=1)  # fmt: skip
    assert v == v_half(pp, m)


def test_imbalanced_costs_searched_split_and_order_beat_every_builtin():
    # a head of three layers' cost: the split decides as much as the order
    n = 8
    work = [1.0] * (n - 1) + [3.0]
    costs = SearchCosts(tuple(work), tuple(work), tuple(work), send=0.05, source="test")
    result = search(costs, 2, 4, time_limit=20)
    assert result.best.sim.makespan <= _best_builtin(result) + 1e-9
    assert max(result.best.sim.peak_per_rank) <= 2
    assert result.step_bound <= result.best.sim.makespan
    lists, placement = result.best.lists, result.best.placement
    validate(lists, placement, 4)
    # buffered, as every built-in is checked (1F1B itself needs its receives posted first: the
    # runtime posts them; tests/test_search_train.py runs searched lists with comm.sync_sends)
    dry_run(lower(lists, placement), placement, synchronous=False)
    # the CSV reads back as the same lists
    back, back_placement, m = parse_csv(csv_of(result), "search.csv")
    assert back == lists and back_placement == placement and m == 4


def test_same_costs_same_schedule():
    costs = SearchCosts((1.0, 2.0, 1.5, 1.0), (1.0, 2.0, 1.0, 2.0), (0.5, 1.0, 1.0, 0.5),
                        send=0.1, source="test")  # fmt: skip
    runs = [search(costs, 2, 4, time_limit=5, deterministic=True).best.lists for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    "forward, match",
    [((float("nan"), 1.0), "block 0 has F = nan"), ((0.0, 1.0), "block 0 has F = 0.0"),
     ((1.0, -2.0), "block 1 has F = -2.0")],
)  # fmt: skip
def test_bad_costs_are_one_line(forward, match):
    with pytest.raises(CostsError, match=match):
        check_values(SearchCosts(forward, (1.0, 1.0), (1.0, 1.0), source="test"))


def test_a_limit_below_one_names_the_smallest():
    with pytest.raises(ScheduleError, match="smallest limit any schedule meets is 1"):
        search(unit_costs(2), 2, 4, max_inflight=0.5)


def test_solver_missing_gives_the_heuristic(monkeypatch):
    def missing(*args, **kwargs):
        raise search_exact.SolverMissing("the exact search needs OR-Tools: pip install x")

    monkeypatch.setattr(search_exact, "solve", missing)
    result = search(unit_costs(2), 2, 4)
    assert result.status == "heuristic" and any("OR-Tools" in n for n in result.notes)
    validate(result.best.lists, result.best.placement, 4)


def test_timeout_gives_the_best_found_and_its_gap():
    pytest.importorskip("ortools", reason="the exact search's solver (the search extra)")
    costs = SearchCosts(tuple(1.0 + 0.37 * (i % 3) for i in range(8)), (1.3,) * 8, (0.9,) * 8,
                        send=0.07, source="test")  # fmt: skip
    placement = Placement.v(4)
    res = search_exact.solve(placement, 8, costs.split([range(i, i + 1) for i in range(8)]),
                             limit=[8] * 4, time_limit=0.05, fifo=False)  # fmt: skip
    assert res.seconds < 5
    assert res.status in ("feasible", "optimal", "unknown")
    if res.lists is not None:
        assert res.gap >= 0 and res.bound <= res.makespan + 1e-9
